"""RoPE, and the index branch's Gemma RMSNorm + RoPE, fused (forward and backward): one launch each instead of the
dozen elementwise ops (and their backwards) the reference runs per tensor.

    rms_norm(x, w)                         the models' RMSNorm, forward only (the frozen backbone's norms)
    add_rms_norm(x, d, w)                  (x + d, rms_norm(x + d, w)): a residual add and the next norm, one launch
    rope(x, cos, sin)                      NeoX RoPE on the first `width` channels of every head (the rest pass)
    index_norm_rope(y, wq, wk, cos, sin)   y = x @ [W_qi; W_ki]^T viewed as [B, T, Hi + 1, Di]: per head the Gemma
                                           RMSNorm (x * (1 + w), w = wq for the Hi index query heads, wk for the
                                           index key head), then RoPE -> (q_idx [B, T, Hi, Di], k_idx [B, T, Di])

One program owns ROWS (token, head) rows of D channels. RoPE pairs channel p with its partner p +- width/2 inside
the rotated width, so a row's partner channels are loaded beside it; the norm's mean square is a row reduction.
Rounding follows the reference op by op (the norm's output, each product and the sum are rounded to the
activations' dtype), so `rope` is the reference to the bit wherever the compiler does not fuse a multiply-add;
the norm's mean is summed in another order. Backward: RoPE's transpose (the partner's sine term moves to the
other channel) and the RMSNorm backward in fp32; the norm weights' gradients are summed per program and then
over programs (no atomics: deterministic).

Shapes: x [B, T, H, D], cos/sin [B | 1, T, R] (the main branch's tables; width <= R), y [B, T, (Hi + 1) * Di].
References (kernels/norm_rope/naive.py): `naive.rope`, `naive.index_norm_rope`, `naive.rms_norm`,
`naive.add_rms_norm`.
"""
from __future__ import annotations

import torch

from m3compile.kernels.norm_rope import naive
from m3compile.kernels._common import next_pow2, use_triton

__all__ = ["rope", "index_norm_rope", "rms_norm", "add_rms_norm"]

_ROWS = 16  # (token, head) rows per program


