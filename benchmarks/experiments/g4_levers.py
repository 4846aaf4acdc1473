"""What G = 4's sparse attention at 128K spends beyond its kernels, and what each remaining lever would save
(sparse attention at G = 4 against 0.45 of ideal).

The inputs are `m3c bench kernels`' (`_prefill_one`: same seed, same draw order, the fused indexer's
selection on random index inputs), so the base row is the bench's attention row. Every time is the bench's own
timer (`bench.kernels._time`: triton's do_bench, median, L2 flushed before each run) unless the row says otherwise:

    base          sparse_attention as `m3c bench kernels` times it
    base_events   the same, CUDA events around single calls with a sync between them (bench_common.median_ms)
    base_graph    the same captured in a CUDA graph and replayed (no host launch time at all)
    balanced      query chunks of equal size (today: chunks of the budget's size and a short last one)
    one_chunk     a partial budget large enough for one query chunk (no CSR rebuilt per chunk)
    rows2048      2,048 gathered rows per program for every query chunk (the default below
                  sparse_attention.LONG_ROWS rows a query chunk; chunks of at least that many take 4,096)
    no_local      the selection with each token's own (local) block removed (slot set to -1): what the gather and
                  the combine cost for the local block, the upper bound of computing it elsewhere
    csr           the CSR build alone for the base's chunks
and a profile of three calls back to back: device time per kernel name, and the idle time between kernels with
the largest gaps and the kernels around them (what the host's launches cost on the device).

    python benchmarks/experiments/g4_levers.py [--heads 32 --kv-heads 8 --length 131072] > OUT.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from m3compile.kernels import sparse_attention as sa
from m3compile.kernels._common import next_pow2
from m3compile.kernels.indexer import select_blocks
from m3compile.kernels.sparse_attention import build_csr, forward_stage, sparse_attention
from m3compile.bench import kernels as bench
from m3compile.bench.common import median_ms, profile_run


def timeline(fn, calls: int = 3) -> dict:
    """Device kernels of `calls` back-to-back calls of fn (one sync at the end): ms per kernel name, the idle time
    between consecutive kernels, and the largest gaps with their neighbours."""
    fn()
    ev = [e for e in profile_run(lambda: [fn() for _ in range(calls)], "cuda").device_events
          if e.time_range.elapsed_us() > 0]
    ev.sort(key=lambda e: e.time_range.start)
    names: dict[str, float] = {}
    for e in ev:
        names[e.name[:60]] = names.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3 / calls
    gaps = []
    for a, b in zip(ev, ev[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 0:
            gaps.append((gap / 1e3, a.name[:40], b.name[:40]))
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3 / calls
    return dict(span_ms_per_call=round(span, 3), kernels={n: round(t, 3) for n, t in sorted(names.items(),
                                                                                             key=lambda x: -x[1])},
                kernel_sum_ms=round(sum(names.values()), 3), idle_ms_per_call=round(sum(g[0] for g in gaps) / calls, 3),
                launches_per_call=len(ev) // calls,
                largest_gaps=[(round(g, 3), a, b) for g, a, b in sorted(gaps, reverse=True)[:8]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (no timeline)")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    T = a.length
    cfg = bench.BenchConfig(heads=a.heads, kv_heads=a.kv_heads, prefill_lengths=(T,), decode_lengths=(),
                            selections=("independent",), flex=False, device=a.device)
    dev = a.device
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    q, k, v, q_idx, k_idx = bench.prefill_inputs(cfg, T)  # the bench's own draws
    blocks = select_blocks(q_idx, k_idx, block_size=cfg.block, topk=cfg.topk)
    bs, scale = cfg.block, D**-0.5
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "T": T, "heads": H, "kv_heads": Hkv, "rows": {}}

    def row(name, ms, **extra):
        res["rows"][name] = dict(ms=round(ms, 4), **extra)
        print(json.dumps({name: res["rows"][name]}), flush=True)

    attn = lambda sel=blocks, **kw: sparse_attention(q, k, v, sel, block_size=bs, scale=scale, **kw)  # noqa: E731
    if "dense" not in skip:
        row("dense", bench._time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                        enable_gqa=True), cfg))
    ideal = bench.prefill_flops(T, H, D) / bench.prefill_flops(T, H, D, bench.visible_keys(blocks, bs))
    res["ideal"] = ideal
    row("base", bench._time(attn, cfg))
    row("base_gather", bench._time(lambda: forward_stage(q, k, v, blocks, block_size=bs, scale=scale), cfg))
    row("base_events", median_ms(attn, steps=10, warmup=2, device=dev)[0])
    if "graph" not in skip and dev == "cuda":
        import triton.testing as tt

        try:
            row("base_graph", float(tt.do_bench_cudagraph(attn, rep=cfg.rep_ms, return_mode="median")))
        except Exception as e:  # noqa: BLE001
            res["rows"]["base_graph"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    G, K = H // Hkv, cfg.topk
    GP = next_pow2(G)
    row_bytes = K * Hkv * GP * (D * q.element_size() + 4)  # partials per query token, as _forward_csr counts them
    C = max(1, min(T, sa.PARTIAL_BYTES // row_bytes))
    n_chunks = -(-T // C)
    res["chunks"] = [min(C, T - t0) for t0 in range(0, T, C)]
    row("balanced", bench._time(lambda: attn(query_chunk=-(-T // n_chunks)), cfg), chunks=n_chunks)
    if "one_chunk" not in skip:
        row("one_chunk", bench._time(lambda: attn(max_partial_bytes=T * row_bytes + 1), cfg),
            partial_gb=T * row_bytes / 1e9)
    old = sa.LONG_ROWS
    sa.LONG_ROWS = 1 << 62  # every query chunk at FORWARD_CHUNK_ROWS (2048), the short chunks' default
    try:
        row("rows2048", bench._time(attn, cfg))
    finally:
        sa.LONG_ROWS = old
    tok = torch.arange(T, device=dev, dtype=blocks.dtype).view(1, 1, T, 1) // bs
    no_local = torch.where(blocks == tok, -1, blocks)
    res["local_share"] = (blocks == tok).sum().item() / (blocks >= 0).sum().item()
    row("no_local", bench._time(lambda: attn(no_local), cfg))
    row("no_local_gather", bench._time(lambda: forward_stage(q, k, v, no_local, block_size=bs, scale=scale), cfg))
    nb = -(-T // bs)

    def csr_all():  # the CSR of every query chunk the forward walks
        return [build_csr(blocks, nb, t0, min(T, t0 + C), sa.attention_chunk(G, Hkv * C * K)) for t0 in range(0, T, C)]

    row("csr", bench._time(csr_all, cfg))
    if dev != "cuda":
        print("RESULT " + json.dumps(res))
        return
    res["timeline_all"] = timeline(attn)
    res["timeline_csr"] = timeline(csr_all)
    d = res["rows"].get("dense", {}).get("ms")
    if d:
        res["share_of_ideal"] = {n: round(d / r["ms"] / ideal, 4) for n, r in res["rows"].items() if "ms" in r}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
