"""The key shift of an fp8 K/V cache: one vector per (layer, KV head) subtracted from every key before it is
quantised, so that what the e4m3 rows hold is the keys' variation, not a large constant.

Attention to keys k_j from a query q is softmax_j(q . k_j): subtracting one vector mu from every key subtracts
q . mu from every score of that query, and the softmax does not change. The shift is therefore exact whatever mu is;
it only decides what the fp8 rounding sees. e4m3 rounds each value to 3 mantissa bits of its own size, so a key
channel that holds a large constant (the K bias of Qwen2-family models: |b| up to ~200 in Qwen2.5-Coder-0.5B, where
the other channels are ~5) adds noise of that constant's size to every score, while the information it carries (its
variation) is small; a per-row or per-channel scale cannot remove it (the rounding error is relative), the shift
does. Qwen2.5-Coder-0.5B on 2K tokens of code (fp32 compute, against a bf16 cache): fp8 K alone costs +0.60% loss,
fp8 V alone nothing measurable; the fp8 cache costs +0.65% without the shift, -0.05% with it (4K tokens: +0.73%
-> +0.24%).

The shift comes from the weights, so it holds for every sequence and every chunking of a prompt: it is the mean of the
rotated K bias over the positions the cache can hold (0 .. max_len - 1). RoPE turns the constant bias b (pre-rotation)
into R_t b at position t; a rotary pair of frequency w contributes b's mean rotation, (1/L) sum_t R_t, which is b
itself where w L is small (the slow pairs, where the large constants sit) and ~0 where the pair turns many times.
Channels past the rotary width keep b. Models without a K bias, or with a norm on K (which changes the bias's
size per token), get no shift.
"""
from __future__ import annotations

import torch

from m3compile.models.decoder import Attention, Decoder

__all__ = ["key_shifts", "rope_mean", "rotation"]


def rope_mean(inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over positions 0 .. length - 1 of the RoPE tables: (mean cos, mean sin) [R] fp64, R = 2 * pairs
    (NeoX layout, as RotaryEmbedding's tables), in closed form (a geometric sum per frequency)."""
    w = inv_freq.double()
    half = torch.sin(w / 2)
    # sum_{t<L} e^{iwt} = e^{iw(L-1)/2} sin(wL/2) / sin(w/2); -> L as w -> 0
    ratio = torch.where(half.abs() > 1e-12, torch.sin(w * length / 2) / half.where(half.abs() > 1e-12, 1.0),
                        torch.full_like(w, float(length))) / length
    c, s = ratio * torch.cos(w * (length - 1) / 2), ratio * torch.sin(w * (length - 1) / 2)
    return torch.cat([c, c]), torch.cat([s, s])


def _layer_shift(attn: Attention, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """[Hkv, D] fp32: mean over positions of the rotated K bias (None: no K bias, or a norm on K)."""
    bias = attn.k_proj.bias
    if bias is None or hasattr(attn, "k_norm"):
        return None
    b = bias.detach().double().view(attn.n_kv_heads, attn.head_dim)
    cos, sin = cos.to(b.device), sin.to(b.device)
    r, half = cos.shape[0], cos.shape[0] // 2
    rot = b[:, :r]
    rotated = torch.cat([-rot[:, half:], rot[:, :half]], dim=-1)  # rotate_half, as ops.apply_rope
    mu = torch.cat([rot * cos + rotated * sin, b[:, r:]], dim=-1)
    return mu.float()


def key_shifts(model: Decoder, max_len: int) -> dict[int, torch.Tensor | None]:
    """Per layer the shift [Hkv, D] fp32 (on the K bias's device) that an fp8 K/V cache of `max_len` positions
    subtracts from each key before quantising it (None: that layer has none); see the module's docstring."""
    bb = model.model
    cos, sin = rope_mean(bb.rotary_emb.inv_freq.detach().cpu(), max(1, max_len))
    out = {}
    for i, layer in enumerate(bb.layers):
        mu = _layer_shift(layer.self_attn, cos, sin)
        out[i] = mu
    return out


def rotation(dim: int) -> torch.Tensor:
    """An orthonormal [dim, dim] fp32 matrix that an int8 K/V cache multiplies each key and value row by before
    rounding them (q . k = (q R) . (k R), and softmax(.) (V R) R^T = softmax(.) V, so attention is unchanged): a
    Walsh-Hadamard matrix where dim is a power of two, else a fixed random orthogonal one (QR of a seeded Gaussian).

    Why: an 8-bit integer row is exact to 1/254 of its largest value, so a row whose energy sits in a few channels
    (a key's RoPE-rotated bias, an outlier channel) rounds the rest coarsely; the rotation spreads every channel over
    all of them, so a row's largest value is near its rms. Qwen2.5-Coder-0.5B, one 8K window of held-out code, fp32,
    keys rounded as the caches round them (benchmarks/experiments/fp8_key_error.py): rms score error 0.167 with e4m3
    rows (shifted keys), 0.040 with rotated int8 rows; loss +0.214% against +0.016%. e4m3 gains nothing from the
    rotation (its rounding is relative to each value), so an fp8 cache does not rotate."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return (h / dim ** 0.5).float()
    g = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()
