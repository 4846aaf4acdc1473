"""The block-ranking loss (kernels/block_stats/naive.py: block_rank_kl) against a naive per-query loop, its gradient,
its empty cases and its memory."""
import math

import pytest
import torch

from m3compile.kernels.block_stats import naive as ref
from m3compile.ops import block_loss_rows, msa_block_loss
from tests.memory import PeakMemory


def naive(q_idx, k_idx, q, k, block_size, init_blocks, local_blocks, rows):
    """One (batch, group, query) at a time, float64, straight from the definition: teacher block mass over the
    non-forced visible blocks (renormalised) vs the softmax of the index branch's block maxima."""
    B, H, T, Di = q_idx.shape
    G, D = q.shape[1] // H, q.shape[-1]
    losses = []
    for b in range(B):
        for g in range(H):
            for t in rows:
                own = t // block_size
                cands = [c for c in range(own + 1) if c <= own - local_blocks and c >= init_blocks]
                if not cands:
                    continue
                heads = [torch.softmax(q[b, g * G + h, t].double() @ k[b, g, :t + 1].double().T / math.sqrt(D), -1)
                         for h in range(G)]
                p = torch.stack(heads).mean(0)
                mass = torch.stack([p[c * block_size:min((c + 1) * block_size, t + 1)].sum() for c in cands])
                mass = mass / mass.sum()
                s = q_idx[b, g, t].double() @ k_idx[b, :t + 1].double().T / math.sqrt(Di)
                top = torch.stack([s[c * block_size:min((c + 1) * block_size, t + 1)].max() for c in cands])
                losses.append((mass * (mass.log() - torch.log_softmax(top, -1))).sum())
    return torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float64)


def inputs(B, H, G, T, Di=16, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(B, H, T, Di, generator=g, dtype=dtype).requires_grad_()
    k_idx = torch.randn(B, T, Di, generator=g, dtype=dtype).requires_grad_()
    q = 2 * torch.randn(B, H * G, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    return q_idx, k_idx, q, k


CASES = {  # B, H (KV groups = index heads), G (query heads per group), T, block, topk, init, local
    "T-not-a-multiple-G3": (1, 2, 3, 37, 8, 2, 0, 1),
    "G1-batch2-init-block": (2, 1, 1, 50, 7, 3, 1, 1),
    "two-local-blocks": (1, 3, 2, 29, 4, 3, 0, 2),
    "partial-last-block": (1, 2, 3, 33, 8, 2, 0, 1),
}


@pytest.mark.parametrize("B,H,G,T,block,topk,init,local", CASES.values(), ids=CASES.keys())
def test_matches_the_per_query_loop_in_value_and_gradient(B, H, G, T, block, topk, init, local):
    q_idx, k_idx, q, k = inputs(B, H, G, T)
    rows = ref.choice_rows(T, block, topk)
    assert rows.numel() == T - topk * block
    got = ref.block_rank_kl(q_idx, k_idx, q, k, block_size=block, init_blocks=init, local_blocks=local, topk=topk,
                            chunk=5)  # chunks that do not divide the rows
    want = naive(q_idx, k_idx, q, k, block, init, local, rows.tolist())
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(got, (q_idx, k_idx))
    for a, b in zip(grads, torch.autograd.grad(want, (q_idx, k_idx))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # a subset of rows (what the graph op samples), fp32 inputs: the same loop on those rows, fp32 result
    sub = rows[::3]
    got32 = ref.block_rank_kl(*(t.detach().float() for t in (q_idx, k_idx, q, k)), block_size=block,
                              init_blocks=init, local_blocks=local, rows=sub)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), naive(q_idx, k_idx, q, k, block, init, local, sub.tolist()),
                               rtol=1e-4, atol=1e-6)


def test_gradcheck_float64():
    q_idx, k_idx, q, k = inputs(1, 2, 3, 19, Di=4, D=4, seed=1)
    loss = lambda a, b: ref.block_rank_kl(a, b, q, k, block_size=4, topk=2, chunk=4)  # noqa: E731
    assert torch.autograd.gradcheck(loss, (q_idx, k_idx))


@pytest.mark.parametrize("T", [1, 16, 17], ids=["one-token", "exactly-topk-blocks", "one-row-with-a-choice"])
def test_few_visible_blocks(T):
    """With no more visible blocks than topk slots there is nothing to rank: loss 0, no NaN; at T = topk * block + 1
    the one query with a choice counts."""
    q_idx, k_idx, q, k = inputs(1, 3, 1, T)
    loss = ref.block_rank_kl(q_idx, k_idx, q, k, block_size=4, topk=4)
    assert torch.isfinite(loss)
    if T <= 16:
        assert float(loss) == 0.0
    else:
        torch.testing.assert_close(loss, naive(q_idx, k_idx, q, k, 4, 0, 1, [16]))
        loss.backward()
        assert torch.isfinite(q_idx.grad).all() and q_idx.grad[:, :, 16].abs().sum() > 0
        assert q_idx.grad[:, :, :16].abs().sum() == 0  # rows without a choice get nothing


def test_graph_op_samples_evenly_spaced_rows_with_a_choice():
    rows = block_loss_rows(600, 8, 4, n=100)
    assert rows.numel() == 100 and int(rows[0]) == 32 and int(rows[-1]) == 599 and bool((rows.diff() > 0).all())
    assert block_loss_rows(40, 8, 4, n=100).tolist() == list(range(32, 40))
    q_idx, k_idx, q, k = inputs(1, 2, 3, 45, dtype=torch.float32)
    got = msa_block_loss(q, k, q_idx.transpose(1, 2), k_idx, block_size=8, scale=8**-0.5, topk=4, rows=5)
    want = naive(q_idx, k_idx, q, k, 8, 0, 1, block_loss_rows(45, 8, 4, n=5).tolist())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def _peak_bytes(T: int, chunk: int) -> int:
    q_idx, k_idx, q, k = inputs(1, 2, 3, T, Di=16, D=16, dtype=torch.float32)
    with PeakMemory() as mem:
        ref.block_rank_kl(q_idx, k_idx, q, k, block_size=32, topk=4, chunk=chunk).backward()
    return mem.peak


def test_memory_grows_linearly_with_length():
    small, large = _peak_bytes(768, 64), _peak_bytes(1536, 64)
    assert large / small < 2.4, (small, large)
    assert large < 3 * 1536 * 1536 * 4  # below one [T, T] fp32 tensor per group
