"""The graph ops: every function that stands as one node in a traced or rewritten graph, with its reference, its
lowering beside it, and access to its arguments by name.

    op                 reference (plain torch, any device)          lowering (Triton on CUDA, reference elsewhere)
    apply_rope         NeoX RoPE on the first R channels            apply_rope_triton (one fused kernel, + backward)
    apply_index_rope   the index branch's RoPE: the table cut to the index width (transformers' M3 rule)
                                                                    apply_index_rope_triton
    (index projections, Gemma norms, RoPE of one layer)            index_branch_triton (fuse_index_branch)
                                                                    index_norm_rope_triton (the same after a
                                                                    fused q/k/v/index matmul: Decoder)
    (an RMSNorm module)                                             rms_norm_triton (lower_norms)
    split_heads        [B, T, H*D] -> [B, T, H, D]                  -
    msa_select         kernels.indexer.naive.select_blocks          msa_select_triton (fused scores + top-k)
                       (index_dtype "fp8": e4m3-rounded q and k)    (index_dtype "fp8": fp8 x fp8 scores)
    msa_attention      kernels.sparse_attention.naive               msa_attention_triton (gather-Q sparse prefill)
                       .sparse_attention                            msa_attention_lse_triton (+ per-head LSE)
    msa_index_kl       kernels.sparse_kl.naive.index_kl             msa_index_kl_triton (fused sparse-support KL)
    msa_block_loss     kernels.block_stats.naive.block_rank_kl      msa_block_loss_triton (fused block stats, then
                                                                    the loss and its backward in vectorised torch)
    msa (torch.ops.m3compile.msa)  msa_select then msa_attention: the one node per layer that ONNX export emits
    frame_segments / window_segments / segment_attention   the ViT's attention segments and varlen attention

Passes never read these nodes' arguments by position: `op_args(node)` binds them to the op's parameter names and
`set_op_arg(node, name, value)` rewrites one (the node keeps its arguments as keywords from then on). The
project's Tracer (m3compile.graph.tracing) keeps every op here a single node, wherever it is called from.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F

from m3compile.config import INDEX_DTYPES, INDEX_ROPES
from m3compile.kernels import block_stats, causal_lse, indexer, norm_rope
from m3compile.kernels.block_stats.naive import block_rank_kl, choice_rows
from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.norm_rope.naive import gemma_rms_norm
from m3compile.kernels.sparse_attention.naive import sparse_attention
from m3compile.kernels.sparse_kl.naive import index_kl
from m3compile.kernels import sparse_attention as _sparse, sparse_kl
from m3compile.kernels.sparse_attention import tile as sparse_tile
from m3compile.kernels import varlen_attention as varlen
from m3compile.kernels._common import use_triton

__all__ = [
    "apply_rope", "apply_index_rope", "index_rope_dim", "index_rope_rule", "index_rope_tables", "tile_pairs",
    "split_heads", "msa_select",
    "msa_attention", "msa_index_kl", "msa_block_loss", "msa_select_triton", "SPARSE_KERNELS", "sparse_kernel",
    "using_sparse_kernel",
    "msa_attention_triton", "msa_attention_lse_triton", "msa_index_kl_triton", "msa_block_loss_triton",
    "frame_segments", "window_segments",
    "segment_attention", "msa_fused", "GRAPH_OPS", "LOWERING", "is_op", "op_args", "set_op_arg", "recall_rows",
    "RECALL_ROWS", "BLOCK_LOSS_ROWS", "block_loss_rows", "visible_blocks", "dense_support", "scope",
    "recording_scopes", "apply_rope_triton",
    "apply_index_rope_triton", "index_branch_triton", "index_norm_rope_triton", "rms_norm_triton",
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


def _scoped(name: str):
    """Run the op inside `scope("m3c.<name>")`."""
    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with scope(f"m3c.{name}"):
                return fn(*args, **kwargs)
        return run
    return decorate


# ----------------------------------------------------------------------------------------------------------------
# Reference ops


@torch.fx.wrap
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


def index_rope_dim(rope_dim: int, index_dim: int) -> int:
    """Width of the index branch's RoPE table: the main table (R = rope_dim) cut to the index head's first index_dim
    channels, so min(R, index_dim) (transformers' MiniMaxM3VLIndexer: cos[..., :index_head_dim])."""
    return min(rope_dim, index_dim)


def index_rope_rule(head_dim: int, rope_dim: int, index_dim: int) -> str:
    """The index RoPE rule (config.INDEX_ROPES) a conversion writes for these widths: "low" below the rotary width
    R, "tile" above it when the dense head rotates all its channels (no non-rotated channels to fit; an even index
    dim), else M3's own "m3"."""
    if index_dim < rope_dim:
        return "low"
    if index_dim > rope_dim == head_dim and index_dim % 2 == 0:
        return "tile"
    return "m3"


def tile_pairs(rope_dim: int, index_dim: int, device=None) -> torch.Tensor:
    """Rule "tile": the main table's pair (0 .. R/2 - 1) that each of the index head's Di/2 pairs turns as, [Di/2]
    int64. Every pair of the main table once, then again from the lowest frequencies (the highest pair numbers:
    the long-range ones a block selection needs) while index pairs remain: Di = 2R gives each pair twice.
    Built on `device` (no host-to-device copy: a CUDA graph can capture the decode step that builds it)."""
    h, n = rope_dim // 2, index_dim // 2
    return (torch.arange(n, device=device) + (h - n % h) % h) % h


def index_rope_tables(cos: torch.Tensor, sin: torch.Tensor, index_dim: int, rope: str = "m3"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The index branch's RoPE tables [.., T, w] from the main ones [.., T, R] (NeoX layout: the R/2 frequencies
    twice), as `rope` (config.INDEX_ROPES) says:
        "m3"   the first w = min(R, Di) channels (transformers' M3 rule; see apply_index_rope)
        "low"  the Di/2 lowest frequencies, twice (w = Di <= R): channel p of the index head and p + Di/2 turn as
               one pair at frequency R/2 - Di/2 + p, a true rotation at any index width (even Di < R).
        "tile" (Di > R, even) all Di channels: channel c and c + Di/2 turn as one pair at the frequency of the main
               table's pair tile_pairs(R, Di)[c] (each frequency at least once)."""
    if rope not in INDEX_ROPES:
        raise ValueError(f"index rope must be one of {', '.join(INDEX_ROPES)}, got {rope!r}")
    R = cos.shape[-1]
    if rope == "tile":
        if index_dim % 2 or index_dim < R:
            raise ValueError(f"index rope 'tile' needs an even index dim of at least the rotary width {R}, got "
                             f"{index_dim}")
        pairs = tile_pairs(R, index_dim, cos.device)
        c, s = cos[..., :R // 2].index_select(-1, pairs), sin[..., :R // 2].index_select(-1, pairs)
        return torch.cat((c, c), -1), torch.cat((s, s), -1)
    if rope == "m3" or index_dim >= R:
        w = index_rope_dim(R, index_dim)
        return cos[..., :w], sin[..., :w]
    if index_dim % 2:
        raise ValueError(f"index rope 'low' needs an even index dim, got {index_dim}")
    h, n = R // 2, index_dim // 2
    return (torch.cat((cos[..., h - n:h], cos[..., R - n:]), -1), torch.cat((sin[..., h - n:h], sin[..., R - n:]), -1))


@torch.fx.wrap
def apply_index_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: str = "m3") -> torch.Tensor:
    """RoPE of the index branch, the one rule every path uses: x [B, T, H, Di], cos/sin the main table [B, T, R].

    rope "m3" (the default): the table is cut to its first index_rope_dim(R, Di) channels and NeoX RoPE runs over
    that cut width w, as transformers' M3 indexer does. With Di >= R this is the main branch's RoPE; with Di < R the
    cut table keeps the first w entries of the frequencies [f_0 .. f_{R/2-1}, f_0 .. f_{R/2-1}] and rotate_half
    pairs channel p with p + w/2 of the cut width (not p + R/2): each pair then mixes two frequencies, so it is not
    a rotation, but it is the reference. rope "low" (a converted model whose index head is narrower than R): the
    Di/2 lowest frequencies (index_rope_tables), so scores depend on relative position only.
    """
    cos, sin = index_rope_tables(cos, sin, x.shape[-1], rope)
    return apply_rope(x, cos, sin)


@torch.fx.wrap
def split_heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, n_heads * head_dim] -> [B, T, n_heads, head_dim]."""
    return x.view(*x.shape[:-1], n_heads, head_dim)


def _fp8_scoring(index_dtype: str) -> bool:
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, got {index_dtype!r}")
    return index_dtype == "fp8"


@torch.fx.wrap
@_scoped("msa_select")
def msa_select(q_idx, k_idx, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
               index_dtype: str = "auto"):
    """Index-branch block selection. q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] (-1 = empty).

    index_dtype "fp8": scores of the e4m3-quantised query rows and keys (kernels.indexer.naive.select_blocks fp8)."""
    return select_blocks(
        q_idx.transpose(1, 2), k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
        local_blocks=local_blocks, fp8=_fp8_scoring(index_dtype),
    )


@torch.fx.wrap
@_scoped("msa_attention")
def msa_attention(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True):
    """Block-sparse attention over the selected blocks (or dense causal when `sparse` is False).

    q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D].
    """
    if not sparse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)


@torch.fx.wrap
@_scoped("msa_index_kl")
def msa_index_kl(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool, teacher_lse=None,
                 csr=None):
    """Mean KL(teacher || student) and mean block recall of one MSA layer over (batch, group, token).

    q [B, Hq, T, D], k [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di], blocks [B, Hi, T, K] -> two scalars.
    `teacher_lse` (the attention's per-head log-sum-exp) and `csr` (the BlockCSR its kernel walked), given by a
    lowered graph, are only used by the lowering.
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
@_scoped("msa_block_loss")
def msa_block_loss(q, k, q_idx, k_idx, block_size: int, scale: float, topk: int, init_blocks: int = 0,
                   local_blocks: int = 1, rows: int = BLOCK_LOSS_ROWS):
    """The block-ranking loss of one MSA layer (kernels.block_stats.naive.block_rank_kl): mean over (batch, group,
    sampled query) of KL(teacher block mass || softmax of the index branch's block-max scores) over the non-forced
    visible blocks, on at most `rows` queries per sequence that have a choice (block_loss_rows). fp32, autocast off
    (the query-chunked torch reference; msa_block_loss_triton is the lowering); gradients reach q_idx and k_idx
    only.

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
            block_size: int, topk: int, init_blocks: int, local_blocks: int, scale: float) -> torch.Tensor:
    """One MSA layer: msa_select (q_idx [B, T, Hi, Di], k_idx [B, T, Di]) then msa_attention (q, k, v head-major)."""
    blocks = msa_select(q_idx, k_idx, block_size, topk, init_blocks, local_blocks)
    return msa_attention(q, k, v, blocks, block_size, scale)


@_msa_op.register_fake
def _(q, k, v, q_idx, k_idx, block_size, topk, init_blocks, local_blocks, scale):
    return torch.empty_like(q)


msa_fused = torch.ops.m3compile.msa.default  # what passes/fuse_msa.py puts in place of msa_select + msa_attention


# ----------------------------------------------------------------------------------------------------------------
# Lowered ops: the same signatures, the Triton kernels on CUDA tensors (and under TRITON_INTERPRET=1), the torch
# reference elsewhere, so a lowered graph still runs anywhere.


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


def _all_selected(T: int, block_size: int, topk: int) -> bool:
    """Every visible block is selected: MSA is dense causal attention exactly (MSA_SPEC 2.6)."""
    return -(-T // block_size) <= topk


@torch.fx.wrap
@_scoped("msa_select")
def msa_select_triton(q_idx, k_idx, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                      index_dtype: str = "auto"):
    """Fused index scoring + top-k. q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] int32 (-1 = empty).

    index_dtype "fp8": the keys are quantised here (one scale per key block), the query rows inside the kernel."""
    k_scale = None
    if _fp8_scoring(index_dtype):
        k_idx, k_scale = indexer.quantize_index_keys(k_idx, block_size)
    return indexer.select_blocks(q_idx, k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, k_scale=k_scale)


@torch.fx.wrap
@_scoped("msa_attention")
def msa_attention_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True):
    """Gather-Q block-sparse attention. q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D].
    Where no gradient is needed and sparse_kernel() is "tile": the query-tile union kernel instead (same result).

    When every visible block is selected MSA is dense causal attention exactly, and the dense kernel (SDPA) runs.
    """
    if not sparse or _all_selected(q.shape[2], block_size, blocks.shape[-1]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not grad and sparse_kernel() == "tile" and use_triton(q, k, v, blocks):
        return sparse_tile.sparse_attention_tiled(q, k, v, blocks, block_size=block_size, scale=scale)
    return _sparse.sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)


@torch.fx.wrap
@_scoped("msa_attention")
def msa_attention_lse_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True):
    """msa_attention_triton that also returns each head's log-sum-exp over the selected keys ([B, T, Hq] fp32, base
    2, no gradient) and the BlockCSR of the selection its kernel walked (None where SDPA or the torch reference
    runs): lowering wires both into the same layer's KL hook, the teacher's normaliser and the KL kernel's
    layout, so the hook needs no attention pass and no CSR build of its own."""
    if not sparse or _all_selected(q.shape[2], block_size, blocks.shape[-1]):
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


@torch.fx.wrap
@_scoped("msa_index_kl")
def msa_index_kl_triton(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool, teacher_lse=None,
                        csr=None):
    """Mean KL and mean block recall of one MSA layer, as msa_index_kl; Triton on CUDA for both supports.

    Sparse support: the KL is the fused kernel (kernels/sparse_kl/) fed with the sparse attention's per-head
    log-sum-exp (`teacher_lse`, from the layer's msa_attention_lse_triton; computed here by an LSE-only pass when
    not given) and its BlockCSR (`csr`; built here when not given); recall = mean over the group's heads of
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
        return msa_index_kl(q, k, q_idx, k_idx, blocks, block_size, scale, sparse)
    q = q.detach() if q.requires_grad else q  # (a detach is a dispatch; the frozen backbone's need none)
    k = k.detach() if k.requires_grad else k
    everything = _all_selected(T, block_size, blocks.shape[-1])
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