def _tables(cos, sin, x, width):
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[1] != x.shape[1] or cos.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"cos/sin must be [B | 1, T, R] for x {tuple(x.shape)}, got {tuple(cos.shape)}")
    if width % 2 or not 0 < width <= min(cos.shape[-1], x.shape[-1]):
        raise ValueError(f"width {width} must be even and at most min(R, D) = {min(cos.shape[-1], x.shape[-1])}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    b = 0 if cos.shape[0] == 1 else 1
    return cos, sin, (cos.stride(0) * b, cos.stride(1), sin.stride(0) * b, sin.stride(1))


def _token_stride(x: torch.Tensor, heads: int, D: int) -> int | None:
    """Elements between consecutive tokens of x [B, T, ...] whose `heads` rows of D channels sit side by side in
    each token (a contiguous tensor, or a slice of the last dim of one: a fused projection's part); None otherwise."""
    B, T = x.shape[:2]
    if x.stride(-1) != 1 or (x.dim() == 4 and heads > 1 and x.stride(2) != D):
        return None
    if T == 1:
        return x.stride(0)
    return x.stride(1) if B == 1 or x.stride(0) == T * x.stride(1) else None


def _launch_fwd(x, wq, wk, cos, sin, out, D, heads, q_heads, width, eps, norm, stride_t=None):
    """Rows of D channels: out holds B * T * heads of them, (token, head) major; x the same rows, its tokens
    stride_t elements apart (None: heads * D, contiguous)."""
    from m3compile.kernels.norm_rope._tl_norm_rope import norm_rope_fwd_kernel

    B, T = x.shape[:2]
    cos, sin, cs = _tables(cos, sin, x, width)
    n = B * T * heads
    norm_rope_fwd_kernel[(-(-n // _ROWS),)](
        x, wq, wk, cos, sin, out, heads * D if stride_t is None else stride_t, *cs, n, T, heads, q_heads, eps,
        D=D, DP=next_pow2(D), W=width, NORM=norm, ROWS=_ROWS,
    )
    return out


def _launch_bwd(g, g_k, x, wq, wk, cos, sin, dx, D, heads, q_heads, width, eps, norm):
    """g [B, T, q_heads, D] (strided) for the first q_heads rows of a token, g_k [B, T, D] for the others."""
    from m3compile.kernels.norm_rope._tl_norm_rope import norm_rope_bwd_kernel

    B, T = x.shape[:2]
    cos, sin, cs = _tables(cos, sin, x, width)
    n = B * T * heads
    programs = -(-n // _ROWS)
    dw = torch.empty(programs, 2, D, dtype=torch.float32, device=x.device) if norm else dx.new_empty(1, 1, 1)
    g_k = g if g_k is None else g_k
    norm_rope_bwd_kernel[(programs,)](
        g, g_k, x, wq, wk, cos, sin, dx, dw, g.stride(0), g.stride(1), g.stride(2), g_k.stride(0), g_k.stride(1),
        *cs, n, T, heads, q_heads, eps,
        D=D, DP=next_pow2(D), W=width, NORM=norm, ROWS=_ROWS,
    )
    return dw.sum(0) if norm else None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, width, stride_t):
        ctx.save_for_backward(cos, sin)
        ctx.width = width
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _launch_fwd(x, x, x, cos, sin, out, x.shape[3], x.shape[2], x.shape[2], width, 0.0, False, stride_t)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        dx = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        _launch_bwd(g, None, g, g, g, cos, sin, dx, g.shape[3], g.shape[2], g.shape[2], ctx.width, 0.0, False)
        return dx, None, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, width: int | None = None,
         backend: str = "auto") -> torch.Tensor:
    """NeoX RoPE on the first `width` (default R) channels of each head, in x's dtype: x [B, T, H, D] (contiguous,
    or a slice of a wider last dim: read in place), cos/sin [B | 1, T, R] -> [B, T, H, D] (contiguous);
    differentiable in x (the tables get no gradient)."""
    width = cos.shape[-1] if width is None else width
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D], got {tuple(x.shape)}")
    if not use_triton(x, cos, sin, backend=backend) or cos.requires_grad or sin.requires_grad:
        return naive.rope(x, cos, sin, width=width)
    stride_t = _token_stride(x, x.shape[2], x.shape[3])
    if stride_t is None:
        x = x.contiguous()  # rows of D channels, (token, head) major
    return _Rope.apply(x, cos, sin, width, stride_t)


class _IndexNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, wq, wk, cos, sin, heads, width, eps, stride_t):
        B, T = y.shape[:2]
        D = wq.shape[0]
        out = torch.empty(B, T, heads, D, dtype=y.dtype, device=y.device)
        _launch_fwd(y, wq, wk, cos, sin, out, D, heads, heads - 1, width, eps, True, stride_t)
        ctx.save_for_backward(y, wq, wk, cos, sin)
        ctx.args = (heads, width, eps)
        return out[:, :, : heads - 1], out[:, :, heads - 1]

    @staticmethod
    def backward(ctx, g_q, g_k):
        y, wq, wk, cos, sin = ctx.saved_tensors
        y = y if y.is_contiguous() else y.contiguous()  # the backward reads rows (token, head) major
        heads, width, eps = ctx.args
        B, T = y.shape[:2]
        D = wq.shape[0]
        g_q = g_q if g_q.stride(-1) == 1 else g_q.contiguous()
        g_k = g_k if g_k.stride(-1) == 1 else g_k.contiguous()
        dy = torch.empty(B, T, heads * D, dtype=y.dtype, device=y.device)
        dw = _launch_bwd(g_q, g_k, y, wq, wk, cos, sin, dy, D, heads, heads - 1, width, eps, True)
        return dy, dw[0].to(wq.dtype), dw[1].to(wk.dtype), None, None, None, None, None, None


