"""MSA index branch for prefill: fused token scores, causal mask, block max and running top-k (docs/msa.md section 2).

One program owns BLOCK_T query tokens x all index heads (the rows of one matmul: the single index key head is
shared, so every row reads the same keys) and walks the key blocks it can see. Per key block it computes
[rows, block] token scores, masks keys after each row's token, max-pools them to one block score per row and
inserts that score into a per-row top-k kept in registers: each slot one int64 (the score's bits made monotone,
over the block id), so an insertion is one min and one select over the slots. No [T, T] tensor and no [T, n_blocks]
score tensor is ever written: the only output is the block ids. Past 32 slots (a top-k or an adaptive ceiling above
32) the running top-k takes twice the registers, and a program takes 64 rows instead of 128
(`index_topk_kernel_wide`).

Forced blocks (the query's own `local_blocks` most recent blocks, the first `init_blocks` blocks) enter with score
+inf; slots that no visible block fills stay -1. Slot order carries no meaning.

fp8 scoring: index keys in fp8 e4m3 with fp32 scales (`quantize_index_keys`: one per token, or one per key block as
the graph's prefill quantises them) make the kernel quantise each query row (token, head) to e4m3 too, as it loads
it (the decode kernel does the same); token scores are then an fp8 x fp8 matmul with fp32 accumulation, times the
key's scale (the query's scale, one positive number per row, cannot change that row's ranking and is not applied),
followed by the same block max and top-k. With one key scale per key block (what the graph's prefill uses) the scale
multiplies the block max instead: one multiply per block score, not one per token score (at Llama-3-8B index shapes,
128K: 17.4 -> 14.5 ms at index dim 64, BENCHMARKS.md). On a GPU whose Triton cannot compile an fp8 matmul, and under
the interpreter, both operands are widened to fp16, which holds every e4m3 value exactly. The plain-torch meaning is
`select_blocks_reference`: quantise, dequantise, score in fp32.

Layout: q_idx [B, T, Hi, Di] (as the graph produces it), k_idx [B, T, Di] -> blocks [B, Hi, T, topk] int32.
"""
from __future__ import annotations

import torch

from m3compile.kernels.indexer import naive
from m3compile.kernels._common import launch_fp8, next_pow2, tune_bucket, use_triton
from m3compile.kernels.naive_common import FP8_MAX, dequantize_index_keys, fp8_round, quantize_index_keys

__all__ = ["select_blocks", "select_blocks_reference", "quantize_index_keys", "dequantize_index_keys", "FP8_MAX"]


