"""load_module: the generated graph/module.py plus the safetensors weights reproduce the converted model exactly,
with no model class involved."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from m3compile import M3CompileError, MSAConfig, convert_checkpoint, load, load_module
from tests.conftest import LLAMA_BYTE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("src", [LLAMA_BYTE, None], ids=["byte-llama", "m3-tiny-moe"])
def test_standalone_module_equals_the_model(src, tmp_path):
    out = tmp_path / "msa"
    convert_checkpoint(src, out, MSAConfig(block_size=16, topk=4))
    module = load_module(out, dtype=torch.float32)
    assert type(module).__name__ == "ConvertedModule"
    x = torch.randint(0, 256, (2, 150))  # 10 blocks of 16, 4 selected: really sparse
    with torch.no_grad():
        torch.testing.assert_close(module(x), load(out, dtype="float32")(x), rtol=0, atol=0)


def test_loads_without_any_model_class(tmp_path):
    out = tmp_path / "msa"
    convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=4))
    x = torch.randint(0, 256, (1, 100))
    with torch.no_grad():
        want = load(out, dtype="float32")(x)
    save_file({"x": x, "want": want}, str(tmp_path / "io.safetensors"))
    script = textwrap.dedent(f"""
        import sys, torch
        torch.set_num_threads({torch.get_num_threads()})  # this process's: the same reduction order, bit for bit
        sys.modules["transformers"] = None  # no transformers at all
        import m3compile.models.decoder
        class Forbidden:
            def __init__(self, *a, **k):
                raise RuntimeError("the model class was used")
        m3compile.models.decoder.Decoder = Forbidden
        from m3compile import load_module
        from safetensors.torch import load_file
        io = load_file({str(tmp_path / "io.safetensors")!r})
        with torch.no_grad():
            got = load_module({str(out)!r}, dtype=torch.float32)(io["x"])
        assert torch.equal(got, io["want"]), (got - io["want"]).abs().max()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_directory_without_a_module(tmp_path):
    with pytest.raises(M3CompileError, match="no graph/module.py"):
        load_module(LLAMA_BYTE)
