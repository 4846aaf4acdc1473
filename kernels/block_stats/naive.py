"""Plain-PyTorch reference of the block-ranking loss (does the selection's block score rank blocks as the teacher's
attention mass does?) and of the per-block statistics it is built from. Shapes and conventions:
kernels/naive_common.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels.indexer.naive import block_masks
from m3compile.kernels.naive_common import check_attention_inputs, check_index_inputs, compute_dtype, query_chunk

__all__ = ["choice_rows", "block_stats", "block_rank_terms", "block_rank_grads", "block_rank_kl"]

def choice_rows(T: int, block_size: int, topk: int, n: int | None = None, device=None) -> torch.Tensor:
    """Query positions where the selection has a choice to make (t >= topk * block_size: more visible blocks than
    slots), all of them, or `n` evenly spaced from the first to the last (distinct). 1-D int64, maybe empty."""
    first = topk * block_size
    count = max(0, T - first)
    if n is None or count <= n:
        return torch.arange(first, first + count, device=device)
    return torch.linspace(first, T - 1, n, device=device).round().long()


def _candidates(t_pos: torch.Tensor, n_blocks: int, block_size: int, init_blocks: int, local_blocks: int):
    """[C, n_blocks] bool: the blocks each query at `t_pos` may select beyond its forced ones (visible, neither among
    the `local_blocks` most recent nor the first `init_blocks`): what the selection ranks."""
    visible, local, init = block_masks(t_pos, n_blocks, block_size, init_blocks, local_blocks)
    return visible & ~local & ~init


def _block_stats_chunk(q_idx, k_idx, q, k, pos, block_size, scale, index_scale):
    """block_stats of the queries at `pos` in one piece, over keys [0, T) (no host read of the positions)."""
    B, H, T, _ = q_idx.shape
    ct = compute_dtype(q_idx)
    nb = -(-T // block_size)
    after = torch.arange(T, device=q.device)[None, :] > pos[:, None]  # [C, T]
    pad = (0, nb * block_size - T)
    z = torch.einsum("bhcd,bjd->bhcj", q_idx[:, :, pos].to(ct), k_idx.to(ct)) * index_scale
    z = F.pad(z.masked_fill(after, float("-inf")), pad, value=float("-inf"))
    scores, arg = z.unflatten(-1, (nb, block_size)).max(-1)  # [B, H, C, nb]
    arg = arg + torch.arange(nb, device=q.device) * block_size  # the key holding each block's max
    qg = q[:, :, pos].to(ct).unflatten(1, (H, q.shape[1] // H))  # [B, H, G, C, D]
    a = torch.einsum("bhgcd,bhjd->bhgcj", qg, k.to(ct)).flatten(1, 2) * scale  # [B, Hq, C, T]
    a = F.pad(a.masked_fill(after, float("-inf")), pad, value=float("-inf"))
    return torch.logsumexp(a.unflatten(-1, (nb, block_size)), -1), scores, arg  # blse [B, Hq, C, nb]


def block_stats(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per key block, what the block-ranking loss needs of the queries at `rows` (each sees keys j <= its position):

        blse[b, h, r, n]   = logsumexp_{j in n, j <= t_r} q[h, t_r] . k[h // G, j] * scale     every query head h
        scores[b, g, r, n] = max_{j in n, j <= t_r} q_idx[g, t_r] . k_idx[j] / sqrt(Di)         every index head g
        arg[b, g, r, n]    = the key j of that max

    -inf (and arg the block's first key) where block n holds no visible key. The teacher's block mass of head h is
    exp(blse - logsumexp_n blse); M3's block score is `scores` (section 2.4). fp32 (fp64 for fp64 inputs); memory
    O(chunk * T) (query rows in chunks), never T x T. kernels/block_stats/ computes the same in one kernel.

    q_idx [B, Hi, T, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (Hi == Hkv), rows [R] int64
    -> (blse [B, Hq, R, nb], scores [B, Hi, R, nb], arg [B, Hi, R, nb] int64), nb = ceil(T / block_size).
    """
    k_idx = check_index_inputs(q_idx, k_idx)
    check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    Hi = q_idx.shape[1]
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * (Hq + 2 * Hi), T)
    nb = -(-T // block_size)
    ct = compute_dtype(q_idx)
    R = rows.numel()
    blse = torch.empty(B, Hq, R, nb, dtype=ct, device=q.device)
    scores = torch.empty(B, Hi, R, nb, dtype=ct, device=q.device)
    arg = torch.empty(B, Hi, R, nb, dtype=torch.long, device=q.device)
    for s in range(0, R, chunk):
        out = _block_stats_chunk(q_idx, k_idx, q, k, rows[s:s + chunk], block_size, scale, q_idx.shape[-1] ** -0.5)
        for dst, src in zip((blse, scores, arg), out):
            dst[:, :, s:s + chunk] = src
    return blse, scores, arg


def block_rank_terms(blse: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, *, block_size: int,
                     init_blocks: int, local_blocks: int):
    """The block-ranking loss of the queries at `pos` from their block_stats (no T-sized tensor): per query head
    the block mass exp(blse - logsumexp_n blse), its group mean, kept on the candidate blocks (_candidates) and
    renormalised: P; Q = softmax of `scores` over the candidates. Returns (kl [B, Hi, C]: KL(P || Q), 0 where the
    row has no candidate; valid [B, Hi, C] bool: the row has one; d_scores [B, Hi, C, nb]: Q - P, the gradient of
    kl by the block scores, 0 off the candidates and on rows without one)."""
    Hi, nb = scores.shape[1], scores.shape[-1]
    mass = torch.exp(blse - torch.logsumexp(blse, -1, keepdim=True)).unflatten(1, (Hi, -1)).mean(2)  # [B, Hi, C, nb]
    cand = _candidates(pos, nb, block_size, init_blocks, local_blocks)
    mass = mass * cand
    total = mass.sum(-1, keepdim=True)
    valid = total[..., 0] > 0
    keep = cand & valid[..., None]  # [B, Hi, C, nb]
    p = mass / total.clamp(min=torch.finfo(mass.dtype).tiny) * keep
    log_q = torch.log_softmax(scores.masked_fill(~cand, float("-inf")), -1).masked_fill(~keep, 0.0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    return kl, valid, torch.where(keep, log_q.exp() - p, 0.0)


def block_rank_grads(d_scores: torch.Tensor, arg: torch.Tensor, pos: torch.Tensor, q_idx: torch.Tensor,
                     k_idx: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor) -> None:
    """Backward of the block scores of the queries at `pos`: d_scores [B, Hi, C, nb] (d loss / d score, index scale
    included) reaches each block's max through its key arg [B, Hi, C, nb]: added into dq [B, Hi, T, Di] (rows
    `pos`) and dk [B, T, Di] (rows `arg`) with index_add, in dq's dtype."""
    B, _, T, Di = q_idx.shape
    ct = dq.dtype
    ids = arg.long()
    i_b = torch.arange(B, device=ids.device)[:, None, None, None]
    dq.index_add_(2, pos, torch.einsum("bhcn,bhcnd->bhcd", d_scores, k_idx.to(ct)[i_b, ids]))
    contrib = d_scores[..., None] * q_idx[:, :, pos].to(ct)[:, :, :, None, :]  # [B, Hi, C, nb, Di]
    dk.view(B * T, Di).index_add_(0, (ids + i_b * T).flatten(), contrib.reshape(-1, Di))


class _BlockRankKL(torch.autograd.Function):
    """Mean over (batch, group, row) of KL(P_b || softmax_b S_b); backward: (Q - P) to each block's argmax key."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, rows, block_size, init_blocks, local_blocks, scale, chunk):
        B, H, T, Di = q_idx.shape
        ct = compute_dtype(q_idx)
        index_scale = Di**-0.5
        nb = -(-T // block_size)
        R = rows.numel()
        d_scores = torch.zeros(B, H, R, nb, dtype=ct, device=q.device)  # Q - P per (row, block), 0 off-candidates
        arg = torch.zeros(B, H, R, nb, dtype=torch.long, device=q.device)
        kl_sum = torch.zeros((), dtype=ct, device=q.device)
        n_valid = torch.zeros((), dtype=ct, device=q.device)
        for s in range(0, R, chunk):
            pos = rows[s:s + chunk]
            blse, scores, a = _block_stats_chunk(q_idx, k_idx, q, k, pos, block_size, scale, index_scale)
            kl, valid, d_scores[:, :, s:s + chunk] = block_rank_terms(blse, scores, pos, block_size=block_size,
                                                                      init_blocks=init_blocks,
                                                                      local_blocks=local_blocks)
            kl_sum = kl_sum + kl.sum()
            n_valid = n_valid + valid.sum()
            arg[:, :, s:s + chunk] = a
        ctx.save_for_backward(q_idx, k_idx, rows, d_scores, arg, n_valid)
        ctx.args = (index_scale, chunk)
        return kl_sum / n_valid.clamp(min=1.0)

    @staticmethod
    def backward(ctx, g):
        q_idx, k_idx, rows, d_scores, arg, n_valid = ctx.saved_tensors
        index_scale, chunk = ctx.args
        ct = d_scores.dtype
        dq = torch.zeros(q_idx.shape, dtype=ct, device=q_idx.device)
        dk = torch.zeros(k_idx.shape, dtype=ct, device=q_idx.device)
        coeff = g.to(ct) * index_scale / n_valid.clamp(min=1.0)
        for s in range(0, rows.numel(), chunk):
            block_rank_grads(d_scores[:, :, s:s + chunk] * coeff, arg[:, :, s:s + chunk], rows[s:s + chunk], q_idx,
                             k_idx, dq, dk)
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), None, None, None, None, None, None, None, None


def block_rank_kl(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
    topk: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """A block-ranking loss for the index branch: does the selection's block score rank blocks as the teacher's
    attention mass does?

    For each (KV group g, query t in `rows`) over its candidate blocks b (visible, not forced: neither among the
    `local_blocks` most recent nor the first `init_blocks`): teacher P_b = the dense group-mean causal softmax
    (docs/msa.md section 4, detached) summed over block b, renormalised over the candidates; student Q_b = softmax
    over b of S[g, t, b] = max_{j in b, j <= t} q_idx[g, t] . k_idx[j] / sqrt(Di) (M3's block score, section 2.4).
    Returns the mean of KL(P || Q) over (batch, group, row) as a 0-d fp32 tensor (fp64 for fp64 inputs; 0 when no
    row has a candidate).
    The gradient reaches q_idx and k_idx through the max: each block's (Q_b - P_b) goes to its argmax key.
    `rows`: query positions (1-D int64, distinct) [default: every t >= topk * block_size, which needs `topk`].
    Memory O(chunk * T), never T x T; keys [0, T) are scored for every row (masked), so no value is read back to
    the host (a CUDA graph can capture it).

    q_idx [B, Hi, T, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (Hi == Hkv) -> [].
    """
    k_idx = check_index_inputs(q_idx, k_idx)
    check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    if q_idx.shape[:3] != (B, k.shape[1], T):
        raise ValueError(f"q_idx {tuple(q_idx.shape)} needs one index head per KV head of k {tuple(k.shape)}")
    if rows is None:
        if topk is None:
            raise ValueError("block_rank_kl needs rows or topk")
        rows = choice_rows(T, block_size, topk, device=q.device)
    rows = rows.to(q.device)
    if rows.numel() == 0:
        return torch.zeros((), dtype=compute_dtype(q_idx), device=q.device)  # no choice anywhere: nothing to rank
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * (Hq + 3 * k.shape[1]), T)
    return _BlockRankKL.apply(q_idx, k_idx, q.detach(), k.detach(), rows, block_size, init_blocks, local_blocks,
                              scale, chunk)
