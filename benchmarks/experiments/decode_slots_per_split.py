"""The MSA decode attention's split of the selected pages: how many pages one program reads (`slots_per_split`).

`paged_attention` gives each (sequence, KV group) one program per selected page (a top-k of up to 64) and merges
their partials by log-sum-exp. At top-16 that was the fastest; at larger top-k a program of one page does little
work for its dependent loads (block id, page, K/V tiles) and the merge folds more partials. This times one MSA
layer's decode attention (split kernel + merge) at the llama3-8b preset's shapes (32 query / 8 KV heads, head dim
128, fp8 K/V pages of 128 tokens with one scale per token and head), batch 8, 128K tokens a sequence, random pages
selected (the last one always), for each pages-per-program count, replayed as a CUDA graph; and checks that every
split gives the same output. Prints one JSON object.

    python benchmarks/experiments/decode_slots_per_split.py [--topks 16,45,64] [--length 131072] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from m3compile.kernels.decode import default_slots_per_split, paged_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topks", default="16,45,64")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    a = ap.parse_args()
    B, Hq, Hkv, D, bs = a.batch, a.heads, a.kv_heads, a.dim, a.block
    n_pages = -(-a.length // bs)
    g = torch.Generator(device="cuda").manual_seed(0)
    P = B * n_pages
    k_cache = torch.randn(P, bs, Hkv, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v_cache = torch.randn(P, bs, Hkv, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k_scale = torch.rand(P, bs, Hkv, device="cuda", generator=g) * 0.02 + 0.001
    v_scale = torch.rand(P, bs, Hkv, device="cuda", generator=g) * 0.02 + 0.001
    q = torch.randn(B, Hq, D, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.arange(P, device="cuda", dtype=torch.int32).view(B, n_pages)
    seq_lens = torch.full((B,), a.length, device="cuda", dtype=torch.int32)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "shape": dict(batch=B, heads=Hq, kv_heads=Hkv, dim=D, block=bs,
                                                             length=a.length), "rows": []}
    for K in [int(x) for x in a.topks.split(",")]:
        rest = torch.rand(B, Hkv, n_pages - 1, device="cuda", generator=g).argsort(-1)[..., : K - 1]
        blocks = torch.cat([rest, torch.full((B, Hkv, 1), n_pages - 1, device="cuda")], -1).int()
        kw = dict(k_scale=k_scale, v_scale=v_scale)
        ref = paged_attention(q, k_cache, v_cache, blocks, table, seq_lens, slots_per_split=1, **kw).float()
        for pps in sorted({1, 2, 3, 4, 6, 8, 12, 16, K} & set(range(1, K + 1))):
            def fn(pps=pps):
                return paged_attention(q, k_cache, v_cache, blocks, table, seq_lens, slots_per_split=pps, **kw)
            diff = (fn().float() - ref).abs().max().item()
            ms = do_bench_cudagraph(fn, rep=200)
            row = dict(topk=K, slots_per_split=pps, default=pps == default_slots_per_split(K), us=round(ms * 1e3, 2),
                       max_abs_diff=diff)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
