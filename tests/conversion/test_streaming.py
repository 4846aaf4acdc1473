"""Streaming conversion: bounded memory on a ~300 MB synthetic checkpoint, bit-for-bit equal to the in-memory path,
correct shards and index, dtypes kept, nothing left behind on failure."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from m3compile import M3CompileError, MSAConfig, convert, convert_checkpoint, load, save
from m3compile.bench.synthetic import write_synthetic_checkpoint
from tests.conftest import LLAMA_BYTE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A Llama checkpoint of about 300 MB (bf16, 10 layers, hidden 1024, 16 / 4 heads), in 3 source shards."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("syn") / "src", "300m", max_shard_size=150 * 10**6)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_peak_memory_stays_far_below_the_model(synthetic, tmp_path):
    """Resident memory added by the conversion, measured in a fresh process: about one layer, not the model.

    A first conversion of the 9.5M-parameter shared checkpoint loads what every conversion loads once (torch's
    fake-tensor and fx machinery, about 170 MB); then the kernel's high-water mark is reset (/proc/self/clear_refs)
    and the peak of the real conversion is compared with the memory before it."""
    model_bytes = sum(f.stat().st_size for f in synthetic.glob("*.safetensors"))
    script = textwrap.dedent(f"""
        import json
        from m3compile import MSAConfig, convert_checkpoint
        def status(key):
            return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
        convert_checkpoint({str(LLAMA_BYTE)!r}, {str(tmp_path / "warm")!r}, MSAConfig())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM, the peak resident set size
        base = status("VmRSS")
        convert_checkpoint({str(synthetic)!r}, {str(tmp_path / "out")!r}, MSAConfig(block_size=64, topk=8),
                           max_shard_size=100 * 10**6)
        print(json.dumps({{"base": base, "peak": status("VmHWM")}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    added = figures["peak"] - figures["base"]
    assert figures["peak"] >= figures["base"]
    assert added < 0.3 * model_bytes, f"conversion added {added / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model"


def test_streaming_equals_in_memory_conversion_bit_for_bit(synthetic, tmp_path):
    config = MSAConfig(block_size=64, topk=8, dense_layers=(0, 3))
    convert_checkpoint(synthetic, tmp_path / "stream", config, max_shard_size=60 * 10**6)
    model = load(synthetic)
    gm, report = convert(model, config)
    save(gm, report, tmp_path / "memory", model.source_config)
    a, b = tensors(tmp_path / "stream"), tensors(tmp_path / "memory")
    assert a.keys() == b.keys() and any(".index_q_proj." in k for k in a)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.bfloat16 and torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "stream" / "config.json").read_text()) == json.loads(
        (tmp_path / "memory" / "config.json").read_text())
    # shards: at most the cap (a larger single tensor gets a shard of its own), and an index that tells the truth
    index = json.loads((tmp_path / "stream" / "model.safetensors.index.json").read_text())
    files = sorted((tmp_path / "stream").glob("model-*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == {f.name for f in files}
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            names = list(h.keys())
            sizes = [h.get_slice(n).get_shape() for n in names]
        nbytes = sum(2 * torch.Size(s).numel() for s in sizes)
        total += nbytes
        assert nbytes <= 60 * 10**6 or len(names) == 1
        assert all(index["weight_map"][n] == f.name for n in names)
    assert total == index["metadata"]["total_size"] == sum(t.numel() * 2 for t in a.values())


def test_dtype_kept_per_tensor_or_cast_on_request(tmp_path):
    src = tmp_path / "mixed"
    src.mkdir()
    (src / "config.json").write_text((LLAMA_BYTE / "config.json").read_text())
    state = tensors(LLAMA_BYTE)
    state["model.norm.weight"] = state["model.norm.weight"].float()  # one fp32 tensor among bf16 ones
    save_file(state, str(src / "model.safetensors"))
    convert_checkpoint(src, tmp_path / "kept", MSAConfig(block_size=64, topk=8))
    kept = tensors(tmp_path / "kept")
    assert kept["model.norm.weight"].dtype == torch.float32
    assert kept["model.layers.1.self_attn.index_q_proj.weight"].dtype == torch.bfloat16
    convert_checkpoint(src, tmp_path / "cast", MSAConfig(block_size=64, topk=8), dtype="float16")
    assert {t.dtype for t in tensors(tmp_path / "cast").values()} == {torch.float16}


def test_a_truncated_shard_leaves_no_output(synthetic, tmp_path):
    src = tmp_path / "broken"
    src.mkdir()
    for f in synthetic.iterdir():
        data = f.read_bytes()
        (src / f.name).write_bytes(data[: len(data) // 2] if f.name.endswith("00003-of-00003.safetensors") else data)
    with pytest.raises(M3CompileError, match="00003-of-00003"):
        convert_checkpoint(src, tmp_path / "out", MSAConfig())
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
