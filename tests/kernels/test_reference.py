"""The reference kernels against brute-force statements of MSA_SPEC sections 2-3, on odd shapes."""
import math

import pytest
import torch
import torch.nn.functional as F

from m3compile.kernels import reference as ref


def brute_select(q_idx, k_idx, block_size, topk, init_blocks, local_blocks):
    """Per (b, h, t): the set of selected blocks, straight from the spec, one query at a time."""
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
                out[b, h, t] = forced | set(rest[: topk - len(forced)])
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
    blocks = ref.select_blocks(q_idx, k_idx, block_size=bs, topk=topk, init_blocks=init, local_blocks=local)
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
    a = ref.select_blocks(q_idx, k_idx, block_size=8, topk=3)
    b = ref.select_blocks(q_idx, k_idx, block_size=8, topk=3, chunk=7)
    assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    # each index head selects on its own: changing head 1's query changes only head 1's selection
    q2 = q_idx.clone()
    q2[:, 1] = torch.randn_like(q2[:, 1])
    c = ref.select_blocks(q2, k_idx, block_size=8, topk=3)
    assert torch.equal(a[:, [0, 2]], c[:, [0, 2]]) and not torch.equal(a[:, 1], c[:, 1])


def brute_sparse_attention(q, k, v, blocks, block_size, scale):
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // G
            for t in range(T):
                keys = [j for blk in blocks[b, g, t].tolist() if blk >= 0
                        for j in range(blk * block_size, min((blk + 1) * block_size, T)) if j <= t]
                s = torch.stack([q[b, h, t].double() @ k[b, g, j].double() for j in keys]) * scale
                out[b, h, t] = torch.softmax(s, 0) @ v[b, g, keys].double()
    return out


ATTN_CASES = [
    # B, Hkv, G, T, D, block, topk
    (1, 1, 1, 1, 8, 4, 1),  # one token, G = 1
    (2, 2, 3, 19, 8, 4, 2),  # G = 3, T not a multiple of the block
    (1, 3, 4, 30, 16, 8, 2),
    (1, 1, 5, 12, 4, 16, 4),  # T smaller than one block, -1 slots
]


@pytest.mark.parametrize("B,Hkv,G,T,D,bs,topk", ATTN_CASES, ids=[str(c) for c in ATTN_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("reach", [ref.MASKED_REACH, 0], ids=["masked", "gathered"])
def test_sparse_attention_matches_brute_force(B, Hkv, G, T, D, bs, topk, dtype, reach, monkeypatch):
    monkeypatch.setattr(ref, "MASKED_REACH", reach)  # 0: every case through the per-query gather of whole blocks
    q = torch.randn(B, Hkv * G, T, D).to(dtype)
    k, v = torch.randn(B, Hkv, T, D).to(dtype), torch.randn(B, Hkv, T, D).to(dtype)
    blocks = ref.select_blocks(torch.randn(B, Hkv, T, 4), torch.randn(B, T, 4), block_size=bs, topk=topk)
    # shuffle the slot order: no consumer may assume one
    blocks = blocks.gather(-1, torch.rand(blocks.shape).argsort(-1))
    got = ref.sparse_attention(q, k, v, blocks, block_size=bs, scale=D**-0.5)
    want = brute_sparse_attention(q, k, v, blocks, bs, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_sparse_attention_ignores_minus_one_and_chunks():
    B, Hkv, G, T, D, bs = 1, 2, 2, 23, 8, 4
    q, k, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = ref.select_blocks(torch.randn(B, Hkv, T, 4), torch.randn(B, T, 4), block_size=bs, topk=3)
    padded = torch.cat([blocks, torch.full_like(blocks[..., :2], -1)], -1)
    a = ref.sparse_attention(q, k, v, blocks, block_size=bs)
    b = ref.sparse_attention(q, k, v, padded, block_size=bs, chunk=5)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,Hkv,G,T,bs,topk", [(1, 2, 3, 50, 8, 4), (2, 1, 4, 37, 16, 2), (1, 1, 1, 1, 16, 3),
                                                  (1, 3, 2, 130, 16, 3)])
def test_masked_and_gathered_sparse_attention_agree(B, Hkv, G, T, bs, topk, monkeypatch):
    """The masked causal pass (selections that reach much of the sequence) and the per-query gather of whole blocks
    are one function: -1 slots add nothing and a block in two slots weighs twice, in both (fp64)."""
    q = torch.randn(B, Hkv * G, T, 16, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, T, 16, dtype=torch.float64), torch.randn(B, Hkv, T, 16, dtype=torch.float64)
    blocks = ref.select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=topk)
    blocks[..., 1:][torch.rand(blocks[..., 1:].shape) < 0.3] = -1
    blocks[..., -1] = blocks[..., 0]  # a duplicate in every row
    masked = ref.sparse_attention(q, k, v, blocks, block_size=bs, chunk=7)
    monkeypatch.setattr(ref, "MASKED_REACH", 0)
    gathered = ref.sparse_attention(q, k, v, blocks, block_size=bs)
    torch.testing.assert_close(masked, gathered, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 7, 64, 131])
def test_all_blocks_selected_equals_dense(T):
    B, Hkv, G, D, bs = 1, 2, 3, 16, 16
    q, k, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    topk = -(-T // bs)
    blocks = ref.select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=topk)
    sparse = ref.sparse_attention(q, k, v, blocks, block_size=bs)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.dense_attention(q, k, v, chunk=5), dense, rtol=1e-5, atol=1e-5)
    recall = ref.block_recall(q, k, blocks, block_size=bs)
    torch.testing.assert_close(recall, torch.ones_like(recall))


