"""Fused sparse-support index KL (Triton, interpreter on CPU) against naive.index_kl(sparse=True)."""
import pytest
import torch

from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.sparse_kl import naive
from m3compile.kernels import sparse_kl

CASES = [  # B, Hkv, G, T, D, Di, block, topk
    (1, 1, 1, 1, 16, 16, 16, 4),  # one token
    (1, 2, 3, 19, 16, 24, 8, 4),  # G = 3, Di not a power of two, ragged tail
    (1, 1, 16, 20, 32, 16, 8, 3),  # G = 16
    (1, 1, 4, 17, 16, 16, 4, 16),  # more slots than blocks: -1 slots
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-G{}-T{}-D{}-Di{}-bs{}-k{}".format(*c))
def test_fused_kl_and_its_gradients_match_the_reference(case):
    B, Hkv, G, T, D, Di, bs, K = case
    q_idx = torch.randn(B, T, Hkv, Di, requires_grad=True)
    k_idx = torch.randn(B, T, Di, requires_grad=True)
    q, k = torch.randn(B, Hkv * G, T, D, requires_grad=True), torch.randn(B, Hkv, T, D, requires_grad=True)
    blocks = select_blocks(q_idx.detach().transpose(1, 2), k_idx.detach(), block_size=bs, topk=K)
    blocks = blocks[..., torch.randperm(K)]
    g = torch.rand(B, Hkv, T)
    kl = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=bs, backend="triton")
    kl.backward(g)
    got = (q_idx.grad.clone(), k_idx.grad.clone())
    assert q.grad is None and k.grad is None  # the teacher is detached
    q_idx.grad = k_idx.grad = None
    want, _ = naive.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=bs, sparse=True)
    want.backward(g)
    assert (kl - want).abs().max().item() < 1e-5
    for a, b in zip(got, (q_idx.grad, k_idx.grad)):
        assert not a.isnan().any()
        assert (a - b).norm().item() <= 1e-5 * max(1.0, b.norm().item())


def test_fused_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes disagree"):
        sparse_kl.sparse_index_kl(torch.randn(1, 8, 2, 16), torch.randn(1, 8, 16), torch.randn(1, 4, 8, 16),
                                  torch.randn(1, 3, 8, 16), torch.zeros(1, 2, 8, 2, dtype=torch.int32), block_size=4)


def test_fused_kl_takes_the_attention_lse_and_checks_its_shape():
    from m3compile.kernels.sparse_attention import PARTIAL_BYTES, _forward

    B, Hkv, G, T, D, Di, bs, K = 1, 2, 2, 21, 16, 16, 4, 3
    q_idx, k_idx = torch.randn(B, T, Hkv, Di), torch.randn(B, T, Di)
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    blocks = select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=K)
    lse = _forward(q, k, k, blocks.int(), bs, D**-0.5, PARTIAL_BYTES, None, "all", True)[1]
    given = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=bs, teacher_lse=lse, backend="triton")
    want, _ = naive.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=bs, sparse=True)
    assert (given - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="teacher_lse must be"):
        sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=bs, teacher_lse=lse[:, :-1],
                                  backend="triton")


@pytest.mark.parametrize("G,K", [(1, 16), (3, 2), (4, 3)])  # K 16 > 6 blocks: -1 slots
def test_lse_only_pass_equals_the_attention_forward_lse(G, K):
    """The KL's teacher pass (stage "lse": no P V, no output) gives the attention forward's per-head LSE."""
    from m3compile.kernels.sparse_attention import PARTIAL_BYTES, _forward

    B, Hkv, T, D, bs = 2, 2, 23, 16, 4
    q, k, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=K).int()
    want = _forward(q, k, v, blocks, bs, D**-0.5, PARTIAL_BYTES, None, "all", True)[1]
    got = _forward(q, k, k, blocks, bs, D**-0.5, PARTIAL_BYTES, None, "lse", True)[1]
    chunked = _forward(q, k, k, blocks, bs, D**-0.5, 1, 5, "lse", True)[1]  # several query chunks
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-5 and (chunked - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: "B{}-Hkv{}-G{}-T{}-D{}-Di{}-bs{}-k{}".format(*c))
def test_mean_block_mass_and_a_given_csr(case):
    """reduction="mean" (a scalar whose backward broadcasts in the kernel), the teacher's mass per slot (the
    reference's block_mass, 0 at -1 slots), and the KL over a CSR built at the attention's chunk."""
    from m3compile.kernels import sparse_attention as sa

    B, Hkv, G, T, D, Di, bs, K = case
    q_idx = torch.randn(B, T, Hkv, Di, requires_grad=True)
    k_idx = torch.randn(B, T, Di, requires_grad=True)
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    blocks = select_blocks(q_idx.detach().transpose(1, 2), k_idx.detach(), block_size=bs, topk=K).int()
    csr = sa.block_csr(blocks, -(-T // bs), sa.attention_chunk(G))
    kl, mass = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=bs, backend="triton", csr=csr,
                                         reduction="mean", block_mass=True)
    kl.backward()
    got = (q_idx.grad.clone(), k_idx.grad.clone())
    q_idx.grad = k_idx.grad = None
    want, _ = naive.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=bs, sparse=True)
    want.mean().backward()
    assert kl.dim() == 0 and abs(kl.item() - want.mean().item()) < 1e-6
    for a, b in zip(got, (q_idx.grad, k_idx.grad)):
        assert (a - b).norm().item() <= 1e-5 * max(1.0, b.norm().item())
    want_mass = naive.block_mass(q, k, blocks, block_size=bs)
    assert (mass - want_mass).abs().max().item() < 1e-5
    assert torch.equal(mass[blocks < 0], torch.zeros_like(mass[blocks < 0]))
    assert (mass.sum(-1) - 1).abs().max().item() < 1e-5  # the support holds all of the sparse teacher's mass
    torch_kl, torch_mass = sparse_kl.sparse_index_kl(q_idx, k_idx, q, k, blocks, block_size=bs, backend="torch",
                                                     reduction="mean", block_mass=True)
    assert abs(torch_kl.item() - want.mean().item()) < 1e-6 and torch.equal(torch_mass, want_mass)
