"""The graph ops: every function that stands as one node in a traced or rewritten graph, with its reference and its
lowering, the one switch that picks between them, and access to the ops' arguments by name.

    op                 reference (plain torch, any device)          lowering (Triton on CUDA and under TRITON_INTERPRET=1)
    apply_rope         NeoX RoPE on the first R channels            kernels.norm_rope.rope (+ backward)
    rms_norm           the models' RMSNorm                          kernels.norm_rope.rms_norm (where no gradient)
    add_rms_norm       a residual add and the norm after it         kernels.norm_rope.add_rms_norm (where no gradient)
    index_norm_rope    an MSA layer's index branch after its        kernels.norm_rope.index_norm_rope (+ backward)
                       projections: Gemma norms, the index RoPE
    index_branch       the same from the layer's input: both        one matmul, then the same kernel
                       projections as one matmul, then the above
    msa_select         kernels.indexer.naive.select_blocks          kernels.indexer.select_blocks (fused scores +
                       (index_dtype "fp8": e4m3-rounded q and k)    top-k; fp8 x fp8 for index_dtype "fp8")
    msa_oracle_select  kernels.causal_lse.naive.oracle_blocks       kernels.causal_lse.oracle_blocks
    msa_recent_select  kernels.indexer.naive.recent_blocks          -
    msa_attention      kernels.sparse_attention.naive               gather-Q sparse prefill (+ backward); SDPA where
                       .sparse_attention                            every visible block is selected
    msa_attention_lse  msa_attention, (out, None, None)             + per-head LSE and the BlockCSR it walked
    msa_index_kl       kernels.sparse_kl.naive.index_kl             fused sparse-support KL, streamed recall
    msa_block_loss     kernels.block_stats.naive.block_rank_kl      fused block statistics, then the loss in torch
    frame_segments / window_segments / segment_attention (the ViT's segments and varlen attention),
    msa (torch.ops.m3compile.msa: msa_select then msa_attention, the one node per layer ONNX export emits)

The switch: inside `lowering()` (or `lowering(True)`) every op of LOWERING runs its lowering, outside it its
reference. It is the one place that decides which kernel an op runs: the eager model, a traced or rewritten graph
and the paged runtime read it alike (m3compile.lower and the commands that run kernels turn it on; on a CPU without
TRITON_INTERPRET=1 a lowering runs the reference itself). Passes never read these nodes' arguments by position:
`op_args(node)` binds them to the op's parameter names and `set_op_arg(node, name, value)` rewrites one (the node
keeps its arguments as keywords from then on). The project's Tracer (m3compile.graph.tracing) keeps every op here a
single node, wherever it is called from.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F

from m3compile.config import INDEX_DTYPES
from m3compile.kernels import block_stats, causal_lse, indexer, norm_rope
from m3compile.kernels import sparse_attention as _sparse, sparse_kl
from m3compile.kernels import varlen_attention as varlen
from m3compile.kernels._common import use_triton
from m3compile.kernels.block_stats.naive import block_rank_kl, choice_rows
from m3compile.kernels.causal_lse import naive as causal_lse_naive
from m3compile.kernels.indexer.naive import recent_blocks, select_blocks
from m3compile.kernels.norm_rope import naive as norm_rope_naive
from m3compile.kernels.norm_rope.index_rope import index_rope_tables
from m3compile.kernels.sparse_attention import tile as sparse_tile
from m3compile.kernels.sparse_attention.naive import sparse_attention
from m3compile.kernels.sparse_kl.naive import index_kl

__all__ = [
    "lowering", "lowering_enabled", "LOWERING", "GRAPH_OPS", "apply_rope", "rms_norm", "add_rms_norm",
    "index_norm_rope", "index_branch", "msa_select", "msa_oracle_select", "msa_recent_select", "msa_attention",
    "msa_attention_lse", "msa_index_kl", "msa_block_loss", "frame_segments", "window_segments", "segment_attention",
    "msa_fused", "is_op", "op_args", "set_op_arg", "recall_rows", "RECALL_ROWS", "BLOCK_LOSS_ROWS",
    "block_loss_rows", "visible_blocks", "dense_support", "SPARSE_KERNELS", "sparse_kernel", "using_sparse_kernel",
    "scope", "recording_scopes",
]

RECALL_ROWS = 1024  # queries the lowered KL hook measures block recall on, at most
BLOCK_LOSS_ROWS = 1024  # queries per sequence the block-ranking loss is computed on, at most


_FORCED_SCOPES = [0]  # > 0 inside `recording_scopes`


def scope(name: str):
    """A profiler range `name` while a profiler records (what `m3c bench distill` attributes GPU time to) or
    inside `recording_scopes`; otherwise nothing: a range costs two dispatches per call, paid by every step."""
    if _FORCED_SCOPES[0] or torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def recording_scopes():
    """Open the `scope` ranges without a profiler (bench.op_count attributes dispatches to them)."""
    _FORCED_SCOPES[0] += 1
    try:
        yield
    finally:
        _FORCED_SCOPES[0] -= 1


# ----------------------------------------------------------------------------------------------------------------
# The switch

_LOWERING: contextvars.ContextVar[bool] = contextvars.ContextVar("m3compile_lowering", default=False)

# reference op -> its lowering (registered by `_lowers`)
LOWERING: dict[Callable, Callable] = {}


@contextlib.contextmanager
def lowering(enabled: bool = True):
    """Inside the block, every op of LOWERING runs its lowering (enabled) or its reference (not); the setting of
    the enclosing block comes back after. Context-local: threads and tasks each see their own."""
    token = _LOWERING.set(bool(enabled))
    try:
        yield
    finally:
        _LOWERING.reset(token)


def lowering_enabled() -> bool:
    """Whether the ops run their lowerings here (the innermost `lowering` block says; off outside any)."""
    return _LOWERING.get()


def _lowerable(scope_name: str | None = None):
    """Make `reference` a graph op: it runs the lowering registered for it (`_lowers`) while the switch is on, else
    `reference` itself (also at `op.reference`, which a lowering calls where its kernels do not apply); inside
    `scope("m3c.<scope_name>")` when a name is given."""
    def decorate(reference: Callable) -> Callable:
        @functools.wraps(reference)
        def op(*args, **kwargs):
            fn = (LOWERING.get(op) or reference) if _LOWERING.get() else reference
            if scope_name is None:
                return fn(*args, **kwargs)
            with scope(f"m3c.{scope_name}"):
                return fn(*args, **kwargs)

        op.reference = reference
        return op
    return decorate


def _lowers(op: Callable):
    """Register the decorated function as the lowering of `op`."""
    def register(fn: Callable) -> Callable:
        LOWERING[op] = fn
        return fn
    return register


def _backend() -> str:
    """The kernels' backend argument that follows the switch: "auto" (Triton where it runs) or "torch"."""
    return "auto" if _LOWERING.get() else "torch"


