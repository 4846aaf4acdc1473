"""What generation needs in memory, counted before any of it is allocated: the weights, the caches of every
sequence, and the activations of one prefill chunk; and a check of it against the device's free memory that names,
when it does not fit, what would (an fp8 KV cache, a smaller batch, a smaller prefill chunk).

One count serves `m3compile.generate`, `m3c bench model` and the remote code's `generate()` (so it sits below them
all, beside config and errors, importing only the kernels' constants). It describes the model by its shapes alone
(`ModelShape`: from a Decoder's ModelArgs, or from the remote code's settings) and one of two cache layouts:
    paged       the runtime's PagedCache: pages of `page` tokens per layer (K, V; fp8 K/V with one fp32 scale per
                token and head), index-key pages of every MSA layer (fp8: one fp32 scale per token row and an
                unquantised tail page per sequence); equal to PagedCache.nbytes() (tests/runtime/test_kv_cache.py)
    contiguous  transformers' cache as the remote code fills it: K and V of every layer (the model's dtype, or fp8
                with one fp32 scale per position and head: the remote code's Fp8RowLayer), an MSA layer's index
                keys as ceil(Di / D) extra key heads of the keys; no pages. Each step concatenates
                a layer's keys and values anew (and an fp8 cache returns them dequantised): one layer's K and V in
                the model's dtype count among the activations
A prefill chunk's activations are its tokens' tensors through one layer (the residual stream, the normed input,
q/k/v, the attention output, the MLP's gate, up and product), the sparse attention's partial outputs (bounded by
kernels.sparse_attention.PARTIAL_BYTES), and, for an fp8 KV cache, the dequantised keys and values the chunk attends
to (the whole prefix of one layer: 2 x T x Hkv x D in the model's dtype).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from m3compile.errors import M3CompileError
from m3compile.kernels.decode.naive import KV_QUANTISED
from m3compile.kernels.sparse_attention import PARTIAL_BYTES

__all__ = ["ModelShape", "MemoryPlan", "cache_bytes", "activation_bytes", "plan_memory", "fitted_plan",
           "prefill_chunk", "available_bytes", "check_memory", "weight_bytes", "size", "GB", "DEQUANTIZE_ROWS"]

GB = 1e9
_FP8 = torch.float8_e4m3fn
DEQUANTIZE_ROWS = 1 << 16  # tokens an fp8 K/V read-back dequantises at once (runtime.PagedCache.keys_values)


def size(n: float) -> str:
    """Bytes for a message: 145.8 GB, 12.3 MB, 4.0 KB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class ModelShape:
    """The shapes memory depends on. sparse_layers: how many layers are MSA layers (index keys cached)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    sparse_layers: int = 0
    index_heads: int = 0
    index_dim: int = 0
    topk: int = 0
    block: int = 128

    @classmethod
    def from_args(cls, args) -> "ModelShape":
        """From a Decoder's ModelArgs (MoE: the routed experts' intermediate, at least the dense MLP's)."""
        inter = max(args.intermediate_size, args.experts_per_tok * args.moe_intermediate_size
                    + args.shared_intermediate_size)
        m = args.msa
        return cls(args.n_layers, args.hidden_size, args.n_heads, args.n_kv_heads, args.head_dim, inter,
                   args.vocab_size, sum(args.is_sparse(i) for i in range(args.n_layers)),
                   m.index_heads if m else 0, m.index_dim if m else 0, m.topk if m else 0, m.block_size if m else 128)


