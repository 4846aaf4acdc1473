"""Why the MSA kernels run slower inside the whole model than alone: clocks under sustained load, or not.

A whole Llama-3-8B-shaped model at 128K spent 23.2 ms per layer in index_topk_kernel against 17.2 ms
alone, and 22.0 against 18.2 in the gather-Q sparse attention. index_topk_kernel's work does not depend on the data
(its top-k insert is branch-free), so the suspects are the GPU's clocks under a sustained matmul load and the
inputs' layouts. This script times, on one GPU, at the model's shapes (index: 8 heads x 64 dims, fp8 keys; sparse
attention: 32 query / 8 KV heads x 128, block 128, top-16 random selection; T tokens):

    cold      the kernel alone: median of `reps` runs after a warm-up, an idle gap before each run
    loaded    the same run right after `--load-ms` of bf16 matmuls at the MLP's shape (T x 4096 x 14336), as in
              the model, where a layer's projections and MLP run between its attention kernels

and reads the SM clock and power (nvidia-smi) at each phase's end. Prints one JSON object.

    python benchmarks/experiments/kernels_under_load.py [--length 131072] [--reps 7] [--load-ms 300]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.bench.common import median_ms


def _smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        sm, power, temp = (float(x) for x in out.strip().splitlines()[0].split(","))
        return {"sm_mhz": sm, "power_w": power, "temp_c": temp}
    except Exception as e:  # noqa: BLE001 - a diagnostic: say what failed, keep timing
        return {"error": f"{type(e).__name__}: {e}"}


def _timed(fn) -> float:
    """One run's ms (CUDA events)."""
    return median_ms(fn, steps=1, warmup=0, device="cuda")[0]


def _run(fn, load, reps: int, gap_s: float) -> tuple[list[float], dict]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if load is None:
            time.sleep(gap_s)
        else:
            load()
        times.append(_timed(fn))
    return sorted(times), _smi()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--load-ms", type=float, default=300.0)
    ap.add_argument("--gap-s", type=float, default=1.0)
    args = ap.parse_args()
    T, dev = args.length, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    # the index branch's inputs at Llama-3-8B shapes with --index-dim 64 --index-dtype fp8
    q_idx = torch.randn(1, T, 8, 64, device=dev, generator=g).to(bf)
    k_idx, k_scale = quantize_index_keys(torch.randn(1, T, 64, device=dev, generator=g).to(bf))
    # the sparse attention's: q [B, Hq, T, D] as a head-major view of token-major storage, as the graph gives it
    q = torch.randn(1, T, 32, 128, device=dev, generator=g).to(bf).transpose(1, 2)
    k = torch.randn(1, T, 8, 128, device=dev, generator=g).to(bf).transpose(1, 2)
    v = torch.randn(1, T, 8, 128, device=dev, generator=g).to(bf).transpose(1, 2)
    nb = -(-T // 128)
    t_blk = torch.arange(T, device=dev) // 128
    rnd = torch.rand(1, 8, T, nb, device=dev, generator=g)
    rnd = torch.where(torch.arange(nb, device=dev)[None, None, None, :] <= t_blk[None, None, :, None], rnd, -1.0)
    rnd[..., torch.arange(T, device=dev), t_blk] = 2.0  # the local block always
    blocks = torch.where(rnd.topk(16, -1).values >= 0, rnd.topk(16, -1).indices, -1).to(torch.int32)
    del rnd
    x = torch.randn(T, 4096, device=dev, generator=g).to(bf)
    w = torch.randn(14336, 4096, device=dev, generator=g).to(bf) * 0.01
    gemm_ms = _timed(lambda: x @ w.T)
    n_gemm = max(1, round(args.load_ms / max(gemm_ms, 1e-3)))

    def load():
        for _ in range(n_gemm):
            x @ w.T

    kernels = {
        "index_topk": lambda: select_blocks(q_idx, k_idx, block_size=128, topk=16, k_scale=k_scale),
        "sparse_attention": lambda: sparse_attention(q, k, v, blocks, block_size=128),
    }
    out = {"T": T, "reps": args.reps, "gemm_ms": round(gemm_ms, 3), "load_gemms": n_gemm, "idle": _smi(),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": {}}
    for name, fn in kernels.items():
        row = {}
        for phase, ld in (("cold", None), ("loaded", load), ("cold_again", None)):
            times, smi = _run(fn, ld, args.reps, args.gap_s)
            row[phase] = {"median_ms": round(times[len(times) // 2], 3), "min_ms": round(times[0], 3),
                          "max_ms": round(times[-1], 3), **smi}
        row["loaded_over_cold"] = round(row["loaded"]["median_ms"] / row["cold"]["median_ms"], 3)
        out["kernels"][name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
