"""Plain-PyTorch reference of RoPE and of the index branch's norm: the model's own ops (m3compile.ops.apply_rope
and the models' RMSNorm) spelled out.
"""
from __future__ import annotations

import torch

__all__ = ["rope", "gemma_rms_norm", "rms_norm", "add_rms_norm", "index_norm_rope"]

def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, width: int | None = None) -> torch.Tensor:
    """NeoX RoPE on the first `width` (default R) channels, in x's dtype. x [B, T, H, D], cos/sin [B | 1, T, R]."""
    width = cos.shape[-1] if width is None else width
    cos, sin = cos[..., :width].unsqueeze(2).to(x.dtype), sin[..., :width].unsqueeze(2).to(x.dtype)
    x_rot, x_pass = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm x * (1 + w) over the last dim, computed in fp32, in x's dtype (M3's index norms)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "rms") -> torch.Tensor:
    """The models' RMSNorm: style "rms" w * x_hat (x_hat rounded to x's dtype first), "gemma" x_hat * (1 + w)."""
    if style == "gemma":
        return gemma_rms_norm(x, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: str = "rms") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, rms_norm(x + d)): a residual add and the norm after it."""
    s = x + d
    return s, rms_norm(s, weight, eps, style)


def index_norm_rope(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, *, eps: float, width: int | None = None):
    """y [B, T, (Hi + 1) * Di] -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di]): per head Gemma RMSNorm (q_weight for
    the Hi query heads, k_weight for the last, key head) then RoPE on the first `width` channels."""
    D = q_weight.shape[0]
    heads = y.view(*y.shape[:-1], -1, D)
    width = min(cos.shape[-1], D) if width is None else width
    q = rope(gemma_rms_norm(heads[:, :, :-1], q_weight, eps), cos, sin, width=width)
    k = rope(gemma_rms_norm(heads[:, :, -1:], k_weight, eps), cos, sin, width=width)
    return q, k[:, :, 0]
