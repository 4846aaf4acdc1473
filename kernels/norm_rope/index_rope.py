"""The index branch's RoPE rules: which rotation an index head of `index_dim` channels gets from the main branch's
tables [.., T, R] (NeoX layout: the R/2 frequencies twice). A converted checkpoint names its rule in
`sparse_attention_config.sparse_index_rope` (m3compile.config.INDEX_ROPES):

    "m3"    the main table cut to the index head's first min(R, Di) channels (transformers' M3 indexer). With Di >= R
            this is the main branch's RoPE; with Di < R the cut table pairs channel p with p + w/2 of the cut width
            and mixes two frequencies per pair: not a rotation, but M3's own reference.
    "low"   (Di < R, even) the index head's Di/2 pairs turn at the main table's Di/2 lowest frequencies, a true
            rotation at any width: what a conversion writes below the rotary width.
    "tile"  (Di > R = head_dim, even) every one of the Di/2 pairs turns, each at one of the R/2 frequencies
            (`tile_pairs`: every frequency once, then the lowest ones again): what a conversion writes for an index
            head wider than a fully rotated dense head.

The tables these give are what the index-branch kernels (index_norm_rope) and their reference read; the index init
(models/index_init.py) fits the same pairs.
"""
from __future__ import annotations

import torch

__all__ = ["index_rope_dim", "index_rope_rule", "tile_pairs", "index_rope_tables"]


def index_rope_dim(rope_dim: int, index_dim: int) -> int:
    """Width of the "m3" rule's table: the main table (R = rope_dim) cut to the index head's first index_dim
    channels, so min(R, index_dim) (transformers' MiniMaxM3VLIndexer: cos[..., :index_head_dim])."""
    return min(rope_dim, index_dim)


def index_rope_rule(head_dim: int, rope_dim: int, index_dim: int) -> str:
    """The rule a conversion writes for these widths: "low" below the rotary width R, "tile" above it when the dense
    head rotates all its channels (no non-rotated channels to fit; an even index dim), else M3's own "m3"."""
    if index_dim < rope_dim:
        return "low"
    if index_dim > rope_dim == head_dim and index_dim % 2 == 0:
        return "tile"
    return "m3"


def tile_pairs(rope_dim: int, index_dim: int, device=None) -> torch.Tensor:
    """Rule "tile": the main table's pair (0 .. R/2 - 1) that each of the index head's Di/2 pairs turns as, [Di/2]
    int64. Every pair of the main table once, then again from the lowest frequencies (the highest pair numbers:
    the long-range ones a block selection needs) while index pairs remain: Di = 2R gives each pair twice.
    Built on `device` (no host-to-device copy: a CUDA graph can capture the decode step that builds it)."""
    h, n = rope_dim // 2, index_dim // 2
    return (torch.arange(n, device=device) + (h - n % h) % h) % h


def index_rope_tables(cos: torch.Tensor, sin: torch.Tensor, index_dim: int, rope: str = "m3"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The index branch's tables [.., T, w] from the main ones [.., T, R], as rule `rope` says (module doc):
    "m3" w = min(R, Di); "low" the Di/2 lowest frequencies twice (w = Di <= R): channel p and p + Di/2 turn as one
    pair at frequency R/2 - Di/2 + p; "tile" (even Di >= R) all Di channels: channel c and c + Di/2 turn as one pair
    at the frequency of the main table's pair tile_pairs(R, Di)[c]."""
    R = cos.shape[-1]
    if rope == "tile":
        if index_dim % 2 or index_dim < R:
            raise ValueError(f"index rope 'tile' needs an even index dim of at least the rotary width {R}, got "
                             f"{index_dim}")
        pairs = tile_pairs(R, index_dim, cos.device)
        c, s = cos[..., :R // 2].index_select(-1, pairs), sin[..., :R // 2].index_select(-1, pairs)
        return torch.cat((c, c), -1), torch.cat((s, s), -1)
    if rope not in ("m3", "low"):
        raise ValueError(f"index rope must be one of m3, low, tile, got {rope!r}")
    if rope == "m3" or index_dim >= R:
        w = index_rope_dim(R, index_dim)
        return cos[..., :w], sin[..., :w]
    if index_dim % 2:
        raise ValueError(f"index rope 'low' needs an even index dim, got {index_dim}")
    h, n = R // 2, index_dim // 2
    return (torch.cat((cos[..., h - n:h], cos[..., R - n:]), -1), torch.cat((sin[..., h - n:h], sin[..., R - n:]), -1))
