"""`m3c bench kernels` (and `backward`, `vision`): MSA kernels against dense SDPA and FlexAttention, on one GPU.

Prefill, per length T (one sequence, bf16, 64 query heads / 4 KV heads / head dim 128, index 4 x 128 with one key
head, block 128, top-16 by default):
    dense      SDPA causal with enable_gqa (measured up to --dense-max, extrapolated as T^2 beyond and marked so)
    flex       FlexAttention, BlockMask built from the same selection (per 128-query block, the union of the
               blocks its tokens chose; a mask_mod keeps each token to its own blocks)
    attention  this project's gather-Q sparse attention alone
    indexer    fused scores + block max + top-k (bf16), and with fp8 scoring (index_dtype "fp8": the keys quantised
               per key block, then the kernel, which quantises the query rows), with the share of the bf16 selection's
               blocks that fp8 scoring also selects and of the (head, token) rows it selects identically
    msa        indexer + attention (the whole MSA prefill, index projections excluded), bf16 and fp8 indexer
Selections: "independent" = what the indexer picks on random index queries/keys (per-token selections barely
overlap: FlexAttention's worst case); "shared" = every token of a 128-token query block uses its last token's
selection (FlexAttention's best case). The gather-Q kernel does the same work for both.

Decode, per context length, batch B: dense SDPA over a contiguous cache vs paged select + split-K attention
with bf16 and with fp8 index keys. Timed as CUDA-graph replays (launch overhead excluded from both sides).

Every figure is the median of repeated timed runs after warm-up (triton.testing.do_bench / do_bench_cudagraph,
CUDA events). Writes bench.json and bench.png (speedup vs context length) to --out.
"""
from __future__ import annotations

import functools
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table

from m3compile.config import check_size
from m3compile.errors import M3CompileError
from m3compile.outputs import atomic_save_figure, atomic_write_text, check_output_folder
from m3compile.kernels.decode import paged_attention, paged_select, quantize_pages
from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.kernels.sparse_attention import forward_stage, sparse_attention, sparse_attention_lse
from m3compile.kernels.sparse_kl import sparse_index_kl
from m3compile.kernels.varlen_attention import varlen_attention, window_segments

__all__ = ["BenchConfig", "BenchResult", "VisionBenchConfig", "run_bench", "run_backward_bench", "run_vision_bench",
           "render", "render_backward", "render_vision", "write_json",
           "speedups", "write_outputs", "visible_keys", "flex_block_mask", "prefill_flops", "selection_agreement",
           "prefill_inputs"]


@dataclass(frozen=True)
class BenchConfig:
    heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    index_dim: int = 128
    block: int = 128
    topk: int = 16
    prefill_lengths: tuple[int, ...] = (8192, 32768, 131072, 524288, 1048576)
    decode_lengths: tuple[int, ...] = (32768, 131072, 524288, 1048576)
    batch: int = 8
    dense_max: int = 131072  # dense prefill is measured up to here and extrapolated (T^2) beyond
    selections: tuple[str, ...] = ("independent", "shared")
    flex: bool = True
    query_chunk_sweep: tuple[int, ...] = ()  # also time the attention with these query chunks (tuning aid)
    flex_max: int = 131072  # beyond, Flex's per-query-head kv_indices ([Hq, T/128, T/128] int32) outgrow memory
    device: str = "cuda"
    warmup_ms: int = 100
    rep_ms: int = 500
    seed: int = 0

    def __post_init__(self):
        for name in ("heads", "kv_heads", "head_dim", "index_dim", "block", "topk"):
            if getattr(self, name) < 1:
                raise M3CompileError(f"{name} must be >= 1")
        if self.heads % self.kv_heads:
            raise M3CompileError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        check_size(self.batch, "batch", "batch")
        for name in ("prefill_lengths", "decode_lengths", "query_chunk_sweep"):
            for n in getattr(self, name):
                check_size(n, name)
        check_size(self.dense_max, "dense_max")
        check_size(self.flex_max, "flex_max")
        for name in ("rep_ms", "warmup_ms"):
            if not getattr(self, name) >= 1:
                raise M3CompileError(f"{name} must be >= 1 millisecond, got {getattr(self, name)}")
        bad = [s for s in self.selections if s not in ("independent", "shared")]
        if bad:
            raise M3CompileError(f"unknown selection {bad[0]!r} (use independent or shared)")


@dataclass
class BenchResult:
    config: dict
    env: dict
    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    autotune: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# FLOP and byte models


