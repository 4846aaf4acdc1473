"""`m3c bench model PRESET|DIR`: the whole model, dense against converted-and-lowered: time to first token at a
list of lengths and decode tokens/s at batch B, each split into stages.

Models: a preset's shapes with random weights built on the device (`llama3-8b`, `qwen2.5-7b`, ...), or a checkpoint
directory; a dense one is converted in memory (m3compile.convert: block / top-k, layer 0 dense), a converted one
gets its dense twin (the same weights without the index branch).

Prefill, time to first token: one sequence of T random tokens through the backbone, then the logits of the last
position only (no [T, vocab] tensor: at 128K tokens and a 128K vocabulary it alone would be 34 GB):
    dense   the model as loaded, its backbone through m3compile.lower too (the same RMSNorm / RoPE kernels as the
            MSA side): SDPA causal attention in every layer
    msa     the converted model's backbone through m3compile.lower: the fused indexer and the gather-Q sparse
            attention in every MSA layer (layer 0 stays dense)
Timed with CUDA events (the median of up to `steps` runs after one warm-up, fewer where one run is long) up to
`dense_max` / `msa_max` tokens; one more run under torch.profiler splits the time into stages:
    attention        SDPA in dense layers, the sparse attention (m3c.msa_attention, SDPA inside it included) in MSA
                     layers
    indexer          index_projections: the index branch (lowered: m3c.index_branch, the fused projections, norms
                     and RoPE); index_select: the fused scoring + top-k (m3c.msa_select)
    projections_mlp  the q/k/v/o projections and the MLP's matmuls (gate/up/down, or a whole MoE block)
    rest             every other kernel: norms, RoPE, residual adds, the SwiGLU product, the embedding, the logits
    unattributed     kernels whose launch the profiler did not record (0 when it works; the JSON names them)
    host             the rest of the timed total: time the device waited for launches (on a CPU, where the
                     profiler's overhead inflates op times, the profiled split is scaled to the timed total)
Each kernel counts once (bench_common.Profile.attribute): for the innermost labelled range open when the host
launched it (its CUDA runtime / driver call, matched by CUPTI correlation id), except that m3c.msa_attention keeps
everything inside it; so the stages sum to the profiled kernel time (`attribution.work_ms`, beside the device-busy
union `busy_ms`, the launch routes and each stage's largest kernels) and, with host, to the timed total.
Longer lengths are extrapolated stage by stage from the longest timed one and marked "extrapolated": dense attention
and the selection as causal key pairs T(T+1)/2, the sparse attention as the keys a top-k selection reaches
(min(t+1, topk * block) summed over the queries t), the index projections, projections + MLP, rest and
unattributed linearly in T, host time constant.
`ceiling` = dense time / dense time outside attention: the speedup if attention cost nothing.

Decode, tokens/s: the decode step of m3compile.generate (paged KV cache, for MSA the paged index-key cache and
kernels/decode/'s selection) for B sequences at context T, eager and replayed as a CUDA graph
(m3compile.runtime DecodeStep), after a check that the replay's logits equal the eager step's from the same state.
The caches hold random keys, values and index keys: a step's work does not depend on them (dense reads every page;
MSA scores every index key and reads its top-k pages). B is lowered to what fits in free device memory and the row
says so (the bf16 KV cache of Llama-3-8B at 128K x 8 sequences is 137 GB); a second row then runs the asked batch on
the first L1 and L2 layers of both models (`shallow`: the same modules; L2 the deepest whose caches fit, L1 = L2 // 2)
and extrapolates every time linearly in the depth to the whole model, marked "extrapolated" (`extrapolate_depth`:
each layer past layer 0 does the same work, so a step's time is linear in the layer count).
Both models run the step on the same lowered ops on CUDA (m3compile.ops.lowering, as `m3c generate` does:
RMSNorm, RoPE and, for MSA, the index branch's norms + RoPE as one kernel) and, as `m3c generate` does, with fused
projections (Decoder.fuse_projections, both models, their weights still shared: one matmul per layer for q/k/v and,
in MSA layers, the index q/k, counted in projections_mlp; one for gate/up); --separate-projections runs the
separate Linears instead (the index projections then count in index_projections). Stages as for prefill, from one
profiled eager step (attention = m3c.decode_attention, indexer = the index branch (m3c.index_branch; with the
reference ops the index projections and norms, the index RoPE then counting in rest) + m3c.decode_select).
"""
from __future__ import annotations

import gc
import json
import math
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.table import Table

from m3compile.config import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, check_size, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.outputs import atomic_save_figure, atomic_write_text, check_output_folder
from m3compile.kernels.decode import quantize_kv, quantize_pages
from m3compile.models.decoder import Decoder, ModelArgs, MoE
from m3compile.ops import SPARSE_KERNELS, using_sparse_kernel
from m3compile.pipelines import lower
from m3compile.bench.byte_floor import bandwidth_tbs, step_bytes
from m3compile.bench.common import bench_models, is_cuda, median_ms, module_ranges, profile_run, sync
from m3compile import memory
from m3compile.ops import lowering
from m3compile.runtime import DecodeStep, PagedCache, graph_unavailable, lowering_default, prefill
from m3compile.runtime.generate import KV_CACHE_TORCH_DTYPES, resolve_index_cache

__all__ = ["ModelBenchConfig", "run_model_bench", "write_model_outputs", "render", "decode_batch", "decode_depths",
           "cache_bytes", "extrapolate", "extrapolate_depth", "shallow", "STAGES", "GROUPS"]

# range name -> fine stage; a kernel counts once, for the innermost labelled range that launched it, except that a
# range of ENCLOSING keeps everything inside it (Profile.attribute)
PREFILL_LABELS = {
    "m3c.msa_attention": "attention_sparse",  # enclosing: its SDPA (every block selected) counts here
    "aten::scaled_dot_product_attention": "attention_dense",
    "m3c.msa_select": "index_select",  # the fused scoring + top-k (and the fp8 key quantisation)
    "m3c.index_branch": "index_projections",  # lowered: the fused projections + norms + RoPE; else the modules
    "m3c.proj_mlp": "projections_mlp",
}
DECODE_LABELS = {
    "m3c.decode_attention": "attention_dense",  # split-K over the selected pages (every page in a dense layer)
    "m3c.decode_select": "index_select",
    "m3c.index_branch": "index_projections",
    "m3c.proj_mlp": "projections_mlp",
}
ENCLOSING = ("m3c.msa_attention",)
STAGES = ("attention_dense", "attention_sparse", "index_select", "index_projections", "projections_mlp", "rest",
          "unattributed", "host")
