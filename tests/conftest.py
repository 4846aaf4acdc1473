import json
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The suite runs the Triton kernels in Triton's interpreter on CPU tensors, with or without a GPU (set before any
# kernel module is imported); full-size GPU checks are benchmarks/check_kernels.py
os.environ.setdefault("TRITON_INTERPRET", "1")
# and import Triton now, under that setting: triton.language's own @triton.jit helpers (the reductions' combine
# functions behind tl.max / tl.argmin, ...) are built when Triton is first imported, as interpreted functions only if
# the interpreter is on then. A test that turns it off (test_readme, "as on a reader's CPU") and happens to be the
# first to import Triton (torch imports it lazily) would otherwise leave compiled-only helpers behind, and every
# later interpreted kernel in that process fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
import triton  # noqa: E402,F401

# What libraries print while an m3c command runs goes to m3c's log (m3compile/commands/common.py): the suite's, in the
# temporary directory, not the user's ~/.cache
os.environ.setdefault("M3C_LOG", str(Path(tempfile.gettempdir()) / f"m3compile-test-{os.getuid()}.log"))

from m3compile import MSAConfig, convert_checkpoint  # noqa: E402

# `pytest -n 2` on 2 cores: one torch thread per worker. Two workers of 2 OpenMP threads each on 2 cores spin
# against each other: the torch-heavy tests then ran up to 6x slower side by side than alone
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Longest first: with `--dist loadgroup` xdist hands the next scope (a test, or all tests of one xdist_group) in
# collection order to whichever worker is free, so a long scope collected late left the other worker idle at the end
# (a run on 2 cores: 462 s, of which the scopes below are 90, 89, 47, 30 and 30 s). These start at once, longest
# first; the rest keep their order.
LONGEST_FIRST = ("tests/runtime/test_compile_ahead.py::test_the_synthetic_runs_cover_a_real_generation", "vllm",
                 "onnx_export", "tests/export/test_remote_code.py::test_adaptive_budget_matches_m3compile",
                 "tests/runtime/test_generate.py::test_an_answer_budget_through_the_kernels_matches_the_references",
                 "shard")


def pytest_collection_modifyitems(items):
    def rank(item):
        group = item.get_closest_marker("xdist_group")
        scope = (group.args[0] if group.args else group.kwargs.get("name")) if group else item.nodeid.split("@")[0]
        return LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)


ROOT = Path(__file__).resolve().parents[1]
# the small trained byte-level Llama kept in the repository (scripts/train_byte_model.py, checkpoints/byte-llama/
# training.json): 6 layers, hidden 192, 8 query / 2 KV heads of 24, token id = byte value
LLAMA_BYTE = ROOT / "checkpoints" / "byte-llama"


def with_sparse_config(src: Path, dst: Path, **keys) -> Path:
    """A copy of the converted checkpoint `src` at `dst` (made where `dst` does not exist yet) with `keys` written into
    its config.json's sparse_attention_config: how a test stores a value convert would never write."""
    if not dst.exists():
        shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sparse_attention_config"].update(keys)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load_script(name: str) -> dict:
    """The functions of scripts/NAME, without running its command line; its folder is first on the module path while
    it loads, as when Python runs it (the scripts share scripts/_script.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return runpy.run_path(str(ROOT / "scripts" / name))
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _code_data() -> dict[str, Path]:
    """Code bytes of this Python's standard library, split by file (scripts/code_data.py): calib.bin (4 MB of the
    training files) and eval.bin (300 KB of held-out ones), made once per Python version into the temporary
    directory (each file written whole or not at all, so two test processes can race to make them)."""
    folder = Path(tempfile.gettempdir()) / f"m3compile-test-code-{sys.version_info.major}.{sys.version_info.minor}"
    paths = {name: folder / f"{name}.bin" for name in ("calib", "eval")}
    if not all(p.is_file() for p in paths.values()):
        load_script("code_data.py")["write"](folder, echo=False)
    return paths


_DATA = _code_data()
EVAL_DATA = _DATA["eval"]
CALIB_DATA = _DATA["calib"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def byte_msa(tmp_path_factory) -> Path:
    """The byte-level model converted with 16-token blocks and top-4, layer 0 dense: sparse from 128 tokens on."""
    out = tmp_path_factory.mktemp("byte") / "msa"
    convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=4, dense_layers=(0,)))
    return out


@pytest.fixture(scope="module")
def tiny_msa(tmp_path_factory) -> Path:
    """The m3-tiny preset converted with 8-token blocks and top-2, layer 0 dense, in fp32."""
    out = tmp_path_factory.mktemp("tiny") / "msa"
    convert_checkpoint(None, out, MSAConfig(block_size=8, topk=2, dense_layers=(0,)), preset="m3-tiny",
                       dtype="float32")
    return out
