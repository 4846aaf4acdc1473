"""Each query head's log-sum-exp over every causally visible key, and the dense teacher's recall of a selection,
fused (never T x T): what the lowered KL hook needs besides the KL itself.

    causal_lse(q, k)                     [B, R, Hq]  log-sum-exp (base 2, scale included) of rows R of the queries
    dense_recall(q, k, selected_lse)     [B, R, Hkv] mean over each group's heads of exp2(selected_lse - lse), the
                                                     share of the dense attention mass inside the selected blocks
    oracle_blocks(q, k, ...)             [B, Hkv, T, topk] the blocks of most group-mean dense attention mass (the
                                                     oracle selection), from block_stats.block_lse: never T x T

One program owns TOK query rows (sampled positions `rows`, ascending) x the G heads of one KV group (the rows of
one matmul, as in the gather kernels) and streams the keys up to its last row's position in tiles of BN with an
online max and sum: the FlashAttention forward without V. Warm-up distillation takes `causal_lse` over every
query as its dense teacher's normaliser; sparse distillation measures recall on up to RECALL_ROWS sampled rows.
Shapes: q [B, Hq, T, D], k [B, Hkv, T, D] (unit last stride), rows [R] int64, selected_lse [B, T, Hq] fp32.
The torch reference is `naive.causal_lse` (kernels/causal_lse/naive.py).
"""
from __future__ import annotations

import functools
import math

import torch

from m3compile.kernels.block_stats import block_lse
from m3compile.kernels.causal_lse import naive
from m3compile.kernels.indexer.naive import select_from_scores
from m3compile.kernels.naive_common import check_attention_inputs
from m3compile.kernels._common import next_pow2, tune_bucket, use_triton

__all__ = ["causal_lse", "dense_recall", "oracle_blocks", "all_rows"]

# fp32 elements of block log-sum-exps one chunk of oracle rows holds ([B, Hq, rows, blocks]; 512 MiB)
_ORACLE_ELEMENTS = 1 << 27


@functools.lru_cache(maxsize=16)
def all_rows(T: int, device: torch.device) -> torch.Tensor:
    """arange(T) int64 on `device` (cached: never written to)."""
    return torch.arange(T, device=device)


def _check(q, k, rows):
    check_attention_inputs(q, k, k)
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows must be a 1-D int64 tensor of query positions, got {rows.dtype} {tuple(rows.shape)}")


def _launch(q, k, rows, selected_lse, out, scale):
    from m3compile.kernels.causal_lse._tl_lse import causal_lse_kernel

    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    R = rows.numel()
    recall = selected_lse is not None
    sel = selected_lse if recall else out  # unused pointer without recall
    grid = lambda meta: (-(-R // max(1, meta["ROWS"] // next_pow2(G))), B * Hkv)  # noqa: E731
    causal_lse_kernel[grid](
        q, k, rows, sel, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        sel.stride(0), sel.stride(1), out.stride(0), out.stride(1),
        R, T, scale * math.log2(math.e), tune_bucket(T),
        HKV=Hkv, G=G, GP=next_pow2(G), D=D, DP=max(16, next_pow2(D)), RECALL=recall, IEEE=q.dtype == torch.float32,
    )
    return out


def causal_lse(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, rows: torch.Tensor | None = None,
               backend: str = "auto") -> torch.Tensor:
    """Every query head's log-sum-exp (base 2, softmax scale included) over its causally visible keys.

    q [B, Hq, T, D], k [B, Hkv, T, D], rows (query positions, ascending, int64; default all) -> [B, R, Hq] fp32."""
    _check(q, k, rows)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q, k, backend=backend):
        return naive.causal_lse(q, k, scale, rows=rows)
    rows = all_rows(q.shape[2], q.device) if rows is None else rows
    out = torch.empty(q.shape[0], rows.numel(), q.shape[1], dtype=torch.float32, device=q.device)
    return _launch(q, k, rows, None, out, scale)


def dense_recall(q: torch.Tensor, k: torch.Tensor, selected_lse: torch.Tensor, *, scale: float | None = None,
                 rows: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Block recall of a selection: per (batch, query row, KV group) the mean over the group's heads of the dense
    attention mass inside the selected keys, exp2(selected_lse - causal_lse).

    q [B, Hq, T, D], k [B, Hkv, T, D], selected_lse [B, T, Hq] (base 2: the sparse attention's log-sum-exp over the
    selected keys), rows (ascending int64; default all) -> [B, R, Hkv] fp32."""
    _check(q, k, rows)
    B, Hq, T, _ = q.shape
    Hkv = k.shape[1]
    if selected_lse.shape != (B, T, Hq):
        raise ValueError(f"selected_lse must be [B, T, Hq] = [{B}, {T}, {Hq}], got {tuple(selected_lse.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q, k, backend=backend):
        rows = torch.arange(T, device=q.device) if rows is None else rows
        lse_all = naive.causal_lse(q, k, scale, rows=rows)
        return torch.exp2(selected_lse[:, rows].float() - lse_all).unflatten(2, (Hkv, Hq // Hkv)).mean(-1)
    rows = all_rows(T, q.device) if rows is None else rows
    out = torch.empty(B, rows.numel(), Hkv, dtype=torch.float32, device=q.device)
    return _launch(q, k, rows, selected_lse.float(), out, scale)


def oracle_blocks(q: torch.Tensor, k: torch.Tensor, *, block_size: int, topk: int, init_blocks: int = 0,
                  local_blocks: int = 1, scale: float | None = None, top_p: float = 1.0, min_blocks: int = 0,
                  backend: str = "auto") -> torch.Tensor:
    """The oracle selection of naive.oracle_blocks (per KV group and query, the forced blocks, then the earlier
    blocks of most group-mean dense attention mass; -1 where nothing is left). On Triton each chunk of query rows
    takes its per-head block log-sum-exps from one kernel (block_stats.block_lse: a FlashAttention-style pass
    over the keys, no softmax materialised), then mass = group mean of exp(blse - logsumexp_n blse), then the
    reference top-k; the reference path computes the [chunk, T] softmax in torch.

    q [B, Hq, T, D], k [B, Hkv, T, D] -> [B, Hkv, T, topk] int64."""
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    check_attention_inputs(q, k, k)
    if not use_triton(q, k, backend=backend):
        return naive.oracle_blocks(q, k, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks, scale=scale, top_p=top_p, min_blocks=min_blocks)
    B, Hq, T, _ = q.shape
    Hkv = k.shape[1]
    nb = -(-T // block_size)
    out = torch.empty(B, Hkv, T, topk, dtype=torch.long, device=q.device)
    chunk = max(1, _ORACLE_ELEMENTS // (B * Hq * nb))
    for start in range(0, T, chunk):
        rows = torch.arange(start, min(T, start + chunk), device=q.device)
        blse = block_lse(q, k, rows, block_size=block_size, scale=scale, backend="triton")  # [B, Hq, R, nb]
        mass = torch.exp(blse - torch.logsumexp(blse, -1, keepdim=True)).unflatten(1, (Hkv, -1)).mean(2)
        out[:, :, start:start + rows.numel()] = select_from_scores(naive.oracle_scores(mass, top_p), rows, block_size,
                                                                   topk, init_blocks, local_blocks, top_p, min_blocks)
    return out