# ----------------------------------------------------------------------------------------------------------------
# Reference ops


@torch.fx.wrap
@_lowerable()
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first cos.shape[-1] channels. x [B, T, H, D], cos/sin [B, T, R] -> [B, T, H, D]."""
    r = cos.shape[-1]
    # the tables in x's dtype: under autocast q/k are bf16 while the tables follow fp32 embeddings, and fp32 tables
    # would promote q/k to fp32 (and every kernel after them)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


@torch.fx.wrap
@_lowerable()
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """The models' RMSNorm over the last dim: style "rms" w * x_hat (x_hat rounded to x's dtype first), "gemma"
    x_hat * (1 + w) in x's dtype; x_hat = x * rsqrt(mean(x^2) + eps) in fp32."""
    return norm_rope_naive.rms_norm(x, weight, eps, style)


@torch.fx.wrap
@_lowerable()
def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: str = "rms") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d)): a residual add and the norm after it."""
    return norm_rope_naive.add_rms_norm(x, d, weight, eps, style)


@torch.fx.wrap
@_lowerable("index_branch")
def index_norm_rope(y: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, eps: float, rope: str = "m3") -> tuple[torch.Tensor, torch.Tensor]:
    """One MSA layer's index branch after its projections: y [B, T, (Hi + 1) * Di] (the index query heads, then the
    key head) -> per head the Gemma RMSNorm (q_norm_weight for the query heads, k_norm_weight for the key) and the
    index RoPE of rule `rope` (kernels/norm_rope/index_rope.py) from the main tables cos/sin [B, T, R] ->
    (q_idx [B, T, Hi, Di], k_idx [B, T, Di]). Differentiable in y and both weights."""
    cos, sin = index_rope_tables(cos, sin, q_norm_weight.shape[0], rope)
    return norm_rope_naive.index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps=eps, width=cos.shape[-1])


@torch.fx.wrap
@_lowerable("index_branch")
def index_branch(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_norm_weight: torch.Tensor,
                 k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 rope: str = "m3") -> tuple[torch.Tensor, torch.Tensor]:
    """One MSA layer's index branch from its (detached) input x [B, T, hidden]: both projections (q_weight
    [Hi * Di, hidden], k_weight [Di, hidden]) as one matmul over their concatenated weights, then index_norm_rope
    -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di]). Differentiable in the four weights."""
    return index_norm_rope.reference(F.linear(x, torch.cat((q_weight, k_weight))), q_norm_weight, k_norm_weight,
                                     cos, sin, eps, rope)


def _fp8_scoring(index_dtype: str) -> bool:
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, got {index_dtype!r}")
    return index_dtype == "fp8"


@torch.fx.wrap
@_lowerable("msa_select")
def msa_select(q_idx, k_idx, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
               index_dtype: str = "auto", top_p: float = 1.0, min_blocks: int = 0):
    """Index-branch block selection. q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] (-1 = empty).

    index_dtype "fp8": scores of the e4m3-quantised query rows and keys (kernels.indexer.naive.select_blocks fp8).
    top_p < 1: the adaptive budget (docs/msa.md 2.8; topk its ceiling, min_blocks its floor)."""
    return select_blocks(
        q_idx.transpose(1, 2), k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
        local_blocks=local_blocks, fp8=_fp8_scoring(index_dtype), top_p=top_p, min_blocks=min_blocks,
    )


@torch.fx.wrap
@_lowerable("msa_select")
def msa_oracle_select(q, k, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                      scale: float | None = None, top_p: float = 1.0, min_blocks: int = 0):
    """The oracle's blocks: per KV group and query, the forced blocks, then the earlier blocks of most group-mean
    dense attention mass (what a perfect index branch would select; top_p < 1: the fewest holding top_p of the
    candidates' mass). q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T, topk] (-1 = empty)."""
    return causal_lse_naive.oracle_blocks(q, k, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                          local_blocks=local_blocks, scale=scale, top_p=top_p, min_blocks=min_blocks)


@torch.fx.wrap
def msa_recent_select(q, k, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1):
    """The forced blocks, then the most recent ones: a sliding window with the top-k's budget (a baseline that finds
    nothing further back). q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T, topk] (-1 = empty)."""
    B, Hkv, T = k.shape[:3]
    return recent_blocks(B, Hkv, T, block_size=block_size, topk=topk, init_blocks=init_blocks,
                         local_blocks=local_blocks, device=k.device)


@torch.fx.wrap
@_lowerable("msa_attention")
def msa_attention(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True, adaptive: bool = False):
    """Block-sparse attention over the selected blocks (or dense causal when `sparse` is False).

    q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D].
    adaptive: the selection has an adaptive budget (docs/msa.md 2.8), so it may leave visible blocks out even where
    its K slots could hold every one: the lowering never takes that for dense attention.
    """
    if not sparse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)


