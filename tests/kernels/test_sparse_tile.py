"""The query-tile union sparse attention (kernels/sparse_attention/tile.py) against the plain-torch reference, on odd
shapes: lengths not a multiple of the block, one token, group sizes 1, 3 and 4, -1 slots, tiles that straddle blocks."""
import pytest
import torch

from m3compile.kernels.sparse_attention import naive
from m3compile.kernels import sparse_attention as gather
from m3compile.kernels.sparse_attention.tile import sparse_attention_tiled, tile_tokens, tile_union


def selection(B, Hkv, T, K, block, g, holes=True):
    """Per (batch, group, token): its own block, then up to K - 1 distinct earlier blocks (random), -1 where the
    token sees fewer blocks than K, and (holes) some further -1 slots."""
    n = -(-T // block)
    out = torch.full((B, Hkv, T, K), -1, dtype=torch.int32)
    for t in range(T):
        own = t // block
        for b in range(B):
            for h in range(Hkv):
                earlier = torch.randperm(own, generator=g)[: K - 1] if own else torch.empty(0, dtype=torch.long)
                row = torch.cat((torch.tensor([own]), earlier))
                out[b, h, t, : len(row)] = row.to(torch.int32)
    if holes:
        out[..., 1::3][torch.rand(out[..., 1::3].shape, generator=g) < 0.3] = -1
    return out[..., torch.randperm(K, generator=g)]  # slot order carries no meaning


def test_tile_union_is_sorted_distinct_and_complete():
    g = torch.Generator().manual_seed(0)
    blocks = selection(2, 3, 45, 4, 8, g)
    union, count = tile_union(blocks, 6, 5)
    assert union.shape == (2, 3, 9, 20) and count.shape == (2, 3, 9)
    for b in range(2):
        for h in range(3):
            for i in range(9):
                want = sorted({int(x) for x in blocks[b, h, 5 * i:5 * i + 5].flatten() if x >= 0})
                got = union[b, h, i].tolist()
                assert got[: count[b, h, i]] == want and all(x == -1 for x in got[count[b, h, i]:])


@pytest.mark.parametrize("B,Hq,Hkv,T,D,K,block,tile", [
    (1, 4, 1, 1, 16, 2, 16, None),      # one token, G 4
    (2, 2, 2, 45, 24, 3, 8, None),      # G 1, T not a multiple of the block, D not a power of two
    (1, 6, 2, 77, 32, 4, 12, 5),        # G 3 (padded to 4 rows), tiles of 8 (5 rounded up) straddling blocks of 12
    (1, 8, 2, 70, 16, 3, 32, 16),       # G 4, 70 = 2 blocks + 6
])
def test_tiled_matches_reference_and_gather_q(B, Hq, Hkv, T, D, K, block, tile):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, Hq, D, generator=g).transpose(1, 2)  # the graph's token-major layout
    k = torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, D, generator=g)
    blocks = selection(B, Hkv, T, K, block, g)
    want = naive.sparse_attention(q, k, v, blocks, block_size=block)
    out, lse = sparse_attention_tiled(q, k, v, blocks, block_size=block, tile=tile, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    _, want_lse = gather.sparse_attention_lse(q, k, v, blocks, block_size=block)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tile_tokens_fill_64_rows():
    assert [tile_tokens(G) for G in (1, 3, 4, 7, 16, 128)] == [64, 16, 16, 8, 4, 1]


def test_tiled_refuses_bad_input():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="blocks must be"):
        sparse_attention_tiled(q, k, k, torch.zeros(1, 2, 7, 2, dtype=torch.int32), block_size=4)
    with pytest.raises(ValueError, match="tile must be"):
        sparse_attention_tiled(q, k, k, torch.zeros(1, 2, 8, 2, dtype=torch.int32), block_size=4, tile=0)


def test_lowered_model_runs_the_tile_kernel_when_asked(monkeypatch):
    """ops.using_sparse_kernel("tile") (or M3C_SPARSE_KERNEL=tile) swaps the lowered model's gather-Q prefill for
    the query-tile kernel where no gradient is needed: the same logits; a bad name is refused."""
    from m3compile import ops
    from m3compile.pipelines import lower
    from m3compile.bench.common import bench_models

    _, sparse, _, _ = bench_models("m3-tiny", device="cpu", dtype="float32", block=8, topk=2, n_layers=2)
    lowered = lower(sparse.model)
    ids = torch.randint(0, sparse.args.vocab_size, (1, 37))  # 5 blocks of 8, top-2: really sparse
    calls = []
    real = ops.sparse_tile.sparse_attention_tiled
    monkeypatch.setattr(ops.sparse_tile, "sparse_attention_tiled", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        want = lowered(ids)
        assert not calls
        with ops.using_sparse_kernel("tile"):
            got = lowered(ids)
    assert calls and ops.sparse_kernel() == "gather"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("M3C_SPARSE_KERNEL", "tiles")
    with pytest.raises(ValueError, match="M3C_SPARSE_KERNEL must be one of gather, tile"):
        ops.sparse_kernel()
