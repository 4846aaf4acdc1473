"""The sparse attention's reference (kernels/sparse_attention/naive.py) against brute-force statements of
docs/msa.md section 3, on odd shapes."""
import pytest
import torch
import torch.nn.functional as F

from m3compile.kernels.causal_lse.naive import block_recall
from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.sparse_attention import naive


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
@pytest.mark.parametrize("reach", [naive.MASKED_REACH, 0], ids=["masked", "gathered"])
def test_sparse_attention_matches_brute_force(B, Hkv, G, T, D, bs, topk, dtype, reach, monkeypatch):
    monkeypatch.setattr(naive, "MASKED_REACH", reach)  # 0: every case through the per-query gather of whole blocks
    q = torch.randn(B, Hkv * G, T, D).to(dtype)
    k, v = torch.randn(B, Hkv, T, D).to(dtype), torch.randn(B, Hkv, T, D).to(dtype)
    blocks = select_blocks(torch.randn(B, Hkv, T, 4), torch.randn(B, T, 4), block_size=bs, topk=topk)
    # shuffle the slot order: no consumer may assume one
    blocks = blocks.gather(-1, torch.rand(blocks.shape).argsort(-1))
    got = naive.sparse_attention(q, k, v, blocks, block_size=bs, scale=D**-0.5)
    want = brute_sparse_attention(q, k, v, blocks, bs, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_sparse_attention_ignores_minus_one_and_chunks():
    B, Hkv, G, T, D, bs = 1, 2, 2, 23, 8, 4
    q, k, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = select_blocks(torch.randn(B, Hkv, T, 4), torch.randn(B, T, 4), block_size=bs, topk=3)
    padded = torch.cat([blocks, torch.full_like(blocks[..., :2], -1)], -1)
    a = naive.sparse_attention(q, k, v, blocks, block_size=bs)
    b = naive.sparse_attention(q, k, v, padded, block_size=bs, chunk=5)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,Hkv,G,T,bs,topk", [(1, 2, 3, 50, 8, 4), (2, 1, 4, 37, 16, 2), (1, 1, 1, 1, 16, 3),
                                                  (1, 3, 2, 130, 16, 3)])
def test_masked_and_gathered_sparse_attention_agree(B, Hkv, G, T, bs, topk, monkeypatch):
    """The masked causal pass (selections that reach much of the sequence) and the per-query gather of whole blocks
    are one function: -1 slots add nothing and a block in two slots weighs twice, in both (fp64)."""
    q = torch.randn(B, Hkv * G, T, 16, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, T, 16, dtype=torch.float64), torch.randn(B, Hkv, T, 16, dtype=torch.float64)
    blocks = select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=topk)
    blocks[..., 1:][torch.rand(blocks[..., 1:].shape) < 0.3] = -1
    blocks[..., -1] = blocks[..., 0]  # a duplicate in every row
    masked = naive.sparse_attention(q, k, v, blocks, block_size=bs, chunk=7)
    monkeypatch.setattr(naive, "MASKED_REACH", 0)
    gathered = naive.sparse_attention(q, k, v, blocks, block_size=bs)
    torch.testing.assert_close(masked, gathered, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 7, 64, 131])
def test_all_blocks_selected_equals_dense(T):
    B, Hkv, G, D, bs = 1, 2, 3, 16, 16
    q, k, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    topk = -(-T // bs)
    blocks = select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=topk)
    sparse = naive.sparse_attention(q, k, v, blocks, block_size=bs)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive.dense_attention(q, k, v, chunk=5), dense, rtol=1e-5, atol=1e-5)
    recall = block_recall(q, k, blocks, block_size=bs)
    torch.testing.assert_close(recall, torch.ones_like(recall))