def visible_keys(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Keys each (group, token) attends to: per valid slot, the causally visible part of its block. [B, Hkv, T]."""
    T = blocks.shape[2]
    t = torch.arange(T, device=blocks.device).view(1, 1, T, 1)
    start = blocks.long() * block
    n = (t - start + 1).clamp(min=0, max=block)
    return torch.where(blocks >= 0, n, 0).sum(-1)


def prefill_flops(T: int, heads: int, head_dim: int, keys_per_group_token: torch.Tensor | None = None) -> float:
    """Attention FLOPs (QK^T and PV): dense causal when `keys_per_group_token` is None, else over those keys."""
    if keys_per_group_token is None:
        return 4.0 * heads * head_dim * T * (T + 1) / 2
    G = heads // keys_per_group_token.shape[1]
    return 4.0 * G * head_dim * float(keys_per_group_token.sum())


def index_flops(T: int, index_heads: int, index_dim: int) -> float:
    return 2.0 * index_heads * index_dim * T * (T + 1) / 2


def selection_agreement(blocks: torch.Tensor, baseline: torch.Tensor, chunk: int = 8192) -> tuple[float, float]:
    """How much a selection [B, H, T, K] agrees with a baseline one (slot order ignored): the share of the baseline's
    valid (non -1) blocks it also selects, and the share of (head, token) rows selected identically."""
    hit = valid = same = 0
    for t in range(0, blocks.shape[2], chunk):
        a, b = blocks[:, :, t:t + chunk].long(), baseline[:, :, t:t + chunk].long()
        ok = b >= 0
        hit += int(((b[..., :, None] == a[..., None, :]).any(-1) & ok).sum())
        valid += int(ok.sum())
        same += int((a.sort(-1).values == b.sort(-1).values).all(-1).sum())
    return hit / max(1, valid), same / max(1, blocks.shape[0] * blocks.shape[1] * blocks.shape[2])


# ---------------------------------------------------------------------------------------------------------------
# FlexAttention


def flex_block_mask(blocks: torch.Tensor, heads: int, block: int):
    """A FlexAttention BlockMask for the selection [B, Hkv, T, K]: per (query head, 128-query block) the union of
    its tokens' blocks, and a mask_mod that keeps each token to its own causally visible blocks (a bit set)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Hkv, T, K = blocks.shape
    G = heads // Hkv
    nb = -(-T // block)
    valid = blocks >= 0
    safe = blocks.long().clamp(min=0)
    # per token: bit set of chosen blocks, packed in bytes [B, Hkv, T, ceil(nb / 8)]
    bits = torch.zeros(B, Hkv, T, -(-nb // 8), dtype=torch.uint8, device=blocks.device)
    one = torch.ones_like(safe, dtype=torch.uint8) << (safe % 8).to(torch.uint8)
    for s in range(K):  # scatter_add would sum duplicate bytes; slots are distinct blocks, so OR by slot
        byte = safe[..., s:s + 1] // 8
        cur = bits.gather(-1, byte)
        bits.scatter_(-1, byte, torch.where(valid[..., s:s + 1], cur | one[..., s:s + 1], cur))
    # per query block: union of its tokens' blocks
    nq = nb
    union = torch.zeros(B, Hkv, nq, nb + 1, dtype=torch.bool, device=blocks.device)
    qb = (torch.arange(T, device=blocks.device) // block).view(1, 1, T, 1).expand(B, Hkv, T, K)
    flat = qb * (nb + 1) + torch.where(valid, safe, nb)
    union.view(B, Hkv, -1).scatter_(-1, flat.reshape(B, Hkv, -1), True)
    union = union[..., :nb]
    num = union.sum(-1).int()
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).int()
    num = num.repeat_interleave(G, dim=1)
    order = order.repeat_interleave(G, dim=1)

    def mask_mod(b, h, q_idx, kv_idx):
        kvb = kv_idx // block
        byte = bits[b, h // G, q_idx, kvb // 8]
        return ((byte >> (kvb % 8).to(torch.uint8)) & 1).bool() & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T))


# ---------------------------------------------------------------------------------------------------------------
# timing


def _time(fn, cfg: BenchConfig, graph: bool = False) -> float:
    """Median ms of repeated runs after warm-up (CUDA events); `graph` times CUDA-graph replays."""
    if cfg.device != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=cfg.rep_ms, return_mode="median"))
        except Exception:  # a path that cannot be captured is timed plainly
            torch.cuda.synchronize()
    return float(tt.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))