def _item(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def cache_bytes(shape: ModelShape, tokens: int, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                model_dtype: torch.dtype, page: int = 128, layout: str = "paged") -> int:
    """Bytes of one sequence's caches at `tokens` positions (module docstring: the layouts)."""
    D, Hkv = shape.head_dim, shape.kv_heads
    if layout == "contiguous":
        extra = -(-shape.index_dim // D) if shape.sparse_layers else 0
        row = D * _item(kv_dtype) + (4 if kv_dtype in KV_QUANTISED else 0)
        return tokens * row * (2 * Hkv * shape.layers + extra * shape.sparse_layers)
    if layout != "paged":
        raise ValueError(f"layout must be 'paged' or 'contiguous', got {layout!r}")
    slots = -(-tokens // page) * page
    kv_row = D * _item(kv_dtype) + (4 if kv_dtype in KV_QUANTISED else 0)  # one (token, head) row and its scale
    total = shape.layers * 2 * slots * Hkv * kv_row
    if shape.sparse_layers:
        fp8 = index_dtype == _FP8
        idx = slots * (shape.index_dim * _item(index_dtype) + (4 if fp8 else 0))
        idx += page * shape.index_dim * _item(model_dtype) if fp8 else 0  # the unquantised tail page
        total += shape.sparse_layers * idx
    return total


def activation_bytes(shape: ModelShape, chunk: int, tokens: int, kv_dtype: torch.dtype,
                     model_dtype: torch.dtype) -> int:
    """Peak transient bytes of a prefill chunk of `chunk` tokens at a context of `tokens` (module docstring)."""
    item = _item(model_dtype)
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    attention = 3 * shape.hidden + qkv + shape.heads * shape.head_dim + (shape.index_heads + 1) * shape.index_dim
    mlp = 3 * shape.hidden + 4 * shape.intermediate
    total = chunk * max(attention, mlp) * item + shape.vocab * 4  # + the last position's fp32 logits
    if shape.sparse_layers:
        gp = 1 << max(0, shape.heads // shape.kv_heads - 1).bit_length()
        partial_row = shape.topk * shape.kv_heads * gp * (shape.head_dim * item + 4)
        total += min(chunk * partial_row, PARTIAL_BYTES + partial_row)
        total += chunk * shape.kv_heads * shape.topk * 24  # the CSR of the chunk's selection (ids, sort, payload)
    if kv_dtype in KV_QUANTISED:
        total += 2 * tokens * shape.kv_heads * shape.head_dim * item
        # the fp32 rows of one piece (an int8 cache's also rotated back: a second fp32 piece)
        total += min(tokens, DEQUANTIZE_ROWS) * shape.kv_heads * shape.head_dim * 4 * (2 if kv_dtype == torch.int8 else 1)
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes generation needs: `weights` (already resident once a model is loaded), the caches of `batch`
    sequences of `tokens` positions, and one prefill chunk's activations. `need` = what is still to allocate."""

    shape: ModelShape
    batch: int
    tokens: int
    chunk: int
    kv_dtype: torch.dtype
    index_dtype: torch.dtype
    model_dtype: torch.dtype
    page: int
    layout: str
    weights: int
    caches: int
    activations: int

    @property
    def need(self) -> int:
        return self.caches + self.activations

    def to_dict(self) -> dict:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return {"batch": self.batch, "tokens": self.tokens, "prefill_chunk": self.chunk,
                "kv_cache": name(self.kv_dtype), "index_cache": name(self.index_dtype), "weights_gb": self.weights / GB,
                "caches_gb": self.caches / GB, "activations_gb": self.activations / GB, "need_gb": self.need / GB}

    def describe(self) -> str:
        kv = {_FP8: "fp8", torch.int8: "int8"}.get(self.kv_dtype, str(self.kv_dtype).replace("torch.", ""))
        weights = f" (beside {size(self.weights)} of weights)" if self.weights else ""
        return (f"{self.batch} x {self.tokens:,} positions need {size(self.caches)} of caches ({kv} KV) and "
                f"{size(self.activations)} for a prefill chunk of {self.chunk:,} tokens{weights}")


def plan_memory(shape: ModelShape, batch: int, tokens: int, *, kv_dtype: torch.dtype, index_dtype: torch.dtype,
                model_dtype: torch.dtype, chunk: int, page: int = 128, weights: int = 0,
                layout: str = "paged") -> MemoryPlan:
    """The memory of `batch` sequences of `tokens` positions, prefilled `chunk` tokens at a time (paged: one
    sequence at a time, as m3compile.generate does; contiguous: the whole batch in one forward, as transformers'
    generate does)."""
    caches = batch * cache_bytes(shape, tokens, kv_dtype, index_dtype, model_dtype, page, layout)
    acts = activation_bytes(shape, min(chunk, tokens), tokens, kv_dtype if layout == "paged" else model_dtype,
                            model_dtype)
    if layout == "contiguous":  # the whole batch's prompts in one forward; a layer's keys and values concatenated
        extra = -(-shape.index_dim // shape.head_dim) if shape.sparse_layers else 0  # anew (or dequantised) a step
        acts = batch * acts + batch * tokens * _item(model_dtype) * shape.head_dim * (2 * shape.kv_heads + extra)
    return MemoryPlan(shape, batch, tokens, min(chunk, tokens), kv_dtype, index_dtype, model_dtype, page, layout,
                      weights, caches, acts)


def fitted_plan(shape: ModelShape, batch: int, tokens: int, prompt: int, free: float | None, *,
                kv_dtype: torch.dtype, index_dtype: torch.dtype, model_dtype: torch.dtype, chunk: int | None = None,
                page: int = 128, weights: int = 0) -> MemoryPlan:
    """The paged plan of `batch` sequences of `tokens` positions whose longest prompt has `prompt` tokens,
    prefilled `chunk` tokens at a time, or (chunk None) in the chunk `prefill_chunk` picks for `free` bytes."""
    kw = dict(kv_dtype=kv_dtype, index_dtype=index_dtype, model_dtype=model_dtype, page=page, weights=weights)
    plan = plan_memory(shape, batch, tokens, chunk=prompt if chunk is None else min(chunk, prompt), **kw)
    if chunk is None:
        plan = plan_memory(shape, batch, tokens, chunk=prefill_chunk(plan, free, prompt), **kw)
    return plan


def prefill_chunk(plan: MemoryPlan, free: float | None, tokens: int) -> int:
    """The prefill chunk for a prompt of `tokens`: the whole prompt where its activations fit in half the memory
    left beside the caches (the other half a margin for what the count leaves out: allocator rounding, kernel
    scratch), else the largest multiple of the page that does (at least one page). free None: the whole prompt."""
    if free is None:
        return tokens
    fixed = activation_bytes(plan.shape, 0, plan.tokens, plan.kv_dtype if plan.layout == "paged" else
                             plan.model_dtype, plan.model_dtype)
    per_token = (activation_bytes(plan.shape, plan.page, plan.tokens, plan.kv_dtype, plan.model_dtype) - fixed) \
        / plan.page
    spare = (free - plan.caches - fixed) / 2
    fit = int(spare // per_token) if per_token > 0 else tokens
    return max(plan.page, min(tokens, fit // plan.page * plan.page))


def available_bytes(device) -> float | None:
    """Memory a new allocation can take on `device`: CUDA free memory plus what torch's allocator holds unused;
    on a CPU the system's available memory (Linux /proc/meminfo, else free pages); None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(plan: MemoryPlan, free: float | None, where: str = "the device", auto_chunk: bool = False,
                 batch_of: str | None = None) -> None:
    """Raise M3CompileError with the numbers, and the options that would fit, when `plan` does not fit in `free`
    bytes (None: unknown, nothing checked). auto_chunk: the plan's prefill chunk was chosen by `prefill_chunk`
    (no option set it), so each option gets its own. batch_of: what the batch's sequences are, when they are given
    one by one rather than by a batch size ("prompts": the smaller batch is then "2 of these 3 prompts at once")."""
    if free is None or plan.need <= free:
        return

    def fitting(**changes) -> MemoryPlan | None:  # the plan with `changes`, its chunk lowered to fit if need be
        p = plan_memory(plan.shape, changes.get("batch", plan.batch), changes.get("tokens", plan.tokens),
                        kv_dtype=changes.get("kv_dtype", plan.kv_dtype),
                        index_dtype=changes.get("index_dtype", plan.index_dtype), model_dtype=plan.model_dtype,
                        chunk=changes.get("tokens", plan.tokens) if auto_chunk else plan.chunk, page=plan.page,
                        weights=plan.weights, layout=plan.layout)
        if p.need > free and plan.layout == "paged":
            p = plan_memory(p.shape, p.batch, p.tokens, kv_dtype=p.kv_dtype, index_dtype=p.index_dtype,
                            model_dtype=p.model_dtype, chunk=prefill_chunk(p, free, p.tokens), page=p.page,
                            weights=p.weights)
        return p if p.need <= free else None

    def chunk_note(p: MemoryPlan) -> str:
        return "" if auto_chunk or p.chunk == plan.chunk else f" and --prefill-chunk {p.chunk}"

    options = []
    index = plan.shape.sparse_layers and plan.index_dtype != _FP8  # an index-key cache not yet fp8
    if plan.kv_dtype not in KV_QUANTISED or index:
        kv8 = plan.kv_dtype if plan.kv_dtype in KV_QUANTISED else _FP8  # an int8 cache stays int8 (the same bytes)
        name = "int8" if kv8 == torch.int8 else "fp8"
        p = fitting(kv_dtype=kv8, index_dtype=_FP8 if plan.shape.sparse_layers else plan.index_dtype)
        how = f"kv_cache='{name}'" if plan.layout == "contiguous" else \
            f"--kv-cache {name}{' --index-cache fp8' if index else ''}{'' if p is None else chunk_note(p)}"
        if p is not None:
            options.append(f"an {name} KV cache ({how}: {size(p.need)})")
    if plan.layout == "paged" and plan.chunk > plan.page and not auto_chunk:
        p = fitting()
        if p is not None:
            options.append(f"a smaller prefill chunk (--prefill-chunk {p.chunk}: {size(p.need)})")
    for batch in range(plan.batch - 1, 0, -1):
        p = fitting(batch=batch)
        if p is not None:
            fewer = f"{batch} of these {plan.batch} {batch_of} at once" if batch_of else f"a batch of {batch}"
            options.append(f"{fewer}{chunk_note(p)} ({size(p.need)})")
            break
    lo, hi = 0, plan.tokens  # the longest context that fits as asked otherwise
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fitting(tokens=mid) is not None else (lo, mid - 1)
    if lo:
        options.append(f"at most {lo:,} positions per sequence (prompt + new tokens)")
    advice = "; it would fit with " + ", or ".join(options) if options else "; nothing smaller fits either"
    raise M3CompileError(f"not enough memory: {plan.describe()}: {size(plan.need)}, and {where} has "
                         f"{size(free)} free{advice}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (a tensor shared by two modules once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
