"""MSA sparse prefill attention, query-tile union design (an alternative to sparse_attention's gather-Q).

The gather-Q kernel (kernels/sparse_attention/) loads each selected K/V block once, but writes a partial output
and log-sum-exp per (token, slot, head) and merges them in a second kernel: at Llama-3-8B shapes (G = 4) and 128K
that is ~51 GB of traffic per layer, and it runs at 0.29 of the ideal (BENCHMARKS.md). This design keeps
the partials on chip instead. One program takes TILE consecutive query tokens x the G heads of one KV group as the
matmul rows (TILE * G >= 64 rows: `tile_tokens`) and loops over the union of the blocks those tokens selected
(`tile_union`, built in torch: sorted, deduplicated, -1 slots dropped). For each union block it loads K and V once,
scores all rows, keeps for each row only the keys of its own token's selection (and causal keys), and runs one
online softmax per row from the first block to the output. Nothing per slot is written.

Its cost against the ideal is the union's size over top-k: 1 when the tile's tokens select the same blocks (the
bench's "shared" regime), up to TILE when they share none ("independent", random selections). On a real model's
own selections consecutive queries share most blocks (benchmarks/experiments/selection_locality.py: tiles of 16
tokens of a 9.5M-parameter byte-level Llama, block 64 / top-8, 8K: 1.24x; random selections: 6.8x).

Measured (H200, 128K, BENCHMARKS.md): even where the union is the top-k it only ties gather-Q (Llama-3-8B
shapes, tiles of 16 tokens: 25.9 against 24.7 ms; M3 shapes, tiles of 4: 44.4 against 41.4), running at 0.28 of
the ideal as gather-Q does, so it stays opt-in; it was timed untuned (4 warps, 2 stages, the causal mask on every
block).

Forward only (prefill inference; training keeps gather-Q, whose backward exists).

Shapes: q [B, Hq, T, D], k/v [B, Hkv, T, D] (unit last stride), blocks [B, Hkv, T, K] (-1 = empty; ids distinct
per row, as every selection makes them) -> out [B, Hq, T, D] and, with return_lse, the log-sum-exp (base 2) over the
selected keys [B, T, Hq] fp32.
"""
from __future__ import annotations

import math

import torch

from m3compile.kernels.naive_common import check_attention_inputs
from m3compile.kernels.sparse_attention import naive
from m3compile.kernels._common import next_pow2, tune_bucket, use_triton

__all__ = ["sparse_attention_tiled", "tile_union", "tile_tokens"]


def tile_tokens(G: int, rows: int = 64) -> int:
    """Query tokens per program: enough that tokens x (G rounded up to a power of two) fill `rows` matmul rows."""
    return max(1, rows // next_pow2(G))


def tile_union(blocks: torch.Tensor, n_blocks: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, Hkv, T, K] -> (union [B, Hkv, ceil(T / tile), tile * K] int32: per tile of `tile` consecutive
    tokens, the distinct block ids any of them selected, ascending, then -1; count [B, Hkv, ceil(T / tile)] int32).
    No host synchronisation (the width is the bound tile * K, not the largest union)."""
    B, H, T, K = blocks.shape
    n_tiles = -(-T // tile)
    ids = blocks.to(torch.int64).masked_fill(blocks < 0, n_blocks)  # empty slots sort last
    ids = torch.nn.functional.pad(ids, (0, 0, 0, n_tiles * tile - T), value=n_blocks)
    ids = ids.view(B, H, n_tiles, tile * K).sort(-1).values
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = ids.masked_fill(dup, n_blocks).sort(-1).values
    count = (ids < n_blocks).sum(-1, dtype=torch.int32)
    return ids.masked_fill(ids >= n_blocks, -1).to(torch.int32), count


def sparse_attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           block_size: int, scale: float | None = None, tile: int | None = None,
                           backend: str = "auto", return_lse: bool = False):
    """Exact causal attention of every query head over its group's selected key blocks (as
    sparse_attention.naive.sparse_attention), by the query-tile union design of the module doc. `tile`: query tokens per
    program [default: tile_tokens(G); rounded up to a power of two of at least 16 matmul rows]. Elsewhere than on
    CUDA / under the interpreter it runs the reference, which has no log-sum-exp: return_lse then raises."""
    G = check_attention_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv, K = k.shape[1], blocks.shape[-1]
    if blocks.dim() != 4 or blocks.shape[:3] != (B, Hkv, T):
        raise ValueError(f"blocks must be [B, Hkv, T, K] = [{B}, {Hkv}, {T}, K], got {tuple(blocks.shape)}")
    scale = D**-0.5 if scale is None else scale
    if tile is not None and tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    # a power of two (the rows are one arange), at least 16 matmul rows (tl.dot's minimum)
    tile = max(next_pow2(tile_tokens(G) if tile is None else tile), tile_tokens(G, rows=16))
    if not use_triton(q, k, v, blocks, backend=backend):
        if return_lse:
            raise ValueError("return_lse needs the Triton kernel (CUDA, or TRITON_INTERPRET=1 on CPU)")
        return naive.sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last dimension")
    n_blocks = -(-T // block_size)
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    union, count = tile_union(blocks, n_blocks, tile)
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)  # token-major, as gather-Q's
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    from m3compile.kernels.sparse_attention._tl_sparse_tile import tile_union_fwd_kernel

    grid = (union.shape[2], B * Hkv)
    tile_union_fwd_kernel[grid](
        q, k, v, blocks, union, count, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), blocks.stride(0), blocks.stride(1), blocks.stride(2), union.stride(0), union.stride(1),
        union.stride(2), count.stride(0), count.stride(1), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        T, scale * math.log2(math.e), tune_bucket(T),
        HKV=Hkv, G=G, GP=next_pow2(G), D=D, DP=max(16, next_pow2(D)), BS=block_size, BN=max(16, next_pow2(block_size)),
        K=K, KP=next_pow2(K), TILE=tile, IEEE=q.dtype == torch.float32,
    )
    return (out, lse) if return_lse else out
