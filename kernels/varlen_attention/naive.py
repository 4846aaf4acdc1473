"""Plain-PyTorch reference of the variable-length block-diagonal attention of kernels/varlen_attention/."""
from __future__ import annotations

import torch

__all__ = ["varlen_attention_reference"]


def varlen_attention_reference(q, k, v, cu_seqlens, scale: float | None = None) -> torch.Tensor:
    """Plain torch, fp32: softmax(q k^T * scale) v inside each segment."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        s = torch.einsum("ihd,jhd->hij", q[a:b].float(), k[a:b].float()) * scale
        out[a:b] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v[a:b].float()).to(q.dtype)
    return out