def index_norm_rope(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, *, eps: float, width: int | None = None, backend: str = "auto"):
    """The index branch after its projections: y [B, T, (Hi + 1) * Di] (index query heads, then the index key head;
    contiguous, or a slice of a wider last dim: read in place) -> Gemma RMSNorm per head (q_weight [Di] for the
    query heads, k_weight [Di] for the key head), RoPE on the first `width` (default min(R, Di)) channels ->
    (q_idx [B, T, Hi, Di], k_idx [B, T, Di]), views of one buffer; differentiable in y and both weights."""
    D = q_weight.shape[0]
    if y.dim() != 3 or y.shape[-1] % D or y.shape[-1] // D < 2 or k_weight.shape != q_weight.shape:
        raise ValueError(f"y must be [B, T, (Hi + 1) * Di] with Di = {D}, got {tuple(y.shape)}")
    heads = y.shape[-1] // D
    width = min(cos.shape[-1], D) if width is None else width
    if not use_triton(y, cos, sin, backend=backend):
        return naive.index_norm_rope(y, q_weight, k_weight, cos, sin, eps=eps, width=width)
    stride_t = _token_stride(y, heads, D)
    if stride_t is None:
        y = y.contiguous()
    return _IndexNormRope.apply(y, q_weight, k_weight, cos, sin, heads, width, eps, stride_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, style: str = "rms",
             backend: str = "auto") -> torch.Tensor:
    """The models' RMSNorm over the last dim (models.decoder.RMSNorm), forward only: where a gradient is needed
    (x or weight requires it) the reference runs. style "rms": w * x_hat, in promote(w, x) dtype; "gemma":
    x_hat * (1 + w), in x's dtype; x_hat = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype."""
    if style not in ("rms", "gemma"):
        raise ValueError(f"unknown norm style {style!r}")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if needs_grad or not use_triton(x, weight, backend=backend):
        return naive.rms_norm(x, weight, eps, style)
    from m3compile.kernels.norm_rope._tl_norm_rope import rms_norm_kernel

    x = x if x.is_contiguous() else x.contiguous()
    out, n, grid, meta = _norm_launch(x, weight, style)
    rms_norm_kernel[grid](x, weight, out, n, eps, **meta)
    return out


def _norm_launch(x: torch.Tensor, weight: torch.Tensor, style: str):
    """The norm kernels' output (style "gemma": x's dtype, else promote(w, x)), row count, grid and constexprs."""
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype if style == "gemma" else torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    n = x.numel() // max(1, D)
    rows = max(1, min(16, 4096 // next_pow2(D)))
    return out, n, (-(-n // rows),), dict(D=D, DP=next_pow2(D), GEMMA=style == "gemma", ROWS=rows)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, *, eps: float, style: str = "rms",
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + d (x's dtype, as torch adds; d the same shape): a residual add and the norm that
    follows it in one launch, forward only (the reference where a gradient is needed). The same values as the two
    ops apart, to the bit where `rms_norm` is."""
    if style not in ("rms", "gemma"):
        raise ValueError(f"unknown norm style {style!r}")
    if d.shape != x.shape or d.dtype != x.dtype:
        raise ValueError(f"add_rms_norm needs x and d of one shape and dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(d.shape)} {d.dtype}")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or d.requires_grad or weight.requires_grad)
    if needs_grad or not use_triton(x, d, weight, backend=backend):
        return naive.add_rms_norm(x, d, weight, eps, style)
    from m3compile.kernels.norm_rope._tl_norm_rope import add_rms_norm_kernel

    x = x if x.is_contiguous() else x.contiguous()
    d = d if d.is_contiguous() else d.contiguous()
    s = torch.empty_like(x)
    out, n, grid, meta = _norm_launch(x, weight, style)
    add_rms_norm_kernel[grid](x, d, s, weight, out, n, eps, **meta)
    return s, out
