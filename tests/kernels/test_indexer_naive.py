"""The selection's reference (kernels/indexer/naive.py) against brute-force statements of docs/msa.md section 2, on
odd shapes."""
import math

import pytest
import torch

from m3compile.kernels import naive_common
from m3compile.kernels.indexer import naive


def brute_select(q_idx, k_idx, block_size, topk, init_blocks, local_blocks, top_p=None, min_blocks=0):
    """Per (b, h, t): the set of selected blocks, straight from the spec, one query at a time. top_p: the adaptive
    budget of docs/msa.md 2.8 (the forced blocks, then the candidates best first until their softmax probability over
    every candidate sums to at least top_p, then more while fewer than min_blocks blocks are kept, never more than
    topk); None: the fixed top-k."""
    B, H, T, D = q_idx.shape
    out = {}
    for b in range(B):
        for h in range(H):
            for t in range(T):
                qb = t // block_size
                scores = {}
                for blk in range(qb + 1):
                    keys = range(blk * block_size, min((blk + 1) * block_size, t + 1))
                    scores[blk] = max(float(q_idx[b, h, t] @ k_idx[b, j]) / math.sqrt(D) for j in keys)
                forced = {blk for blk in range(qb + 1) if blk > qb - local_blocks or blk < init_blocks}
                rest = sorted((blk for blk in scores if blk not in forced), key=lambda x: -scores[x])
                if top_p is None:
                    out[b, h, t] = forced | set(rest[: topk - len(forced)])
                    continue
                z = sum(math.exp(scores[c]) for c in rest)
                kept, mass = set(forced), 0.0
                for c in rest:
                    if len(kept) >= topk or (mass >= top_p and len(kept) >= min_blocks):
                        break
                    kept.add(c)
                    mass += math.exp(scores[c]) / z
                out[b, h, t] = kept
    return out


SELECT_CASES = [
    # B, H, T, D, block, topk, init, local
    (1, 1, 1, 4, 4, 1, 0, 1),  # one token
    (2, 3, 17, 8, 4, 3, 0, 1),  # T not a multiple of the block, 3 index heads
    (1, 2, 33, 5, 8, 2, 1, 1),  # init block forced
    (1, 1, 40, 6, 4, 4, 0, 2),  # two local blocks
    (1, 4, 9, 4, 16, 4, 0, 1),  # T smaller than one block
    (1, 2, 64, 8, 4, 32, 0, 1),  # topk larger than the block count: -1 slots
]


@pytest.mark.parametrize("B,H,T,D,bs,topk,init,local", SELECT_CASES, ids=[str(c) for c in SELECT_CASES])
def test_select_blocks_matches_spec(B, H, T, D, bs, topk, init, local):
    q_idx, k_idx = torch.randn(B, H, T, D), torch.randn(B, T, D)
    blocks = naive.select_blocks(q_idx, k_idx, block_size=bs, topk=topk, init_blocks=init, local_blocks=local)
    assert blocks.shape == (B, H, T, topk)
    expected = brute_select(q_idx, k_idx, bs, topk, init, local)
    for (b, h, t), want in expected.items():
        row = blocks[b, h, t].tolist()
        got = [x for x in row if x >= 0]
        assert len(got) == len(set(got)), f"duplicate block in {row}"
        assert set(got) == want, (b, h, t, row, want)
        assert row.count(-1) == topk - len(want)


def test_select_blocks_is_per_group_and_chunk_invariant():
    q_idx, k_idx = torch.randn(1, 3, 70, 8), torch.randn(1, 70, 8)
    a = naive.select_blocks(q_idx, k_idx, block_size=8, topk=3)
    b = naive.select_blocks(q_idx, k_idx, block_size=8, topk=3, chunk=7)
    assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    # each index head selects on its own: changing head 1's query changes only head 1's selection
    q2 = q_idx.clone()
    q2[:, 1] = torch.randn_like(q2[:, 1])
    c = naive.select_blocks(q2, k_idx, block_size=8, topk=3)
    assert torch.equal(a[:, [0, 2]], c[:, [0, 2]]) and not torch.equal(a[:, 1], c[:, 1])


def test_memory_is_bounded_at_16k(monkeypatch):
    """No [T, T] tensor at T = 16384: every scoring chunk covers far fewer than T queries."""
    T, seen = 16384, []
    original = naive.block_scores

    def spy(q_idx, k_idx, block_size, start=0, end=None):
        seen.append((end - start) * end)
        return original(q_idx, k_idx, block_size, start, end)

    monkeypatch.setattr(naive, "block_scores", spy)
    q_idx, k_idx = torch.randn(1, 1, T, 4), torch.randn(1, T, 4)
    blocks = naive.select_blocks(q_idx, k_idx, block_size=128, topk=4)
    assert max(seen) <= naive_common._CHUNK_ELEMENTS and max(seen) < T * T
    assert int(blocks[0, 0, -1].max()) == T // 128 - 1  # the last query keeps its own block


