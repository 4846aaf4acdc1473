"""Where the gather-Q sparse prefill spends its time at users' shapes.

One sequence, Llama-3-8B attention shapes by default (32 query / 8 KV heads, d 128, G = 4), block 128 / top-16,
the selection from the fused indexer on random index queries and keys. Times `sparse_attention` (median of 5, CUDA
events), its gather pass alone (stage "gather": CSR build + gather kernel), and profiles one call: device time per
kernel name. The ideal is the dense-causal FLOPs on the keys the selection makes visible at ~600 TFLOP/s (the
rate dense SDPA reaches on this GPU, BENCHMARKS.md). Run it with M3C_AUTOTUNE=1 TRITON_PRINT_AUTOTUNING=1 to
see the tuned configs. Also times the query-tile union kernel (kernels/sparse_attention/tile.py) on the same selection and
on the "shared" one (the tile's tokens share their blocks; a real model's consecutive queries come close:
benchmarks/experiments/selection_locality.py), with the union's size over top-k. Prints one JSON object.

    python benchmarks/experiments/sparse_attention_profile.py [--heads 32 --kv-heads 8 --lengths 32768,131072]
        [--tiles 8,16,32]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from m3compile.kernels.indexer import select_blocks
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels.sparse_attention import forward_stage, sparse_attention
from m3compile.kernels.sparse_attention.tile import sparse_attention_tiled, tile_tokens, tile_union
from m3compile.bench.common import median_ms, profile_run


def _time(fn, reps: int = 5) -> float:
    return median_ms(fn, steps=reps, warmup=1, device="cuda")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--tiles", default="", help="query-tile kernel: tokens per program to time "
                    "[default: 64 rows' worth]; 'none' skips it")
    ap.add_argument("--chunk-rows", default="", help="also time gather-Q at these gathered rows per program "
                    "(sparse_attention.FORWARD_CHUNK_ROWS; the default's row is the main one)")
    a = ap.parse_args()
    H, Hkv, D, bs, topk = a.heads, a.kv_heads, a.dim, a.block, a.topk
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "autotune": os.environ.get("M3C_AUTOTUNE", "1"), "rows": []}
    for T in [int(x) for x in a.lengths.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
        # the graph's layout: [B, T, H, D] projections viewed as [B, H, T, D] (a token's heads adjacent)
        q, k, v = (rnd(1, T, n, D).transpose(1, 2) for n in (H, Hkv, Hkv))
        blocks = select_blocks(rnd(1, T, Hkv, 128), rnd(1, T, 128), block_size=bs, topk=topk)
        visible = ((blocks >= 0).sum(-1).float() * bs).clamp(max=torch.arange(1, T + 1, device="cuda")).sum()
        ideal_ms = 4 * H // Hkv * D * visible.item() / 600e12 * 1e3
        all_ms = _time(lambda: sparse_attention(q, k, v, blocks, block_size=bs))
        gather_ms = _time(lambda: forward_stage(q, k, v, blocks, block_size=bs, stage="gather"))
        prof = profile_run(lambda: sparse_attention(q, k, v, blocks, block_size=bs), "cuda")
        names: dict[str, list[float]] = {}
        for d in prof.device_events:
            if d.time_range.elapsed_us() > 0:
                names.setdefault(d.name[:70], []).append(d.time_range.elapsed_us() / 1e3)
        top = sorted(((n, round(sum(v), 3), len(v)) for n, v in names.items()), key=lambda r: -r[1])[:8]
        row = dict(T=T, heads=H, kv_heads=Hkv, dim=D, ms=round(all_ms, 3), gather_stage_ms=round(gather_ms, 3),
                   ideal_ms=round(ideal_ms, 3), share_of_ideal=round(ideal_ms / all_ms, 3), kernels=top)
        # the query-tile union kernel (kernels/sparse_attention/tile.py) on this selection and on the "shared" one (every token
        # of a 128-token query block takes its last token's selection: union = top-k), with the union's size / top-k
        last = ((torch.arange(T, device="cuda") // bs + 1) * bs - 1).clamp(max=T - 1)
        if a.tiles == "none":
            tiles = []
        else:
            tiles = [int(t) for t in a.tiles.split(",")] if a.tiles else [tile_tokens(H // Hkv)]
        for name, sel in (("independent", blocks), ("shared", blocks[:, :, last])):
            vis = ((sel >= 0).sum(-1).float() * bs).clamp(max=torch.arange(1, T + 1, device="cuda")).sum()
            ideal = 4 * H // Hkv * D * vis.item() / 600e12 * 1e3
            for tile in tiles:
                _, count = tile_union(sel, -(-T // bs), tile)
                ms = _time(lambda: sparse_attention_tiled(q, k, v, sel, block_size=bs, tile=tile))
                row[f"tiled_{name}_tile{tile}"] = dict(
                    ms=round(ms, 3), ideal_ms=round(ideal, 3), share_of_ideal=round(ideal / ms, 3),
                    union_over_topk=round(count.float().mean().item() / topk, 3))
            if name == "shared":
                row["gather_q_shared_ms"] = round(_time(lambda: sparse_attention(q, k, v, sel, block_size=bs)), 3)
        default_rows = sa.FORWARD_CHUNK_ROWS
        for rows in [int(r) for r in a.chunk_rows.split(",") if r]:
            sa.FORWARD_CHUNK_ROWS = rows
            row.setdefault("chunk_rows_ms", {})[rows] = round(
                _time(lambda: sparse_attention(q, k, v, blocks, block_size=bs)), 3)
        sa.FORWARD_CHUNK_ROWS = default_rows
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, blocks
        torch.cuda.empty_cache()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
