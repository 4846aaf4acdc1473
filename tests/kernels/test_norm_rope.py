"""Fused RoPE, index norm + RoPE and RMSNorm (Triton, interpreter on CPU) against the reference ops."""
import pytest
import torch

from m3compile.kernels import norm_rope as nr
from m3compile.kernels.norm_rope import naive

CASES = [  # B, T, H, D, R (table width), rotated width
    (1, 1, 1, 16, 16, 16),  # one token, one head
    (2, 7, 3, 24, 16, 8),  # partial rotation, D not a power of two, the table wider than the rotated part
    (1, 5, 9, 64, 64, 64),  # SmolLM2's heads
    (2, 3, 4, 12, 20, 12),  # the table wider than the head (the index RoPE's cut)
]


def tables(B, T, R):
    pos = torch.arange(T)[None, :, None].float()
    cos, sin = (pos * torch.rand(R)).cos(), (pos * torch.rand(R)).sin()
    return (cos.expand(B, T, R), sin.expand(B, T, R)) if B > 1 else (cos, sin)  # a batch stride of 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-D{}-R{}-w{}".format(*c))
def test_rope_and_index_norm_rope_match_the_reference(case):
    B, T, H, D, R, w = case
    cos, sin = tables(B, T, R)
    x = torch.randn(B, T, H, D, requires_grad=True)
    got, want = nr.rope(x, cos, sin, width=w, backend="triton"), naive.rope(x, cos, sin, width=w)
    g = torch.randn_like(got)
    assert torch.equal(got, want)  # fp32: the reference's operations exactly
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    y = torch.randn(B, T, (H + 1) * D, requires_grad=True)
    wq, wk = (0.1 * torch.randn(D)).requires_grad_(), (0.1 * torch.randn(D)).requires_grad_()
    got = nr.index_norm_rope(y, wq, wk, cos, sin, eps=1e-6, width=w, backend="triton")
    want = naive.index_norm_rope(y, wq, wk, cos, sin, eps=1e-6, width=w)
    assert got[0].shape == (B, T, H, D) and got[1].shape == (B, T, D)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-5
    gq, gk = torch.randn_like(got[0]), torch.randn_like(got[1])
    for a, b in zip(torch.autograd.grad(got, (y, wq, wk), (gq, gk)), torch.autograd.grad(want, (y, wq, wk), (gq, gk))):
        assert (a - b).norm().item() <= 1e-5 * max(1.0, b.norm().item())
    with torch.no_grad():  # slices of a wider projection (a fused matmul's parts) are read in place, same results
        wide = torch.randn(B, T, (H + 3) * D)
        xs, ys = wide[..., D:(H + 1) * D].view(B, T, H, D), wide[..., 2 * D:]
        assert torch.equal(nr.rope(xs, cos, sin, width=w, backend="triton"), naive.rope(xs, cos, sin, width=w))
        got = nr.index_norm_rope(ys, wq, wk, cos, sin, eps=1e-6, width=w, backend="triton")
        for a, b in zip(got, nr.index_norm_rope(ys.contiguous(), wq, wk, cos, sin, eps=1e-6, width=w,
                                                backend="triton")):
            assert torch.equal(a, b)


@pytest.mark.parametrize("style", ["rms", "gemma"])
def test_rms_norm_matches_the_models_norm_and_defers_to_it_under_autograd(style):
    from m3compile.models.decoder import RMSNorm

    norm = RMSNorm(40, 1e-5, style)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(40))
    x = torch.randn(3, 5, 40)
    with torch.no_grad():
        got = nr.rms_norm(x, norm.weight, eps=1e-5, style=style, backend="triton")
        assert (got - norm(x)).abs().max().item() < 1e-6
        half = nr.rms_norm(x.bfloat16(), norm.weight.bfloat16(), eps=1e-5, style=style, backend="triton")
        assert half.dtype == torch.bfloat16 and (half.float() - norm(x)).abs().max().item() < 5e-2
    x.requires_grad_(True)
    out = nr.rms_norm(x, norm.weight, eps=1e-5, style=style, backend="triton")  # a gradient is needed: reference
    assert out.grad_fn is not None and torch.equal(out, norm(x))


@pytest.mark.parametrize("style", ["rms", "gemma"])
@pytest.mark.parametrize("shape", [(1, 1, 40), (3, 1, 576), (2, 5, 24)], ids=["one-token", "hidden576", "D24"])
def test_add_rms_norm_is_the_add_and_the_norm(style, shape):
    """The residual add and the norm after it in one kernel: the sum and the normed sum, bf16 and fp32, as the two ops
    apart (the model's RMSNorm with a residual, lowered and not)."""
    from m3compile.models.decoder import RMSNorm
    from m3compile.ops import lowering

    norm = RMSNorm(shape[-1], 1e-5, style)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(shape[-1]))
        for dtype in (torch.float32, torch.bfloat16):
            x, d = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            w = norm.weight.to(dtype)
            s, y = nr.add_rms_norm(x, d, w, eps=1e-5, style=style, backend="triton")
            ws, wy = naive.add_rms_norm(x, d, w, 1e-5, style)
            assert s.dtype == dtype and y.dtype == wy.dtype
            if dtype == torch.float32:
                assert torch.equal(s, ws) and torch.equal(y, nr.rms_norm(ws, w, eps=1e-5, style=style,
                                                                         backend="triton"))
                assert (y - wy).abs().max().item() < 1e-6
            else:  # (the interpreter casts to bf16 toward zero, the GPU to nearest: within a unit in the last place)
                assert ((s.float() - ws.float()).abs() <= ws.float().abs() * 2**-7).all()
                assert (y.float() - wy.float()).abs().max().item() < 5e-2
        x, d = torch.randn(shape), torch.randn(shape)
        want = norm(x, residual=d)
        with lowering():
            got = norm(x, residual=d)
        assert torch.equal(got[0], want[0]) and (got[1] - want[1]).abs().max().item() < 1e-6
        # an fp32 residual stream beside a bf16 branch output (a frozen fp32 backbone under bf16 autocast, as the
        # distillation runs it): the lowering adds them as torch's sum promotes them
        d16 = d.bfloat16()
        want = norm(x, residual=d16)
        with lowering():
            got = norm(x, residual=d16)
        assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0])
        assert (got[1] - want[1]).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="one shape and dtype"):
        nr.add_rms_norm(x, d[..., :-1], norm.weight, eps=1e-5)


def test_bf16_and_bad_input():
    B, T, H, D = 1, 6, 2, 32
    cos, sin = tables(B, T, D)
    x = torch.randn(B, T, H, D).bfloat16()
    got = nr.rope(x, cos, sin, backend="triton")
    assert got.dtype == torch.bfloat16 and (got.float() - naive.rope(x, cos, sin).float()).abs().max().item() < 5e-2
    with pytest.raises(ValueError, match="width"):
        nr.rope(x, cos, sin, width=7, backend="triton")
    with pytest.raises(ValueError, match="cos/sin"):
        nr.rope(x, cos[:, :-1], sin[:, :-1], backend="triton")
    with pytest.raises(ValueError, match=r"\(Hi \+ 1\) \* Di"):
        nr.index_norm_rope(torch.randn(1, 6, 40), torch.ones(32), torch.ones(32), cos, sin, eps=1e-6)