@torch.fx.wrap
@_scoped("msa_block_loss")
def msa_block_loss_triton(q, k, q_idx, k_idx, block_size: int, scale: float, topk: int, init_blocks: int = 0,
                          local_blocks: int = 1, rows: int = BLOCK_LOSS_ROWS):
    """msa_block_loss with the per-block statistics of its rows (teacher log-sum-exp per head, the index branch's
    block max and its key) from one Triton kernel (kernels/block_stats/), then the loss and its backward over all
    rows at once in vectorised torch: no chunk loop, no host read (a CUDA graph captures it). fp32 (the kernel
    takes the bf16 inputs as they come), autocast off. CPU tensors keep the chunked torch reference.

    q [B, Hq, T, D], k [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> a scalar."""
    if not use_triton(q, k, q_idx, k_idx):
        return msa_block_loss(q, k, q_idx, k_idx, block_size, scale, topk, init_blocks, local_blocks, rows)
    positions = block_loss_rows(q.shape[2], block_size, topk, rows, q.device)
    with torch.autocast(q.device.type, enabled=False):
        return block_stats.block_rank_kl(q_idx, k_idx, q, k, block_size=block_size, rows=positions,
                                         init_blocks=init_blocks, local_blocks=local_blocks, scale=scale)


@torch.fx.wrap
def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope as one fused kernel (forward and backward; the reference's roundings), the reference elsewhere."""
    if not use_triton(x, cos, sin):
        return apply_rope(x, cos, sin)
    return norm_rope.rope(x, cos, sin)


@torch.fx.wrap
def apply_index_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: str = "m3") -> torch.Tensor:
    """apply_index_rope as one fused kernel, the reference elsewhere."""
    if not use_triton(x, cos, sin):
        return apply_index_rope(x, cos, sin, rope)
    cos, sin = index_rope_tables(cos, sin, x.shape[-1], rope)
    return norm_rope.rope(x, cos, sin, width=cos.shape[-1])