def test_block_recall_partial():
    B, Hkv, G, T, D, bs = 1, 1, 2, 32, 8, 8
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    only_local = (torch.arange(T) // bs).view(1, 1, T, 1)
    recall = ref.block_recall(q, k, only_local, block_size=bs)
    p = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf), -1)
    p = p.mean(1)[0]  # group mean [T, T]
    want = torch.stack([p[t, (t // bs) * bs: t + 1].sum() for t in range(T)])
    torch.testing.assert_close(recall[0, 0], want, rtol=1e-5, atol=1e-6)
    none = torch.full((B, Hkv, T, 2), -1)
    assert float(ref.block_recall(q, k, none, block_size=bs).abs().max()) == 0.0


def test_memory_is_bounded_at_16k(monkeypatch):
    """No [T, T] tensor at T = 16384: every scoring chunk covers far fewer than T queries."""
    T, seen = 16384, []
    original = ref.block_scores

    def spy(q_idx, k_idx, block_size, start=0, end=None):
        seen.append((end - start) * end)
        return original(q_idx, k_idx, block_size, start, end)

    monkeypatch.setattr(ref, "block_scores", spy)
    q_idx, k_idx = torch.randn(1, 1, T, 4), torch.randn(1, T, 4)
    blocks = ref.select_blocks(q_idx, k_idx, block_size=128, topk=4)
    assert max(seen) <= ref._CHUNK_ELEMENTS and max(seen) < T * T
    assert int(blocks[0, 0, -1].max()) == T // 128 - 1  # the last query keeps its own block


@pytest.mark.parametrize("T,bs,topk,local", [(1, 4, 2, 1), (23, 4, 3, 1), (40, 8, 2, 2)])
def test_oracle_recall_is_the_teachers_best_choice(T, bs, topk, local):
    """Brute force over every allowed choice of blocks: the oracle is the best, and it bounds the index's recall."""
    import itertools

    torch.manual_seed(T)
    q, k = torch.randn(1, 6, T, 8), torch.randn(1, 2, T, 8)
    oracle = ref.oracle_recall(q, k, block_size=bs, topk=topk, local_blocks=local)
    selected = ref.select_blocks(torch.randn(1, 2, T, 8), torch.randn(1, T, 8), block_size=bs, topk=topk,
                                 local_blocks=local)
    assert bool((ref.block_recall(q, k, selected, block_size=bs) <= oracle + 1e-6).all())
    for t in range(T):
        qb = t // bs
        forced = [b for b in range(qb + 1) if b > qb - local]
        free = [b for b in range(qb + 1) if b not in forced]
        best = 0.0
        for extra in itertools.combinations(free, max(0, min(topk - len(forced), len(free)))):
            blocks = torch.full((1, 2, T, topk), -1)
            chosen = torch.tensor((forced + list(extra))[:topk])
            blocks[:, :, t, :len(chosen)] = chosen
            best = torch.maximum(torch.as_tensor(best), ref.block_recall(q, k, blocks, block_size=bs)[0, :, t])
        torch.testing.assert_close(oracle[0, :, t], best.expand(2).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,bs,topk,init,local", [(1, 4, 2, 0, 1), (23, 4, 3, 1, 1), (40, 8, 3, 0, 2)])
def test_oracle_blocks_reach_the_oracle_recall_and_keep_the_forced_blocks(T, bs, topk, init, local):
    """oracle_blocks is the selection oracle_recall scores: same recall, forced blocks in, -1 for short prefixes,
    and the same at any query chunk (no [T, T] tensor is needed)."""
    torch.manual_seed(T)
    q, k = torch.randn(2, 6, T, 8), torch.randn(2, 2, T, 8)
    kw = dict(block_size=bs, topk=topk, init_blocks=init, local_blocks=local)
    blocks = ref.oracle_blocks(q, k, **kw)
    assert blocks.shape == (2, 2, T, topk) and blocks.dtype == torch.long
    torch.testing.assert_close(ref.block_recall(q, k, blocks, block_size=bs), ref.oracle_recall(q, k, **kw))
    assert torch.equal(ref.oracle_blocks(q, k, chunk=5, **kw).sort(-1).values, blocks.sort(-1).values)  # order: none
    for t in range(T):
        qb, row = t // bs, blocks[0, 0, t].tolist()
        forced = {b for b in range(qb + 1) if b > qb - local or b < init}
        assert forced <= set(row) and all(-1 <= b <= qb for b in row)
        assert row.count(-1) == max(0, topk - (qb + 1))


def test_fp8_quantisation_keeps_three_bits_per_row():
    """quantize_index_keys: each row's largest magnitude lands on 448, every value within half an e4m3 ulp (2^-4
    relative for normals, 2^-10 of the scale in the subnormal range), zero rows stay zero."""
    x = torch.randn(3, 7, 24) * torch.logspace(-5, 4, 7)[None, :, None]
    x[1, 2] = 0.0
    x8, scale = ref.quantize_index_keys(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (3, 7) and scale.dtype == torch.float32
    y = x8.float()
    assert torch.equal(y.abs().amax(-1)[scale > 1e-12 / 448], torch.full_like(scale, 448.0)[scale > 1e-12 / 448])
    assert not y[1, 2].any() and torch.isfinite(ref.dequantize_index_keys(x8, scale)).all()
    v = x / scale[..., None]
    bound = torch.where(v.abs() >= 2**-6, v.abs() * 2**-4, torch.full_like(v, 2**-10))
    assert ((y - v).abs() <= bound * (1 + 1e-6)).all()


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
    want = ref.select_blocks(q_idx, k_idx, block_size=bs, topk=k)
    got = ref.select_blocks(q_idx, k_idx, block_size=bs, topk=k, fp8=True)
    assert (want == -1).any() and not torch.equal(want[:, 0], want[:, 1])
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