@torch.fx.wrap
@_lowerable("msa_attention")
def msa_attention_lse(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True,
                      adaptive: bool = False):
    """msa_attention that also gives the per-head log-sum-exp over the selected keys ([B, T, Hq] fp32, base 2, no
    gradient) and the BlockCSR of the selection its kernel walked: (out, lse, csr). The reference gives
    (out, None, None); the lowering gives both where its sparse kernel ran (None, None where SDPA did: dense
    support, or every visible block selected). A layer with a KL hook (passes/kl_distill.py) wires them into the
    hook, its teacher's normaliser and its kernel's layout, so the hook needs no attention pass and no CSR build of
    its own; evaluation reads block recall off the lse."""
    return msa_attention.reference(q, k, v, blocks, block_size, scale, sparse, adaptive), None, None


@torch.fx.wrap
@_lowerable("msa_index_kl")
def msa_index_kl(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool, teacher_lse=None,
                 csr=None, adaptive: bool = False):
    """Mean KL(teacher || student) and mean block recall of one MSA layer over (batch, group, token); with an
    adaptive budget (`adaptive`, as msa_attention's) over the blocks it kept.

    q [B, Hq, T, D], k [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di], blocks [B, Hi, T, K] -> two scalars.
    `teacher_lse` (the attention's per-head log-sum-exp) and `csr` (the BlockCSR its kernel walked), from the
    layer's msa_attention_lse, are only used by the lowering.
    """
    kl, recall = index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=block_size, sparse=sparse,
                          scale=scale)
    return kl.mean(), recall.mean()


