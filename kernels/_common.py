"""What every Triton kernel wrapper shares: when to run Triton, autotune config lists, small integer helpers.

Nothing here imports Triton at module level: `import kernels` must stay cheap and GPU-free.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

__all__ = ["interpreting", "use_triton", "next_pow2", "configs", "tune_bucket", "autotune", "launch_fp8", "detached"]

_FP8_DOT = [True]  # becomes False after the first fp8 matmul this Triton build failed to compile


def interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`: kernels run on the CPU through Triton's interpreter (how CI tests them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor, backend: str = "auto") -> bool:
    """Whether a wrapper should launch its Triton kernel.

    backend "torch" forces the reference, "triton" forces the kernel (an error on CPU unless interpreting),
    "auto" runs Triton on CUDA tensors, and on CPU tensors only under the interpreter.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if on_cuda or interpreting():
        return True
    if backend == "triton":
        raise RuntimeError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return False


def detached(t: torch.Tensor) -> torch.Tensor:
    """t.detach() where t requires grad, else t itself (no dispatch where there is nothing to detach)."""
    return t.detach() if t.requires_grad else t


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tune_bucket(length: int) -> int:
    """Autotune key for a sequence length: its power of two, capped at 128K (tuning longer ones costs seconds per
    config and picks the same tiles)."""
    return min(next_pow2(max(1, length)), 1 << 17)


def configs(full: list[dict], interpret: dict, default: dict | None = None, pre_hook=None) -> list:
    """triton.Config list: the H200 search space on a GPU; one small config under the interpreter (autotuning
    there would only multiply the CPU time of every test); with M3C_AUTOTUNE=0, only `default` (the config the
    H200 runs recorded in BENCHMARKS.md chose), which skips the compile-and-time sweep of every new shape.
    `pre_hook(nargs)` runs before every launch of a config (the arguments and the config's values): e.g. to fit a
    TMA descriptor's box to the config's tile."""
    import triton

    if interpreting():
        chosen = [interpret]
    elif os.environ.get("M3C_AUTOTUNE", "1") == "0" and default is not None:
        chosen = [default]
    else:
        chosen = full
    out = []
    for c in chosen:
        c = dict(c)
        warps, stages = c.pop("num_warps", 4), c.pop("num_stages", 2)
        out.append(triton.Config(c, num_warps=warps, num_stages=stages, pre_hook=pre_hook))
    return out


def autotune(**kwargs):
    """`triton.autotune` that keeps its choices on disk (Triton's `cache_results`, in the Triton cache directory,
    keyed on the kernel source, the configs and the tuning key), so a second process with the same shapes skips
    the compile-and-time sweep; `M3C_AUTOTUNE_CACHE=0` turns that off. A Triton without `cache_results` tunes in
    every process as before."""
    import inspect

    import triton

    supported = "cache_results" in inspect.signature(triton.autotune).parameters
    if supported and os.environ.get("M3C_AUTOTUNE_CACHE", "1") != "0":
        kwargs.setdefault("cache_results", True)
    return triton.autotune(**kwargs)


def launch_fp8(launch: Callable[[bool], None], fp8: bool) -> None:
    """Run `launch(fp8_dot)` of a kernel with an FP8_DOT constexpr. With fp8 operands on a GPU: an fp8 x fp8
    tensor-core matmul first; if this Triton build cannot compile one, the operands are widened to fp16 instead,
    with one warning, from then on. Under the interpreter they are always widened (fp16 holds every e4m3 value,
    so the products are the same; both accumulate in fp32). Without fp8 operands: launch(False)."""
    if not (fp8 and _FP8_DOT[0] and not interpreting()):
        launch(False)
        return
    try:
        launch(True)
    except Exception as e:  # noqa: BLE001 - a compiler error of any type
        _FP8_DOT[0] = False
        warnings.warn(f"fp8 index matmul unavailable ({type(e).__name__}); widening fp8 operands to fp16")
        launch(False)
