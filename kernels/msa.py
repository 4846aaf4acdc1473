"""The MSA graph ops after lowering: the same signatures as models.decoder.msa_select / msa_attention and
passes.kl_distill.msa_index_kl, backed by the Triton kernels on CUDA (and under TRITON_INTERPRET=1), by the torch
reference elsewhere.

`passes/lower_triton.py` swaps a converted graph's reference ops for these.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from kernels import indexer, reference as ref, sparse_attention as _sparse
from kernels._common import use_triton

__all__ = ["msa_select_triton", "msa_attention_triton", "msa_attention_lse_triton", "msa_index_kl_triton",
           "recall_rows", "RECALL_ROWS"]

RECALL_ROWS = 1024  # queries the lowered KL hook measures block recall on, at most


def recall_rows(T: int, device=None) -> torch.Tensor:
    """Query positions block recall is measured on: all T up to RECALL_ROWS, else RECALL_ROWS evenly spaced ones
    from the first to the last (distinct: their spacing exceeds one). The streamed torch log-sum-exp over all keys
    took 45 ms per layer and step for every query at 4 x 8192 tokens, 8 heads, d 48 on the H200 (cProfile of
    `m3c train`: 4.5 s of a 20-step run); on RECALL_ROWS queries its cost is linear in T."""
    if T <= RECALL_ROWS:
        return torch.arange(T, device=device)
    return torch.linspace(0, T - 1, RECALL_ROWS, device=device).round().long()


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


@torch.fx.wrap
def msa_attention_lse_triton(q, k, v, blocks, block_size: int, scale: float, sparse: bool = True):
    """msa_attention_triton that also returns each head's log-sum-exp over the selected keys ([B, T, Hq] fp32, base
    2, no gradient; None where SDPA or the torch reference runs): lowering wires it into the same layer's KL hook
    as the teacher's normaliser, so the hook needs no attention pass of its own."""
    T = q.shape[2]
    if not sparse or -(-T // block_size) <= blocks.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True), None
    return _sparse.sparse_attention_lse(q, k, v, blocks, block_size=block_size, scale=scale)


@torch.fx.wrap
def msa_index_kl_triton(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool, teacher_lse=None):
    """Mean KL and mean block recall of one MSA layer, as passes.kl_distill.msa_index_kl.

    Sparse support on CUDA: the KL is the fused kernel (kernels/sparse_kl.py) fed with the sparse attention's
    per-head log-sum-exp (`teacher_lse`, from the layer's msa_attention_lse_triton; computed here by an LSE-only
    pass when not given), and recall = mean over the group's heads of exp2(lse_selected - lse_all) (the dense
    teacher's mass inside the selected blocks), no T x T tensor and no gradient. lse_all, the dense log-sum-exp over
    every visible key, is O(T) per query, so recall is measured on `recall_rows` (every query up to RECALL_ROWS
    tokens, RECALL_ROWS evenly spaced ones beyond): a logged metric must not cost a dense attention forward per
    layer and step at long context. Warm-up (dense support) and CPU tensors keep the chunked torch reference.
    """
    T = q.shape[2]
    if not sparse or not use_triton(q, k, q_idx, k_idx) or -(-T // block_size) <= blocks.shape[-1]:
        kl, recall = ref.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=block_size, sparse=sparse,
                                  scale=scale)
        return kl.mean(), recall.mean()
    from kernels.sparse_kl import sparse_index_kl

    q, k = q.detach(), k.detach()
    with torch.no_grad():
        lse_sel = teacher_lse
        if lse_sel is None:
            lse_sel = _sparse._forward(q, k, k, blocks, block_size, scale, _sparse._PARTIAL_BYTES, None, "lse",
                                       True)[1]
        rows = recall_rows(T, q.device)
        lse_all = ref.causal_lse(q, k, scale, rows=rows)  # [B, rows, Hq], base 2
        G = q.shape[1] // k.shape[1]
        recall = torch.exp2(lse_sel[:, rows] - lse_all).unflatten(2, (k.shape[1], G)).mean(-1)  # [B, rows, Hi]
    kl = sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=block_size, scale=scale, teacher_lse=lse_sel)
    return kl.mean(), recall.mean()

