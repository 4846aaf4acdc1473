"""Plain-PyTorch reference of the index branch's distillation loss (docs/msa.md section 4): KL(teacher || student) over
the causally visible keys of the selected blocks (or all of them), streamed over query chunks, and the sparse
teacher's mass inside each selected block. Shapes and conventions: kernels/naive_common.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels.naive_common import check_attention_inputs, check_index_inputs, query_chunk

__all__ = ["selected_blocks_mask", "block_mass", "index_kl"]

def selected_blocks_mask(blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """[..., K] block ids (-1 = empty) -> [..., n_blocks] bool: which blocks each row selected."""
    hit = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    hit.scatter_(-1, torch.where((blocks >= 0) & (blocks < n_blocks), blocks, n_blocks), True)  # -1: the spare slot
    return hit[..., :n_blocks]


def _support(blocks: torch.Tensor | None, start: int, end: int, block_size: int, device) -> torch.Tensor:
    """[B | 1, H | 1, C, end] bool: the keys each query of `start:end` may see (causal, and in its blocks if given)."""
    t_pos = torch.arange(start, end, device=device)[:, None]
    j_pos = torch.arange(end, device=device)
    causal = (j_pos[None, :] <= t_pos)[None, None]
    if blocks is None:
        return causal
    idx = blocks[:, :, start:end]  # [B, H, C, K]
    n_blocks = -(-end // block_size)
    return causal & selected_blocks_mask(idx, n_blocks).repeat_interleave(block_size, dim=-1)[..., :end]


def _kl_chunk(q, k, q_idx, k_idx, blocks, sparse, start, end, block_size, scale, index_scale):
    """Teacher P, student log Q and support over keys [0, end) for queries start:end; also the dense recall.

    P = mean over the G heads of each group of softmax over the support; Q = softmax of the index scores over the
    same support. Shapes [B, H, C, end]; recall [B, H, C] (None without blocks).
    """
    Hkv = k.shape[1]
    qg = q[:, :, start:end].float().unflatten(1, (Hkv, q.shape[1] // Hkv))  # [B, H, G, C, D]
    a = torch.einsum("bhgcd,bhjd->bhgcj", qg, k[:, :, :end].float()) * scale
    causal = _support(None, start, end, block_size, q.device)
    support = _support(blocks, start, end, block_size, q.device) if sparse else causal
    p = torch.softmax(a.masked_fill(~support[:, :, None], float("-inf")), -1).mean(2)
    recall = None
    if blocks is not None:
        dense = p if not sparse else torch.softmax(a.masked_fill(~causal[:, :, None], float("-inf")), -1).mean(2)
        selected = support if sparse else _support(blocks, start, end, block_size, q.device)
        recall = (dense * selected).sum(-1)
    z = torch.einsum("bhcd,bjd->bhcj", q_idx[:, :, start:end].float(), k_idx[:, :end].float()) * index_scale
    log_q = torch.log_softmax(z.masked_fill(~support, float("-inf")), -1)
    return p, log_q, support, recall


def block_mass(q: torch.Tensor, k: torch.Tensor, blocks: torch.Tensor, *, block_size: int,
               scale: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """The sparse teacher's mass inside each slot's block: P = mean over each group's heads of the softmax over the
    causally visible keys of the selected blocks; per (group, query, slot) the sum of P over that slot's block
    (0 at -1 slots). With every visible block selected, the mass of a subset of them is its recall.

    q [B, Hq, T, D], k [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hkv, T, K] fp32."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * Hq, T)
    nb = -(-T // block_size)
    out = torch.zeros(blocks.shape, dtype=torch.float32, device=q.device)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        qg = q[:, :, start:end].float().unflatten(1, (Hkv, Hq // Hkv))
        a = torch.einsum("bhgcd,bhjd->bhgcj", qg, k[:, :, :end].float()) * scale
        support = _support(blocks, start, end, block_size, q.device)
        p = torch.softmax(a.masked_fill(~support[:, :, None], float("-inf")), -1).mean(2)  # [B, H, C, end]
        per_block = F.pad(p, (0, nb * block_size - end)).unflatten(-1, (nb, block_size)).sum(-1)  # [B, H, C, nb]
        ids = blocks[:, :, start:end].long()
        got = per_block.gather(-1, ids.clamp(min=0, max=nb - 1))
        out[:, :, start:end] = torch.where(ids >= 0, got, 0.0)
    return out


class _IndexKL(torch.autograd.Function):
    """KL(teacher || student) per (group, token), streamed over query chunks; backward recomputes each chunk.

    Only the index branch gets gradients: d(KL)/dz = Q - P on the support, z = q_idx . k_idx * index_scale.
    """

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, blocks, sparse, block_size, scale, chunk):
        B, H, T, _ = q_idx.shape
        index_scale = q_idx.shape[-1] ** -0.5
        kl = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        recall = torch.ones(B, H, T, dtype=torch.float32, device=q.device)
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            p, log_q, support, r = _kl_chunk(q, k, q_idx, k_idx, blocks, sparse, start, end, block_size, scale,
                                             index_scale)
            kl[:, :, start:end] = (torch.xlogy(p, p) - p * log_q.masked_fill(~support, 0.0)).sum(-1)
            if r is not None:
                recall[:, :, start:end] = r
        ctx.save_for_backward(q_idx, k_idx, q, k, blocks)
        ctx.args = (sparse, block_size, scale, index_scale, chunk)
        ctx.mark_non_differentiable(recall)
        return kl, recall

    @staticmethod
    def backward(ctx, g_kl, _g_recall):
        q_idx, k_idx, q, k, blocks = ctx.saved_tensors
        sparse, block_size, scale, index_scale, chunk = ctx.args
        T = q_idx.shape[2]
        dq = torch.zeros(q_idx.shape, dtype=torch.float32, device=q_idx.device)
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=k_idx.device)
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            p, log_q, _, _ = _kl_chunk(q, k, q_idx, k_idx, blocks if sparse else None, sparse, start, end, block_size,
                                       scale, index_scale)
            dz = (log_q.exp() - p) * (g_kl[:, :, start:end, None].float() * index_scale)  # [B, H, C, end]
            dq[:, :, start:end] = torch.einsum("bhcj,bjd->bhcd", dz, k_idx[:, :end].float())
            dk[:, :end] += torch.einsum("bhcj,bhcd->bjd", dz, q_idx[:, :, start:end].float())
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), None, None, None, None, None, None, None


