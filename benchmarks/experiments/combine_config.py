"""The gather-Q forward's combine at each launch width (G = 4 sparse attention).

combine_kernel (kernels/sparse_attention/_tl_sparse.py) merges each (token, KV group)'s top-k partial outputs, found through the CSR's
inverse permutation, in one program of G head rows x D. At Llama-3-8B shapes that is 512 bf16 values per partial,
4 per thread at the default 4 warps. This times it at 1, 2, 4 and 8 warps on one sequence (random partials; the
CSR of the fused indexer's selection on random index inputs, so the partials are read in the real scattered
order), checks every width writes the same output bit for bit, and reports the bytes it moves per ms. Prints one
JSON object. H200 figures: BENCHMARKS.md. They rank the widths as the model's pass does at G = 4 (one
warp best), not at G = 16, where one warp wins here and loses in the pass (10.38 against 8.53 ms): choose widths in
the pass (`sparse_attention_profile.py`), not from this alone.

    python benchmarks/experiments/combine_config.py [--length 131072] [--heads 32 --kv-heads 8] [--warps 1,2,4,8]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from m3compile.kernels import sparse_attention as sa
from m3compile.kernels._common import next_pow2
from m3compile.kernels.sparse_attention._tl_sparse import combine_kernel
from m3compile.kernels.indexer import select_blocks
from m3compile.bench.common import median_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = a.device
    T, H, Hkv, D, bs, K = a.length, a.heads, a.kv_heads, 128, 128, 16
    G = H // Hkv
    GP = next_pow2(G)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    blocks = select_blocks(rnd(1, T, Hkv, 128), rnd(1, T, 128), block_size=bs, topk=K)
    csr = sa.block_csr(blocks, -(-T // bs), sa.attention_chunk(G))
    rows = Hkv * T * K * GP
    part_o = rnd(rows, D)
    part_lse = torch.randn(rows, device=dev, generator=g)
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "T": T, "heads": H, "kv_heads": Hkv,
           "rows": []}
    # bytes a combine must move: every live partial (G rows of D bf16 + G fp32 log-sum-exps) read, the output written
    live = int((blocks >= 0).sum().item())
    gbytes = (live * G * (2 * D + 4) + T * H * (2 * D + 4)) / 1e9
    ref = None
    for w in [int(x) for x in a.warps.split(",")]:
        out = torch.empty(1, T, H, D, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(1, T, H, dtype=torch.float32, device=dev)

        def run():
            combine_kernel[(T, Hkv)](
                part_o, part_lse, csr.entry, blocks, out, lse,
                blocks.stride(0), blocks.stride(1), blocks.stride(2), out.stride(0), out.stride(1), out.stride(2),
                lse.stride(0), lse.stride(1), T, 0,
                HKV=Hkv, K=K, G=G, GP=GP, D=D, DP=D, STORE_LSE=True, num_warps=w)

        ms = median_ms(run, steps=a.reps, warmup=2, device=dev)[0]
        if ref is None:
            ref = (out.clone(), lse.clone())
        row = {"num_warps": w, "ms": ms, "tb_s": gbytes / ms,
               "same_as_first": bool(torch.equal(out, ref[0]) and torch.equal(lse, ref[1]))}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    res["gbytes"] = gbytes
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