def test_fp8_selection_keeps_clear_winners():
    """fp8 scoring changes only near-ties: with block scores planted far apart (one strong key per block, its
    strength a permutation of the block ids along two directions; 3 index heads reading +u1, +u2 and -u1), the fp8
    reference selects exactly what fp32 scoring selects, ragged tail and -1 slots included."""
    B, T, D, bs, k = 2, 45, 16, 8, 4
    g = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(D, 2, generator=g))[0].T * 4  # two orthogonal directions, |u| = 4
    nb = -(-T // bs)
    k_idx = torch.randn(B, T, D, generator=g) * 0.05
    for b in range(B):
        a, c = torch.randperm(nb, generator=g).float() + 1, torch.randperm(nb, generator=g).float() + 1
        k_idx[b, ::bs] += a[:, None] * u[0] + c[:, None] * u[1]
    heads = torch.stack([u[0], u[1], -u[0]])  # [3, D]
    q_idx = heads[None, :, None] * torch.rand(B, 3, T, 1, generator=g).add(0.5) \
        + torch.randn(B, 3, T, D, generator=g) * 0.05
    want = naive.select_blocks(q_idx, k_idx, block_size=bs, topk=k)
    got = naive.select_blocks(q_idx, k_idx, block_size=bs, topk=k, fp8=True)
    assert (want == -1).any() and not torch.equal(want[:, 0], want[:, 1])
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


ADAPTIVE_CASES = [
    # B, H, T, D, block, topk (ceiling), init, local, top_p, min_blocks
    (1, 1, 1, 4, 4, 3, 0, 1, 0.5, 2),  # one token: only its own block, whatever the floor
    (2, 3, 37, 8, 4, 6, 0, 1, 0.6, 0),  # T not a multiple of the block, 3 index heads
    (1, 2, 41, 5, 4, 5, 1, 1, 0.9, 3),  # init block forced, a floor of 3
    (1, 1, 50, 6, 4, 4, 0, 2, 0.3, 0),  # two local blocks, a low p
    (1, 2, 64, 8, 4, 32, 0, 1, 0.8, 4),  # the ceiling above the block count: -1 slots
]


@pytest.mark.parametrize("B,H,T,D,bs,topk,init,local,p,floor", ADAPTIVE_CASES, ids=[str(c) for c in ADAPTIVE_CASES])
def test_adaptive_budget_matches_spec(B, H, T, D, bs, topk, init, local, p, floor):
    q_idx, k_idx = torch.randn(B, H, T, D) * 2, torch.randn(B, T, D)
    blocks = naive.select_blocks(q_idx, k_idx, block_size=bs, topk=topk, init_blocks=init, local_blocks=local,
                                 top_p=p, min_blocks=floor)
    fixed = naive.select_blocks(q_idx, k_idx, block_size=bs, topk=topk, init_blocks=init, local_blocks=local)
    assert blocks.shape == (B, H, T, topk)
    expected = brute_select(q_idx, k_idx, bs, topk, init, local, p, floor)
    for (b, h, t), want in expected.items():
        row = blocks[b, h, t].tolist()
        got = [x for x in row if x >= 0]
        assert len(got) == len(set(got)) and set(got) == want, (b, h, t, row, want)
        assert set(got) <= set(fixed[b, h, t].tolist())  # a subset of the fixed top-k, in its slots
    if T > 8 * bs:  # enough candidates for the budget to bite somewhere
        assert (blocks >= 0).sum() < (fixed >= 0).sum()


def test_top_p_of_one_is_the_fixed_top_k():
    q_idx, k_idx = torch.randn(2, 2, 70, 8), torch.randn(2, 70, 8)
    fixed = naive.select_blocks(q_idx, k_idx, block_size=8, topk=5, init_blocks=1)
    assert torch.equal(naive.select_blocks(q_idx, k_idx, block_size=8, topk=5, init_blocks=1, top_p=1.0,
                                           min_blocks=3), fixed)


def test_adaptive_keep_keeps_forced_slots_and_the_order():
    blocks = torch.tensor([[4, 0, 2, 3, -1]])
    logits = torch.tensor([[float("inf"), 1.0, 3.0, 2.0, float("-inf")]])
    lse = torch.logsumexp(torch.tensor([1.0, 3.0, 2.0]), 0)[None]
    assert naive.adaptive_keep(blocks, logits, lse, 0.5, 0).tolist() == [[4, -1, 2, -1, -1]]  # 0.67 >= 0.5
    assert naive.adaptive_keep(blocks, logits, lse, 0.7, 0).tolist() == [[4, -1, 2, 3, -1]]  # 0.67 + 0.24
    assert naive.adaptive_keep(blocks, logits, lse, 0.1, 4).tolist() == [[4, 0, 2, 3, -1]]  # the floor
