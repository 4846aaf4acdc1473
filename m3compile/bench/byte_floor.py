"""A decode step's byte floor: the bytes one step must read from device memory, and the time that takes at the
GPU's memory bandwidth, the bound a memory-bound step can approach (`m3c bench model` reports the share reached).

A step of B sequences at context T reads:
    weights      every parameter once (the embedding table: only the B rows looked up, unless the head shares it)
    KV           per layer and sequence, the keys and values attention reads: every cached token in a dense layer,
                 the top-k selected blocks (at most T tokens) in an MSA layer; at the cache's dtype, with the fp8
                 cache's one fp32 scale per token and head
    index keys   per MSA layer and sequence, every cached index key (the selection scores them all), with the fp8
                 cache's fp32 scale per token row
Activations, the new tokens' cache writes and the fp8 index cache's newest-page rewrite are left out: a few MB
against the GB above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3compile.kernels.decode.naive import KV_QUANTISED

__all__ = ["BANDWIDTH_TBS", "bandwidth_tbs", "StepBytes", "step_bytes"]

# HBM bandwidth of common GPUs, TB/s (vendors' figures), matched against torch.cuda.get_device_name() in this order
BANDWIDTH_TBS = (
    ("GH200", 4.9), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
    ("H20", 4.0), ("B200", 8.0), ("B100", 8.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
    ("A100", 1.555), ("A800", 2.039), ("L40S", 0.864), ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6), ("A10", 0.6),
    ("RTX 4090", 1.008), ("RTX 3090", 0.936), ("V100", 0.9), ("T4", 0.32),
)


def bandwidth_tbs(device_name: str | None) -> float | None:
    """The memory bandwidth (TB/s) of a GPU by its name (the first entry of BANDWIDTH_TBS it contains), or None."""
    if not device_name:
        return None
    return next((bw for name, bw in BANDWIDTH_TBS if name.lower() in device_name.lower()), None)


def _item(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int
    index: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.index

    def floor_ms(self, tbs: float) -> float:
        return self.total / (tbs * 1e12) * 1e3

    def to_dict(self) -> dict:
        return {"weights": self.weights, "kv": self.kv, "index": self.index, "total": self.total}


def step_bytes(model: torch.nn.Module, batch: int, tokens: int, kv_dtype: torch.dtype,
               index_dtype: torch.dtype) -> StepBytes:
    """The bytes one decode step of `model` (a Decoder) reads for `batch` sequences at context `tokens`."""
    args = model.args
    emb = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (a tied head's table once)
    if model.lm_head.weight is not emb:  # the table itself: only the looked-up rows
        weights += batch * emb.shape[1] * emb.element_size() - emb.numel() * emb.element_size()
    scaled = kv_dtype in KV_QUANTISED  # one fp32 scale per row
    row = 2 * (args.head_dim * _item(kv_dtype) + (4 if scaled else 0))  # one token's K and V of one head
    kv = index = 0
    for i in range(args.n_layers):
        msa = args.msa if args.is_sparse(i) else None
        read = tokens if msa is None else min(tokens, msa.topk * msa.block_size)
        kv += batch * args.n_kv_heads * read * row
        if msa is not None:
            idx_fp8 = index_dtype == torch.float8_e4m3fn
            index += batch * tokens * (msa.index_dim * _item(index_dtype) + (4 if idx_fp8 else 0))
    return StepBytes(weights, kv, index)
