"""Plain-PyTorch reference for MiniMax Sparse Attention (MSA): the ground truth every kernel is tested against.

Shapes (head-major, the layout `scaled_dot_product_attention` takes):
    q        [B, Hq, T, D]     query heads of the main branch, RoPE applied
    k, v     [B, Hkv, T, D]    key/value heads; query head h belongs to KV group h // (Hq // Hkv)
    q_idx    [B, Hi, T, Di]    index queries, one head per KV group (Hi == Hkv)
    k_idx    [B, T, Di]        the single shared index key head
    blocks   [B, Hi, T, K]     selected key-block ids per (group, query); -1 marks an empty slot;
                               slot order carries no meaning

Everything is computed in fp32 (fp64 for fp64 inputs, so gradcheck can run on it) and cast back to the input dtype.
fp8 index scoring is stated here too: `quantize_index_keys` (one e4m3 scale per row or key block), `fp8_round`, and
`select_blocks(fp8=True)`. The query axis is processed in chunks sized so that no [T, T] tensor is ever allocated:
memory is O(chunk * T) for scoring and O(chunk * K * block) for the sparse attention itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "block_scores",
    "select_blocks",
    "sparse_attention",
    "dense_attention",
    "block_recall",
    "oracle_recall",
    "oracle_blocks",
    "selected_blocks_mask",
    "index_kl",
    "block_rank_kl",
    "block_stats",
    "block_rank_terms",
    "block_rank_grads",
    "choice_rows",
    "query_chunk",
    "quantize_index_keys",
    "dequantize_index_keys",
    "expand_block_scale",
    "fp8_round",
    "FP8_MAX",
    "block_mass",
    "causal_lse",
    "rope",
    "index_norm_rope",
    "rms_norm",
    "gemma_rms_norm",
]

# Elements of fp32 scratch one chunk may allocate (128 MiB): bounds memory at any T.
_CHUNK_ELEMENTS = 1 << 25


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when the input is fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def query_chunk(rows_per_query: int, length: int, budget: int = _CHUNK_ELEMENTS) -> int:
    """Queries per chunk so that `chunk * rows_per_query * length` elements stay within `budget`."""
    return max(1, min(length, budget // max(1, rows_per_query * length)))


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_keys(x: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Di] -> (fp8 e4m3 [..., Di], fp32 scale [...]) with x ~= fp8 * scale: one scale per row (each
    token's index key; for index queries, each (token, head)), the row's largest magnitude mapped to 448, rounded to
    nearest even. The fp8 index kernels quantise queries exactly so, inside the kernel.

    block_size (keys x [..., T, Di] only): one scale per aligned block of `block_size` keys instead, the block's
    largest magnitude mapped to 448 -> scale [..., ceil(T / block_size)]. e4m3 is a floating format, so a key
    smaller than its block's largest keeps the same relative precision unless it falls 2^15 below it (e4m3's
    subnormals); the prefill indexer then applies the scale once per block score, after the block max
    (a positive scale commutes with the max), instead of once per token score."""
    if block_size is None:
        scale = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        per_row = scale
    else:
        T = x.shape[-2]
        n_blocks = -(-T // block_size)
        pad = F.pad(x.float().abs(), (0, 0, 0, n_blocks * block_size - T))
        scale = pad.reshape(*x.shape[:-2], n_blocks, block_size * x.shape[-1]).amax(-1).clamp(min=1e-12) / FP8_MAX
        per_row = expand_block_scale(scale, block_size, T)
    return (x.float() / per_row[..., None]).to(torch.float8_e4m3fn), scale


def expand_block_scale(scale: torch.Tensor, block_size: int, T: int) -> torch.Tensor:
    """A per-key-block scale [..., ceil(T / block_size)] as one scale per key [..., T]."""
    return scale.repeat_interleave(block_size, -1)[..., :T]


def dequantize_index_keys(x_fp8: torch.Tensor, scale: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """fp8 keys [..., T, Di] times their scales: per key [..., T], or per key block [..., ceil(T / block_size)]."""
    if block_size is not None and scale.shape[-1] != x_fp8.shape[-2]:
        scale = expand_block_scale(scale, block_size, x_fp8.shape[-2])
    return x_fp8.float() * scale[..., None]


def fp8_round(x: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """x [..., Di] as fp8 index scoring sees it: quantised (quantize_index_keys: per row, or per key block),
    dequantised, fp32."""
    return dequantize_index_keys(*quantize_index_keys(x, block_size), block_size)


def _check_index_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    if k_idx.dim() == 4:  # [B, 1, T, Di] accepted too
        if k_idx.shape[1] != 1:
            raise ValueError(f"k_idx must have a single index key head, got shape {tuple(k_idx.shape)}")
        k_idx = k_idx[:, 0]
    if q_idx.dim() != 4 or k_idx.dim() != 3:
        raise ValueError(f"q_idx must be [B, Hi, T, Di] and k_idx [B, T, Di]; got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}")
    if q_idx.shape[0] != k_idx.shape[0] or q_idx.shape[2] != k_idx.shape[1] or q_idx.shape[3] != k_idx.shape[2]:
        raise ValueError(f"q_idx {tuple(q_idx.shape)} and k_idx {tuple(k_idx.shape)} disagree on B, T or Di")
    return k_idx


def block_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, block_size: int, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Causal block-max index scores for queries `start:end`.

    Token score s[g, t, j] = q_idx[g, t] . k_idx[j] / sqrt(Di) in fp32, keys j > t set to -inf before pooling;
    block score S[g, t, b] = max over the keys j of block b. Returns [B, Hi, end - start, ceil(end / block_size)]
    (blocks wholly in the future of every query of the chunk are not returned; those inside are -inf).
    """
    k_idx = _check_index_inputs(q_idx, k_idx)
    T = q_idx.shape[2]
    end = T if end is None else end
    n_blocks = -(-end // block_size)
    q = q_idx[:, :, start:end].float()
    k = k_idx[:, :end].float()
    s = torch.einsum("bhtd,bjd->bhtj", q, k) / math.sqrt(q_idx.shape[-1])
    t_pos = torch.arange(start, end, device=q.device)
    j_pos = torch.arange(end, device=q.device)
    s = s.masked_fill(j_pos[None, :] > t_pos[:, None], float("-inf"))
    s = F.pad(s, (0, n_blocks * block_size - end), value=float("-inf"))
    return s.view(*s.shape[:3], n_blocks, block_size).amax(-1)


def _block_masks(t_pos: torch.Tensor, n_blocks: int, block_size: int, init_blocks: int, local_blocks: int):
    """[C, n_blocks] bool masks of the queries at `t_pos`: the visible blocks, and among them the forced ones: the
    `local_blocks` most recent (the query's own included) and the first `init_blocks`."""
    b_pos = torch.arange(n_blocks, device=t_pos.device)[None, :]
    q_block = (t_pos // block_size)[:, None]  # [C, 1]
    visible = b_pos <= q_block
    return visible, visible & (b_pos > q_block - local_blocks), visible & (b_pos < init_blocks)


def _select_from_scores(
    scores: torch.Tensor, t_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int, local_blocks: int
) -> torch.Tensor:
    """Top-k over block scores [B, Hi, C, NB] for queries at positions `t_pos` [C]; forced blocks win; -1 pads."""
    n_blocks = scores.shape[-1]
    visible, local, init = _block_masks(t_pos, n_blocks, block_size, init_blocks, local_blocks)
    # forced blocks win; when they outnumber the slots, local blocks win over init blocks
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(init, torch.finfo(torch.float32).max)
    scores = scores.masked_fill(local, float("inf"))
    k = min(topk, n_blocks)
    top_scores, top_idx = scores.topk(k, dim=-1)
    top_idx = top_idx.masked_fill(top_scores == float("-inf"), -1)
    if k < topk:
        top_idx = F.pad(top_idx, (0, topk - k), value=-1)
    return top_idx


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
) -> torch.Tensor:
    """Per (index head, query) selection of `topk` key blocks (MSA_SPEC section 2).

    The `local_blocks` most recent blocks (the query's own block first) and the first `init_blocks` blocks are
    always kept when visible; the remaining slots take the best-scoring earlier blocks; slots that cannot be filled
    hold -1. Index heads are never reduced together: each KV group selects its own blocks.
    fp8: score as the fp8 prefill kernel does: every query row (token, head) quantised to e4m3 with one scale per
    row, the keys with one scale per key block (quantize_index_keys), dequantised, then scored in fp32
    (`fp8_round`).

    q_idx [B, Hi, T, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] int64.
    """
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    k_idx = _check_index_inputs(q_idx, k_idx)
    if fp8:
        q_idx, k_idx = fp8_round(q_idx), fp8_round(k_idx, block_size)
    B, Hi, T, _ = q_idx.shape
    out = torch.empty(B, Hi, T, topk, dtype=torch.long, device=q_idx.device)
    chunk = chunk or query_chunk(B * Hi, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        scores = block_scores(q_idx, k_idx, block_size, start, end)
        t_pos = torch.arange(start, end, device=q_idx.device)
        out[:, :, start:end] = _select_from_scores(scores, t_pos, block_size, topk, init_blocks, local_blocks)
    return out


def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} are not a GQA pair")
    return Hq // k.shape[1]


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention restricted to the selected key blocks (MSA_SPEC section 3).

    All G = Hq // Hkv query heads of group g attend over the causally visible tokens of the blocks selected for
    (g, t); -1 slots are ignored; the query's own block is masked per token.

    q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D] in q's dtype.
    """
    G = _check_attention_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv, K = k.shape[1], blocks.shape[-1]
    if blocks.shape[:3] != (B, Hkv, T):
        raise ValueError(f"blocks must be [B, Hkv, T, K] = [{B}, {Hkv}, {T}, K], got {tuple(blocks.shape)}")
    scale = D**-0.5 if scale is None else scale
    ct = _compute_dtype(q)
    out = torch.empty(B, Hkv, G, T, D, dtype=ct, device=q.device)
    # the selection reaches much of the sequence: one masked causal pass; else gather the selected blocks per query
    fill = _sparse_attention_masked if MASKED_REACH * K * block_size >= T else _sparse_attention_gathered
    fill(q.view(B, Hkv, G, T, D), k, v, blocks, block_size, scale, ct, out, chunk)
    return out.view(B, Hq, T, D).to(q.dtype)


def _sparse_attention_gathered(qg, k, v, blocks, block_size, scale, ct, out, chunk):
    """sparse_attention by gathering each query's K selected blocks: qg [B, Hkv, G, T, D] -> out [B, Hkv, G, T, D]."""
    B, Hkv, G, T, D = qg.shape
    K = blocks.shape[-1]
    n_blocks = -(-T // block_size)
    pad = (0, 0, 0, n_blocks * block_size - T)
    kb = F.pad(k.to(ct), pad).view(B, Hkv, n_blocks, block_size, D)  # keys as whole blocks
    vb = F.pad(v.to(ct), pad).view(B, Hkv, n_blocks, block_size, D)
    i_b = torch.arange(B, device=qg.device)[:, None, None, None]
    i_h = torch.arange(Hkv, device=qg.device)[None, :, None, None]
    offs = torch.arange(block_size, device=qg.device)
    chunk = chunk or query_chunk(B * Hkv * (G + 2 * D), K * block_size)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        idx = blocks[:, :, start:end]  # [B, Hkv, C, K]
        safe = idx.clamp(min=0)  # -1 slots read block 0, then are masked out by `valid`
        pos = (safe[..., None] * block_size + offs).flatten(-2)  # [B, Hkv, C, K*bs] token ids
        t_pos = torch.arange(start, end, device=qg.device)[:, None]
        valid = (idx >= 0).repeat_interleave(block_size, dim=-1) & (pos <= t_pos)
        C = end - start
        kg = kb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)  # gather whole blocks
        vg = vb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)
        s = torch.einsum("bhgcd,bhcsd->bhgcs", qg[:, :, :, start:end].to(ct), kg) * scale
        s = s.masked_fill(~valid[:, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, :, :, start:end] = torch.einsum("bhgcs,bhcsd->bhgcd", p, vg)


# sparse_attention masks a causal pass over all keys instead of gathering K * block keys per query where
# MASKED_REACH * K * block >= T: on a 2-core CPU at 8K tokens (SmolLM2 shapes, block 128 / top-16) the gathers took
# 50 of a 1K window's 61 s of attention
MASKED_REACH = 4


def _sparse_attention_masked(qg, k, v, blocks, block_size, scale, ct, out, chunk):
    """sparse_attention as causal attention over every key with the unselected blocks masked out, for selections
    that reach much of the sequence (as at CPU eval lengths): matmuls over all T keys instead of gathering K * block
    keys per query, the same softmax. A block in n slots weighs n times (log n added to its scores), as the gathered
    form and the kernels count it; -1 slots add nothing. qg [B, Hkv, G, T, D] -> out [B, Hkv, G, T, D]."""
    B, Hkv, G, T, D = qg.shape
    n_blocks = -(-T // block_size)
    key_block = torch.arange(T, device=qg.device) // block_size
    chunk = chunk or query_chunk(B * Hkv * G, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        idx = blocks[:, :, start:end].long()  # [B, Hkv, C, K]
        count = torch.zeros(*idx.shape[:3], n_blocks + 1, dtype=ct, device=qg.device)
        count.scatter_add_(-1, torch.where(idx >= 0, idx, n_blocks), torch.ones_like(idx, dtype=ct))
        bias = count[..., :n_blocks].log()[..., key_block[:end]]  # [B, Hkv, C, end]: log n, -inf where unselected
        causal = torch.arange(end, device=qg.device) > torch.arange(start, end, device=qg.device)[:, None]
        bias = bias.masked_fill(causal, float("-inf"))
        s = torch.einsum("bhgcd,bhjd->bhgcj", qg[:, :, :, start:end].to(ct), k[:, :, :end].to(ct)) * scale
        p = torch.softmax(s + bias[:, :, None], dim=-1)
        out[:, :, :, start:end] = torch.einsum("bhgcj,bhjd->bhgcd", p, v[:, :, :end].to(ct))


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, chunk: int | None = None
) -> torch.Tensor:
    """Causal GQA softmax attention, query-chunked; the dense baseline MSA must equal when every block is selected.

    q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D].
    """
    G = _check_attention_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, Hkv, G, T, D, dtype=torch.float32, device=q.device)
    qg = q.view(B, Hkv, G, T, D)
    chunk = chunk or query_chunk(B * Hq, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        s = torch.einsum("bhgcd,bhjd->bhgcj", qg[:, :, :, start:end].float(), k[:, :, :end].float()) * scale
        t_pos = torch.arange(start, end, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(end, device=q.device) > t_pos, float("-inf"))
        out[:, :, :, start:end] = torch.einsum("bhgcj,bhjd->bhgcd", torch.softmax(s, -1), v[:, :, :end].float())
    return out.view(B, Hq, T, D).to(q.dtype)


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

    The mass is the teacher of MSA_SPEC section 4: the mean over the G heads of the group of their causal softmax.
    q [B, Hq, T, D], k [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hkv, T] fp32 in [0, 1].
    """
    _check_attention_inputs(q, k, k)
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


def _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk):
    """Per query chunk [start, end): the dense group-mean block mass p [B, Hkv, C, ceil(end / bs)] and the oracle's
    blocks [B, Hkv, C, topk] (forced blocks, then the most mass; -1 where nothing is left)."""
    _check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * Hq, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        p = _block_mass(q, k, start, end, block_size, scale)
        t_pos = torch.arange(start, end, device=q.device)
        yield start, end, p, _select_from_scores(p, t_pos, block_size, topk, init_blocks, local_blocks)


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
) -> torch.Tensor:
    """The best recall any index branch could reach: the teacher's own top-k blocks (forced blocks kept).

    q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T] fp32 in [0, 1].
    """
    B, _, T, _ = q.shape
    out = torch.empty(B, k.shape[1], T, dtype=torch.float32, device=q.device)
    for start, end, p, best in _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk):
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
) -> torch.Tensor:
    """Oracle selection: per (KV group, query) the blocks holding most of the group's true attention mass.

    The mass is the dense teacher of MSA_SPEC section 4 (mean over the group's G heads of their causal softmax,
    fp32), summed per key block; the forced blocks are kept exactly as `select_blocks` keeps them (the
    `local_blocks` most recent, the first `init_blocks`), and the remaining slots take the earlier blocks of most
    mass. Slots that cannot be filled hold -1. It is what a perfect index branch would select, so the loss of a
    model run with it bounds what distillation can reach at this block size and top-k. Query-chunked: memory is
    O(chunk * T), never T x T.

    q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T, topk] int64.
    """
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    B, _, T, _ = q.shape
    out = torch.empty(B, k.shape[1], T, topk, dtype=torch.long, device=q.device)
    for start, end, _, best in _oracle_chunks(q, k, block_size, topk, init_blocks, local_blocks, scale, chunk):
        out[:, :, start:end] = best
    return out


# ----------------------------------------------------------------------------------------------------------------
# Index-branch distillation (MSA_SPEC section 4)


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
    """The index branch's distillation loss (MSA_SPEC section 4) per (KV group, query token), and block recall.

    Teacher P[g, t] = mean over the G query heads of group g of softmax_{j in S}(q_h . k_j * scale), detached;
    student Q[g, t] = softmax_{j in S}(q_idx[g, t] . k_idx[j] / sqrt(Di)); returns KL(P || Q). The support S is
    the causally visible keys of the selected `blocks` (`sparse`, the post-warm-up recipe) or every causally visible
    key (warm-up: `sparse` False or no blocks). Recall is the share of the dense teacher's mass inside the selected
    blocks (1 without blocks). Gradients flow to q_idx and k_idx only; memory is O(chunk * T), never T x T, in
    forward and backward.

    q_idx [B, Hi, T, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (Hi == Hkv),
    blocks [B, Hi, T, K] or None -> (kl [B, Hi, T] fp32, recall [B, Hi, T] fp32).
    """
    k_idx = _check_index_inputs(q_idx, k_idx)
    _check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    if q_idx.shape[:3] != (B, k.shape[1], T):
        raise ValueError(f"q_idx {tuple(q_idx.shape)} needs one index head per KV head of k {tuple(k.shape)}")
    if blocks is not None and blocks.shape[:3] != q_idx.shape[:3]:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be [B, Hi, T, K] for q_idx {tuple(q_idx.shape)}")
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * Hq + 4 * B * k.shape[1], T)
    sparse = sparse and blocks is not None
    return _IndexKL.apply(q_idx, k_idx, q.detach(), k.detach(), blocks, sparse, block_size, scale, chunk)


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
    visible, local, init = _block_masks(t_pos, n_blocks, block_size, init_blocks, local_blocks)
    return visible & ~local & ~init


def _block_stats_chunk(q_idx, k_idx, q, k, pos, block_size, scale, index_scale):
    """block_stats of the queries at `pos` in one piece, over keys [0, T) (no host read of the positions)."""
    B, H, T, _ = q_idx.shape
    ct = _compute_dtype(q_idx)
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
    k_idx = _check_index_inputs(q_idx, k_idx)
    _check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    Hi = q_idx.shape[1]
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * (Hq + 2 * Hi), T)
    nb = -(-T // block_size)
    ct = _compute_dtype(q_idx)
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
        ct = _compute_dtype(q_idx)
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
    (MSA_SPEC section 4, detached) summed over block b, renormalised over the candidates; student Q_b = softmax
    over b of S[g, t, b] = max_{j in b, j <= t} q_idx[g, t] . k_idx[j] / sqrt(Di) (M3's block score, section 2.4).
    Returns the mean of KL(P || Q) over (batch, group, row) as a 0-d fp32 tensor (fp64 for fp64 inputs; 0 when no
    row has a candidate).
    The gradient reaches q_idx and k_idx through the max: each block's (Q_b - P_b) goes to its argmax key.
    `rows`: query positions (1-D int64, distinct) [default: every t >= topk * block_size, which needs `topk`].
    Memory O(chunk * T), never T x T; keys [0, T) are scored for every row (masked), so no value is read back to
    the host (a CUDA graph can capture it).

    q_idx [B, Hi, T, Di], k_idx [B, T, Di], q [B, Hq, T, D], k [B, Hkv, T, D] (Hi == Hkv) -> [].
    """
    k_idx = _check_index_inputs(q_idx, k_idx)
    _check_attention_inputs(q, k, k)
    B, Hq, T, D = q.shape
    if q_idx.shape[:3] != (B, k.shape[1], T):
        raise ValueError(f"q_idx {tuple(q_idx.shape)} needs one index head per KV head of k {tuple(k.shape)}")
    if rows is None:
        if topk is None:
            raise ValueError("block_rank_kl needs rows or topk")
        rows = choice_rows(T, block_size, topk, device=q.device)
    rows = rows.to(q.device)
    if rows.numel() == 0:
        return torch.zeros((), dtype=_compute_dtype(q_idx), device=q.device)  # no choice anywhere: nothing to rank
    scale = D**-0.5 if scale is None else scale
    chunk = chunk or query_chunk(B * (Hq + 3 * k.shape[1]), T)
    return _BlockRankKL.apply(q_idx, k_idx, q.detach(), k.detach(), rows, block_size, init_blocks, local_blocks,
                              scale, chunk)


# ----------------------------------------------------------------------------------------------------------------
# RoPE and the index branch's norm (the model's own ops, m3compile.ops.apply_rope and models' RMSNorm, spelled out)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, width: int | None = None) -> torch.Tensor:
    """NeoX RoPE on the first `width` (default R) channels, in x's dtype. x [B, T, H, D], cos/sin [B | 1, T, R]."""
    width = cos.shape[-1] if width is None else width
    cos, sin = cos[..., :width].unsqueeze(2).to(x.dtype), sin[..., :width].unsqueeze(2).to(x.dtype)
    x_rot, x_pass = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm x * (1 + w) over the last dim, computed in fp32, in x's dtype (M3's index norms)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """The models' RMSNorm: style "rms" w * x_hat (x_hat rounded to x's dtype first), "gemma" x_hat * (1 + w)."""
    if style == "gemma":
        return gemma_rms_norm(x, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def index_norm_rope(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, *, eps: float, width: int | None = None):
    """y [B, T, (Hi + 1) * Di] -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di]): per head Gemma RMSNorm (q_weight for
    the Hi query heads, k_weight for the last, key head) then RoPE on the first `width` channels."""
    D = q_weight.shape[0]
    heads = y.view(*y.shape[:-1], -1, D)
    width = min(cos.shape[-1], D) if width is None else width
    q = rope(gemma_rms_norm(heads[:, :, :-1], q_weight, eps), cos, sin, width=width)
    k = rope(gemma_rms_norm(heads[:, :, -1:], k_weight, eps), cos, sin, width=width)
    return q, k[:, :, 0]