def block_loss_rows(T: int, block_size: int, topk: int, n: int = BLOCK_LOSS_ROWS, device=None) -> torch.Tensor:
    """The queries the block-ranking loss is computed on: those with a choice to make (t >= topk * block_size),
    all of them up to `n`, else `n` evenly spaced (kernels.block_stats.naive.choice_rows). The same rows every step: the
    loss stays a pure function of the batch (a resumed run continues bit for bit). Cached per shape and device
    (a CUDA-graph capture finds them built): never write to the result."""
    return _block_loss_rows(T, block_size, topk, n, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=16)
def _block_loss_rows(T: int, block_size: int, topk: int, n: int, device: torch.device) -> torch.Tensor:
    return choice_rows(T, block_size, topk, n, device=device)


@torch.fx.wrap
@_lowerable("msa_block_loss")
def msa_block_loss(q, k, q_idx, k_idx, block_size: int, scale: float, topk: int, init_blocks: int = 0,
                   local_blocks: int = 1, rows: int = BLOCK_LOSS_ROWS):
    """The block-ranking loss of one MSA layer (kernels.block_stats.naive.block_rank_kl): mean over (batch, group,
    sampled query) of KL(teacher block mass || softmax of the index branch's block-max scores) over the non-forced
    visible blocks, on at most `rows` queries per sequence that have a choice (block_loss_rows). fp32, autocast off
    (the query-chunked torch reference); gradients reach q_idx and k_idx only.

    q [B, Hq, T, D], k [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> a scalar."""
    positions = block_loss_rows(q.shape[2], block_size, topk, rows, q.device)
    with torch.autocast(q.device.type, enabled=False):
        return block_rank_kl(q_idx.transpose(1, 2), k_idx, q, k, block_size=block_size, init_blocks=init_blocks,
                             local_blocks=local_blocks, scale=scale, rows=positions)


def _grid(grid_thw) -> torch.Tensor:
    return torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).cpu()


@torch.fx.wrap
def frame_segments(grid_thw) -> torch.Tensor:
    """cu_seqlens of the per-frame ViT: every temporal step of every image/video is its own segment."""
    return varlen.window_segments(_grid(grid_thw), 1)


@torch.fx.wrap
def window_segments(grid_thw, window: int) -> torch.Tensor:
    """cu_seqlens of 3D windows of at most `window` temporal steps (kernels.varlen_attention.window_segments)."""
    return varlen.window_segments(_grid(grid_thw), window)


