"""Fused index KL over the selected support (MSA_SPEC section 4), forward and backward, never T x T.

Per (batch, KV group g, token t): teacher P = mean over the group's G heads of softmax over the causally visible
keys of the selected blocks of q_h . k * scale; student Q = softmax over the same keys of q_idx . k_idx / sqrt(Di);
KL(P || Q). One program per (batch, group, token) walks the token's <= K selected blocks twice (log-sum-exps, then
the KL), holding one block at a time; the per-head and student log-sum-exps are kept for the backward, which
recomputes P and Q per block and returns d(q_idx) and d(k_idx) only (dKL/dz = Q - P): the teacher is detached.

Shapes: q_idx [B, T, Hi, Di] (the graph's layout), k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D],
blocks [B, Hi, T, K] -> kl [B, Hi, T] fp32. The torch reference is `reference.index_kl(..., sparse=True)`.
"""
from __future__ import annotations

import math

import torch

from kernels import reference as ref
from kernels._common import next_pow2, use_triton

__all__ = ["sparse_index_kl"]


def _meta(q_idx, k_idx, q, k, blocks, block_size):
    B, T, Hi, Di = q_idx.shape
    Hq, D = q.shape[1], q.shape[3]
    G = Hq // k.shape[1]
    return dict(HKV=k.shape[1], K=blocks.shape[-1], G=G, GP=max(16, next_pow2(G)), D=D, DP=max(16, next_pow2(D)),
                DI=Di, DIP=max(16, next_pow2(Di)), BS=block_size, BN=max(16, next_pow2(block_size)),
                IEEE=q.dtype == torch.float32)


class _SparseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, blocks, block_size, scale):
        from kernels._tl_kl import sparse_kl_fwd_kernel

        B, T, Hi, Di = q_idx.shape
        meta = _meta(q_idx, k_idx, q, k, blocks, block_size)
        kl = torch.empty(B, Hi, T, dtype=torch.float32, device=q.device)
        lse_s = torch.empty_like(kl)
        lse_t = torch.empty(B, Hi, meta["GP"], T, dtype=torch.float32, device=q.device)
        sl2, isl2 = scale * math.log2(math.e), Di**-0.5 * math.log2(math.e)
        sparse_kl_fwd_kernel[(T, Hi, B)](
            q, k, q_idx, k_idx, blocks, kl, lse_t, lse_s,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            blocks.stride(0), blocks.stride(1), blocks.stride(2), kl.stride(0), kl.stride(1),
            T, sl2, isl2, **meta,
        )
        ctx.save_for_backward(q_idx, k_idx, q, k, blocks, lse_t, lse_s)
        ctx.block_size, ctx.scale = block_size, scale
        return kl

    @staticmethod
    def backward(ctx, d_kl):
        from kernels._tl_kl import sparse_kl_bwd_kernel

        q_idx, k_idx, q, k, blocks, lse_t, lse_s = ctx.saved_tensors
        B, T, Hi, Di = q_idx.shape
        meta = _meta(q_idx, k_idx, q, k, blocks, ctx.block_size)
        d_kl = d_kl.float().contiguous()
        dq = torch.empty(q_idx.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=q.device)
        sl2, isl2 = ctx.scale * math.log2(math.e), Di**-0.5 * math.log2(math.e)
        sparse_kl_bwd_kernel[(T, Hi, B)](
            q, k, q_idx, k_idx, blocks, lse_t, lse_s, d_kl, dq, dk,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            blocks.stride(0), blocks.stride(1), blocks.stride(2), lse_s.stride(0), lse_s.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1),
            T, sl2, isl2, Di**-0.5, **meta,
        )
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), None, None, None, None, None


def sparse_index_kl(q_idx: torch.Tensor, k_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    blocks: torch.Tensor, *, block_size: int, scale: float | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """KL(teacher || student) per (batch, KV group, token) over the selected blocks; gradients reach q_idx and
    k_idx only. q_idx [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D], blocks [B, Hi, T, K]."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or blocks.dim() != 4 or q.dim() != 4 or k.dim() != 4:
        raise ValueError("q_idx must be [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D], "
                         "blocks [B, Hi, T, K]")
    B, T, Hi, Di = q_idx.shape
    if k.shape[1] != Hi or blocks.shape[:3] != (B, Hi, T) or q.shape[2] != T or k_idx.shape != (B, T, Di):
        raise ValueError(f"shapes disagree: q_idx {tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, blocks {tuple(blocks.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q_idx, k_idx, q, k, backend=backend):
        return ref.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=block_size, sparse=True,
                            scale=scale)[0]
    for name, t in (("q_idx", q_idx), ("k_idx", k_idx), ("q", q), ("k", k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    return _SparseKL.apply(q_idx, k_idx, q.detach(), k.detach(), blocks, block_size, scale)
