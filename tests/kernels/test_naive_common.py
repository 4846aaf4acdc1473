"""What the references share (kernels/naive_common.py): the fp8 e4m3 quantisation of index keys."""
import torch

from m3compile.kernels import naive_common


def test_fp8_quantisation_keeps_three_bits_per_row():
    """quantize_index_keys: each row's largest magnitude lands on 448, every value within half an e4m3 ulp (2^-4
    relative for normals, 2^-10 of the scale in the subnormal range), zero rows stay zero."""
    x = torch.randn(3, 7, 24) * torch.logspace(-5, 4, 7)[None, :, None]
    x[1, 2] = 0.0
    x8, scale = naive_common.quantize_index_keys(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (3, 7) and scale.dtype == torch.float32
    y = x8.float()
    assert torch.equal(y.abs().amax(-1)[scale > 1e-12 / 448], torch.full_like(scale, 448.0)[scale > 1e-12 / 448])
    assert not y[1, 2].any() and torch.isfinite(naive_common.dequantize_index_keys(x8, scale)).all()
    v = x / scale[..., None]
    bound = torch.where(v.abs() >= 2**-6, v.abs() * 2**-4, torch.full_like(v, 2**-10))
    assert ((y - v).abs() <= bound * (1 + 1e-6)).all()