def _shared_selection(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Every token of a query block takes the selection of the block's last token (causally still valid: that
    selection holds the query block itself and earlier blocks only)."""
    T = blocks.shape[2]
    last = ((torch.arange(T, device=blocks.device) // block + 1) * block - 1).clamp(max=T - 1)
    return blocks[:, :, last]


def prefill_inputs(cfg: BenchConfig, T: int):
    """The prefill rows' inputs, one sequence of T tokens drawn from cfg.seed (bf16 on a GPU, fp32 elsewhere):
    q [1, H, T, D] (a head-major view of token-major memory, as in the graph), k, v [1, Hkv, T, D], the index
    queries [1, T, Hkv, Di] and keys [1, T, Di]. Experiments that must time the bench's own rows draw them here."""
    dev, dt = cfg.device, torch.bfloat16 if cfg.device == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    q_idx = torch.randn(1, T, Hkv, cfg.index_dim, device=dev, dtype=dt, generator=g)
    k_idx = torch.randn(1, T, cfg.index_dim, device=dev, dtype=dt, generator=g)
    return q, k, v, q_idx, k_idx


def _prefill_one(cfg: BenchConfig, T: int, log) -> list[dict]:
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    q, k, v, q_idx, k_idx = prefill_inputs(cfg, T)
    scale = D**-0.5

    def indexer():
        return select_blocks(q_idx, k_idx, block_size=cfg.block, topk=cfg.topk)

    def indexer_fp8():  # as the lowered msa_select with index_dtype "fp8" runs it: keys quantised, then the kernel
        k8, k_scale = quantize_index_keys(k_idx, cfg.block)  # one scale per key block, as the graph quantises
        return select_blocks(q_idx, k8, block_size=cfg.block, topk=cfg.topk, k_scale=k_scale)

    blocks = indexer()
    t_index = _time(indexer, cfg)
    t_index_fp8 = _time(indexer_fp8, cfg)
    same_blocks, same_rows = selection_agreement(indexer_fp8(), blocks)
    dense_flops = prefill_flops(T, H, D)
    if T <= cfg.dense_max:
        t_dense = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
                        cfg)
        dense_note = "measured"
    else:
        t_dense = None
        dense_note = "extrapolated"
    rows = []
    for sel_name in cfg.selections:
        sel = blocks if sel_name == "independent" else _shared_selection(blocks, cfg.block)
        vis = visible_keys(sel, cfg.block)
        sparse_fl = prefill_flops(T, H, D, vis)
        t_attn = _time(lambda: sparse_attention(q, k, v, sel, block_size=cfg.block, scale=scale), cfg)
        t_flex = None
        flex_err = None
        if cfg.flex and T <= cfg.flex_max:
            try:
                t_flex = _flex_time(cfg, q, k, v, sel, scale)
            except Exception as e:  # reported, not fatal: the table says why Flex has no figure
                flex_err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        t_gather = _time(lambda: forward_stage(q, k, v, sel, block_size=cfg.block, scale=scale, stage="gather"),
                         cfg)
        sweep = {}
        for qc in cfg.query_chunk_sweep:
            if qc < T:
                sweep[qc] = _time(lambda: sparse_attention(q, k, v, sel, block_size=cfg.block, scale=scale,
                                                           query_chunk=qc), cfg)
        rows.append(dict(T=T, selection=sel_name, gather_ms=t_gather, query_chunk_ms=sweep, dense_ms=t_dense, dense=dense_note, flex_ms=t_flex,
                         flex_error=flex_err, attention_ms=t_attn, indexer_ms=t_index, msa_ms=t_attn + t_index,
                         indexer_fp8_ms=t_index_fp8, msa_fp8_ms=t_attn + t_index_fp8, fp8_same_blocks=same_blocks,
                         fp8_same_rows=same_rows,
                         dense_tflops=dense_flops, sparse_tflops=sparse_fl,
                         ideal=dense_flops / sparse_fl, index_tflops=index_flops(T, Hkv, cfg.index_dim)))
        log(f"prefill T={T} {sel_name}: attention {t_attn:.3f} ms, indexer {t_index:.3f} ms (fp8 {t_index_fp8:.3f} "
            f"ms, {100 * same_blocks:.1f}% of the blocks the same), "
            f"flex {t_flex if t_flex is None else round(t_flex, 3)} ms, dense {t_dense} ms")
    return rows


def _flex_time(cfg: BenchConfig, q, k, v, blocks, scale) -> float:
    from torch.nn.attention.flex_attention import flex_attention

    mask = flex_block_mask(blocks, cfg.heads, cfg.block)
    fn = torch.compile(flex_attention, dynamic=False) if cfg.device == "cuda" else flex_attention
    return _time(lambda: fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True), cfg)


