"""Plain-PyTorch reference of the paged decode ops of kernels/decode/ (every sequence at once, fp32), and the
quantisations the fp8 caches hold: index-key pages (one scale per page) and K/V rows (one scale per token and head).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from m3compile.kernels.causal_lse.naive import oracle_scores
from m3compile.kernels.indexer.naive import FORCED, adaptive_keep, block_masks, candidate_lse, select_from_scores
from m3compile.kernels.naive_common import quantize_index_keys

__all__ = ["paged_block_scores_reference", "paged_select_reference", "top_blocks_reference", "newest_top_blocks",
           "adaptive_decode", "index_logit_scale",
           "paged_oracle_select", "paged_recent_select", "paged_attention_reference", "quantize_pages", "paged_index_write_reference", "quantize_kv", "dequantize_kv", "paged_kv_write_reference"]


def paged_block_scores_reference(q_idx, idx_cache, block_table, seq_lens, idx_scale=None):
    """Block scores [B, Hi, max_pages] (-inf past each sequence's last page) of the newest token of each sequence:
    every page of the block table gathered at once (entries past a sequence's pages read a valid page, then masked)."""
    B, H, D = q_idx.shape
    bs = idx_cache.shape[1]
    if idx_scale is not None:  # fp8 mode: the query is quantized too (its per-head scale cannot change the order)
        q_idx = quantize_index_keys(q_idx)[0].float()
    pages = block_table.long().clamp(0, idx_cache.shape[0] - 1)  # [B, max_pages]
    keys = idx_cache[pages].float()  # [B, max_pages, BS, Di]
    if idx_scale is not None:
        keys = keys * idx_scale[pages].float()[..., None]
    s = torch.einsum("bhd,bptd->bhpt", q_idx.float(), keys) / math.sqrt(D)  # [B, H, max_pages, BS]
    pos = torch.arange(pages.shape[1] * bs, device=q_idx.device).view(pages.shape[1], bs)
    return s.masked_fill(pos >= seq_lens.long()[:, None, None, None], float("-inf")).amax(-1)


def paged_select_reference(q_idx, idx_cache, block_table, seq_lens, *, topk, init_blocks=0, local_blocks=1,
                           idx_scale=None, top_p=1.0, min_blocks=0):
    """Plain-torch `paged_select`: block scores of each sequence's cached keys, then reference top-k (top_p < 1: the
    adaptive budget, `adaptive_decode`)."""
    scores = paged_block_scores_reference(q_idx, idx_cache, block_table, seq_lens, idx_scale)
    bs = idx_cache.shape[1]
    blocks = top_blocks_reference(scores, seq_lens, block_size=bs, topk=topk, init_blocks=init_blocks,
                                  local_blocks=local_blocks)
    if top_p >= 1:
        return blocks
    # the reference's scores are q . k / sqrt(Di); fp8: of the e4m3 query row without its scale
    logits = scores * (index_logit_scale(q_idx, idx_scale is not None) * math.sqrt(q_idx.shape[-1]))
    return adaptive_decode(blocks, logits, seq_lens, block_size=bs, init_blocks=init_blocks,
                           local_blocks=local_blocks, top_p=top_p, min_blocks=min_blocks)


def index_logit_scale(q_idx: torch.Tensor, fp8: bool) -> torch.Tensor:
    """[B, Hi, 1]: what turns the decode scoring kernel's block scores (q . k, the query's own fp8 scale left out
    where it scores in fp8) into the index branch's logits (q . k / sqrt(Di) of the dequantised query)."""
    scale = torch.full((*q_idx.shape[:2], 1), q_idx.shape[-1] ** -0.5, device=q_idx.device)
    return scale * quantize_index_keys(q_idx)[1].float()[..., None] if fp8 else scale


def adaptive_decode(blocks: torch.Tensor, logits: torch.Tensor, seq_lens: torch.Tensor, *, block_size: int,
                    init_blocks: int, local_blocks: int, top_p: float, min_blocks: int) -> torch.Tensor:
    """The adaptive budget (indexer.naive.adaptive_keep) over a decode step's fixed selection: blocks [B, Hi, K]
    (-1 = empty) of each sequence's newest token, logits [B, Hi, pages] the index branch's block logits (anything
    past a sequence's pages) -> blocks with the candidates past the budget set to -1. No host synchronisation: a
    CUDA graph captures it."""
    visible, local, init = block_masks(seq_lens.long() - 1, logits.shape[-1], block_size, init_blocks,
                                       local_blocks)  # [B, pages]
    lse = candidate_lse(logits, (visible & ~local & ~init)[:, None])
    ids = blocks.long().clamp(min=0)
    slot = logits.float().gather(-1, ids)
    forced = (local | init)[:, None].expand_as(logits).gather(-1, ids)
    kept = adaptive_keep(blocks, slot.masked_fill(forced, FORCED), lse, top_p, min_blocks)
    return kept.to(blocks.dtype)


def top_blocks_reference(scores, seq_lens, *, block_size, topk, init_blocks=0, local_blocks=1):
    """Plain-torch `top_blocks`: per sequence, its row of block scores [B, Hi, max_pages] (its first
    ceil(seq_len / block_size) pages; the rest are not read) with the forced blocks as the prefill's selection keeps
    them (local: +inf, init: FLT_MAX), in a stable descending sort: best first, equal scores (forced blocks too) to the
    lower page -> [B, Hi, topk] int32, -1 past the sequence's blocks."""
    out = torch.full((*scores.shape[:2], topk), -1, dtype=torch.int32, device=scores.device)
    t_pos = seq_lens.long() - 1  # each sequence's newest token
    visible, local, init = block_masks(t_pos, scores.shape[-1], block_size, init_blocks, local_blocks)  # [B, pages]
    s = scores.float().masked_fill(~visible[:, None], float("-inf"))
    s = s.masked_fill(init[:, None], FORCED).masked_fill(local[:, None], float("inf"))
    top = s.sort(dim=-1, descending=True, stable=True)
    k = min(topk, s.shape[-1])
    out[..., :k] = top.indices[..., :k].masked_fill(top.values[..., :k] == float("-inf"), -1).int()
    return out


def newest_top_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, *, block_size: int, topk: int,
                      init_blocks: int = 0, local_blocks: int = 1, top_p: float = 1.0,
                      min_blocks: int = 0) -> torch.Tensor:
    """Top-k of block scores [B, Hkv, pages] for each sequence's newest token (position seq_lens - 1), forced blocks
    first (indexer.naive.select_from_scores, the sequences as its query rows; top_p < 1: the adaptive budget, the
    scores being logits) -> [B, Hkv, topk] int32. No host synchronisation: a CUDA graph captures it."""
    rows = select_from_scores(scores.transpose(0, 1)[None], seq_lens.long() - 1, block_size, topk, init_blocks,
                              local_blocks, top_p, min_blocks)  # [1, Hkv, B, topk]
    return rows[0].transpose(0, 1).to(torch.int32)


def paged_oracle_select(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        *, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                        scale: float | None = None, k_scale: torch.Tensor | None = None, top_p: float = 1.0,
                        min_blocks: int = 0) -> torch.Tensor:
    """The oracle's blocks for the newest token of each sequence, from the paged KV cache: per KV group, the mean
    over its query heads of their softmax over every cached key (fp32), summed per page (= block), then the
    top-k with the forced blocks as `paged_select` keeps them (top_p < 1: the adaptive budget over the mass). Plain
    torch over every page of the block table (one
    query per sequence: no kernel needed), no host synchronisation, so a CUDA graph captures it.

    q [B, Hq, D], k_cache [P, BS, Hkv, D] (a quantised cache with its k_scale [P, BS, Hkv]: each key row times its
    scale), block_table [B, max_pages], seq_lens [B] -> [B, Hkv, topk] int32."""
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = D**-0.5 if scale is None else scale
    keys = k_cache[block_table.long()].float()  # [B, pages, BS, Hkv, D]
    if k_scale is not None:
        keys = keys * k_scale[block_table.long()].float()[..., None]
    s = torch.einsum("bhgd,bnthd->bhgnt", q.float().view(B, Hkv, Hq // Hkv, D), keys) * scale
    pos = torch.arange(keys.shape[1] * bs, device=q.device).view(keys.shape[1], bs)
    s = s.masked_fill(pos >= seq_lens.long()[:, None, None, None, None], float("-inf"))
    mass = torch.softmax(s.flatten(-2), -1).view_as(s).mean(2).sum(-1)  # [B, Hkv, pages]
    return newest_top_blocks(oracle_scores(mass, top_p), seq_lens, block_size=bs, topk=topk, init_blocks=init_blocks,
                             local_blocks=local_blocks, top_p=top_p, min_blocks=min_blocks)


def paged_recent_select(block_table: torch.Tensor, seq_lens: torch.Tensor, n_kv: int, *, block_size: int, topk: int,
                        init_blocks: int = 0, local_blocks: int = 1) -> torch.Tensor:
    """The selection "recent" for the newest token of each sequence: the forced blocks, then the most recent pages
    -> [B, n_kv, topk] int32 (no host synchronisation)."""
    age = torch.arange(block_table.shape[1], dtype=torch.float32, device=block_table.device)
    return newest_top_blocks(age.expand(block_table.shape[0], n_kv, -1), seq_lens, block_size=block_size, topk=topk,
                             init_blocks=init_blocks, local_blocks=local_blocks)


def paged_attention_reference(q, k_cache, v_cache, blocks, block_table, seq_lens, *, scale=None, k_scale=None,
                              v_scale=None, rotation=None):
    """Plain-torch `paged_attention`: per sequence and KV group, softmax over the tokens of its selected (valid)
    blocks, each block once, every sequence at once (the selected pages gathered [B, Hkv, K, BS, D]). fp8 and int8
    caches: K and V dequantised with their scales [P, BS, Hkv] (`dequantize_kv`) first. rotation [D, D]: the cache
    holds rows times it; the queries go in times it (rounded to their dtype, as the kernel does) and the output comes
    back times its transpose."""
    if rotation is not None:
        q = (q.float() @ rotation).to(q.dtype)
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    blk = blocks.long()  # [B, Hkv, K]
    slot = blk.clamp(min=0)
    pages = block_table.long().gather(1, slot.flatten(1)).view_as(blk).clamp(0, k_cache.shape[0] - 1)
    heads = torch.arange(Hkv, device=q.device)[None, :, None]
    k, v = k_cache[pages, :, heads].float(), v_cache[pages, :, heads].float()  # [B, Hkv, K, BS, D]
    if k_scale is not None:
        k = dequantize_kv(k, k_scale[pages, :, heads])
        v = dequantize_kv(v, v_scale[pages, :, heads])
    again = (blk[..., :, None] == blk[..., None, :]).tril(-1).any(-1)  # a block chosen in an earlier slot too
    pos = slot[..., None] * bs + torch.arange(bs, device=q.device)  # [B, Hkv, K, BS]
    visible = ((blk >= 0) & ~again)[..., None] & (pos < seq_lens.long()[:, None, None, None])
    s = torch.einsum("bhgd,bhktd->bhgkt", q.float().view(B, Hkv, G, D), k) * scale
    p = torch.softmax(s.masked_fill(~visible[:, :, None], float("-inf")).flatten(-2), -1).view_as(s)
    o = torch.einsum("bhgkt,bhktd->bhgd", p, v).reshape(B, Hq, D)
    return (o if rotation is None else o @ rotation.T).to(q.dtype)


def quantize_pages(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index-key pages [P, BS, Di] as an fp8 index cache holds them: e4m3 with one scale per page (a page is a key
    block: quantize_index_keys(k, block_size)), repeated over its tokens -> ([P, BS, Di] fp8,
    [P, BS] fp32)."""
    q8, scale = quantize_index_keys(pages, pages.shape[1])  # scale [P, 1]
    return q8, scale.expand(-1, pages.shape[1]).contiguous()


def paged_index_write_reference(idx_cache, idx_scale, tail, k_idx, rows, pos, block_table) -> None:
    """Plain-torch `paged_index_write` (in place): rows 0..off of each newest page as the quantisation of its tail rows
    0..off, rows after off untouched."""
    bs = idx_cache.shape[1]
    off = pos.long() % bs
    tail[rows, off] = k_idx.to(tail.dtype)
    upto = torch.arange(bs, device=tail.device)[None, :] <= off[:, None]  # [N, BS]
    keys = torch.where(upto[:, :, None], tail[rows].float(), 0.0)
    page = block_table[rows, pos.long() // bs].long()
    q8, scale = quantize_pages(keys)
    idx_cache[page] = torch.where(upto[:, :, None], q8, idx_cache[page])
    idx_scale[page] = torch.where(upto, scale, idx_scale[page])


INT8_MAX = 127.0
KV_QUANTISED = (torch.float8_e4m3fn, torch.int8)  # the K/V cache dtypes stored with one scale per (token, head) row


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows [..., Hkv, D] as a quantised KV cache holds them, with one fp32 scale per (token, head) row ->
    ([..., Hkv, D] of `dtype`, [..., Hkv] fp32). fp8: e4m3, the row's largest magnitude mapped to 448, rounded to
    nearest even. int8: integers, the largest magnitude mapped to 127, rounded half to even (the scale and the
    quotients IEEE, as the kernels compute them)."""
    if dtype == torch.int8:
        amax = x.float().abs().amax(-1).clamp(min=1e-12)
        scale = amax / amax.new_full((), INT8_MAX)
        return (x.float() / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return quantize_index_keys(x)


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantised K or V rows [..., Hkv, D] (fp8 or int8) times their scales [..., Hkv] -> fp32."""
    return x8.float() * scale.float()[..., None]


def paged_kv_write_reference(k_cache, v_cache, k, v, page, off, k_scale=None, v_scale=None, k_shift=None,
                             rotation=None) -> None:
    """Plain-torch `paged_kv_write` (in place): token n's k[n], v[n] [Hkv, D] to slot off[n] of physical page
    page[n] (the keys less k_shift, then both times rotation, in fp32, where given); fp8 and int8 caches store them
    quantised (`quantize_kv`) with their scales."""
    page, off = page.long(), off.long()
    if k_shift is not None:
        k = k.float() - k_shift
    if rotation is not None:
        k, v = k.float() @ rotation, v.float() @ rotation
    if k_scale is None:
        k_cache[page, off] = k.to(k_cache.dtype)
        v_cache[page, off] = v.to(v_cache.dtype)
        return
    k_cache[page, off], k_scale[page, off] = quantize_kv(k, k_cache.dtype)
    v_cache[page, off], v_scale[page, off] = quantize_kv(v, v_cache.dtype)
