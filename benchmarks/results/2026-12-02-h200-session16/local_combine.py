"""The local block in the combine (issue 17, item 4): each token's own key block attended by the combine kernel as a
diagonal tile of consecutive queries, the gather pass skipping those entries (kernels/sparse_attention.py,
`_forward_csr(local=True)`), against the path that gathers every slot and merges every partial (`local=False`).

The inputs are `m3c bench`'s (same seed and draw order, the fused indexer's selection on random index inputs), so
the rows compare with the bench's attention row; every time is the bench's own timer (`tools.bench._time`). Rows:

    dense          SDPA, causal (the share of ideal's numerator)
    all_slots      local=False: every slot gathered, combine_kernel merges
    local          local=True at the default config of combine_local_kernel
    local_RxWxS    local=True with combine_local_kernel at R rows x W warps, its slot loop's loads pipelined over S
                   stages (--configs)
    local_rowsN    local=True with N gathered rows per gather program (FORWARD_CHUNK_ROWS; default 2048)
and the largest relative difference of the local path from all_slots (output and log-sum-exp), and the device time
per kernel of one local call.

    python benchmarks/experiments/local_combine.py [--heads 32 --kv-heads 8 --length 131072]
        [--configs 64x4x2,64x4x3,32x4x4] [--chunk-rows 4096]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from m3compile.kernels import sparse_attention as sa
from m3compile.kernels._tl_sparse import combine_local_kernel
from m3compile.kernels.indexer import select_blocks
from m3compile.tools import bench
from m3compile.tools.bench_common import profile_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--configs", default="64x4x2,64x4x3,64x4x4,32x4x3,32x4x4",
                    help="ROWSxWARPSxSTAGES of combine_local_kernel")
    ap.add_argument("--chunk-rows", default="4096", help="gathered rows per gather program to try ('' none)")
    ap.add_argument("--no-dense", action="store_true")
    a = ap.parse_args()
    T = a.length
    cfg = bench.BenchConfig(heads=a.heads, kv_heads=a.kv_heads, prefill_lengths=(T,), decode_lengths=(),
                            selections=("independent",), flex=False)
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(cfg.seed)  # bench._prefill_one's draws, in its order
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    q_idx = torch.randn(1, T, Hkv, cfg.index_dim, device=dev, dtype=dt, generator=g)
    k_idx = torch.randn(1, T, cfg.index_dim, device=dev, dtype=dt, generator=g)
    blocks = select_blocks(q_idx, k_idx, block_size=cfg.block, topk=cfg.topk)
    bs, scale = cfg.block, D**-0.5
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "T": T, "heads": H, "kv_heads": Hkv, "rows": {}}
    ideal = bench.prefill_flops(T, H, D) / bench.prefill_flops(T, H, D, bench.visible_keys(blocks, bs))
    res["ideal"] = ideal

    def fwd(local, want_lse=False):
        return sa._forward(q, k, v, blocks, bs, scale, sa.PARTIAL_BYTES, None, "all", want_lse, local=local)

    def row(name, ms, **extra):
        res["rows"][name] = dict(ms=round(ms, 4), **extra)
        print(json.dumps({name: res["rows"][name]}), flush=True)

    if not a.no_dense:
        row("dense", bench._time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                        enable_gqa=True), cfg))
    out_all, lse_all = fwd(False, True)
    row("all_slots", bench._time(lambda: fwd(False), cfg))
    out, lse = fwd(True, True)
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
    res["local_vs_all_slots"] = dict(out_rel=rel(out, out_all), lse_max_abs=(lse - lse_all).abs().max().item())
    print(json.dumps(res["local_vs_all_slots"]), flush=True)
    del out_all, lse_all, out, lse
    row("local", bench._time(lambda: fwd(True), cfg))
    default = list(combine_local_kernel.configs)
    for c in [c for c in a.configs.split(",") if c]:
        r, w, ns = (int(x) for x in c.split("x"))
        combine_local_kernel.configs = [triton.Config(dict(ROWS=r, NS=ns), num_warps=w, num_stages=1)]
        combine_local_kernel.cache.clear()
        try:
            row(f"local_{c}", bench._time(lambda: fwd(True), cfg))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a row too
            res["rows"][f"local_{c}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    combine_local_kernel.configs = default
    combine_local_kernel.cache.clear()
    old = sa.FORWARD_CHUNK_ROWS
    for n in [int(x) for x in a.chunk_rows.split(",") if x]:
        sa.FORWARD_CHUNK_ROWS = n
        try:
            row(f"local_rows{n}", bench._time(lambda: fwd(True), cfg))
        finally:
            sa.FORWARD_CHUNK_ROWS = old
    prof = profile_run(lambda: fwd(True), "cuda")
    names: dict[str, float] = {}
    for d in prof.device_events:
        names[d.name[:60]] = names.get(d.name[:60], 0.0) + d.time_range.elapsed_us() / 1e3
    res["kernels_local"] = {n: round(t, 3) for n, t in sorted(names.items(), key=lambda x: -x[1])[:8]}
    d = res["rows"].get("dense", {}).get("ms")
    if d:
        res["share_of_ideal"] = {n: round(d / r["ms"] / ideal, 4) for n, r in res["rows"].items() if "ms" in r}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
