"""fp8 prefill index scoring with one key scale per token against one per key block (issue 17): speed of
`select_blocks` at Llama-3-8B index shapes and how often the two select the same blocks, beside bf16 scoring.

With one scale per key block the kernel multiplies each block score by its block's scale after the block max,
instead of every token score before it (kernels/indexer.py). Runs against whichever m3compile is on PYTHONPATH;
one that predates per-block scales times the per-token and bf16 rows only. Prints one JSON object.

    python benchmarks/experiments/indexer_key_scale.py [--length 131072] [--heads 8] [--dim 64] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.bench.common import median_ms


def same_share(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (head, token) rows whose selected block sets are equal."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    T, bs = a.length, a.block
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, a.heads, a.dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, T, a.dim, device="cuda", generator=g).bfloat16()
    run = dict(block_size=bs, topk=a.topk)
    rows, sel = {}, {}
    k8, s_tok = quantize_index_keys(k)
    cases = {"bf16": (k, None), "fp8_token_scale": (k8, s_tok)}
    try:
        kb, s_blk = quantize_index_keys(k, bs)
        cases["fp8_block_scale"] = (kb, s_blk)
    except TypeError:  # an m3compile without per-block key scales
        pass
    for name, (keys, scale) in cases.items():
        sel[name] = select_blocks(q, keys, k_scale=scale, **run)
        ms, _ = median_ms(lambda: select_blocks(q, keys, k_scale=scale, **run), steps=a.reps, warmup=2, device="cuda")
        rows[name + "_ms"] = round(ms, 3)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), T=T,
               heads=a.heads, dim=a.dim, block=bs, topk=a.topk, **rows)
    for name in sel:
        if name != "bf16":
            out[f"same_rows_{name}_vs_bf16"] = round(same_share(sel[name], sel["bf16"]), 4)
    if "fp8_block_scale" in sel:
        out["same_rows_block_vs_token_scale"] = round(same_share(sel["fp8_block_scale"], sel["fp8_token_scale"]), 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
