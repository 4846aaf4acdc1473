"""Fused index KL over the selected support (docs/msa.md section 4), forward and backward, never T x T.

Per (batch, KV group g, token t): teacher P = mean over the group's G heads of softmax over the causally visible
keys of the selected blocks of q_h . k * scale; student Q = softmax over the same keys of q_idx . k_idx / sqrt(Di);
KL(P || Q). The teacher's per-head log-sum-exp is the sparse attention forward's (`teacher_lse`, as the official
kernels take it; computed here by an LSE-only pass of that forward when not given), so P is exact block by block and

    KL = sum_j P_j ln P_j - ln2 * sum_j P_j z_j + ln2 * lse2(z) * sum_j P_j     (z: student logits in base 2)

adds up over the selected blocks. The kernels use the attention's KV-outer layout (the CSR of queries per (group,
key block), `sparse_attention.build_csr`): a program loads one block's keys and index keys once and sweeps tiles of
the tokens that chose it, looping over the group's heads; it writes per (token, slot) the student's block
log-sum-exp and the three sums, which a merge kernel reduces per token. The backward walks the same tiles with the
merged student log-sum-exp: d(student logit) = Q * sum P - P on the support, d(q_idx) rows by relaxed fp32 atomics
(one share per selected block), d(k_idx) of a block accumulated on chip. Only the index branch gets gradients: the
teacher is detached. Memory: O(T * K) partials, linear in T.

Shapes: q_idx [B, T, Hi, Di] (the graph's layout), k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D],
blocks [B, Hi, T, K], teacher_lse [B, T, Hq] (base 2, scale included) -> kl [B, Hi, T] fp32. The torch reference
is `naive.index_kl(..., sparse=True)` (kernels/sparse_kl/naive.py).
"""
from __future__ import annotations

import math

import torch

from m3compile.kernels.sparse_kl import naive
from m3compile.kernels._common import detached, next_pow2, tune_bucket, use_triton
from m3compile.kernels.sparse_attention import BlockCSR, block_csr, selected_lse

__all__ = ["sparse_index_kl", "CSR_CHUNK"]

CSR_CHUNK = 256  # CSR entries (tokens) one program sweeps over one key block (when the KL builds its own CSR)
_MERGE_ROWS = 64  # (batch, group, token) rows one merge program reduces


def _meta(q_idx, q, k, blocks, block_size):
    Di, D = q_idx.shape[-1], q.shape[-1]
    return dict(HKV=k.shape[1], NB=-(-q.shape[2] // block_size), K=blocks.shape[-1], G=q.shape[1] // k.shape[1],
                D=D, DP=max(16, next_pow2(D)), DI=Di, DIP=max(16, next_pow2(Di)), BS=block_size,
                BN=max(16, next_pow2(block_size)), CHUNK=CSR_CHUNK, IEEE=q.dtype == torch.float32)


def _strides(q_idx, k_idx, q, k, tlse):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            tlse.stride(0), tlse.stride(1))


