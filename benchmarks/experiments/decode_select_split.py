"""Where the decode selection's time goes: block scoring against the two top-k stages, bf16 and fp8 index keys.

`paged_select` (kernels/decode) runs the scores kernel (`paged_index_scores`: every cached index key of each
sequence read, one score per (sequence, index head, page)), then the top-k: `topk_chunk_kernel` (the best blocks of
each TOPK_CHUNK pages) and `topk_merge_kernel` (one program per row), or the first alone where a row is one chunk.
This script times each launch alone and the whole selection, as CUDA graph replays, at M3's decode shapes (batch 8,
4 index heads x 128 dims, block 128, top-16 by default), the top-k for each chunk size of --chunks and as one
chunk per row (a single pass, one program per row), each stage's way of finding its best keys (`--ways`: serial
maxima in both stages, ranks in both, ranks in the merge alone, the defaults of TOPK_RANK_FROM / TOPK_RANK_MERGE,
and ranks in stage 1 from 32 slots with the merge's up to topk x 8192 candidates squared), torch.topk over the same
scores, and the bytes the scoring must read (index keys, their scales) over the device-to-device copy rate measured
in the same run. Prints one JSON object per row, then one with all rows.

    python benchmarks/experiments/decode_select_split.py [--lengths 131072,1048576] [--batch 8] [--chunks 128,256,512]
        [--topk 16] [--heads 4] [--dim 128] [--ways default,serial,ranks,merge-ranks]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing as tt

from m3compile.kernels import decode as dk
from m3compile.kernels._common import next_pow2


def _graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return float(tt.do_bench_cudagraph(fn, rep=200, return_mode="median"))


def copy_tbps() -> float:
    """Bytes read + written per second by an elementwise kernel over 2 GiB (a captured `copy_` becomes a graph
    memcpy node run by the copy engine, which measured 2.8 TB/s on the H200 against 4.4 for a kernel)."""
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = _graph_ms(lambda: torch.neg(x, out=y))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def stage_ms(q, cache, table, lens, topk, scale, chunk, scores: bool) -> tuple[dict, torch.Tensor]:
    """{launch name: ms} of paged_select's launches with TOPK_CHUNK = chunk (each timed alone, after one run of
    all in order so that each reads what the ones before it wrote; the scores kernel only if `scores`), and the
    selection."""
    dk.TOPK_CHUNK = chunk
    out, launches = dk.paged_select_launches(q, cache, table, lens, topk=topk, idx_scale=scale)
    for _, launch in launches:
        launch()
    return {name: round(_graph_ms(launch), 4) for name, launch in launches if scores or name != "scores"}, out


# (TOPK_RANK_FROM, TOPK_RANK_MERGE) of each way; None: the module's own
WAYS = {"default": None, "serial": (10**9, 0), "ranks": (1, 10**9), "merge-ranks": (10**9, 10**9),
        "ranks-from-32": (32, 8192)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4, help="index heads (= rows of top-k per sequence)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--chunks", default="128,256,512", help="top-k chunk sizes (pages, powers of two) to time")
    ap.add_argument("--ways", default="default,serial,ranks,merge-ranks,ranks-from-32", help=f"of {', '.join(WAYS)}")
    a = ap.parse_args()
    default_chunk = dk.TOPK_CHUNK
    default_ways = dk.TOPK_RANK_FROM, dk.TOPK_RANK_MERGE

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
                cache, scale = dk.quantize_pages(cache)
            stages, want = stage_ms(q, cache, table, lens, a.topk, scale, default_chunk, scores=True)
            scores_ms = stages.pop("scores")
            by_chunk = {default_chunk: dict(stages, topk_ms=round(sum(stages.values()), 4))}
            for chunk in sorted({int(c) for c in a.chunks.split(",")} | {next_pow2(pages)} - {default_chunk}):
                stages, sel = stage_ms(q, cache, table, lens, a.topk, scale, chunk, scores=False)
                assert torch.equal(sel, want), f"chunk {chunk} selects other blocks than chunk {default_chunk}"
                by_chunk[chunk] = dict(stages, topk_ms=round(sum(stages.values()), 4))
            by_way = {}
            for way in a.ways.split(","):
                dk.TOPK_RANK_FROM, dk.TOPK_RANK_MERGE = WAYS[way] or default_ways
                stages, sel = stage_ms(q, cache, table, lens, a.topk, scale, default_chunk, scores=False)
                assert torch.equal(sel, want), f"the top-k's way {way} selects other blocks than the default"
                by_way[way] = dict(stages, topk_ms=round(sum(stages.values()), 4))
            dk.TOPK_RANK_FROM, dk.TOPK_RANK_MERGE = default_ways
            dk.TOPK_CHUNK = default_chunk
            select_ms = _graph_ms(lambda: dk.paged_select(q, cache, table, lens, topk=a.topk, idx_scale=scale))
            scores = torch.randn(B, H, pages, device=dev, dtype=torch.float32, generator=g)
            torch_topk_ms = _graph_ms(lambda: torch.topk(scores, a.topk, dim=-1))
            key_bytes = cache.numel() * cache.element_size() + (0 if scale is None else scale.numel() * 4)
            floor_ms = key_bytes / tbps / 1e9
            default = by_chunk[default_chunk]
            row = dict(T=T, batch=B, keys=name, chunk=default_chunk, select_ms=round(select_ms, 4),
                       scores_ms=scores_ms, topk_ms=default["topk_ms"],
                       single_pass_topk_ms=by_chunk[next_pow2(pages)]["topk_ms"],
                       topk_by_chunk={str(c): by_chunk[c] for c in sorted(by_chunk)}, topk_by_way=by_way,
                       torch_topk_ms=round(torch_topk_ms, 4),
                       key_gb=round(key_bytes / 1e9, 3), scale_share=0 if scale is None else
                       round(scale.numel() * 4 / key_bytes, 4),
                       floor_ms=round(floor_ms, 4), share_of_floor=round(floor_ms / select_ms, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"copy_tbps": round(tbps, 3), "rows": rows}))


if __name__ == "__main__":
    main()