def _decode_one(cfg: BenchConfig, T: int, log) -> dict:

    dev, dt = cfg.device, torch.bfloat16 if cfg.device == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    B, H, Hkv, D, bs = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.block
    pages = -(-T // bs)
    q = torch.randn(B, H, 1, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, generator=g)
    t_dense = _time(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True), cfg, graph=True)
    dense_bytes = 2.0 * B * Hkv * T * D * k.element_size()
    # the same keys and values, paged [B * pages, bs, Hkv, D]; sequence b owns pages b * pages ...
    pad = pages * bs - T
    k_cache = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(B * pages, bs, Hkv, D)
    del k
    v_cache = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(B * pages, bs, Hkv, D)
    del v
    table = torch.arange(B * pages, device=dev, dtype=torch.int32).view(B, pages)
    seq_lens = torch.full((B,), T, device=dev, dtype=torch.int32)
    q_idx = torch.randn(B, Hkv, cfg.index_dim, device=dev, dtype=dt, generator=g)
    idx_cache = torch.randn(B * pages, bs, cfg.index_dim, device=dev, dtype=dt, generator=g)
    q1 = q[:, :, 0]
    row = dict(T=T, batch=B, dense_ms=t_dense, dense_bytes=dense_bytes)
    for name in ("bf16", "fp8"):
        if name == "fp8":
            idx_cache, idx_scale = quantize_pages(idx_cache)  # one scale per page, as generate's caches
        else:
            idx_scale = None

        def step(cache=idx_cache, scale=idx_scale):
            sel = paged_select(q_idx, cache, table, seq_lens, topk=cfg.topk, idx_scale=scale)
            return paged_attention(q1, k_cache, v_cache, sel, table, seq_lens)

        sel = paged_select(q_idx, idx_cache, table, seq_lens, topk=cfg.topk, idx_scale=idx_scale)
        row[f"msa_{name}_ms"] = _time(step, cfg, graph=True)
        row[f"select_{name}_ms"] = _time(
            lambda: paged_select(q_idx, idx_cache, table, seq_lens, topk=cfg.topk, idx_scale=idx_scale), cfg,
            graph=True)
        row[f"attention_{name}_ms"] = _time(lambda: paged_attention(q1, k_cache, v_cache, sel, table, seq_lens), cfg,
                                            graph=True)
        idx_bytes = idx_cache.numel() * idx_cache.element_size() + (0 if idx_scale is None else idx_scale.numel() * 4)
        sparse_kv = 2.0 * B * Hkv * min(cfg.topk, pages) * bs * D * dt.itemsize
        row[f"msa_{name}_bytes"] = idx_bytes + sparse_kv
        row[f"ideal_{name}"] = dense_bytes / (idx_bytes + sparse_kv)
        log(f"decode T={T} B={B} {name}: msa {row[f'msa_{name}_ms']:.4f} ms (select {row[f'select_{name}_ms']:.4f}, "
            f"attention {row[f'attention_{name}_ms']:.4f}), dense {t_dense:.4f} ms")
    return row


def _autotune_choices() -> dict:
    """The configs triton.autotune picked, per kernel and key."""
    out = {}
    import importlib

    for mod, names in (("m3compile.kernels.indexer._tl_indexer", ["index_topk_kernel", "index_topk_kernel_wide"]),
                       ("m3compile.kernels.sparse_attention._tl_sparse", ["gather_q_fwd_kernel", "gather_q_bwd_kernel"]),
                       ("m3compile.kernels.decode._tl_decode", ["paged_index_scores_kernel",
                                                                "paged_index_scores_fp8_kernel",
                                                                "paged_index_scores_fp8_narrow_kernel"]),
                       ("m3compile.kernels.sparse_kl._tl_kl", ["sparse_kl_fwd_kernel", "sparse_kl_bwd_kernel"]),
                       ("m3compile.kernels.varlen_attention._tl_varlen", ["varlen_fwd_kernel"])):
        try:
            m = importlib.import_module(mod)
        except Exception:
            continue
        for n in names:
            tuner = getattr(m, n)
            for key, cfgv in getattr(tuner, "cache", {}).items():
                out.setdefault(n, []).append({"key": [str(x) for x in key], "config": str(cfgv)})
    return out


def run_bench(cfg: BenchConfig, prefill: bool = True, decode: bool = True, log=print) -> BenchResult:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise M3CompileError("m3c bench kernels needs a CUDA GPU (use --device cpu for a smoke run of tiny shapes)")
    if not (prefill and cfg.prefill_lengths) and not (decode and cfg.decode_lengths):
        raise M3CompileError("nothing to run: give prefill or decode lengths")
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": cfg.device,
           "date": time.strftime("%Y-%m-%d")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if cfg.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    result = BenchResult(asdict(cfg), env)
    if prefill:
        for T in cfg.prefill_lengths:
            result.prefill.extend(_prefill_one(cfg, T, log))
            if cfg.device == "cuda":
                torch.cuda.empty_cache()
        _fill_extrapolated(result.prefill)
    if decode:
        for T in cfg.decode_lengths:
            result.decode.append(_decode_one(cfg, T, log))
            if cfg.device == "cuda":
                torch.cuda.empty_cache()
    result.autotune = _autotune_choices()
    return result


