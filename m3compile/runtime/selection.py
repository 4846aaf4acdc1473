"""How the MSA layers of the runtime pick their key blocks: the index branch (the model itself), or, to judge a
selection against bounds, the oracle, dense attention or the most recent blocks.

    index    the index branch's top-k (MSA_SPEC section 2): what the converted model does
    oracle   per KV group, the blocks of most true attention mass (the mean over the group's query heads of their
             softmax over every visible key, summed per block), same top-k and forced blocks: what a perfect index
             branch would select (prefill: kernels.causal_lse.oracle_blocks; decode: `paged_oracle_select`)
    dense    every MSA layer attends to every visible key
    recent   the forced blocks, then the most recent blocks: a sliding window with the top-k's budget, which finds
             nothing further back (a selection that should fail long-range retrieval)

prefill and decode_step (m3compile.runtime.forward) take `selection`; `prefill_blocks` and `decode_blocks` give the
oracle's and the recent window's blocks in the layouts the sparse kernels read.
"""
from __future__ import annotations

import torch

from m3compile.kernels.causal_lse import oracle_blocks
from m3compile.kernels.indexer.naive import select_from_scores
from m3compile.models.decoder import MSALayerArgs

__all__ = ["RUNTIME_SELECTIONS", "prefill_blocks", "decode_blocks", "paged_oracle_select"]

RUNTIME_SELECTIONS = ("index", "oracle", "dense", "recent")


def prefill_blocks(selection: str, q: torch.Tensor, k: torch.Tensor, m: MSALayerArgs, scale: float,
                   backend: str) -> torch.Tensor:
    """The blocks [B, Hkv, T, topk] (int64, -1 = empty) of selection "oracle" or "recent" for a prompt's
    q [B, Hq, T, D], k [B, Hkv, T, D]."""
    if selection == "oracle":
        return oracle_blocks(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                             local_blocks=m.local_blocks, scale=scale, backend=backend)
    if selection != "recent":
        raise ValueError(f"no block list for selection {selection!r}")
    B, Hkv, T = k.shape[:3]
    n_blocks = -(-T // m.block_size)
    age = torch.arange(n_blocks, dtype=torch.float32, device=q.device).expand(B, Hkv, T, n_blocks)
    return select_from_scores(age, torch.arange(T, device=q.device), m.block_size, m.topk, m.init_blocks,
                              m.local_blocks)


def decode_blocks(selection: str, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, m: MSALayerArgs, scale: float,
                  k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks [B, Hkv, topk] (int32, -1 = empty) of selection "oracle" or "recent" for one new token per
    sequence: q [B, Hq, D], k_cache [P, page, Hkv, D] (page = block; fp8 with k_scale [P, page, Hkv]), seq_lens
    counting the new token."""
    if selection == "oracle":
        return paged_oracle_select(q, k_cache, block_table, seq_lens, topk=m.topk, init_blocks=m.init_blocks,
                                   local_blocks=m.local_blocks, scale=scale, k_scale=k_scale)
    if selection != "recent":
        raise ValueError(f"no block list for selection {selection!r}")
    age = torch.arange(block_table.shape[1], dtype=torch.float32, device=q.device)
    return _pick(age.expand(q.shape[0], k_cache.shape[2], -1), seq_lens, m.block_size, m.topk, m.init_blocks,
                 m.local_blocks)


def paged_oracle_select(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        *, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                        scale: float | None = None, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle's blocks for the newest token of each sequence, from the paged KV cache: per KV group, the mean
    over its query heads of their softmax over every cached key (fp32), summed per page (= block), then the
    top-k with the forced blocks as `paged_select` keeps them. Plain torch over every page of the block table (one
    query per sequence: no kernel needed), no host synchronisation, so a CUDA graph captures it.

    q [B, Hq, D], k_cache [P, BS, Hkv, D] (an fp8 cache with its k_scale [P, BS, Hkv]: each key row times its scale),
    block_table [B, max_pages], seq_lens [B] -> [B, Hkv, topk] int32."""
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
    return _pick(mass, seq_lens, bs, topk, init_blocks, local_blocks)


def _pick(scores: torch.Tensor, seq_lens: torch.Tensor, block_size: int, topk: int, init_blocks: int,
          local_blocks: int) -> torch.Tensor:
    """Top-k of block scores [B, Hkv, pages] for each sequence's newest token (position seq_lens - 1), forced blocks
    first (indexer.naive.select_from_scores, the sequences as its query rows) -> [B, Hkv, topk] int32."""
    rows = select_from_scores(scores.transpose(0, 1)[None], seq_lens.long() - 1, block_size, topk, init_blocks,
                              local_blocks)  # [1, Hkv, B, topk]
    return rows[0].transpose(0, 1).to(torch.int32)