class _SparseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, blocks, teacher_lse, block_size, scale, csr, mean, want_mass):
        from m3compile.kernels.sparse_kl._tl_kl import sparse_kl_fwd_kernel, sparse_kl_merge_kernel

        B, T, Hi, Di = q_idx.shape
        meta = _meta(q_idx, q, k, blocks, block_size)
        if csr is None:
            csr = block_csr(blocks, meta["NB"], CSR_CHUNK)
        payload, seg_off, tile_seg, tile_start, chunk = (csr.payload, csr.seg_off, csr.tile_seg, csr.tile_start,
                                                         csr.chunk)
        meta["CHUNK"] = chunk
        K = meta["K"]
        # every (token, slot) of a selected block is written by the kernel, the -1 slots are skipped by the merge
        part_lse = torch.empty(B, Hi, T, K, dtype=torch.float32, device=q.device)
        part_stat = torch.empty(B, Hi, T, K, 3, dtype=torch.float32, device=q.device)  # sum P ln P, P z, P
        sparse_kl_fwd_kernel[(tile_seg.numel(),)](
            q, k, q_idx, k_idx, teacher_lse, part_lse, part_stat, tile_seg, tile_start, seg_off, payload,
            *_strides(q_idx, k_idx, q, k, teacher_lse),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            part_stat.stride(0), part_stat.stride(1), part_stat.stride(2),
            T, B * Hi * meta["NB"], scale * math.log2(math.e), Di**-0.5 * math.log2(math.e), tune_bucket(T), **meta,
        )
        kl = torch.empty(B, Hi, T, dtype=torch.float32, device=q.device)
        lse_s, psum = torch.empty_like(kl), torch.empty_like(kl)  # the student's log-sum-exp (base 2), sum P
        n = B * Hi * T
        sparse_kl_merge_kernel[(-(-n // _MERGE_ROWS),)](
            part_lse, part_stat, blocks, kl, lse_s, psum, blocks.stride(0), blocks.stride(1), blocks.stride(2), n, T,
            HI=Hi, K=K, KP=next_pow2(K), ROWS=_MERGE_ROWS, CLEAN=want_mass,
        )
        ctx.save_for_backward(q_idx, k_idx, q, k, teacher_lse, lse_s, psum, payload, seg_off, tile_seg, tile_start)
        ctx.scale, ctx.meta, ctx.mean = scale, meta, mean
        out = kl.mean() if mean else kl
        if not want_mass:
            return out
        mass = part_stat[..., 2]
        ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, d_kl, _d_mass=None):
        from m3compile.kernels.sparse_kl._tl_kl import sparse_kl_bwd_kernel

        q_idx, k_idx, q, k, teacher_lse, lse_s, psum, payload, seg_off, tile_seg, tile_start = ctx.saved_tensors
        B, T, Hi, Di = q_idx.shape
        meta = ctx.meta
        d_kl = d_kl.float().contiguous()
        dq = torch.zeros(q_idx.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=q.device)
        sparse_kl_bwd_kernel[(tile_seg.numel(),)](
            q, k, q_idx, k_idx, teacher_lse, lse_s, psum, d_kl, dq, dk, tile_seg, tile_start, seg_off, payload,
            *_strides(q_idx, k_idx, q, k, teacher_lse), lse_s.stride(0), lse_s.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1),
            T, B * Hi * meta["NB"], ctx.scale * math.log2(math.e), Di**-0.5 * math.log2(math.e), Di**-0.5,
            1.0 / (B * Hi * T), tune_bucket(T), SCALAR_GRAD=ctx.mean, **meta,
        )
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), None, None, None, None, None, None, None, None, None


def sparse_index_kl(q_idx: torch.Tensor, k_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    blocks: torch.Tensor, *, block_size: int, scale: float | None = None,
                    teacher_lse: torch.Tensor | None = None, backend: str = "auto", csr: BlockCSR | None = None,
                    reduction: str = "none", block_mass: bool = False):
    """KL(teacher || student) per (batch, KV group, token) over the selected blocks; gradients reach q_idx and
    k_idx only. q_idx [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D], blocks [B, Hi, T, K].

    reduction "mean": the mean over (batch, group, token) as a scalar (its backward needs no broadcast of the
    gradient). block_mass: also return the teacher's mass inside each slot's block, [B, Hi, T, K] fp32 (0 at -1
    slots, no gradient): with every visible block as the support, the mass of the blocks a selection holds is its
    recall. csr: the BlockCSR of `blocks` (any chunk) when one was built already (the sparse attention's)."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or blocks.dim() != 4 or q.dim() != 4 or k.dim() != 4:
        raise ValueError("q_idx must be [B, T, Hi, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D], "
                         "blocks [B, Hi, T, K]")
    B, T, Hi, Di = q_idx.shape
    if k.shape[1] != Hi or blocks.shape[:3] != (B, Hi, T) or q.shape[2] != T or k_idx.shape != (B, T, Di):
        raise ValueError(f"shapes disagree: q_idx {tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, blocks {tuple(blocks.shape)}")
    if reduction not in ("none", "mean"):
        raise ValueError(f"reduction must be 'none' or 'mean', got {reduction!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q_idx, k_idx, q, k, backend=backend):
        kl = naive.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=block_size, sparse=True,
                          scale=scale)[0]
        kl = kl.mean() if reduction == "mean" else kl
        if not block_mass:
            return kl
        return kl, naive.block_mass(q, k, blocks, block_size=block_size, scale=scale)
    for name, t in (("q_idx", q_idx), ("k_idx", k_idx), ("q", q), ("k", k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    q, k = detached(q), detached(k)
    if teacher_lse is None:  # the attention forward's per-head log-sum-exp over the same support
        teacher_lse = selected_lse(q, k, blocks, block_size=block_size, scale=scale, csr=csr)
    elif teacher_lse.shape != (B, T, q.shape[1]):
        raise ValueError(f"teacher_lse must be [B, T, Hq] = [{B}, {T}, {q.shape[1]}], got {tuple(teacher_lse.shape)}")
    teacher_lse = detached(teacher_lse).float()
    return _SparseKL.apply(q_idx, k_idx, q, k, blocks, teacher_lse, block_size, scale, csr, reduction == "mean",
                           block_mass)