def _fill_extrapolated(rows: list[dict]) -> None:
    measured = [r for r in rows if r["dense"] == "measured"]
    if not measured:
        return
    ref = max(measured, key=lambda r: r["T"])
    for r in rows:
        if r["dense"] == "extrapolated":
            r["dense_ms"] = ref["dense_ms"] * r["dense_tflops"] / ref["dense_tflops"]


def speedups(result: BenchResult) -> tuple[list[dict], list[dict]]:
    pre = []
    for r in result.prefill:
        d = r["dense_ms"]
        pre.append(dict(
            T=r["T"], selection=r["selection"], dense=r["dense"], ideal=r["ideal"],
            attention_x=d / r["attention_ms"], share_of_ideal=d / r["attention_ms"] / r["ideal"],
            flex_x=None if r["flex_ms"] is None else d / r["flex_ms"],
            msa_x=d / r["msa_ms"],
            attention_tflops_s=r["sparse_tflops"] / r["attention_ms"] / 1e9,
            indexer_tflops_s=r["index_tflops"] / r["indexer_ms"] / 1e9,
            indexer_fp8_tflops_s=r["index_tflops"] / r["indexer_fp8_ms"] / 1e9,
            indexer_fp8_x=r["indexer_ms"] / r["indexer_fp8_ms"], msa_fp8_x=d / r["msa_fp8_ms"],
        ))
    dec = []
    for r in result.decode:
        dec.append(dict(T=r["T"], batch=r["batch"], bf16_x=r["dense_ms"] / r["msa_bf16_ms"],
                        fp8_x=r["dense_ms"] / r["msa_fp8_ms"], ideal_bf16=r["ideal_bf16"], ideal_fp8=r["ideal_fp8"],
                        dense_tb_s=r["dense_bytes"] / r["dense_ms"] / 1e9,
                        bf16_tb_s=r["msa_bf16_bytes"] / r["msa_bf16_ms"] / 1e9))
    return pre, dec


def write_outputs(result: BenchResult, out: Path) -> None:
    """bench.json and bench.png (speedup over dense against context length) in the folder `out`, each through the
    output guard, written whole or not at all."""
    check_output_folder(out)
    pre, dec = speedups(result)
    payload = asdict(result) | {"speedups": {"prefill": pre, "decode": dec}}
    atomic_write_text(out / "bench.json", json.dumps(payload, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for sel in sorted({r["selection"] for r in pre}):
        rows = [r for r in pre if r["selection"] == sel]
        xs = [r["T"] for r in rows]
        ax.plot(xs, [r["attention_x"] for r in rows], "o-", label=f"sparse attention ({sel})")
        ax.plot(xs, [r["msa_x"] for r in rows], "s-", label=f"indexer + attention ({sel})")
        if any(r["flex_x"] for r in rows):
            ax.plot([r["T"] for r in rows if r["flex_x"]], [r["flex_x"] for r in rows if r["flex_x"]], "^--",
                    label=f"FlexAttention ({sel})")
    if pre:
        xs = sorted({r["T"] for r in pre})
        ideal = {r["T"]: r["ideal"] for r in pre if r["selection"] == pre[0]["selection"]}
        ax.plot(xs, [ideal[x] for x in xs], "k:", label="ideal (FLOPs)")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="speedup over dense SDPA",
           title="prefill")
    ax.legend(fontsize=7)
    ax = axes[1]
    if dec:
        xs = [r["T"] for r in dec]
        ax.plot(xs, [r["bf16_x"] for r in dec], "o-", label="MSA decode, bf16 index keys")
        ax.plot(xs, [r["fp8_x"] for r in dec], "s-", label="MSA decode, fp8 index keys")
        ax.plot(xs, [r["ideal_bf16"] for r in dec], "k:", label="byte limit, bf16")
        ax.plot(xs, [r["ideal_fp8"] for r in dec], "k--", label="byte limit, fp8")
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="speedup over dense SDPA",
               title=f"decode, batch {dec[0]['batch']}")
        ax.legend(fontsize=7)
    gpu = result.env.get("gpu", result.env["device"])
    fig.suptitle(f"m3c bench kernels: {gpu}, torch {result.env['torch']}, triton {result.env['triton']}", fontsize=9)
    fig.tight_layout()
    try:
        atomic_save_figure(fig, out / "bench.png", dpi=110)
    finally:
        plt.close(fig)


