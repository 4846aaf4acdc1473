"""Backward of the gather-Q sparse attention (Triton, interpreter on CPU) against autograd through the reference."""
import pytest
import torch

from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.sparse_attention import naive
from m3compile.kernels import sparse_attention as sa


def _inputs(B, Hkv, G, T, D, bs, K, dtype=torch.float32):
    q = torch.randn(B, T, Hkv * G, D, dtype=dtype).transpose(1, 2).requires_grad_()  # the graph's layout
    k = torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True)
    blocks = select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=K)
    return q, k, v, blocks[..., torch.randperm(K)]  # slot order carries no meaning


def test_reference_gradcheck_float64():
    q, k, v, blocks = _inputs(1, 2, 2, 11, 4, 4, 2, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: naive.sparse_attention(a, b, c, blocks, block_size=4), (q, k, v))


def _grads(fn, q, k, v, g):
    out = fn(q, k, v)
    out.backward(g)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


def _close(a, b, tol):
    scale = b.norm().clamp(min=1e-6)
    assert not a.isnan().any() and ((a - b).norm() / scale).item() < tol, ((a - b).norm() / scale).item()


CASES = [  # B, Hkv, G, T, D, block, topk
    (1, 1, 1, 1, 16, 16, 4),  # one token
    (2, 2, 3, 37, 16, 8, 4),  # G = 3, ragged tail
    (1, 1, 16, 50, 32, 16, 3),  # G = 16
    (1, 2, 4, 29, 24, 8, 16),  # D not a power of two, more slots than blocks (-1 slots)
    (1, 1, 64, 20, 16, 8, 2),  # G = 64: a group wider than the interpreter's 32-row tile (one token per tile)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-G{}-T{}-D{}-bs{}-k{}".format(*c))
def test_triton_backward_matches_reference(case):
    B, Hkv, G, T, D, bs, K = case
    q, k, v, blocks = _inputs(*case)
    g = torch.randn(B, Hkv * G, T, D)
    out, (dq, dk, dv) = _grads(lambda a, b, c: sa.sparse_attention(a, b, c, blocks, block_size=bs, backend="triton"),
                               q, k, v, g)
    want, (rq, rk, rv) = _grads(lambda a, b, c: naive.sparse_attention(a, b, c, blocks, block_size=bs), q, k, v, g)
    _close(out, want, 1e-5)
    for got, ref_grad in ((dq, rq), (dk, rk), (dv, rv)):
        if ref_grad.norm() == 0:  # T = 1: one key, softmax gradient through q and k is exactly zero
            assert got.abs().max() < 1e-6
        else:
            _close(got, ref_grad, 1e-5)


def test_backward_ignores_minus_one_slots():
    q, k, v, blocks = _inputs(1, 2, 2, 40, 16, 8, 4)
    holes = blocks.clone()
    holes[..., 1:][torch.rand(holes[..., 1:].shape) < 0.5] = -1
    holes = torch.where((holes >= 0).any(-1, keepdim=True), holes, blocks)  # every row keeps some block
    g = torch.randn(1, 4, 40, 16)
    _, got = _grads(lambda a, b, c: sa.sparse_attention(a, b, c, holes, block_size=8, backend="triton"), q, k, v, g)
    _, want = _grads(lambda a, b, c: naive.sparse_attention(a, b, c, holes, block_size=8), q, k, v, g)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("dq_parts", [True, False], ids=["dq-per-slot-shares", "dq-atomics"])
def test_both_dq_paths_in_query_chunks(dq_parts):
    """dQ as per-(token, slot) shares summed by a second kernel (the GPU default) and as fp32 atomics agree with
    the reference, also when a partial-buffer budget splits the queries into chunks (3 here) and slots are -1."""
    B, Hkv, G, T, D, bs, K = 1, 2, 3, 45, 16, 8, 4
    q, k, v, blocks = _inputs(B, Hkv, G, T, D, bs, K)
    blocks[..., -1][torch.rand(blocks[..., -1].shape) < 0.5] = -1
    g = torch.randn(B, Hkv * G, T, D)
    _, want = _grads(lambda a, b, c: naive.sparse_attention(a, b, c, blocks, block_size=bs), q, k, v, g)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = sa._forward(q, k, v, blocks, bs, D**-0.5, sa.PARTIAL_BYTES, None, "all", True)
    budget = 16 * K * Hkv * G * D * 4  # 16 tokens of per-slot dQ shares: chunks of 16, 16, 13
    got = sa._backward(q, k, v, blocks, bs, D**-0.5, out, lse, g, budget, dq_parts=dq_parts)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)