@torch.fx.wrap
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention inside each segment. q/k/v [N, H, D] -> [N, H, D].

    segments: cu_seqlens [S + 1] (the fused varlen kernel on CUDA, its reference elsewhere) or a [N, N] bool mask
    of same-segment pairs (one masked SDPA: the exportable form that vision.onnx uses)."""
    if segments.dtype == torch.bool:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=segments, scale=scale)  # 4D: what the ONNX exporter takes
        return o[0].transpose(0, 1)
    return varlen.varlen_attention(q, k, v, segments.to(q.device), scale=scale)


@torch.library.custom_op("m3compile::msa", mutates_args=())
def _msa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
            block_size: int, topk: int, init_blocks: int, local_blocks: int, scale: float, top_p: float = 1.0,
            min_blocks: int = 0) -> torch.Tensor:
    """One MSA layer: msa_select (q_idx [B, T, Hi, Di], k_idx [B, T, Di]; top_p < 1: the adaptive budget) then
    msa_attention (q, k, v head-major)."""
    blocks = msa_select(q_idx, k_idx, block_size, topk, init_blocks, local_blocks, "auto", top_p, min_blocks)
    return msa_attention(q, k, v, blocks, block_size, scale, True, top_p < 1)


@_msa_op.register_fake
def _(q, k, v, q_idx, k_idx, block_size, topk, init_blocks, local_blocks, scale, top_p=1.0, min_blocks=0):
    return torch.empty_like(q)


msa_fused = torch.ops.m3compile.msa.default  # what passes/fuse_msa.py puts in place of msa_select + msa_attention


# ----------------------------------------------------------------------------------------------------------------
# Lowerings: the same signatures, the Triton kernels on CUDA tensors (and under TRITON_INTERPRET=1), the reference
# elsewhere, so a lowered model still runs anywhere.


def recall_rows(T: int, device=None) -> torch.Tensor:
    """Query positions block recall is measured on: all T up to RECALL_ROWS, else RECALL_ROWS evenly spaced ones
    from the first to the last (distinct: their spacing exceeds one), so the dense log-sum-exp behind a logged
    metric stays linear in T (BENCHMARKS.md has what the full version cost). Cached per (T, device): never write
    to the result."""
    return _recall_rows(T, RECALL_ROWS, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=16)
def _recall_rows(T: int, n: int, device: torch.device) -> torch.Tensor:
    if T <= n:
        return torch.arange(T, device=device)
    return torch.linspace(0, T - 1, n, device=device).round().long()


# The sparse prefill kernel where no gradient is needed (msa_attention_triton): "gather" (kernels/sparse_attention/,
# gather-Q, the default) or "tile" (kernels/sparse_attention/tile.py, the query-tile union design: it ties gather-Q at best
# on the GPU, BENCHMARKS.md, so opt-in: M3C_SPARSE_KERNEL=tile, or using_sparse_kernel("tile"))
SPARSE_KERNELS = ("gather", "tile")
_sparse_kernel: list[str] = []


def sparse_kernel() -> str:
    """The sparse prefill kernel in force: the innermost using_sparse_kernel, else $M3C_SPARSE_KERNEL, else gather."""
    name = _sparse_kernel[-1] if _sparse_kernel else os.environ.get("M3C_SPARSE_KERNEL", "gather")
    if name not in SPARSE_KERNELS:
        raise ValueError(f"M3C_SPARSE_KERNEL must be one of {', '.join(SPARSE_KERNELS)}, got {name!r}")
    return name


@contextlib.contextmanager
def using_sparse_kernel(name: str):
    """msa_attention_triton runs `name` (SPARSE_KERNELS) inside the block where no gradient is needed."""
    if name not in SPARSE_KERNELS:
        raise ValueError(f"sparse kernel must be one of {', '.join(SPARSE_KERNELS)}, got {name!r}")
    _sparse_kernel.append(name)
    try:
        yield
    finally:
        _sparse_kernel.pop()


def _all_selected(T: int, block_size: int, topk: int, adaptive: bool = False) -> bool:
    """Every visible block is selected: MSA is dense causal attention exactly (docs/msa.md 2.6); never so under an
    adaptive budget, which may leave blocks out whatever its ceiling (2.8)."""
    return not adaptive and -(-T // block_size) <= topk


@_lowers(apply_rope)
def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope as one fused kernel (forward and backward; the reference's roundings)."""
    if not use_triton(x, cos, sin):
        return apply_rope.reference(x, cos, sin)
    return norm_rope.rope(x, cos, sin)


@_lowers(rms_norm)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """The norm as one kernel where no gradient is needed (a frozen backbone, inference), the formula elsewhere."""
    return norm_rope.rms_norm(x, weight, eps=eps, style=style)


@_lowers(add_rms_norm)
def add_rms_norm_triton(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float,
                        style: str = "rms") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm in one kernel where no gradient is needed (the same values). x and d of two
    dtypes (an fp32 residual stream beside bf16 autocast outputs) go in as torch's sum would take them: both in the
    promoted dtype, an exact cast."""
    if x.dtype != d.dtype:
        ct = torch.promote_types(x.dtype, d.dtype)
        x, d = x.to(ct), d.to(ct)
    return norm_rope.add_rms_norm(x, d, weight, eps=eps, style=style)


@_lowers(index_norm_rope)
def index_norm_rope_triton(y, q_norm_weight, k_norm_weight, cos, sin, eps: float, rope: str = "m3"):
    """Per head the Gemma RMSNorm and the index RoPE in one kernel (+ backward); y may be a slice of a wider fused
    projection's output (read in place)."""
    cos, sin = index_rope_tables(cos, sin, q_norm_weight.shape[0], rope)
    return norm_rope.index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps=eps, width=cos.shape[-1])


@_lowers(index_branch)
def index_branch_triton(x, q_weight, k_weight, q_norm_weight, k_norm_weight, cos, sin, eps: float, rope: str = "m3"):
    """The two projections as one matmul, then the norms and RoPE of every index head in one kernel (+ backward)."""
    return index_norm_rope_triton(F.linear(x, torch.cat((q_weight, k_weight))), q_norm_weight, k_norm_weight, cos,
                                  sin, eps, rope)


