"""The MSA graph ops after lowering: the same signatures as models.decoder.msa_select / msa_attention, backed by
the Triton kernels on CUDA (and under TRITON_INTERPRET=1), by the torch reference elsewhere.

`passes/lower_triton.py` swaps a converted graph's reference ops for these.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from kernels import indexer, sparse_attention as _sparse

__all__ = ["msa_select_triton", "msa_attention_triton"]


@torch.fx.wrap
def msa_select_triton(q_idx, k_idx, block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1):
    """Fused index scoring + top-k. q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> [B, Hi, T, topk] int32 (-1 = empty)."""
    return indexer.select_blocks(q_idx, k_idx, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks)


@torch.fx.wrap
def msa_attention_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True):
    """Gather-Q block-sparse attention. q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D].

    When every visible block is selected (ceil(T / block) <= K) MSA is dense causal attention exactly, and the
    dense kernel (SDPA) is used.
    """
    T = q.shape[2]
    if not sparse or -(-T // block_size) <= blocks.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return _sparse.sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale)
