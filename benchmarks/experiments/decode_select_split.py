"""Where the decode selection's time goes: block scoring against the top-k, bf16 and fp8 index keys.

`paged_select` (kernels/decode) runs two kernels: `paged_index_scores` reads every cached index key of each
sequence and writes one score per (sequence, index head, page); `topk_rows_kernel` then takes the top-k of each row.
This script times each alone and the pair, as CUDA graph replays, at M3's decode shapes (batch 8, 4 index heads x
128 dims, block 128, top-16 by default), against the bytes the scoring must read (index keys, their scales) over
the device-to-device copy rate measured in the same run. Prints one JSON object.

    python benchmarks/experiments/decode_select_split.py [--lengths 131072,1048576] [--batch 8]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing as tt

from m3compile.kernels._common import next_pow2
from m3compile.kernels.decode import paged_select, quantize_pages


def _graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return float(tt.do_bench_cudagraph(fn, rep=200, return_mode="median"))


def copy_tbps() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _graph_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4, help="index heads (= rows of top-k per sequence)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    a = ap.parse_args()
    from m3compile.kernels.decode._tl_decode import topk_rows_kernel

    dev = "cuda"
    tbps = copy_tbps()
    rows = []
    for T in (int(t) for t in a.lengths.split(",")):
        B, H, D, bs = a.batch, a.heads, a.dim, a.block
        pages = -(-T // bs)
        g = torch.Generator(device=dev).manual_seed(T)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        cache = torch.randn(B * pages, bs, D, device=dev, dtype=torch.bfloat16, generator=g)
        table = torch.arange(B * pages, device=dev, dtype=torch.int32).view(B, pages)
        lens = torch.full((B,), T, device=dev, dtype=torch.int32)
        for name in ("bf16", "fp8"):
            scale = None
            if name == "fp8":
                cache, scale = quantize_pages(cache)
            scores = torch.randn(B, H, pages, device=dev, dtype=torch.float32, generator=g)
            out = torch.empty(B, H, a.topk, dtype=torch.int32, device=dev)

            def topk_only():
                topk_rows_kernel[(B, H)](scores, lens, out, scores.stride(0), scores.stride(1), out.stride(0),
                                         out.stride(1), BS=bs, NBP=next_pow2(pages), TOPK=a.topk, INIT=0, LOCAL=1,
                                         num_warps=8 if pages >= 2048 else 4)

            select_ms = _graph_ms(lambda: paged_select(q, cache, table, lens, topk=a.topk, idx_scale=scale))
            topk_ms = _graph_ms(topk_only)
            torch_topk_ms = _graph_ms(lambda: torch.topk(scores, a.topk, dim=-1))
            key_bytes = cache.numel() * cache.element_size() + (0 if scale is None else scale.numel() * 4)
            floor_ms = key_bytes / tbps / 1e9
            row = dict(T=T, batch=B, keys=name, select_ms=round(select_ms, 4), topk_ms=round(topk_ms, 4),
                       scores_ms_by_difference=round(select_ms - topk_ms, 4), torch_topk_ms=round(torch_topk_ms, 4),
                       key_gb=round(key_bytes / 1e9, 3), scale_share=0 if scale is None else
                       round(scale.numel() * 4 / key_bytes, 4),
                       floor_ms=round(floor_ms, 4), share_of_floor=round(floor_ms / select_ms, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"copy_tbps": round(tbps, 3), "rows": rows}))


if __name__ == "__main__":
    main()
