"""The recall references (kernels/causal_lse/naive.py): block_recall against the dense group-mean softmax, and the
oracle selection against brute force over every allowed choice of blocks."""
import math

import pytest
import torch

from m3compile.kernels.causal_lse import naive
from m3compile.kernels.indexer.naive import select_blocks


def test_block_recall_partial():
    B, Hkv, G, T, D, bs = 1, 1, 2, 32, 8, 8
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    only_local = (torch.arange(T) // bs).view(1, 1, T, 1)
    recall = naive.block_recall(q, k, only_local, block_size=bs)
    p = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf), -1)
    p = p.mean(1)[0]  # group mean [T, T]
    want = torch.stack([p[t, (t // bs) * bs: t + 1].sum() for t in range(T)])
    torch.testing.assert_close(recall[0, 0], want, rtol=1e-5, atol=1e-6)
    none = torch.full((B, Hkv, T, 2), -1)
    assert float(naive.block_recall(q, k, none, block_size=bs).abs().max()) == 0.0


@pytest.mark.parametrize("T,bs,topk,local", [(1, 4, 2, 1), (23, 4, 3, 1), (40, 8, 2, 2)])
def test_oracle_recall_is_the_teachers_best_choice(T, bs, topk, local):
    """Brute force over every allowed choice of blocks: the oracle is the best, and it bounds the index's recall."""
    import itertools

    torch.manual_seed(T)
    q, k = torch.randn(1, 6, T, 8), torch.randn(1, 2, T, 8)
    oracle = naive.oracle_recall(q, k, block_size=bs, topk=topk, local_blocks=local)
    selected = select_blocks(torch.randn(1, 2, T, 8), torch.randn(1, T, 8), block_size=bs, topk=topk,
                             local_blocks=local)
    assert bool((naive.block_recall(q, k, selected, block_size=bs) <= oracle + 1e-6).all())
    for t in range(T):
        qb = t // bs
        forced = [b for b in range(qb + 1) if b > qb - local]
        free = [b for b in range(qb + 1) if b not in forced]
        best = 0.0
        for extra in itertools.combinations(free, max(0, min(topk - len(forced), len(free)))):
            blocks = torch.full((1, 2, T, topk), -1)
            chosen = torch.tensor((forced + list(extra))[:topk])
            blocks[:, :, t, :len(chosen)] = chosen
            best = torch.maximum(torch.as_tensor(best), naive.block_recall(q, k, blocks, block_size=bs)[0, :, t])
        torch.testing.assert_close(oracle[0, :, t], best.expand(2).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,bs,topk,init,local", [(1, 4, 2, 0, 1), (23, 4, 3, 1, 1), (40, 8, 3, 0, 2)])
def test_oracle_blocks_reach_the_oracle_recall_and_keep_the_forced_blocks(T, bs, topk, init, local):
    """oracle_blocks is the selection oracle_recall scores: same recall, forced blocks in, -1 for short prefixes,
    and the same at any query chunk (no [T, T] tensor is needed)."""
    torch.manual_seed(T)
    q, k = torch.randn(2, 6, T, 8), torch.randn(2, 2, T, 8)
    kw = dict(block_size=bs, topk=topk, init_blocks=init, local_blocks=local)
    blocks = naive.oracle_blocks(q, k, **kw)
    assert blocks.shape == (2, 2, T, topk) and blocks.dtype == torch.long
    torch.testing.assert_close(naive.block_recall(q, k, blocks, block_size=bs), naive.oracle_recall(q, k, **kw))
    assert torch.equal(naive.oracle_blocks(q, k, chunk=5, **kw).sort(-1).values, blocks.sort(-1).values)  # order: none
    for t in range(T):
        qb, row = t // bs, blocks[0, 0, t].tolist()
        forced = {b for b in range(qb + 1) if b > qb - local or b < init}
        assert forced <= set(row) and all(-1 <= b <= qb for b in row)
        assert row.count(-1) == max(0, topk - (qb + 1))