GROUPS = {"attention": ("attention_dense", "attention_sparse"), "indexer": ("index_select", "index_projections"),
          "projections_mlp": ("projections_mlp",), "rest": ("rest",), "unattributed": ("unattributed",),
          "host": ("host",)}
_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
_INDEX = {"index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"}


@dataclass(frozen=True)
class ModelBenchConfig:
    model: str  # checkpoint directory or preset name
    prefill_lengths: tuple[int, ...] = (8192, 32768, 131072, 524288)
    decode_lengths: tuple[int, ...] = (32768, 131072)
    batch: int = 8  # decode batch asked for (lowered to what fits)
    # conversion of a dense model: block size, top-k (layer 0 stays dense); None: 128 and 16, or a converted model's
    # own (another is refused); the result's config records what ran
    block: int | None = None
    topk: int | None = None
    top_p: float | None = None  # the conversion's adaptive budget and its floor (None: none, or a converted model's)
    min_blocks: int | None = None
    dense_layers: tuple[int, ...] | None = None  # the conversion's dense layers (None: layer 0, or a converted model's)
    dense_max: int = 131072  # longest prefill timed on the dense model; longer ones are extrapolated
    msa_max: int = 131072  # the same for the MSA model
    profile_max: int | None = None  # longest prefill also run under the profiler for its stages (None: every one)
    dtype: str = "bfloat16"
    index_cache: str = "auto"  # decode index-key cache: "auto" (the model's dtype) or "fp8"
    kv_cache: str = "auto"  # the K/V cache (decode, chunked prefill): "auto" (the model's dtype), "bf16", "fp8", "int8"
    prefill_chunk: int | None = None  # prefill through the runtime in chunks of this many tokens (None: module doc)
    bandwidth_tbs: float | None = None  # the GPU's memory bandwidth for the decode byte floor (None: by its name)
    index_dtype: str = "auto"  # the converted model's index scoring: "auto" (bf16) or "fp8" (prefill and decode)
    index_dim: int | None = None  # conversion of a dense model: the index head dim (None: the head dim)
    sparse_kernel: str = "gather"  # the MSA prefill's sparse attention (ops.SPARSE_KERNELS: gather-Q, or query-tile)
    steps: int = 5  # timed prefill runs per figure, at most
    figure_seconds: float = 10.0  # ... and fewer where one run is long (at least one)
    decode_steps: int = 32  # decode steps per timing
    reserve_gb: float = 4.0  # device memory kept free beside the decode caches
    device: str = "cuda"
    seed: int = 0
    fuse_projections: bool = True  # Decoder.fuse_projections on both models (False: the separate Linears)

    def __post_init__(self):
        for name in ("block", "topk", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise M3CompileError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_size(self.batch, "batch", "batch")
        check_size(self.decode_steps, "decode_steps", "decode steps")
        for name in ("dense_max", "msa_max", "profile_max", "prefill_chunk"):
            if getattr(self, name) is not None:
                check_size(getattr(self, name), name)
        if not self.prefill_lengths and not self.decode_lengths:
            raise M3CompileError("nothing to run: give prefill or decode lengths")
        for n in self.prefill_lengths + self.decode_lengths:
            check_size(n, "lengths")
        for name in ("figure_seconds", "reserve_gb"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise M3CompileError(f"{name} must be a finite number >= 0, got {v}")
        if self.index_cache not in INDEX_CACHE_DTYPES:
            raise M3CompileError(f"index_cache must be 'auto' or 'fp8', got {self.index_cache!r}")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise M3CompileError(f"kv_cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache!r}")
        if self.bandwidth_tbs is not None and not (math.isfinite(self.bandwidth_tbs) and self.bandwidth_tbs > 0):
            raise M3CompileError(f"bandwidth must be a number of TB/s > 0, got {self.bandwidth_tbs}")
        if self.index_dtype not in ("auto", "fp8"):
            raise M3CompileError(f"index_dtype must be 'auto' or 'fp8', got {self.index_dtype!r}")
        if self.sparse_kernel not in SPARSE_KERNELS:
            raise M3CompileError(f"sparse_kernel must be one of {', '.join(SPARSE_KERNELS)}, got {self.sparse_kernel!r}")
        parse_dtype(self.dtype)
        if is_cuda(self.device) and not torch.cuda.is_available():
            raise M3CompileError("m3c bench model needs a CUDA GPU (use --device cpu for a smoke run)")


def _classify(qualname: str, module: torch.nn.Module) -> str | None:
    leaf = qualname.rsplit(".", 1)[-1]
    if leaf in _INDEX:
        return "m3c.index_branch"
    if leaf in _PROJECTIONS or isinstance(module, MoE):
        return "m3c.proj_mlp"
    return None


def _split(prof, labels: dict[str, str], total_ms: float) -> tuple[dict[str, float], dict]:
    """(stages of one profiled run closed to the timed total, attribution check). GPU: each kernel's own time in
    its stage (Profile.attribute: once each) and host = total - their sum (the profiler's host overhead does not
    count; 0 where the profiled kernels outlast the timed run, which the check shows); CPU, where op times carry
    the profiler's overhead: the profiled split (op self times, host = the profiled wall outside every op) scaled
    to the timed total."""
    a = prof.attribute(labels, ENCLOSING)
    check = {"work_ms": round(a.work_ms, 3), "busy_ms": round(a.busy_ms, 3), "profiled_ms": round(prof.wall_ms, 3),
             "routes": a.routes, "unattributed_ms": round(a.stages["unattributed"], 3), "top": a.top}
    if prof.cuda:
        return a.stages | {"host": max(0.0, total_ms - a.work_ms)}, check
    scale = total_ms / prof.wall_ms if prof.wall_ms > 0 else 0.0
    stages = a.stages | {"host": max(0.0, prof.wall_ms - a.work_ms)}
    return {k: v * scale for k, v in stages.items()}, check


def _groups(stages: dict[str, float]) -> dict[str, float]:
    return {g: round(sum(stages.get(s, 0.0) for s in members), 3) for g, members in GROUPS.items()}


# ---------------------------------------------------------------------------------------------------------------
# extrapolation


def _pairs(T: int) -> float:
    return T * (T + 1) / 2


def _reach(T: int, keys: int) -> float:
    """Keys a causal top-k selection of `keys` keys can reach, summed over T queries: sum_t min(t + 1, keys)."""
    return _pairs(T) if T <= keys else _pairs(keys) + (T - keys) * keys


def extrapolate(stages: dict[str, float], T_from: int, T: int, keys: int) -> dict[str, float]:
    """Per-stage ms at T from those measured at T_from (module doc: the law of each stage); keys = topk * block."""
    ratio = {
        "attention_dense": _pairs(T) / _pairs(T_from), "index_select": _pairs(T) / _pairs(T_from),
        "attention_sparse": _reach(T, keys) / _reach(T_from, keys), "host": 1.0,
    }
    return {s: ms * ratio.get(s, T / T_from) for s, ms in stages.items()}


# ---------------------------------------------------------------------------------------------------------------
# prefill


def _prefill_row(name: str, fn, model: torch.nn.Module, T: int, cfg: ModelBenchConfig, log,
                 warmup_tokens: int | None = None) -> dict:
    g = torch.Generator().manual_seed(cfg.seed + T)
    ids = torch.randint(0, _vocab(model), (1, T), generator=g).to(cfg.device)
    with torch.no_grad():
        sync(cfg.device)
        t0 = time.perf_counter()
        fn(ids[:, :warmup_tokens])  # warm-up: compiles kernels, grows the allocator (chunked: its first chunks)
        sync(cfg.device)
        first = (time.perf_counter() - t0) * 1e3
        if cfg.profile_max is not None and T > cfg.profile_max:  # timed only: a run of its own, then as many more
            one, peak = median_ms(lambda: fn(ids), steps=1, warmup=0, device=cfg.device)  # as the figure allows
            runs = max(1, min(cfg.steps, int(cfg.figure_seconds * 1e3 // max(one, 1e-3))))
            ms, peak2 = (one, peak) if runs == 1 else median_ms(lambda: fn(ids), steps=runs, warmup=0,
                                                                device=cfg.device)
            row = {"T": T, "model": name, "measured": "timed", "from_T": None, "ms": round(ms, 3), "runs": runs,
                   "first_ms": round(first, 3), "first_tokens": warmup_tokens or T,
                   "peak_gb": round(max(peak, peak2), 2), "profiled_ms": None, "attribution": None, "stages": None,
                   "breakdown": None, "note": f"not profiled (longer than --profile-max {cfg.profile_max:,})"}
            log(f"prefill T={T:,} {name}: {ms:.1f} ms ({runs} runs; not profiled)")
            return row
        with module_ranges(model, _classify):
            prof = profile_run(lambda: fn(ids), cfg.device)
        runs = max(1, min(cfg.steps, int(cfg.figure_seconds * 1e3 // max(prof.wall_ms, 1e-3))))
        ms, peak = median_ms(lambda: fn(ids), steps=runs, warmup=0, device=cfg.device)
    stages, check = _split(prof, PREFILL_LABELS, ms)
    row = {"T": T, "model": name, "measured": "timed", "from_T": None, "ms": round(ms, 3), "runs": runs,
           "first_ms": round(first, 3), "first_tokens": warmup_tokens or T, "peak_gb": round(peak, 2),
           "profiled_ms": round(prof.wall_ms, 3),
           "attribution": check, "stages": {s: round(stages.get(s, 0.0), 3) for s in STAGES}}
    row["breakdown"] = _groups(row["stages"])
    log(f"prefill T={T:,} {name}: {ms:.1f} ms ({runs} runs; " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                        row["breakdown"].items()) + ")")
    if check["routes"].get("none"):
        log(f"prefill T={T:,} {name}: {check['routes']['none']} kernels with no recorded launch "
            f"({check['unattributed_ms']:.1f} ms, stage 'unattributed'): {check['top'].get('unattributed')}")
    return row


def _vocab(model: torch.nn.Module) -> int:
    emb = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return emb.num_embeddings


def _cache_dtypes(sparse: Decoder, cfg: ModelBenchConfig) -> tuple[torch.dtype, torch.dtype, torch.dtype, int]:
    """(model dtype, K/V cache dtype, index-key cache dtype, page) of the bench's caches, as generate sets them."""
    args = sparse.args
    dtype = next(sparse.parameters()).dtype
    page = args.msa.block_size if args.msa is not None else cfg.block
    return dtype, KV_CACHE_TORCH_DTYPES[cfg.kv_cache] or dtype, resolve_index_cache(cfg.index_cache, args, dtype), page


def _prefill_plan(model: Decoder, sparse: Decoder, T: int, cfg: ModelBenchConfig) -> tuple[str, object]:
    """How one prefill of T tokens runs: ("whole", None), the lowered backbone over the whole prompt (no
    --prefill-chunk, and its activations fit in half the free memory, or no device memory to count);
    ("chunked", plan), runtime.prefill into a paged cache (memory.MemoryPlan: its chunk and bytes); or
    ("does not fit", plan) where even chunks do not fit beside the caches."""
    dtype, kv_dtype, index_dtype, page = _cache_dtypes(sparse, cfg)
    free = _free_bytes(cfg)
    shape = memory.ModelShape.from_args(model.args)
    if cfg.prefill_chunk is None and (free is None or memory.activation_bytes(shape, T, T, dtype, dtype) <= free / 2):
        return "whole", None
    plan = memory.fitted_plan(shape, 1, T, T, free, kv_dtype=kv_dtype, index_dtype=index_dtype, model_dtype=dtype,
                              chunk=cfg.prefill_chunk, page=page)
    return ("chunked" if free is None or plan.need <= free else "does not fit"), plan


def _chunked_row(name: str, model: Decoder, sparse: Decoder, T: int, plan, cfg: ModelBenchConfig, log) -> dict:
    """Time to first token through runtime.prefill in chunks, into a paged cache allocated before the timing."""
    _, kv_dtype, index_dtype, page = _cache_dtypes(sparse, cfg)
    cache = PagedCache(model, 1, T, page, cfg.device, kv_dtype, index_dtype)
    fn = lambda ids: prefill(model, cache, 0, ids[0], plan.chunk)  # noqa: E731
    try:
        with lowering(lowering_default(cfg.device)):
            row = _prefill_row(name, fn, model, T, cfg, log, warmup_tokens=min(T, 2 * plan.chunk + 1))
    finally:
        del cache
    return row | {"prefill": "chunked", "chunk": plan.chunk, "memory": plan.to_dict()}


def _prefill(dense: Decoder, sparse: Decoder, cfg: ModelBenchConfig, log) -> tuple[list[dict], list[dict]]:
    lowered = lower(sparse.model)  # the backbone (the model's forward, lowered): the last position's logits outside it
    # the dense twin lowered too (its RMSNorm and RoPE kernels): both sides run the same fused backbone ops
    dense_lowered = lower(dense.model, require_msa=False)
    runners = {
        "dense": (lambda ids: dense.lm_head(dense_lowered(ids)[:, -1]), dense_lowered, dense, cfg.dense_max),
        "msa": (lambda ids: sparse.lm_head(lowered(ids)[:, -1]), lowered, sparse, cfg.msa_max),
    }
    keys = _keys(sparse.args)
    rows = []
    for name, (fn, module, model, limit) in runners.items():
        timed = []
        for T in sorted(t for t in cfg.prefill_lengths if t <= limit):
            how, plan = _prefill_plan(model, sparse, T, cfg)
            if how == "whole":
                timed.append(_prefill_row(name, fn, module, T, cfg, log) | {"prefill": "whole", "chunk": None})
            elif how == "chunked":
                log(f"prefill T={T:,} {name}: in chunks of {plan.chunk:,} tokens into a paged cache "
                    f"({memory.size(plan.caches)})")
                timed.append(_chunked_row(name, model, sparse, T, plan, cfg, log))
            else:
                note = f"does not fit: {plan.describe()}, {memory.size(_free_bytes(cfg))} free"
                log(f"prefill T={T:,} {name}: {note}")
                rows.append({"T": T, "model": name, "measured": "not run", "from_T": None, "ms": None,
                             "stages": None, "breakdown": None, "note": note, "memory": plan.to_dict()})
            if is_cuda(cfg.device):
                torch.cuda.empty_cache()
        rows += timed
        for T in sorted(t for t in cfg.prefill_lengths if t > limit):
            if not timed:
                rows.append({"T": T, "model": name, "measured": "not run", "from_T": None, "ms": None,
                             "stages": None, "breakdown": None,
                             "note": f"no length <= {limit:,} was timed to extrapolate from"})
                continue
            profiled = [r for r in timed if r["stages"] is not None]
            if not profiled:
                rows.append({"T": T, "model": name, "measured": "not run", "from_T": None, "ms": None,
                             "stages": None, "breakdown": None,
                             "note": f"no length <= {cfg.profile_max:,} was profiled to extrapolate from"})
                continue
            ref = profiled[-1]
            stages = extrapolate(ref["stages"], ref["T"], T, keys)
            how, plan = _prefill_plan(model, sparse, T, cfg)
            rows.append({"T": T, "model": name, "measured": "extrapolated", "from_T": ref["T"],
                         "ms": round(sum(stages.values()), 3), "runs": 0, "peak_gb": None,
                         "stages": {s: round(v, 3) for s, v in stages.items()},
                         "breakdown": _groups(stages), "fits": how != "does not fit",
                         "memory": None if plan is None else plan.to_dict()})
    rows.sort(key=lambda r: (r["T"], r["model"]))
    return rows, _prefill_summary(rows)


def _keys(args: ModelArgs) -> int:
    """Keys one query's selection can reach: topk * block (the dense length for a model without MSA)."""
    return args.msa.topk * args.msa.block_size if args.msa is not None else 1 << 62


def _prefill_summary(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["T"], r["model"]): r for r in rows}
    for T in sorted({r["T"] for r in rows}):
        d, m = by.get((T, "dense")), by.get((T, "msa"))
        if not d or not m or d["ms"] is None or m["ms"] is None:
            continue
        attention = d["breakdown"]["attention"] if d["breakdown"] else None
        out.append({"T": T, "dense_ms": d["ms"], "msa_ms": m["ms"], "dense": d["measured"], "msa": m["measured"],
                    "speedup": round(d["ms"] / m["ms"], 3),
                    "ceiling": None if attention is None else round(d["ms"] / max(d["ms"] - attention, 1e-9), 3),
                    "dense_attention_share": None if attention is None else round(attention / d["ms"], 3)})
    return out


# ---------------------------------------------------------------------------------------------------------------
# decode


def cache_bytes(args: ModelArgs, tokens: int, page: int, dtype: torch.dtype, index_dtype: torch.dtype,
                model_dtype: torch.dtype | None = None) -> int:
    """Bytes of one sequence's paged caches at `tokens` tokens (m3compile.memory.cache_bytes): K and V pages of every
    layer at `dtype` (fp8: with one fp32 scale per token and head), index-key pages of every MSA layer (fp8: their
    fp32 scales and a tail page in the model's dtype, `model_dtype`, default `dtype`)."""
    return memory.cache_bytes(memory.ModelShape.from_args(args), tokens, dtype, index_dtype, model_dtype or dtype,
                              page)


def decode_batch(args: ModelArgs, tokens: int, requested: int, free_bytes: float, page: int, dtype: torch.dtype,
                 index_dtype: torch.dtype, reserve_bytes: float, model_dtype: torch.dtype | None = None) -> int:
    """The largest batch <= requested whose caches at `tokens` tokens fit in free_bytes - reserve_bytes (may be 0)."""
    per_seq = cache_bytes(args, tokens, page, dtype, index_dtype, model_dtype)
    return max(0, min(requested, int((free_bytes - reserve_bytes) // per_seq)))


def _fill(cache: PagedCache, seed: int) -> None:
    g = torch.Generator(device=cache.seq_lens.device).manual_seed(seed)
    for i in cache.k:
        if cache.k_scale[i] is None:
            cache.k[i].normal_(generator=g)
            cache.v[i].normal_(generator=g)
            continue
        for pages, scales in ((cache.k[i], cache.k_scale[i]), (cache.v[i], cache.v_scale[i])):
            for p0 in range(0, pages.shape[0], 1024):  # fp8 or int8 rows with their scales, 1024 pages at a time
                rows = torch.randn(pages[p0:p0 + 1024].shape, device=pages.device, generator=g)
                pages[p0:p0 + 1024], scales[p0:p0 + 1024] = quantize_kv(rows, pages.dtype)
    for i, idx in cache.idx.items():
        if cache.idx_scale[i] is None:
            idx.normal_(generator=g)
        else:  # fp8 keys with their scales, one layer at a time
            keys = torch.randn(idx.shape, device=idx.device, generator=g)
            q, scale = quantize_pages(keys)  # one scale per page, as the graph's caches hold
            idx.copy_(q)
            cache.idx_scale[i].copy_(scale)


def _steps_ms(step: DecodeStep, tokens, cache: PagedCache, T: int, n: int, device) -> float:
    """ms per step of n consecutive steps from context T (seq_lens reset to T before and after)."""
    cache.seq_lens.fill_(T)
    sync(device)
    if is_cuda(device):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            step(tokens)
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / n
    else:
        t0 = time.perf_counter()
        for _ in range(n):
            step(tokens)
        ms = (time.perf_counter() - t0) * 1e3 / n
    cache.seq_lens.fill_(T)
    return ms


def _decode_one(name: str, model: Decoder, cache: PagedCache, T: int, B: int, cfg: ModelBenchConfig, log) -> dict:
    dev = cfg.device
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, model.args.vocab_size, (B,), generator=g).to(dev)
    eager = DecodeStep(model, cache, B)
    # the steps' kernel switch held for the whole row (DecodeStep's own is then a no-op, not host time per step)
    with torch.no_grad(), lowering(lowering_default(dev)):
        _steps_ms(eager, tokens, cache, T, 1, dev)  # warm-up: compiles, autotunes
        eager_ms = _steps_ms(eager, tokens, cache, T, cfg.decode_steps, dev)
        with module_ranges(model, _classify):
            prof = profile_run(lambda: eager(tokens), dev)
        cache.seq_lens.fill_(T)
        stages, check = _split(prof, DECODE_LABELS, eager_ms)
        row = {"T": T, "model": name, "batch": B, "eager_ms": round(eager_ms, 4),
               "eager_tokens_per_s": round(B * 1e3 / eager_ms, 1), "graph_ms": None, "graph_tokens_per_s": None,
               "profiled_ms": round(prof.wall_ms, 4), "attribution": check,
               "stages": {s: round(stages.get(s, 0.0), 4) for s in STAGES}}
        row["breakdown"] = _groups(row["stages"])
        why = graph_unavailable(model, dev)
        row["graph_unavailable"] = why
        graph = None
        if why is None:
            try:
                graph = DecodeStep(model, cache, B, graph=True)
            except RuntimeError as e:  # reported, not fatal: the eager figures stand
                row["graph_unavailable"] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(f"decode T={T:,} {name}: {row['graph_unavailable']}")
        if graph is not None:
            cache.seq_lens.fill_(T)
            want = eager(tokens).clone()
            cache.seq_lens.fill_(T)
            got = graph(tokens).clone()
            cache.seq_lens.fill_(T)
            diff = (got - want).abs().max().item()
            row["graph_check"] = {"max_abs_diff": diff, "max_abs_logit": want.abs().max().item(),
                                  "equal": diff == 0.0, "close": diff <= 1e-3 * max(1.0, want.abs().max().item())}
            graph_ms = _steps_ms(graph, tokens, cache, T, cfg.decode_steps, dev)
            row["graph_ms"] = round(graph_ms, 4)
            row["graph_tokens_per_s"] = round(B * 1e3 / graph_ms, 1)
            del graph
    best = row["graph_ms"] or row["eager_ms"]
    graphed = "-" if row["graph_ms"] is None else f"{row['graph_ms']:.3f}"
    log(f"decode T={T:,} B={B} {name}: eager {eager_ms:.3f} ms/step, graph {graphed} ms/step "
        f"({B * 1e3 / best:,.0f} tokens/s)")
    return row


def _free_bytes(cfg: ModelBenchConfig) -> float | None:
    """Free device memory for the decode caches (None off CUDA: the batch is not limited there)."""
    if not is_cuda(cfg.device):
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(torch.device(cfg.device))[0]


def _first_layers(args: ModelArgs, n: int) -> ModelArgs:
    return args.replace(n_layers=n, sparse_layers=None if args.sparse_layers is None else args.sparse_layers[:n],
                        mlp_layer_types=None if args.mlp_layer_types is None else args.mlp_layer_types[:n])


def shallow(model: Decoder, n: int) -> Decoder:
    """The first n layers of `model` as a Decoder of their own that shares every module with it (embedding, those
    layers, final norm, head): no weight is copied."""
    with torch.device("meta"):
        m = Decoder(_first_layers(model.args, n))
    m.model.embed_tokens, m.model.norm, m.model.rotary_emb = (model.model.embed_tokens, model.model.norm,
                                                              model.model.rotary_emb)
    m.model.layers = torch.nn.ModuleList(list(model.model.layers[:n]))
    m.lm_head = model.lm_head
    return m


def decode_depths(args: ModelArgs, tokens: int, batch: int, free_bytes: float, page: int, dtype: torch.dtype,
                  index_dtype: torch.dtype, reserve_bytes: float,
                  model_dtype: torch.dtype | None = None) -> tuple[int, int] | None:
    """Two depths (first L1 < L2 layers) whose caches for `batch` sequences at `tokens` fit, for a decode step
    extrapolated to the full depth: L2 the deepest that fits (below the model's), L1 = L2 // 2, at least 2 (layer 0
    and one more) and past every layer of another kind (attention dense or MSA, MLP or MoE) than the last: the
    layers that the line adds then all do the same work. None where L1 and L2 would be under 2 layers apart."""
    def fits(n: int) -> bool:
        return decode_batch(_first_layers(args, n), tokens, batch, free_bytes, page, dtype, index_dtype,
                            reserve_bytes, model_dtype) == batch

    kind = lambda i: (args.is_sparse(i), args.is_moe(i))  # noqa: E731
    uniform = next(i for i in range(args.n_layers) if all(kind(j) == kind(args.n_layers - 1)
                                                          for j in range(i, args.n_layers)))
    deep = max((n for n in range(2, args.n_layers) if fits(n)), default=0)
    shallow_n = max(2, uniform, deep // 2)
    return (shallow_n, deep) if deep - shallow_n >= 2 else None


def extrapolate_depth(rows: dict[int, dict], layers: int) -> dict:
    """A decode row at `layers` from rows measured at two depths {L1: row, L2: row}: every time (eager, graph,
    each stage) linear in the depth through the two, ms(L) = ms(L2) + (L - L2) * (ms(L2) - ms(L1)) / (L2 - L1);
    the layers beyond L2 repeat the ones between L1 and L2 (same shapes, all MSA or all dense)."""
    (l1, r1), (l2, r2) = sorted(rows.items())

    def line(a, b):
        return None if a is None or b is None else round(b + (layers - l2) * (b - a) / (l2 - l1), 4)

    out = {"T": r2["T"], "model": r2["model"], "batch": r2["batch"], "eager_ms": line(r1["eager_ms"], r2["eager_ms"]),
           "graph_ms": line(r1["graph_ms"], r2["graph_ms"]),
           "stages": {s: max(0.0, line(r1["stages"][s], r2["stages"][s])) for s in STAGES},
           "graph_unavailable": r2["graph_unavailable"], "graph_check": r2.get("graph_check"),
           "extrapolated_from_depths": [l1, l2], "measured": {str(l1): r1, str(l2): r2}}
    for kind in ("eager", "graph"):
        ms = out[f"{kind}_ms"]
        out[f"{kind}_tokens_per_s"] = None if not ms else round(out["batch"] * 1e3 / ms, 1)
    out["breakdown"] = _groups(out["stages"])
    return out


def _speedups(row: dict) -> dict:
    d, m = row["dense"], row["msa"]
    row["speedup_eager"] = round(d["eager_ms"] / m["eager_ms"], 3)
    row["speedup"] = round(d["graph_ms"] / m["graph_ms"], 3) if d["graph_ms"] and m["graph_ms"] else None
    return row


def _decode_pair(dense: Decoder, sparse: Decoder, T: int, B: int, max_len: int, page: int, dtype, index_dtype,
                 cfg: ModelBenchConfig, log) -> dict:
    cache = PagedCache(sparse, B, max_len, page, cfg.device, dtype, index_dtype)
    _fill(cache, cfg.seed)
    out = {name: _decode_one(name, model, cache, T, B, cfg, log) for name, model in (("dense", dense),
                                                                                      ("msa", sparse))}
    del cache
    return out


def _floor(row: dict, model: Decoder, T: int, B: int, kv_dtype, index_dtype, tbs: float | None) -> None:
    """The step's byte floor (bench.byte_floor) and, at `tbs` TB/s, its time and the share of it the step reached
    (the CUDA graph's time, else the eager step's)."""
    if row is None:
        return
    need = step_bytes(model, B, T, kv_dtype, index_dtype)
    ms = row.get("graph_ms") or row.get("eager_ms")
    floor_ms = None if tbs is None else need.floor_ms(tbs)
    row["floor"] = {"bytes": need.to_dict(), "tbs": tbs, "ms": None if floor_ms is None else round(floor_ms, 4),
                    "share": None if floor_ms is None or not ms else round(floor_ms / ms, 3)}


def _decode(dense: Decoder, sparse: Decoder, cfg: ModelBenchConfig, log, tbs: float | None = None) -> list[dict]:
    args = sparse.args
    model_dtype, dtype, index_dtype, page = _cache_dtypes(sparse, cfg)  # dtype: the K/V cache's
    rows = []
    for T in cfg.decode_lengths:
        max_len = T + cfg.decode_steps + 8  # room for the steps timed from T (seq_lens is reset between runs)
        need = cache_bytes(args, max_len, page, dtype, index_dtype, model_dtype)
        free = _free_bytes(cfg)
        B = cfg.batch if free is None else decode_batch(args, max_len, cfg.batch, free, page, dtype, index_dtype,
                                                        cfg.reserve_gb * 1e9, model_dtype)
        note = None
        if B < cfg.batch:
            note = (f"batch {cfg.batch} needs {cfg.batch * need / 1e9:.1f} GB of caches, "
                    f"{free / 1e9:.1f} GB free: " + (f"ran batch {B}" if B else "not run"))
            log(f"decode T={T:,}: {note}")
        base = {"T": T, "batch_requested": cfg.batch, "batch": B, "cache_gb_per_seq": round(need / 1e9, 3),
                "index_cache": cfg.index_cache, "kv_cache": cfg.kv_cache, "note": note, "extrapolated": False}
        if B == 0:
            rows.append(base | {"dense": None, "msa": None, "speedup": None})
        else:
            rows.append(_speedups(base | _decode_pair(dense, sparse, T, B, max_len, page, dtype, index_dtype, cfg,
                                                      log)))
        if B < cfg.batch:  # the asked batch on shallower copies of both models, extrapolated to the full depth
            depths = decode_depths(args, max_len, cfg.batch, _free_bytes(cfg), page, dtype, index_dtype,
                                   cfg.reserve_gb * 1e9, model_dtype)
            if depths is None:
                log(f"decode T={T:,}: batch {cfg.batch} does not fit at two depths of 2+ layers apart either")
                continue
            log(f"decode T={T:,}: batch {cfg.batch} on the first {depths[0]} and {depths[1]} layers, "
                f"extrapolated to {args.n_layers}")
            measured = {n: _decode_pair(shallow(dense, n), shallow(sparse, n), T, cfg.batch, max_len, page, dtype,
                                        index_dtype, cfg, log) for n in depths}
            row = base | {"batch": cfg.batch, "extrapolated": True,
                          "note": f"batch {cfg.batch} extrapolated from the first {depths[0]} and {depths[1]} "
                                  f"layers to {args.n_layers} (every time linear in the depth)"}
            for name in ("dense", "msa"):
                row[name] = extrapolate_depth({n: measured[n][name] for n in depths}, args.n_layers)
            rows.append(_speedups(row))
    for row in rows:
        for name, model in (("dense", dense), ("msa", sparse)):
            _floor(row.get(name), model, row["T"], row["batch"], dtype, index_dtype, tbs)
            if row.get(name) and row["batch"]:
                f = row[name]["floor"]
                share = "" if f["share"] is None else \
                    f", {f['share']:.0%} of its floor ({f['ms']:.3f} ms at {tbs} TB/s)"
                log(f"decode T={row['T']:,} B={row['batch']} {name}: reads {f['bytes']['total'] / 1e9:.2f} GB a "
                    f"step{share}")
    return rows


# ---------------------------------------------------------------------------------------------------------------


def run_model_bench(cfg: ModelBenchConfig, log=print) -> dict:
    log(f"building {cfg.model} on {cfg.device} ...")
    t0 = time.perf_counter()
    dense, sparse, what, check = bench_models(cfg.model, device=cfg.device, dtype=cfg.dtype, block=cfg.block,
                                              topk=cfg.topk, index_dtype=cfg.index_dtype, index_dim=cfg.index_dim,
                                              top_p=cfg.top_p, min_blocks=cfg.min_blocks,
                                              dense_layers=cfg.dense_layers)
    verdict = "converted checkpoint" if check is None else "ok" if check["ok"] else \
        f"MISMATCH {check['mismatched'][:3]}"
    log(f"models ready in {time.perf_counter() - t0:.1f} s; conversion check: {verdict}")
    if cfg.fuse_projections:  # as generate runs them; the dense twin keeps sharing the weights
        sparse.fuse_projections(dense)
        gc.collect()  # the conversion's graph held the index weights as they were before fusing
    args = sparse.args
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": cfg.device,
           "date": time.strftime("%Y-%m-%d")}
    if is_cuda(cfg.device):
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    ran = asdict(cfg) | {"block": args.msa.block_size, "topk": args.msa.topk}  # what ran, not what was asked
    result = {"bench": "model", "model": what, "name": _slug(cfg.model), "config": ran,
              "layers": args.n_layers, "msa_layers": sum(args.is_sparse(i) for i in range(args.n_layers)),
              "shapes": {"hidden": args.hidden_size, "heads": args.n_heads, "kv_heads": args.n_kv_heads,
                         "head_dim": args.head_dim, "intermediate": args.intermediate_size, "vocab": args.vocab_size},
              "msa": asdict(args.msa), "conversion_check": check, "env": env,
              "prefill": [], "prefill_summary": [], "decode": []}
    if cfg.prefill_lengths:
        with using_sparse_kernel(cfg.sparse_kernel):
            result["prefill"], result["prefill_summary"] = _prefill(dense, sparse, cfg, log)
    if cfg.decode_lengths:
        if is_cuda(cfg.device):
            torch.cuda.empty_cache()
        tbs = cfg.bandwidth_tbs or bandwidth_tbs(env.get("gpu"))
        result["bandwidth_tbs"] = tbs
        result["decode"] = _decode(dense, sparse, cfg, log, tbs)
    return result


def _slug(model: str) -> str:
    name = Path(model).name if Path(model).is_dir() else model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def write_model_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """OUT/<model>.json, then OUT/model_speedup.png drawn from every model bench JSON in OUT (run the bench for two
    models into one OUT to plot both), each written atomically. A run of only prefill or only decode keeps the
    other part of an earlier run of the same model in OUT (`_merge_earlier`). Through the output guard."""
    check_output_folder(out)
    path = out / f"{result['name']}.json"
    result = _merge_earlier(result, path)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    results = []
    for f in sorted(out.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            continue
        if isinstance(data, dict) and data.get("bench") == "model":
            results.append(data)
    png = out / "model_speedup.png"
    _plot(results, png)
    return path, png


def render(result: dict, path: Path, png: Path) -> list:
    """What `m3c bench model` prints (rich tables and lines): time to first token and the prefill speedup, decode and
    its byte floor, then the files written."""
    out = []
    shapes = result["shapes"]
    title = (f"{result['model']}: {result['layers']} layers ({result['msa_layers']} MSA), {shapes['heads']} q / "
             f"{shapes['kv_heads']} kv heads, block {result['msa']['block_size']}, top-{result['msa']['topk']}")

    def f(x, p=1):
        return "-" if x is None else f"{x:,.{p}f}"

    if result["prefill"]:
        t = Table(title=f"time to first token, ms: {title}")
        for c in ("T", "model", "ms", "attention", "indexer", "proj + MLP", "rest", "host", "runs"):
            t.add_column(c, justify="right")
        for r in result["prefill"]:
            b = r["breakdown"] or {}
            mark = {"timed": "", "extrapolated": "*"}.get(r["measured"], " (not run)")
            mark += f" (chunks of {r['chunk']:,})" if r.get("chunk") else ""
            t.add_row(f"{r['T']:,}", r["model"], f(r["ms"]) + mark, f(b.get("attention")), f(b.get("indexer")),
                      f(b.get("projections_mlp")), f(b.get("rest")), f(b.get("host")), str(r.get("runs", "-")))
        out.append(t)
        t = Table(title="prefill speedup (dense / MSA)")
        for c in ("T", "dense ms", "MSA ms", "speedup", "ceiling", "dense attention share"):
            t.add_column(c, justify="right")
        for s in result["prefill_summary"]:
            star = lambda k: "*" if s[k] == "extrapolated" else ""  # noqa: E731
            t.add_row(f"{s['T']:,}", f(s["dense_ms"]) + star("dense"), f(s["msa_ms"]) + star("msa"),
                      f"{s['speedup']:.2f}x", "-" if s["ceiling"] is None else f"{s['ceiling']:.2f}x",
                      "-" if s["dense_attention_share"] is None else f"{s['dense_attention_share']:.0%}")
        out.append(t)
        out.append("* extrapolated per stage from the longest timed length (attention and selection as T^2, "
                      "sparse attention as the keys top-k reaches, the rest as T); ceiling: dense / dense outside "
                      "attention")
        for r in result["prefill"]:
            if r.get("note") or r.get("fits") is False:
                out.append(f"prefill {r['T']:,} {r['model']}: " + (r.get("note") or "does not fit: "
                              f"{r['memory']['caches_gb'] + r['memory']['activations_gb']:.1f} GB of caches and "
                              f"activations"))
    if result["decode"]:
        t = Table(title="decode, ms per step (all sequences) and tokens/s")
        for c in ("T", "batch", "dense eager", "dense graph", "MSA eager", "MSA graph", "dense tok/s", "MSA tok/s",
                  "speedup", "graph = eager"):
            t.add_column(c, justify="right")
        for r in result["decode"]:
            d, m = r.get("dense") or {}, r.get("msa") or {}
            checks = [x.get("graph_check") for x in (d, m) if x.get("graph_check")]
            same = "-" if not checks else ("equal" if all(c["equal"] for c in checks) else
                                          "close" if all(c["close"] for c in checks) else "DIFFERENT")
            tok = lambda x: x.get("graph_tokens_per_s") or x.get("eager_tokens_per_s")  # noqa: E731
            speed = r.get("speedup") or r.get("speedup_eager")
            t.add_row(f"{r['T']:,}", f"{r['batch']}/{r['batch_requested']}" + ("*" if r.get("extrapolated") else ""),
                      f(d.get("eager_ms"), 2),
                      f(d.get("graph_ms"), 2), f(m.get("eager_ms"), 2), f(m.get("graph_ms"), 2), f(tok(d), 0),
                      f(tok(m), 0), "-" if speed is None else f"{speed:.2f}x", same)
        out.append(t)
        for r in result["decode"]:
            if r["note"]:
                out.append(("* " if r.get("extrapolated") else "") + f"decode {r['T']:,}: {r['note']}")
        tbs = result.get("bandwidth_tbs")
        t = Table(title="decode byte floor: what a step must read, and the share of its time at "
                        + (f"{tbs} TB/s" if tbs else "an unknown bandwidth (--bandwidth)"))
        for c in ("T", "batch", "model", "weights GB", "KV GB", "index GB", "total GB", "floor ms", "step ms",
                  "share"):
            t.add_column(c, justify="right")
        for r in result["decode"]:
            for name in ("dense", "msa"):
                x = r.get(name) or {}
                if not x.get("floor"):
                    continue
                fb = x["floor"]["bytes"]
                gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
                share = x["floor"]["share"]
                t.add_row(f"{r['T']:,}", str(r["batch"]) + ("*" if r.get("extrapolated") else ""), name,
                          gb(fb["weights"]), gb(fb["kv"]), gb(fb["index"]), gb(fb["total"]), f(x["floor"]["ms"], 3),
                          f(x.get("graph_ms") or x.get("eager_ms"), 3), "-" if share is None else f"{share:.0%}")
        out.append(t)
        why = next((x.get("graph_unavailable") for r in result["decode"] for x in (r.get("dense"), r.get("msa"))
                    if x and x.get("graph_unavailable")), None)
        if why:
            out.append(f"no CUDA graph: {why}")
    check = result["conversion_check"]
    if check is not None:
        out.append(f"conversion kept device {check['device']} and dtype {check['dtype']}: "
                      + ("yes" if check["ok"] else f"NO ({', '.join(check['mismatched'][:4])})"))
    out.append(f"wrote {path} and {png}")
    return out


def _merge_earlier(result: dict, path: Path) -> dict:
    """A run with only prefill (or only decode) lengths keeps the other part of an earlier run in the same file when
    that run benched the same model with the same MSA settings (so the two parts can run as two shorter commands)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return result
    if not isinstance(old, dict) or old.get("bench") != "model" or old.get("model") != result["model"] \
            or old.get("msa") != result["msa"]:
        return result
    merged = dict(result)
    for part, keys in (("prefill_lengths", ("prefill", "prefill_summary")), ("decode_lengths", ("decode",))):
        if not result["config"][part] and old.get(keys[0]):
            for k in keys:
                merged[k] = old.get(k, [])
            merged.setdefault("kept_from_earlier_run", []).append({"part": keys[0], "env": old.get("env")})
    return merged


def _plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        c = colors[i % len(colors)]
        rows = r.get("prefill_summary") or []
        if rows:
            xs = [s["T"] for s in rows]
            ax.plot(xs, [s["speedup"] for s in rows], "-", color=c, label=f"{r['name']}: MSA vs dense")
            for s in rows:
                timed = s["dense"] == "timed" and s["msa"] == "timed"
                ax.plot([s["T"]], [s["speedup"]], "o", color=c, markerfacecolor=c if timed else "white")
            ax.plot(xs, [float("nan") if s["ceiling"] is None else s["ceiling"] for s in rows], ":", color=c, label=f"{r['name']}: ceiling (attention free)")
        dec = [d for d in r.get("decode") or [] if d.get("speedup") or d.get("speedup_eager")]
        if dec:
            xs = [d["T"] for d in dec]
            ax_label = f"{r['name']}: " + ", ".join(f"B={d['batch']}" for d in dec)
            bx.plot(xs, [d["speedup"] or d["speedup_eager"] for d in dec], "o-", color=c, label=ax_label)
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="time to first token: dense / MSA",
           title="prefill, whole model (hollow: extrapolated)")
    bx.set(xscale="log", xlabel="context length (tokens)", ylabel="decode tokens/s: MSA / dense",
           title="decode, whole model (CUDA graph; eager where none)")
    for a in (ax, bx):
        a.axhline(1.0, color="grey", lw=0.5)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    env = results[-1]["env"] if results else {}
    fig.suptitle(f"m3c bench model: {env.get('gpu', env.get('device', ''))}, torch {env.get('torch')}, "
                 f"triton {env.get('triton')}", fontsize=9)
    fig.tight_layout()
    try:
        atomic_save_figure(fig, png, dpi=110)
    finally:
        plt.close(fig)
