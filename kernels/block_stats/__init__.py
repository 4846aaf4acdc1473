"""The block-ranking loss's heavy part in one kernel: per key block, the teacher's log-sum-exp and the student's block
max of sampled query rows (naive.block_stats), then the loss and its gradient in a few vectorised torch ops.

For query rows `rows` [R] (positions, int64, ascending, distinct; row r at position t_r sees keys j <= t_r):

    blse[b, h, r, n]   = logsumexp_{j in n, j <= t_r} q[h, t_r] . k[h // G, j] * scale     every query head h
    scores[b, g, r, n] = max_{j in n, j <= t_r} q_idx[g, t_r] . k_idx[j] / sqrt(Di)         every index head g
    arg[b, g, r, n]    = the key j of that max (int32)

fp32, -inf (arg: the block's first key) where block n holds no visible key. One program owns TOK rows of one
(batch, KV group): the TOK x G (row, head) pairs of the teacher as the rows of one matmul against the group's keys
(tokens x heads, as the indexer packs them), the TOK rows of the group's index head as another against the shared
index keys. It walks the key blocks its last row sees, the blocks every row sees whole without the causal mask and
the rest with it, and writes one value per (row, head, block): no T x T tensor, nothing per key, no online
softmax across blocks (every block is its own output). Blocks after the tile's last row are written -inf.
fp32 accumulation; inputs bf16/fp16/fp32 (fp32 matmuls with input_precision "ieee").

`block_rank_kl` turns them into the loss of naive.block_rank_kl (naive.block_rank_terms: per-head block
mass exp(blse - logsumexp_n blse), group mean, candidate blocks, renormalised, KL against the softmax of the scores)
and its backward (naive.block_rank_grads: Q - P to each block's argmax key by index_add), both over all rows at
once: [B, H, R, nb] tensors, and [B, H, R, nb, Di] in the backward (SmolLM2 at 8K: 2 x 3 x 1024 x 128 x 64). No
value is read back to the host, so a CUDA graph captures it.

Layout: q_idx [B, T, Hi, Di] (as the graph produces it), k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D]
(Hi == Hkv), rows [R] int64 -> blse [B, Hq, R, nb], scores / arg [B, Hi, R, nb].
"""
from __future__ import annotations

import math

import torch

from m3compile.kernels.block_stats import naive
from m3compile.kernels._common import detached, next_pow2, tune_bucket, use_triton

__all__ = ["block_stats", "block_stats_reference", "block_lse", "block_rank_kl"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q_idx, k_idx, q, k, rows, block_size):
    if q_idx.dim() != 4 or k_idx.dim() != 3 or q.dim() != 4 or k.dim() != 4:
        raise ValueError("q_idx must be [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D]")
    B, T, Hi, Di = q_idx.shape
    if k_idx.shape != (B, T, Di) or k.shape[0] != B or k.shape[1] != Hi or k.shape[2] != T or q.shape[0] != B \
            or q.shape[2] != T or q.shape[3] != k.shape[3] or q.shape[1] % Hi:
        raise ValueError(f"shapes disagree: q_idx {tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be a 1-D int64 tensor of query positions, got {rows.dtype} {tuple(rows.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def block_stats_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          rows: torch.Tensor, *, block_size: int, scale: float | None = None):
    """Plain-torch `block_stats` (same layouts; arg int32): naive.block_stats on q_idx [B, Hi, T, Di]."""
    _check(q_idx, k_idx, q, k, rows, block_size)
    blse, scores, arg = naive.block_stats(q_idx.transpose(1, 2), k_idx, q, k, rows.to(q.device), block_size=block_size,
                                        scale=scale)
    return blse, scores, arg.to(torch.int32)


def _same_dtype(a: torch.Tensor, b: torch.Tensor):
    """a, b in one dtype (the promoted one; a matmul's operands must agree) and unit last stride."""
    if a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        raise ValueError(f"the block-stats kernel takes bf16, fp16 or fp32 inputs, got {a.dtype} and {b.dtype}")
    if a.dtype != b.dtype:
        dt = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dt), b.to(dt)
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))