@torch.fx.wrap
@_scoped("index_branch")
def index_branch_triton(x, q_weight, k_weight, q_norm_weight, k_norm_weight, cos, sin, eps: float, qk_weight=None,
                        rope: str = "m3"):
    """One MSA layer's index branch after its (detached) input, fused (passes/fuse_index_branch.py): the two
    projections as one matmul, then per head the Gemma RMSNorm and the index RoPE in one kernel (+ backward).

    x [B, T, hidden], q_weight [Hi * Di, hidden], k_weight [Di, hidden], q/k_norm_weight [Di], cos/sin [B, T, R]
    -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di]). Elsewhere the reference: the layer's own ops, in order.
    qk_weight: [q_weight; k_weight] concatenated by the caller (the eager Decoder keeps it per layer), so no
    concatenation runs per call; None: concatenated here (differentiable in both weights). rope: as apply_index_rope."""
    Di = q_norm_weight.shape[0]
    if not use_triton(x, cos, sin):
        q = gemma_rms_norm(split_heads(F.linear(x, q_weight), q_weight.shape[0] // Di, Di), q_norm_weight, eps)
        k = gemma_rms_norm(split_heads(F.linear(x, k_weight), 1, Di), k_norm_weight, eps)
        return apply_index_rope(q, cos, sin, rope), apply_index_rope(k, cos, sin, rope)[:, :, 0]
    y = F.linear(x, torch.cat((q_weight, k_weight)) if qk_weight is None else qk_weight)
    return _index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps, rope)


@_scoped("index_branch")
def index_norm_rope_triton(y, q_norm_weight, k_norm_weight, cos, sin, eps: float, rope: str = "m3"):
    """index_branch_triton after its matmul, for a caller that computed the index projections in a wider one (the
    fused projections of Decoder.fuse_projections): y [B, T, (Hi + 1) * Di] (the index query heads, then the key;
    a slice of the wider output is read in place) -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di]). Per head the Gemma
    RMSNorm and the index RoPE in one kernel; elsewhere the reference ops, in order."""
    Di = q_norm_weight.shape[0]
    if not use_triton(y, cos, sin):
        q = gemma_rms_norm(split_heads(y[..., :-Di], y.shape[-1] // Di - 1, Di), q_norm_weight, eps)
        k = gemma_rms_norm(split_heads(y[..., -Di:], 1, Di), k_norm_weight, eps)
        return apply_index_rope(q, cos, sin, rope), apply_index_rope(k, cos, sin, rope)[:, :, 0]
    return _index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps, rope)


def _index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps: float, rope: str):
    cos, sin = index_rope_tables(cos, sin, q_norm_weight.shape[0], rope)
    return norm_rope.index_norm_rope(y, q_norm_weight, k_norm_weight, cos, sin, eps=eps, width=cos.shape[-1])


@torch.fx.wrap
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """A model's RMSNorm module as one kernel where no gradient is needed (the frozen backbone while distilling,
    inference), the module's own formula elsewhere (passes/lower_norms.py)."""
    return norm_rope.rms_norm(x, weight, eps=eps, style=style)


# ----------------------------------------------------------------------------------------------------------------
# The vocabulary: what the tracer keeps as single nodes, what lowering swaps, and arguments by name

LOWERING: dict[Callable, Callable] = {
    msa_select: msa_select_triton, msa_attention: msa_attention_triton, msa_index_kl: msa_index_kl_triton,
    msa_block_loss: msa_block_loss_triton, apply_rope: apply_rope_triton, apply_index_rope: apply_index_rope_triton,
}
GRAPH_OPS: tuple[Callable, ...] = (
    apply_rope, apply_index_rope, split_heads, msa_select, msa_attention, msa_index_kl, msa_block_loss,
    frame_segments, window_segments, segment_attention, msa_select_triton, msa_attention_triton,
    msa_attention_lse_triton, msa_index_kl_triton, msa_block_loss_triton, apply_rope_triton, apply_index_rope_triton,
    index_branch_triton, rms_norm_triton,
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