@_lowers(msa_select)
def msa_select_triton(q_idx, k_idx, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                      index_dtype: str = "auto", top_p: float = 1.0, min_blocks: int = 0):
    """Fused index scoring + top-k -> [B, Hi, T, topk] int32 (-1 = empty). index_dtype "fp8": the keys are
    quantised here (one scale per key block), the query rows inside the kernel."""
    k_scale = None
    if _fp8_scoring(index_dtype):
        k_idx, k_scale = indexer.quantize_index_keys(k_idx, block_size)
    return indexer.select_blocks(q_idx, k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, k_scale=k_scale, top_p=top_p, min_blocks=min_blocks)


@_lowers(msa_oracle_select)
def msa_oracle_select_triton(q, k, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                             scale: float | None = None, top_p: float = 1.0, min_blocks: int = 0):
    """The oracle's blocks with each chunk's block log-sum-exps from one kernel (kernels.causal_lse.oracle_blocks)."""
    return causal_lse.oracle_blocks(q, k, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                    local_blocks=local_blocks, scale=scale, top_p=top_p, min_blocks=min_blocks)


@_lowers(msa_attention)
def msa_attention_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True,
                         adaptive: bool = False):
    """Gather-Q block-sparse attention. Where no gradient is needed and sparse_kernel() is "tile": the query-tile
    union kernel instead (same result). When every visible block is selected MSA is dense causal attention exactly,
    and the dense kernel (SDPA) runs."""
    if not sparse or _all_selected(q.shape[2], block_size, blocks.shape[-1], adaptive):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not grad and sparse_kernel() == "tile" and use_triton(q, k, v, blocks):
        return sparse_tile.sparse_attention_tiled(q, k, v, blocks, block_size=block_size, scale=scale)
    return _sparse.sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)


@_lowers(msa_attention_lse)
def msa_attention_lse_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True,
                             adaptive: bool = False):
    """(out, lse, csr) from the gather-Q kernel; (SDPA, None, None) where every visible block is selected or the
    support is dense; the reference's (out, None, None) where Triton does not run."""
    if not sparse or _all_selected(q.shape[2], block_size, blocks.shape[-1], adaptive):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True), None, None
    return _sparse.sparse_attention_lse(q, k, v, blocks, block_size=block_size, scale=scale, return_csr=True)


