import os
from pathlib import Path

import pytest
import torch

# The suite runs the Triton kernels in Triton's interpreter on CPU tensors, with or without a GPU (set before any
# kernel module is imported); full-size GPU checks are benchmarks/check_kernels.py
os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
LLAMA_BYTE = SHARED / "checkpoints" / "dense-llama-byte"
EVAL_DATA = SHARED / "data" / "eval_code.bin"
CALIB_DATA = SHARED / "data" / "calib_code.bin"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