def render(result: BenchResult, cfg: BenchConfig, out_dir: Path) -> list:
    """What `m3c bench kernels` prints (rich tables and lines): the prefill and decode tables, then what was written
    to `out_dir`."""
    out = []
    pre, dec = speedups(result)

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    if result.prefill:
        t = Table(title=f"prefill ({cfg.heads} q heads, {cfg.kv_heads} kv heads, d {cfg.head_dim}, block {cfg.block}, "
                        f"top-{cfg.topk})")
        for c in ("T", "selection", "dense ms", "flex ms", "attention ms", "indexer ms", "indexer fp8 ms",
                  "fp8 same blocks", "msa ms", "attention x", "ideal x", "share of ideal", "flex x", "msa x",
                  "msa fp8 x"):
            t.add_column(c, justify="right")
        for r, s in zip(result.prefill, pre):
            dense = ms(r["dense_ms"]) + ("*" if r["dense"] == "extrapolated" else "")
            t.add_row(f"{r['T']:,}", r["selection"], dense, ms(r["flex_ms"]), ms(r["attention_ms"]),
                      ms(r["indexer_ms"]), ms(r["indexer_fp8_ms"]), f"{100 * r['fp8_same_blocks']:.1f}%",
                      ms(r["msa_ms"]), f"{s['attention_x']:.1f}", f"{s['ideal']:.1f}",
                      f"{s['share_of_ideal']:.2f}", "-" if s["flex_x"] is None else f"{s['flex_x']:.1f}",
                      f"{s['msa_x']:.1f}", f"{s['msa_fp8_x']:.1f}")
        out.append(t)
        out.append("indexer fp8: keys quantised per key block, then fp8 x fp8 scores (query rows quantised in the "
                      "kernel); fp8 same blocks: share of the bf16 selection's blocks fp8 scoring also selects")
        if any(r["dense"] == "extrapolated" for r in result.prefill):
            out.append("* dense time extrapolated from the longest measured length as causal FLOPs (T^2)")
    if result.decode:
        t = Table(title=f"decode (batch {cfg.batch})")
        for c in ("T", "dense ms", "msa bf16 ms", "msa fp8 ms", "bf16 x", "fp8 x", "byte limit bf16", "byte limit fp8"):
            t.add_column(c, justify="right")
        for r, s in zip(result.decode, dec):
            t.add_row(f"{r['T']:,}", ms(r["dense_ms"]), f"{r['msa_bf16_ms']:.4f}", f"{r['msa_fp8_ms']:.4f}",
                      f"{s['bf16_x']:.2f}", f"{s['fp8_x']:.2f}", f"{s['ideal_bf16']:.2f}", f"{s['ideal_fp8']:.2f}")
        out.append(t)
    out.append(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# vision: 3D windowed attention of a batch of videos


@dataclass(frozen=True)
class VisionBenchConfig:
    steps: tuple[int, ...] = (8, 13, 21, 34, 64)  # temporal steps of each video
    grid: int = 32  # patches per side of every frame
    window: int = 4  # temporal steps per 3D window
    heads: int = 16
    head_dim: int = 80
    block_ms: tuple[int, ...] = (64, 128)  # query-tile heights of the fused kernel to time (the best one counts)
    device: str = "cuda"
    warmup_ms: int = 100
    rep_ms: int = 500
    seed: int = 0

    def __post_init__(self):
        if not self.steps or min(self.steps) < 1 or self.grid < 1 or self.window < 1:
            raise M3CompileError("vision bench needs videos of >= 1 step, a grid >= 1 and a window >= 1")


def run_vision_bench(cfg: VisionBenchConfig, log=print) -> dict:
    """Fused varlen kernel vs a Python loop of SDPA calls per window vs one SDPA over windows padded to the longest."""

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise M3CompileError("m3c bench vision needs a CUDA GPU (use --device cpu for a smoke run)")
    dev, dt = cfg.device, torch.bfloat16 if cfg.device == "cuda" else torch.float32
    bench_cfg = BenchConfig(device=cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
    grids = [[t, cfg.grid, cfg.grid] for t in cfg.steps]
    cu = window_segments(grids, cfg.window, device=dev)
    bounds = cu.tolist()
    N, H, D = bounds[-1], cfg.heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    q, k, v = (torch.randn(N, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    S, L = len(lengths), max(lengths)
    # padded layout: token index of every (window, slot), -1 past each window's end
    slot = torch.arange(L, device=dev)
    starts = cu[:-1].long()[:, None]
    lens = (cu[1:] - cu[:-1]).long()[:, None]
    index = torch.where(slot[None] < lens, starts + slot[None], -1)  # [S, L]
    valid = index >= 0
    flat = index.clamp(min=0).flatten()
    key_mask = valid[:, None, None, :]  # [S, 1, 1, L]

    def loop():
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                               v[a:b].transpose(0, 1)[None])
            out[a:b] = o[0].transpose(0, 1)
        return out

    def padded():
        qp, kp, vp = (x[flat].view(S, L, H, D).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=key_mask)  # [S, H, L, D]
        out = torch.empty_like(q)
        out[index[valid]] = o.transpose(1, 2)[valid]
        return out

    fused = {bm: (lambda bm=bm: varlen_attention(q, k, v, cu, block_m=bm)) for bm in cfg.block_ms}
    ref_out = loop()
    err = {name: ((fn().float() - ref_out.float()).norm() / ref_out.float().norm()).item()
           for name, fn in [("padded", padded)] + [(f"fused_bm{bm}", fn) for bm, fn in fused.items()]}
    times = {name: _time(fn, bench_cfg) for name, fn in (("loop", loop), ("padded", padded))}
    fused_ms = {bm: _time(fn, bench_cfg) for bm, fn in fused.items()}
    best_bm = min(fused_ms, key=fused_ms.get)
    times["fused"] = fused_ms[best_bm]
    err["fused"] = err[f"fused_bm{best_bm}"]
    flops = sum(4.0 * H * D * n * n for n in lengths)
    best_baseline = min(times["loop"], times["padded"])
    result = dict(config=asdict(cfg), windows=S, tokens=N, longest=L, flops=flops, ms=times,
                  fused_ms_by_block_m=fused_ms, best_block_m=best_bm,
                  rel_err_vs_loop=err, speedup_vs_best_baseline=best_baseline / times["fused"],
                  autotune=_autotune_choices(),
                  fused_tflops_s=flops / times["fused"] / 1e9)
    log(f"vision: {S} windows, {N:,} tokens: loop {times['loop']:.3f} ms, padded {times['padded']:.3f} ms, "
        f"fused {times['fused']:.3f} ms (BLOCK_M {best_bm}; " + ", ".join(f"{b}: {t:.3f}" for b, t in fused_ms.items())
        + ")")
    return result


# ---------------------------------------------------------------------------------------------------------------
# training: forward + backward of the sparse attention, and the fused KL's memory


def run_backward_bench(cfg: BenchConfig, lengths: tuple[int, ...], log=print) -> dict:
    """Sparse attention forward+backward vs dense SDPA forward+backward at M3 shapes, and the fused sparse KL's
    time and peak memory (forward + backward, its teacher log-sum-exp pass included) at each length: the memory must
    grow linearly in T. Also the KL step as a lowered training graph runs it: teacher log-sum-exp given (taken from
    the attention forward)."""

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise M3CompileError("m3c bench backward needs a CUDA GPU (use --device cpu for a smoke run)")
    if not lengths:
        raise M3CompileError("nothing to run: give --lengths")
    for n in lengths:
        check_size(n, "lengths")
    dev, dt = cfg.device, torch.bfloat16 if cfg.device == "cuda" else torch.float32
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    rows = []
    for T in lengths:
        g = torch.Generator(device=dev).manual_seed(cfg.seed)
        q = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2).requires_grad_()
        k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g, requires_grad=True)
        v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g, requires_grad=True)
        q_idx = torch.randn(1, T, Hkv, cfg.index_dim, device=dev, dtype=dt, generator=g, requires_grad=True)
        k_idx = torch.randn(1, T, cfg.index_dim, device=dev, dtype=dt, generator=g, requires_grad=True)
        d_out = torch.randn(1, H, T, D, device=dev, dtype=dt, generator=g)
        with torch.no_grad():
            blocks = select_blocks(q_idx, k_idx, block_size=cfg.block, topk=cfg.topk)
        scale = D**-0.5

        def dense():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(d_out)

        def sparse():
            sparse_attention(q, k, v, blocks, block_size=cfg.block, scale=scale).backward(d_out)

        def kl_step():
            sparse_index_kl(q_idx, k_idx, q.detach(), k.detach(), blocks, block_size=cfg.block, scale=scale).sum() \
                .backward()

        def sparse_fwd():
            with torch.no_grad():
                sparse_attention(q, k, v, blocks, block_size=cfg.block, scale=scale)

        with torch.no_grad():
            teacher_lse = sparse_attention_lse(q, k, v, blocks, block_size=cfg.block, scale=scale)[1]

        def kl_step_given_lse():
            sparse_index_kl(q_idx, k_idx, q.detach(), k.detach(), blocks, block_size=cfg.block, scale=scale,
                            teacher_lse=teacher_lse).sum().backward()

        t_dense = _time(dense, cfg) if T <= cfg.dense_max else None
        t_sparse = _time(sparse, cfg)
        t_sparse_fwd = _time(sparse_fwd, cfg)
        t_kl = _time(kl_step, cfg)
        t_kl_lse = _time(kl_step_given_lse, cfg)
        peak = None
        if dev == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            kl_step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        vis = visible_keys(blocks, cfg.block)
        ideal = prefill_flops(T, H, D) / prefill_flops(T, H, D, vis)
        row = dict(T=T, dense_fwd_bwd_ms=t_dense, sparse_fwd_bwd_ms=t_sparse, sparse_fwd_ms=t_sparse_fwd, ideal=ideal,
                   speedup=None if t_dense is None else t_dense / t_sparse,
                   share_of_ideal=None if t_dense is None else t_dense / t_sparse / ideal,
                   kl_fwd_bwd_ms=t_kl, kl_given_lse_fwd_bwd_ms=t_kl_lse, kl_peak_bytes=peak)
        rows.append(row)
        log(f"backward T={T}: dense {t_dense} ms, sparse {t_sparse:.3f} ms, KL {t_kl:.3f} ms (teacher LSE given: "
            f"{t_kl_lse:.3f} ms), KL peak {peak}")
        for t in (q, k, v, q_idx, k_idx):
            t.grad = None
        if dev == "cuda":
            torch.cuda.empty_cache()
    return {"config": asdict(cfg), "rows": rows, "autotune": _autotune_choices()}


