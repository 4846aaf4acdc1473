"""Fused causal log-sum-exp and dense recall (Triton, interpreter on CPU) against naive.causal_lse."""
import pytest
import torch

from m3compile.kernels import causal_lse as cl
from m3compile.kernels.causal_lse import naive

CASES = [  # B, Hkv, G, T, D
    (1, 1, 1, 1, 16),  # one token
    (2, 2, 3, 37, 24),  # G = 3, D not a power of two, T not a multiple of the key tile
    (1, 1, 16, 20, 32),  # G = 16: one token per tile
    (1, 3, 5, 33, 16),  # G = 5
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-G{}-T{}-D{}".format(*c))
def test_causal_lse_and_recall_match_the_reference(case):
    B, Hkv, G, T, D = case
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    want = naive.causal_lse(q, k, 0.3)
    got = cl.causal_lse(q, k, scale=0.3, backend="triton")
    assert got.shape == (B, T, Hkv * G) and (got - want).abs().max().item() < 1e-5
    rows = torch.tensor(sorted({0, T // 3, T // 2, T - 1}), dtype=torch.long)
    assert (cl.causal_lse(q, k, scale=0.3, rows=rows, backend="triton") - want[:, rows]).abs().max().item() < 1e-5
    selected = want - torch.rand_like(want)  # a selection holds part of the mass: lse_selected <= lse_all
    got = cl.dense_recall(q, k, selected, scale=0.3, rows=rows, backend="triton")
    manual = torch.exp2(selected[:, rows] - want[:, rows]).unflatten(2, (Hkv, G)).mean(-1)
    assert got.shape == (B, rows.numel(), Hkv) and (got - manual).abs().max().item() < 1e-6
    assert (cl.dense_recall(q, k, selected, scale=0.3, rows=rows, backend="torch") - manual).abs().max().item() < 1e-6


def test_causal_lse_in_half_precision_and_bad_rows():
    q, k = torch.randn(1, 4, 29, 16).half(), torch.randn(1, 2, 29, 16).half()
    got = cl.causal_lse(q, k, backend="triton")
    assert (got - naive.causal_lse(q.float(), k.float())).abs().max().item() < 1e-2
    with pytest.raises(ValueError, match="rows must be"):
        cl.causal_lse(q, k, rows=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="selected_lse must be"):
        cl.dense_recall(q, k, torch.zeros(1, 29, 3))