def _check(q_idx: torch.Tensor, k_idx: torch.Tensor, k_scale: torch.Tensor | None, block_size: int, topk: int) -> bool:
    """Validates the arguments of select_blocks; returns whether the keys are fp8."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or q_idx.shape[0] != k_idx.shape[0] or q_idx.shape[1] > k_idx.shape[1] \
            or q_idx.shape[3] != k_idx.shape[2]:
        raise ValueError(f"q_idx must be [B, Tq, Hi, Di] and k_idx [B, T, Di] (Tq <= T); got {tuple(q_idx.shape)}, "
                         f"{tuple(k_idx.shape)}")
    if topk < 1 or block_size < 1:
        raise ValueError(f"topk and block_size must be >= 1, got {topk} and {block_size}")
    fp8 = k_idx.dtype == torch.float8_e4m3fn
    B, T = k_idx.shape[:2]
    n_blocks = -(-T // block_size)
    if fp8 and (k_scale is None or tuple(k_scale.shape) not in ((B, T), (B, n_blocks))):
        raise ValueError(f"fp8 index keys need k_scale [B, T] or [B, ceil(T / block_size)] = [{B}, {T}] or "
                         f"[{B}, {n_blocks}] (see quantize_index_keys), got "
                         f"{None if k_scale is None else tuple(k_scale.shape)}")
    if q_idx.dtype == torch.float8_e4m3fn:
        raise ValueError("q_idx must be a floating tensor of bf16/fp16/fp32 (fp8 scoring quantises it itself)")
    return fp8


def select_blocks_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    k_scale: torch.Tensor | None = None,
    top_p: float = 1.0,
    min_blocks: int = 0,
) -> torch.Tensor:
    """Plain-torch `select_blocks` (same layouts, int32). fp8 keys: the query quantised per (token, head) and
    dequantised (naive_common.fp8_round), the keys dequantised with k_scale, then fp32 scores, block max and top-k."""
    fp8 = _check(q_idx, k_idx, k_scale, block_size, topk)
    if fp8:
        q_idx, k_idx = fp8_round(q_idx), dequantize_index_keys(k_idx, k_scale, block_size)
    return naive.select_blocks(q_idx.transpose(1, 2), k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                               local_blocks=local_blocks, top_p=top_p, min_blocks=min_blocks).to(torch.int32)


def select_blocks(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    k_scale: torch.Tensor | None = None,
    top_p: float = 1.0,
    min_blocks: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-k key blocks per (index head, query token).

    q_idx [B, T, Hi, Di] (bf16/fp16/fp32); k_idx [B, T, Di] in the same dtypes, or fp8 e4m3 with k_scale [B, T] fp32
    (quantize_index_keys), which selects fp8 scoring (module docstring), or with k_scale [B, ceil(T / block_size)]
    (one scale per key block, `quantize_index_keys(k, block_size)`: the scale multiplies block scores, not token
    scores) -> [B, Hi, T, topk] int32 (-1 = empty slot).
    A prompt chunk over its cached prefix passes fewer queries: q_idx [B, Tq, Hi, Di] (Tq <= T) are the queries of
    the last Tq positions -> [B, Hi, Tq, topk].
    top_p < 1: the adaptive budget (docs/msa.md 2.8): the kernel also keeps the candidates' log-sum-exp and, at the
    end, sets the slots past the budget to -1 as naive.adaptive_keep does (min_blocks: its floor).
    Runs the fused Triton kernel on CUDA (or under TRITON_INTERPRET=1), otherwise `select_blocks_reference`.
    """
    fp8 = _check(q_idx, k_idx, k_scale, block_size, topk)
    B, Tq, H, D = q_idx.shape
    T = k_idx.shape[1]
    if not use_triton(q_idx, k_idx, backend=backend):
        return select_blocks_reference(q_idx, k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                       local_blocks=local_blocks, k_scale=k_scale, top_p=top_p,
                                       min_blocks=min_blocks)
    if k_idx.stride(-1) != 1 or q_idx.stride(-1) != 1:
        raise ValueError("q_idx and k_idx must be contiguous in their last dimension")
    out = torch.empty(B, H, Tq, topk, dtype=torch.int32, device=q_idx.device)
    if Tq == 0:
        return out
    scale = k_scale.float().contiguous() if fp8 else q_idx.new_empty(1, dtype=torch.float32)
    block_scale = fp8 and scale.shape[1] != T  # one scale per key block: applied after the block max
    from m3compile.kernels.indexer._tl_indexer import index_topk_kernel, index_topk_kernel_wide

    kernel = index_topk_kernel_wide if next_pow2(topk) >= 64 else index_topk_kernel

    HP = next_pow2(H)
    grid = lambda meta: (-(-Tq // (meta["ROWS"] // HP)), B)  # noqa: E731

    def launch(fp8_dot: bool) -> None:
        kernel[grid](
            q_idx, k_idx, scale, out,
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            scale.stride(0) if fp8 else 0, out.stride(0), out.stride(1), out.stride(2),
            T, T - Tq, tune_bucket(T), D**-0.5, float(top_p), int(min_blocks),
            H=H, HP=HP, D=D, DP=max(16, next_pow2(D)), BS=block_size, BN=max(16, next_pow2(block_size)),
            TOPK=topk, KP=next_pow2(topk), INIT=init_blocks, LOCAL=local_blocks,
            HAS_SCALE=fp8, BLOCK_SCALE=block_scale, IEEE=q_idx.dtype == torch.float32 and not fp8, FP8_DOT=fp8_dot,
            ADAPT=top_p < 1,
        )

    launch_fp8(launch, fp8)
    return out
