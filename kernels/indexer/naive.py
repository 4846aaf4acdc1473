"""Plain-PyTorch reference of the index branch's selection (docs/msa.md section 2): causal block-max index scores,
then per (index head, query) the top-k key blocks with the forced ones kept. Shapes and conventions:
kernels/naive_common.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from m3compile.kernels.naive_common import check_index_inputs, fp8_round, query_chunk

__all__ = ["block_scores", "block_masks", "select_from_scores", "select_blocks", "recent_blocks", "adaptive_keep",
           "candidate_lse", "FORCED", "SELECT_CHUNK"]

# the score a forced block enters the selection with (local blocks +inf; init blocks the largest fp32, so that local
# ones win when forced blocks outnumber the slots): a slot whose score is at least this is forced
FORCED = torch.finfo(torch.float32).max
# queries per chunk of select_blocks at most: each chunk scores only the keys up to its last query, so smaller chunks
# skip more of the causally masked half; on a 2-core CPU a 1K-token prompt (2 index heads of 24) took 8 ms in chunks
# of 256 against 29 ms in one
SELECT_CHUNK = 256

def block_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, block_size: int, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Causal block-max index scores for queries `start:end` (rows of q_idx).

    Token score s[g, t, j] = q_idx[g, t] . k_idx[j] / sqrt(Di) in fp32, keys j > t set to -inf before pooling;
    block score S[g, t, b] = max over the keys j of block b. Returns [B, Hi, end - start, ceil(last / block_size)]
    with `last` the position after the chunk's last query (blocks wholly in the future of every query of the chunk
    are not returned; those inside are -inf). q_idx may hold fewer rows (Tq) than k_idx keys (Tk): its queries are
    then the last Tq positions, row t at position Tk - Tq + t (a prompt chunk over its cached prefix).
    """
    k_idx = check_index_inputs(q_idx, k_idx, cached_prefix=True)
    T = q_idx.shape[2]
    off = k_idx.shape[1] - T  # position of query row 0
    end = T if end is None else end
    n_blocks = -(-(end + off) // block_size)
    q = q_idx[:, :, start:end].float()
    k = k_idx[:, :end + off].float()
    s = torch.einsum("bhtd,bjd->bhtj", q, k) / math.sqrt(q_idx.shape[-1])
    t_pos = torch.arange(start + off, end + off, device=q.device)
    j_pos = torch.arange(end + off, device=q.device)
    s = s.masked_fill(j_pos[None, :] > t_pos[:, None], float("-inf"))
    s = F.pad(s, (0, n_blocks * block_size - end - off), value=float("-inf"))
    return s.view(*s.shape[:3], n_blocks, block_size).amax(-1)


def block_masks(t_pos: torch.Tensor, n_blocks: int, block_size: int, init_blocks: int, local_blocks: int):
    """[C, n_blocks] bool masks of the queries at `t_pos`: the visible blocks, and among them the forced ones: the
    `local_blocks` most recent (the query's own included) and the first `init_blocks`."""
    b_pos = torch.arange(n_blocks, device=t_pos.device)[None, :]
    q_block = (t_pos // block_size)[:, None]  # [C, 1]
    visible = b_pos <= q_block
    return visible, visible & (b_pos > q_block - local_blocks), visible & (b_pos < init_blocks)


def select_from_scores(
    scores: torch.Tensor, t_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int, local_blocks: int,
    top_p: float = 1.0, min_blocks: int = 0,
) -> torch.Tensor:
    """Top-k over block scores [B, Hi, C, NB] for queries at positions `t_pos` [C]; forced blocks win; -1 pads.
    top_p < 1: the adaptive budget (`adaptive_keep`), the scores then being the blocks' logits (the probability of a
    candidate block is the softmax of its logit over every candidate); topk is its ceiling."""
    n_blocks = scores.shape[-1]
    visible, local, init = block_masks(t_pos, n_blocks, block_size, init_blocks, local_blocks)
    lse = candidate_lse(scores, visible & ~local & ~init) if top_p < 1 else None
    # forced blocks win; when they outnumber the slots, local blocks win over init blocks
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(init, FORCED)
    scores = scores.masked_fill(local, float("inf"))
    k = min(topk, n_blocks)
    top_scores, top_idx = scores.topk(k, dim=-1)
    top_idx = top_idx.masked_fill(top_scores == float("-inf"), -1)
    if lse is not None:
        top_idx = adaptive_keep(top_idx, top_scores, lse, top_p, min_blocks)
    if k < topk:
        top_idx = F.pad(top_idx, (0, topk - k), value=-1)
    return top_idx


def candidate_lse(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """log-sum-exp over the last dim of the logits [..., NB] of the candidate blocks (bool [..., NB], broadcast): the
    normaliser of the index branch's block probabilities. -inf where a row has no candidate."""
    return torch.logsumexp(logits.float().masked_fill(~candidates, float("-inf")), -1)


def adaptive_keep(blocks: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, top_p: float,
                  min_blocks: int) -> torch.Tensor:
    """The adaptive budget over a fixed selection (docs/msa.md 2.8).

    blocks [..., K] (-1 = empty) with each slot's block logit [..., K] (>= FORCED: a forced block, always kept) and
    lse [...] the log-sum-exp of every candidate block's logit (visible, not forced: `candidate_lse`). A candidate's
    probability is exp(logit - lse). Per row the forced blocks stay, then the candidates best first until their
    probabilities sum to at least top_p (the candidate that reaches it included), and further ones while the row
    holds fewer than min_blocks blocks; the slots past that become -1. Slot order is kept."""
    forced = logits >= FORCED
    cand = (blocks >= 0) & ~forced
    s = logits.float().masked_fill(~cand, float("-inf"))
    order = s.argsort(dim=-1, descending=True, stable=True)
    s_sorted = s.gather(-1, order)
    prob = torch.exp(s_sorted - lse.float()[..., None]).masked_fill(s_sorted == float("-inf"), 0.0)
    before = torch.cumsum(prob, -1) - prob  # mass of the better candidates
    rank = torch.arange(blocks.shape[-1], device=blocks.device)
    n_forced = forced.sum(-1, keepdim=True)
    keep_sorted = (s_sorted > float("-inf")) & ((before < top_p) | (n_forced + rank < min_blocks))
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return blocks.masked_fill(~(keep | forced), -1)


def select_blocks(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    chunk: int | None = None,
    fp8: bool = False,
    top_p: float = 1.0,
    min_blocks: int = 0,
) -> torch.Tensor:
    """Per (index head, query) selection of `topk` key blocks (docs/msa.md section 2).

    The `local_blocks` most recent blocks (the query's own block first) and the first `init_blocks` blocks are
    always kept when visible; the remaining slots take the best-scoring earlier blocks; slots that cannot be filled
    hold -1. Index heads are never reduced together: each KV group selects its own blocks.
    fp8: score as the fp8 prefill kernel does: every query row (token, head) quantised to e4m3 with one scale per
    row, the keys with one scale per key block (quantize_index_keys), dequantised, then scored in fp32
    (`fp8_round`).
    top_p < 1: the adaptive budget (docs/msa.md 2.8, `adaptive_keep`): beside the forced blocks the fewest best
    blocks whose probability (softmax of the block scores over the visible, unforced blocks) sums to at least top_p,
    at least min_blocks blocks in all, at most topk.

    q_idx [B, Hi, T, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] int64. Fewer query rows than keys: the queries of the
    last positions (`block_scores`).
    """
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    k_idx = check_index_inputs(q_idx, k_idx, cached_prefix=True)
    if fp8:
        q_idx, k_idx = fp8_round(q_idx), fp8_round(k_idx, block_size)
    B, Hi, T, _ = q_idx.shape
    off = k_idx.shape[1] - T
    out = torch.empty(B, Hi, T, topk, dtype=torch.long, device=q_idx.device)
    chunk = chunk or min(SELECT_CHUNK, query_chunk(B * Hi, T + off))
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        scores = block_scores(q_idx, k_idx, block_size, start, end)
        t_pos = torch.arange(start + off, end + off, device=q_idx.device)
        out[:, :, start:end] = select_from_scores(scores, t_pos, block_size, topk, init_blocks, local_blocks, top_p,
                                                  min_blocks)
    return out


def recent_blocks(B: int, H: int, T: int, *, block_size: int, topk: int, init_blocks: int = 0,
                  local_blocks: int = 1, device=None) -> torch.Tensor:
    """The selection "recent" for the queries at positions 0 .. T-1: per query the forced blocks, then the most recent
    earlier ones, `topk` in all (a sliding window with the top-k's budget, which finds nothing further back: a
    baseline that should fail long-range retrieval) -> [B, H, T, topk] int64 (-1 = empty)."""
    n_blocks = -(-T // block_size)
    age = torch.arange(n_blocks, dtype=torch.float32, device=device).expand(B, H, T, n_blocks)
    return select_from_scores(age, torch.arange(T, device=device), block_size, topk, init_blocks, local_blocks)