def block_stats(q_idx: torch.Tensor, k_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *,
                block_size: int, scale: float | None = None, backend: str = "auto"):
    """Per key block, the teacher's log-sum-exp of every query head and the index branch's block max (with its key)
    of the query rows at `rows` (module docstring). No gradient.

    q_idx [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (bf16/fp16/fp32), rows [R] int64
    (ascending, distinct, < T; not checked: that would read them back) -> (blse [B, Hq, R, nb] fp32,
    scores [B, Hi, R, nb] fp32, arg [B, Hi, R, nb] int32), nb = ceil(T / block_size).
    Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), otherwise `block_stats_reference`."""
    _check(q_idx, k_idx, q, k, rows, block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q_idx, k_idx, q, k, backend=backend):
        return block_stats_reference(q_idx, k_idx, q, k, rows, block_size=block_size, scale=scale)
    from m3compile.kernels.block_stats._tl_block_stats import block_stats_kernel

    q, k = _same_dtype(q, k)
    q_idx, k_idx = _same_dtype(q_idx, k_idx)
    B, T, Hi, Di = q_idx.shape
    Hq, D = q.shape[1], q.shape[3]
    G = Hq // Hi
    R, nb = rows.numel(), -(-T // block_size)
    blse = torch.empty(B, Hq, R, nb, dtype=torch.float32, device=q.device)
    scores = torch.empty(B, Hi, R, nb, dtype=torch.float32, device=q.device)
    arg = torch.empty(B, Hi, R, nb, dtype=torch.int32, device=q.device)
    if R == 0:
        return blse, scores, arg
    rows = rows.contiguous()
    grid = lambda meta: (-(-R // meta["TOK"]), B * Hi)  # noqa: E731
    block_stats_kernel[grid](
        q, k, q_idx, k_idx, rows, blse, scores, arg,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
        blse.stride(0), blse.stride(1), blse.stride(2), scores.stride(0), scores.stride(1), scores.stride(2),
        R, T, nb, scale * math.log2(math.e), Di**-0.5, tune_bucket(T),
        HKV=Hi, G=G, GP=next_pow2(G), D=D, DP=max(16, next_pow2(D)), DI=Di, DIP=max(16, next_pow2(Di)),
        BS=block_size, BN=max(16, next_pow2(block_size)), IEEE=q.dtype == torch.float32,
        IEEE_IDX=q_idx.dtype == torch.float32, INDEX=True,
    )
    return blse, scores, arg


def block_lse(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, block_size: int, scale: float | None = None,
              backend: str = "auto") -> torch.Tensor:
    """The teacher's half of `block_stats` alone: per key block, every query head's log-sum-exp (natural log,
    scale included) of the query rows at `rows`, -inf where the block holds no visible key; the kernel runs with
    its index half compiled out. What the oracle selection ranks blocks by (causal_lse.oracle_blocks).

    q [B, Hq, T, D], k [B, Hkv, T, D] (bf16/fp16/fp32), rows [R] int64 (ascending, distinct, < T) ->
    blse [B, Hq, R, nb] fp32. Runs the kernel on CUDA (or under TRITON_INTERPRET=1), otherwise the reference
    (naive.block_stats' blse)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [B, Hq, T, D] and k [B, Hkv, T, D] with Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.int64 or block_size < 1:
        raise ValueError("rows must be a 1-D int64 tensor of query positions and block_size >= 1")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, Hkv, T = k.shape[0], k.shape[1], k.shape[2]
    if not use_triton(q, k, backend=backend):
        no_index = q.new_zeros(B, Hkv, T, 1)  # the reference computes both halves: a one-channel index is free
        return naive.block_stats(no_index, no_index[:, 0], q, k, rows.to(q.device), block_size=block_size,
                                 scale=scale)[0].float()
    from m3compile.kernels.block_stats._tl_block_stats import block_stats_kernel

    q, k = _same_dtype(q, k)
    Hq, D = q.shape[1], q.shape[3]
    R, nb = rows.numel(), -(-T // block_size)
    blse = torch.empty(B, Hq, R, nb, dtype=torch.float32, device=q.device)
    if R == 0:
        return blse
    rows = rows.contiguous()
    grid = lambda meta: (-(-R // meta["TOK"]), B * Hkv)  # noqa: E731
    block_stats_kernel[grid](  # the index half's pointers are never read: blse stands in for them
        q, k, q, q, rows, blse, blse, blse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        0, 0, 0, 0, 0,
        blse.stride(0), blse.stride(1), blse.stride(2), 0, 0, 0,
        R, T, nb, scale * math.log2(math.e), 1.0, tune_bucket(T),
        HKV=Hkv, G=Hq // Hkv, GP=next_pow2(Hq // Hkv), D=D, DP=max(16, next_pow2(D)), DI=16, DIP=16,
        BS=block_size, BN=max(16, next_pow2(block_size)), IEEE=q.dtype == torch.float32, IEEE_IDX=False,
        INDEX=False,
    )
    return blse


class _BlockRankKL(torch.autograd.Function):
    """naive.block_rank_kl with every row in one piece and the block statistics from the kernel: the mean over
    (batch, group, row) of KL(P || softmax S); backward (Q - P) to each block's argmax key."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, rows, block_size, init_blocks, local_blocks, scale):
        blse, scores, arg = block_stats(q_idx, k_idx, q, k, rows, block_size=block_size, scale=scale,
                                        backend="triton")
        kl, valid, d_scores = naive.block_rank_terms(blse, scores, rows, block_size=block_size,
                                                   init_blocks=init_blocks, local_blocks=local_blocks)
        n_valid = valid.sum().clamp(min=1)
        ctx.save_for_backward(q_idx, k_idx, rows, d_scores, arg, n_valid)
        return kl.sum() / n_valid

    @staticmethod
    def backward(ctx, g):
        q_idx, k_idx, rows, d_scores, arg, n_valid = ctx.saved_tensors
        dq = torch.zeros(q_idx.shape, dtype=torch.float32, device=q_idx.device)  # [B, T, Hi, Di]
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=q_idx.device)
        coeff = g.float() * q_idx.shape[-1] ** -0.5 / n_valid
        naive.block_rank_grads(d_scores * coeff, arg, rows, q_idx.transpose(1, 2), k_idx, dq.transpose(1, 2), dk)
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), None, None, None, None, None, None, None


def block_rank_kl(q_idx: torch.Tensor, k_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, block_size: int,
                  rows: torch.Tensor, init_blocks: int = 0, local_blocks: int = 1, scale: float | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """The block-ranking loss of naive.block_rank_kl (its docstring has the definition), on the query positions
    `rows`, with its block statistics from the kernel: a 0-d fp32 tensor; gradients reach q_idx and k_idx only.

    q_idx [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (bf16/fp16/fp32), rows [R] int64
    (ascending, distinct) -> []. Runs the kernel on CUDA (or under TRITON_INTERPRET=1), otherwise (and for fp64
    inputs) the chunked reference."""
    _check(q_idx, k_idx, q, k, rows, block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fp64 = torch.float64 in (q_idx.dtype, k_idx.dtype, q.dtype, k.dtype)
    if fp64 or not use_triton(q_idx, k_idx, q, k, backend=backend):
        return naive.block_rank_kl(q_idx.transpose(1, 2), k_idx, q, k, block_size=block_size, init_blocks=init_blocks,
                                 local_blocks=local_blocks, scale=scale, rows=rows)
    if rows.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=q.device)  # no choice anywhere: nothing to rank
    return _BlockRankKL.apply(q_idx, k_idx, detached(q), detached(k), rows, block_size, init_blocks, local_blocks,
                              scale)

