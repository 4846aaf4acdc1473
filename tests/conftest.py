import os
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

# `pytest -n 2` on 2 cores: one torch thread per worker. Two workers of 2 OpenMP threads each on 2 cores spin
# against each other: the torch-heavy tests then ran up to 6x slower side by side than alone
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
LLAMA_BYTE = SHARED / "checkpoints" / "dense-llama-byte"
EVAL_DATA = SHARED / "data" / "eval_code.bin"
CALIB_DATA = SHARED / "data" / "calib_code.bin"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