def write_json(result: dict, path: Path) -> Path:
    """`result` as indented JSON at `path` (its folder made), through the output guard: whole or not at all."""
    check_output_folder(path.parent)
    return atomic_write_text(path, json.dumps(result, indent=2) + "\n")


def render_backward(result: dict, cfg: BenchConfig, path: Path) -> list:
    """What `m3c bench backward` prints: the forward + backward table, then where `result` was written."""
    out = []
    t = Table(title=f"forward + backward ({cfg.heads} q heads, {cfg.kv_heads} kv heads, d {cfg.head_dim}, block "
                    f"{cfg.block}, top-{cfg.topk})")
    for c in ("T", "dense fwd+bwd ms", "sparse fwd+bwd ms", "sparse fwd ms", "speedup", "ideal", "share of ideal",
              "KL fwd+bwd ms", "KL, LSE given ms", "KL peak MB"):
        t.add_column(c, justify="right")
    for r in result["rows"]:
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        t.add_row(f"{r['T']:,}", f(r["dense_fwd_bwd_ms"], 3), f(r["sparse_fwd_bwd_ms"], 3), f(r["sparse_fwd_ms"], 3),
                  f(r["speedup"]),
                  f(r["ideal"]), f(r["share_of_ideal"]), f(r["kl_fwd_bwd_ms"], 3), f(r["kl_given_lse_fwd_bwd_ms"], 3),
                  "-" if r["kl_peak_bytes"] is None else f"{r['kl_peak_bytes'] / 2**20:.1f}")
    out.append(t)
    out.append(f"wrote {path}")
    return out


def render_vision(result: dict, cfg: VisionBenchConfig, path: Path) -> list:
    """What `m3c bench vision` prints: the table of the three methods, then the speedup and where it was written."""
    out = []
    t = Table(title=f"3D windowed attention: {result['windows']} windows of <= {cfg.window} steps, "
                    f"{result['tokens']:,} tokens, {cfg.heads} heads x {cfg.head_dim}")
    for c in ("method", "ms", "TFLOP/s", "rel. error vs loop"):
        t.add_column(c, justify="right")
    for name, label in (("loop", "Python loop of SDPA per window"),
                        ("padded", "SDPA over windows padded to the longest"),
                        ("fused", f"fused varlen kernel (one launch, BLOCK_M {result['best_block_m']})")):
        ms = result["ms"][name]
        t.add_row(label, f"{ms:.3f}", f"{result['flops'] / ms / 1e9:.0f}",
                  "-" if name == "loop" else f"{result['rel_err_vs_loop'][name]:.1e}")
    out.append(t)
    out.append(f"fused vs the faster baseline: {result['speedup_vs_best_baseline']:.2f}x; wrote {path}")
    return out
