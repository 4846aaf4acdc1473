"""Plain-PyTorch reference of each query head's causal log-sum-exp, and of the dense teacher's recall of a selection
(`block_recall`: the share of the group-mean dense attention mass inside the selected blocks, what
causal_lse.dense_recall computes from two log-sum-exps) with the oracle selection that bounds it. Shapes and
conventions: kernels/naive_common.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from m3compile.kernels.indexer.naive import select_from_scores
from m3compile.kernels.naive_common import check_attention_inputs, query_chunk

__all__ = ["causal_lse", "block_recall", "oracle_recall", "oracle_blocks"]

def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, chunk: int | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Every query head's log-sum-exp (base 2, scale included) over all its causally visible keys, streamed over
    query chunks (O(chunk * T) memory, fp32). q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, T, Hq]; with `rows` (query
    positions, 1-D int64) only those queries: [B, len(rows), Hq], each over keys 0..its position."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    rows = torch.arange(T, device=q.device) if rows is None else rows.to(q.device)
    R = rows.numel()
    chunk = chunk or query_chunk(B * Hq, T)
    out = torch.empty(B, R, Hq, dtype=torch.float32, device=q.device)
    kf = k.float()
    for s in range(0, R, chunk):
        pos = rows[s:s + chunk]
        e = int(pos.max()) + 1  # keys any of these queries sees
        qc = q[:, :, pos].float().unflatten(1, (Hkv, G))
        sc = torch.einsum("bhgtd,bhkd->bhgtk", qc, kf[:, :, :e]) * scale
        visible = torch.arange(e, device=q.device)[None, :] <= pos[:, None]
        lse = torch.logsumexp(sc.masked_fill(~visible, float("-inf")), -1) / math.log(2.0)
        out[:, s:s + chunk] = lse.flatten(1, 2).transpose(1, 2)
    return out


def _block_mass(q: torch.Tensor, k: torch.Tensor, start: int, end: int, block_size: int, scale: float) -> torch.Tensor:
    """Group-mean causal softmax of queries start:end summed per key block: [B, Hkv, end - start, ceil(end / bs)]."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    n_blocks = -(-end // block_size)
    qg = q[:, :, start:end].float().view(B, Hkv, Hq // Hkv, end - start, D)
    s = torch.einsum("bhgcd,bhjd->bhgcj", qg, k[:, :, :end].float()) * scale
    t_pos = torch.arange(start, end, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(end, device=q.device) > t_pos, float("-inf"))
    p = torch.softmax(s, -1).mean(2)  # [B, Hkv, C, end]
    return F.pad(p, (0, n_blocks * block_size - end)).view(B, Hkv, end - start, n_blocks, block_size).sum(-1)


def block_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Share of the dense attention mass of each (group, query) that falls in its selected blocks.

    The mass is the teacher of docs/msa.md section 4: the mean over the G heads of the group of their causal softmax.
    q [B, Hq, T, D], k [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hkv, T] fp32 in [0, 1].
    """
    check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, k.shape[1], T, dtype=torch.float32, device=q.device)
    chunk = chunk or query_chunk(B * Hq, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        p = _block_mass(q, k, start, end, block_size, scale)
        n_blocks = p.shape[-1]
        idx = blocks[:, :, start:end]
        picked = p.gather(-1, idx.clamp(min=0).clamp(max=n_blocks - 1)) * (idx >= 0) * (idx < n_blocks)
        out[:, :, start:end] = picked.sum(-1)
    return out


def oracle_scores(mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """What the oracle ranks blocks by: their dense mass; for the adaptive budget (top_p < 1) its log, so that the
    softmax over the candidate blocks is their mass renormalised over them (the block loss's teacher), and a perfect
    index branch keeps the fewest blocks holding top_p of it."""
    return mass.log() if top_p < 1 else mass


def _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk, top_p=1.0, min_blocks=0):
    """Per query chunk [start, end): the dense group-mean block mass p [B, Hkv, C, ceil(end / bs)] and the oracle's
    blocks [B, Hkv, C, topk] (forced blocks, then the most mass; -1 where nothing is left; top_p < 1: the adaptive
    budget over the mass)."""
    check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * Hq, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        p = _block_mass(q, k, start, end, block_size, scale)
        t_pos = torch.arange(start, end, device=q.device)
        yield start, end, p, select_from_scores(oracle_scores(p, top_p), t_pos, block_size, topk, init_blocks,
                                                local_blocks, top_p, min_blocks)


def oracle_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scale: float | None = None,
    chunk: int | None = None,
    top_p: float = 1.0,
    min_blocks: int = 0,
) -> torch.Tensor:
    """The best recall any index branch could reach: the teacher's own top-k blocks (forced blocks kept).

    q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T] fp32 in [0, 1].
    """
    B, _, T, _ = q.shape
    out = torch.empty(B, k.shape[1], T, dtype=torch.float32, device=q.device)
    for start, end, p, best in _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk, top_p,
                                              min_blocks):
        out[:, :, start:end] = (p.gather(-1, best.clamp(min=0)) * (best >= 0)).sum(-1)
    return out


def oracle_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scale: float | None = None,
    chunk: int | None = None,
    top_p: float = 1.0,
    min_blocks: int = 0,
) -> torch.Tensor:
    """Oracle selection: per (KV group, query) the blocks holding most of the group's true attention mass.

    The mass is the dense teacher of docs/msa.md section 4 (mean over the group's G heads of their causal softmax,
    fp32), summed per key block; the forced blocks are kept exactly as `select_blocks` keeps them (the
    `local_blocks` most recent, the first `init_blocks`), and the remaining slots take the earlier blocks of most
    mass. Slots that cannot be filled hold -1. It is what a perfect index branch would select, so the loss of a
    model run with it bounds what distillation can reach at this block size and top-k. top_p < 1: the adaptive
    budget over the mass (`oracle_scores`). Query-chunked: memory is O(chunk * T), never T x T.

    q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T, topk] int64.
    """
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    B, _, T, _ = q.shape
    out = torch.empty(B, k.shape[1], T, topk, dtype=torch.long, device=q.device)
    for start, end, _, best in _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk, top_p,
                                              min_blocks):
        out[:, :, start:end] = best
    return out