def visible_blocks(B: int, H: int, T: int, block_size: int, device=None) -> torch.Tensor:
    """[B, H, T, ceil(T / block_size)] int32: every causally visible block of each query (its own included), -1
    after: the selection that makes the support every visible key (the warm-up's dense support). Slot j holds
    block j."""
    nb = -(-T // block_size)
    ids = torch.arange(nb, device=device, dtype=torch.int32)
    own = torch.arange(T, device=device, dtype=torch.int32) // block_size
    table = torch.where(ids[None, :] <= own[:, None], ids[None, :], -1)  # [T, nb]
    return table.expand(B, H, T, nb).contiguous()


@functools.lru_cache(maxsize=4)
def dense_support(B: int, H: int, T: int, block_size: int, chunk: int, device: torch.device):
    """(visible_blocks, its BlockCSR at `chunk`): the warm-up's support depends on the shapes alone, so it is built
    once and reused by every layer and step (cached; never write to it)."""
    support = visible_blocks(B, H, T, block_size, device)
    return support, _sparse.block_csr(support, -(-T // block_size), chunk)


@_lowers(msa_index_kl)
def msa_index_kl_triton(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool, teacher_lse=None,
                        csr=None, adaptive: bool = False):
    """Mean KL and mean block recall of one MSA layer, as msa_index_kl; Triton on CUDA for both supports.

    Sparse support: the KL is the fused kernel (kernels/sparse_kl/) fed with the sparse attention's per-head
    log-sum-exp (`teacher_lse`, from the layer's msa_attention_lse; computed here by an LSE-only pass when not
    given) and its BlockCSR (`csr`; built here when not given); recall = mean over the group's heads of
    exp2(lse_selected - lse_all) (the dense teacher's mass inside the selected blocks) by one fused kernel
    (kernels/causal_lse/), no T x T tensor and no gradient. lse_all, over every visible key, is O(T) per query,
    so recall is measured on `recall_rows`.
    Dense support (warm-up): the same fused KL over every visible block (`dense_support`, built once per shape),
    its teacher log-sum-exp from the fused causal log-sum-exp, streamed like FlashAttention; the KL kernel also
    gives the teacher's mass per block, and recall is the mass of the selected blocks, exact on every query.
    CPU tensors keep the chunked torch reference.
    """
    T = q.shape[2]
    if not use_triton(q, k, q_idx, k_idx):
        return msa_index_kl.reference(q, k, q_idx, k_idx, blocks, block_size, scale, sparse, adaptive=adaptive)
    q = q.detach() if q.requires_grad else q  # (a detach is a dispatch; the frozen backbone's need none)
    k = k.detach() if k.requires_grad else k
    everything = _all_selected(T, block_size, blocks.shape[-1], adaptive)
    if sparse and not everything:
        with torch.no_grad():
            if teacher_lse is None:
                teacher_lse = _sparse.selected_lse(q, k, blocks, block_size=block_size, scale=scale, csr=csr)
            with scope("m3c.recall"):
                recall = causal_lse.dense_recall(q, k, teacher_lse, scale=scale, rows=recall_rows(T, q.device)).mean()
        kl = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=block_size, scale=scale,
                                       teacher_lse=teacher_lse, csr=csr, reduction="mean")
        return kl, recall
    # dense support, or a selection that holds every visible block
    support, support_csr = dense_support(q.shape[0], k.shape[1], T, block_size, sparse_kl.CSR_CHUNK, q.device)
    with torch.no_grad():
        teacher = causal_lse.causal_lse(q, k, scale=scale)
    kl, mass = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, support, block_size=block_size, scale=scale,
                                         teacher_lse=teacher, csr=support_csr, reduction="mean", block_mass=True)
    with torch.no_grad(), scope("m3c.recall"):
        if everything:
            recall = torch.ones((), device=q.device)
        else:  # slot j of the dense support holds block j: the mass of the selected blocks
            ids = blocks.long()
            recall = torch.where(ids >= 0, mass.gather(-1, ids.clamp(min=0)), 0.0).sum(-1).mean()
    return kl, recall


@_lowers(msa_block_loss)
def msa_block_loss_triton(q, k, q_idx, k_idx, block_size: int, scale: float, topk: int, init_blocks: int = 0,
                          local_blocks: int = 1, rows: int = BLOCK_LOSS_ROWS):
    """msa_block_loss with the per-block statistics of its rows (teacher log-sum-exp per head, the index branch's
    block max and its key) from one Triton kernel (kernels/block_stats/), then the loss and its backward over all
    rows at once in vectorised torch: no chunk loop, no host read (a CUDA graph captures it). fp32 (the kernel
    takes the bf16 inputs as they come), autocast off. CPU tensors keep the chunked torch reference."""
    if not use_triton(q, k, q_idx, k_idx):
        return msa_block_loss.reference(q, k, q_idx, k_idx, block_size, scale, topk, init_blocks, local_blocks, rows)
    positions = block_loss_rows(q.shape[2], block_size, topk, rows, q.device)
    with torch.autocast(q.device.type, enabled=False):
        return block_stats.block_rank_kl(q_idx, k_idx, q, k, block_size=block_size, rows=positions,
                                         init_blocks=init_blocks, local_blocks=local_blocks, scale=scale)


# ----------------------------------------------------------------------------------------------------------------
# The vocabulary: what the tracer keeps as single nodes, and arguments by name

GRAPH_OPS: tuple[Callable, ...] = (
    apply_rope, rms_norm, add_rms_norm, index_norm_rope, index_branch, msa_select, msa_oracle_select,
    msa_recent_select, msa_attention, msa_attention_lse, msa_index_kl, msa_block_loss, frame_segments,
    window_segments, segment_attention,
)
_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(target) -> inspect.Signature:
    if target not in _SIGNATURES:
        _SIGNATURES[target] = inspect.signature(target)
    return _SIGNATURES[target]


def is_op(node, *ops) -> bool:
    """Whether `node` calls one of `ops` (a call_function node)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in ops


def op_args(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments of a graph-op node by parameter name, defaults filled in."""
    bound = _signature(node.target).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def set_op_arg(node: torch.fx.Node, name: str, value) -> None:
    """Set one argument of a graph-op node by name; the node's arguments become keywords."""
    args = op_args(node)
    if name not in args:
        raise KeyError(f"{getattr(node.target, '__name__', node.target)} has no argument {name!r}")
    args[name] = value
    node.args, node.kwargs = (), args