def index_kl(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    blocks: torch.Tensor | None = None,
    *,
    block_size: int,
    sparse: bool = True,
    scale: float | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index branch's distillation loss (docs/msa.md section 4) per (KV group, query token), and block recall.

    Teacher P[g, t] = mean over the G query heads of group g of softmax_{j in S}(q_h . k_j * scale), detached;
    student Q[g, t] = softmax_{j in S}(q_idx[g, t] . k_idx[j] / sqrt(Di)); returns KL(P || Q). The support S is
    the causally visible keys of the selected `blocks` (`sparse`, the post-warm-up recipe) or every causally visible
    key (warm-up: `sparse` False or no blocks). Recall is the share of the dense teacher's mass inside the selected
    blocks (1 without blocks). Gradients flow to q_idx and k_idx only; memory is O(chunk * T), never T x T, in
    forward and backward.

    q_idx [B, Hi, T, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (Hi == Hkv),
    blocks [B, Hi, T, K] or None -> (kl [B, Hi, T] fp32, recall [B, Hi, T] fp32).
    """
    k_idx = check_index_inputs(q_idx, k_idx)
    check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    if q_idx.shape[:3] != (B, k.shape[1], T):
        raise ValueError(f"q_idx {tuple(q_idx.shape)} needs one index head per KV head of k {tuple(k.shape)}")
    if blocks is not None and blocks.shape[:3] != q_idx.shape[:3]:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be [B, Hi, T, K] for q_idx {tuple(q_idx.shape)}")
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * Hq + 4 * B * k.shape[1], T)
    sparse = sparse and blocks is not None
    return _IndexKL.apply(q_idx, k_idx, q.detach(), k.detach(), blocks, sparse, block_size, scale, chunk)
