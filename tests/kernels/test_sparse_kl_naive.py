"""The index-branch KL (docs/msa.md section 4) against a direct T x T formula, its gradients, and its memory."""
import pytest
import torch

from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.sparse_kl import naive
from tests.memory import PeakMemory


def direct_kl(q_idx, k_idx, q, k, blocks, block_size, sparse, scale):
    """Materialise everything: teacher P, student Q over the support S, KL(P || Q) per (group, token)."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    G = Hq // H
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    support = causal.expand(B, H, T, T).clone()
    selected = torch.zeros(B, H, T, T, dtype=torch.bool)
    if blocks is not None:
        for b in range(B):
            for h in range(H):
                for t in range(T):
                    for blk in blocks[b, h, t].tolist():
                        if blk >= 0:
                            selected[b, h, t, blk * block_size:(blk + 1) * block_size] = True
        selected &= causal
        if sparse:
            support = selected
    a = torch.einsum("bhgtd,bhjd->bhgtj", q.unflatten(1, (H, G)).double(), k.double()) * scale
    p = torch.softmax(a.masked_fill(~support[:, :, None], float("-inf")), -1).mean(2)
    dense = torch.softmax(a.masked_fill(~causal, float("-inf")), -1).mean(2)
    z = torch.einsum("bhtd,bjd->bhtj", q_idx.double(), k_idx.double()) / q_idx.shape[-1] ** 0.5
    log_q = torch.log_softmax(z.masked_fill(~support, float("-inf")), -1)
    kl = (torch.xlogy(p, p) - p * log_q.masked_fill(~support, 0)).sum(-1)
    recall = (dense * selected).sum(-1) if blocks is not None else torch.ones_like(kl)
    return kl, recall


CASES = [  # (T, block, G, H, topk)
    pytest.param(1, 4, 1, 1, 2, id="T1"),
    pytest.param(13, 4, 1, 2, 2, id="T13-G1"),
    pytest.param(21, 4, 3, 2, 3, id="T21-G3"),
    pytest.param(16, 8, 4, 1, 1, id="T16-G4-top1"),
    pytest.param(30, 4, 5, 3, 4, id="T30-G5-H3"),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["warmup", "sparse"])
@pytest.mark.parametrize("T,block,G,H,topk", CASES)
def test_kl_matches_direct_formula_and_gradient(T, block, G, H, topk, sparse):
    torch.manual_seed(T * 7 + G)
    B, D, Di = 2, 8, 6
    q = torch.randn(B, H * G, T, D)
    k = torch.randn(B, H, T, D)
    q_idx = torch.randn(B, H, T, Di, dtype=torch.float64, requires_grad=True)
    k_idx = torch.randn(B, T, Di, dtype=torch.float64, requires_grad=True)
    blocks = select_blocks(q_idx.detach(), k_idx.detach(), block_size=block, topk=topk)
    assert (blocks == -1).any() or T > topk * block  # short prefixes leave -1 slots
    kl, recall = naive.index_kl(q_idx, k_idx, q, k, blocks, block_size=block, sparse=sparse, scale=0.3, chunk=5)
    want_kl, want_recall = direct_kl(q_idx, k_idx, q, k, blocks, block, sparse, 0.3)
    torch.testing.assert_close(kl.double(), want_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recall.double(), want_recall, rtol=1e-5, atol=1e-6)
    w = torch.rand_like(want_kl)
    g_want = torch.autograd.grad((want_kl * w).sum(), (q_idx, k_idx))
    g_got = torch.autograd.grad((kl.double() * w).sum(), (q_idx, k_idx))
    for got, want in zip(g_got, g_want):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kl_is_zero_when_student_equals_a_one_head_teacher():
    torch.manual_seed(0)
    T, D = 19, 8
    q = torch.randn(1, 1, T, D)
    k = torch.randn(1, 1, T, D)
    # student logits q_idx . k_idx / sqrt(D) equal teacher logits q . k / sqrt(D) when q_idx = q, k_idx = k
    kl, _ = naive.index_kl(q.clone(), k[:, 0].clone(), q, k, block_size=4)
    assert float(kl.abs().max()) < 1e-5


def test_backbone_gets_no_gradient():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 10, 8, requires_grad=True)
    k = torch.randn(1, 2, 10, 8, requires_grad=True)
    q_idx = torch.randn(1, 2, 10, 8, requires_grad=True)
    k_idx = torch.randn(1, 10, 8, requires_grad=True)
    kl, _ = naive.index_kl(q_idx, k_idx, q, k, block_size=4)
    kl.sum().backward()
    assert q.grad is None and k.grad is None
    assert q_idx.grad.abs().sum() > 0 and k_idx.grad.abs().sum() > 0


def test_bad_shapes_are_named():
    q = torch.randn(1, 4, 10, 8)
    k = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="one index head per KV head"):
        naive.index_kl(torch.randn(1, 3, 10, 8), torch.randn(1, 10, 8), q, k, block_size=4)


def _peak_bytes(T, chunk):
    torch.manual_seed(0)
    q = torch.randn(1, 4, T, 16)
    k = torch.randn(1, 2, T, 16)
    q_idx = torch.randn(1, 2, T, 16, requires_grad=True)
    k_idx = torch.randn(1, T, 16, requires_grad=True)
    blocks = select_blocks(q_idx.detach(), k_idx.detach(), block_size=32, topk=4)
    with PeakMemory() as mem:
        kl, _ = naive.index_kl(q_idx, k_idx, q, k, blocks, block_size=32, chunk=chunk)
        kl.mean().backward()
    return mem.peak


def test_memory_grows_linearly_with_length():
    """Forward + backward at T and 2T: streamed over 64-query chunks the peak doubles; unchunked it would quadruple."""
    small, large = _peak_bytes(1024, 64), _peak_bytes(2048, 64)
    assert large / small < 2.3, (small, large)
    quadratic = _peak_bytes(2048, 2048) / _peak_bytes(1024, 1024)
    assert quadratic > 3.5  # the tracker does see T x T scratch when it exists
    assert large < 4 * 1024 * 2048 * 4  # far below one [T, T] fp32 tensor per group at 2T
