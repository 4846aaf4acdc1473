"""The graph ops (m3compile.ops): the references behind the lowered KL's recall."""
import torch


def test_causal_lse_matches_a_dense_logsumexp():
    from m3compile.kernels.causal_lse import naive as ref

    q, k = torch.randn(2, 6, 13, 8), torch.randn(2, 3, 13, 8)
    s = torch.einsum("bhtd,bhkd->bhtk", q, k.repeat_interleave(2, 1)) * 0.3
    s = s.masked_fill(torch.ones(13, 13, dtype=torch.bool).triu(1), float("-inf"))
    want = (torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))).transpose(1, 2)
    assert (ref.causal_lse(q, k, 0.3, chunk=5) - want).abs().max().item() < 1e-5
    rows = torch.tensor([0, 4, 5, 12])
    assert (ref.causal_lse(q, k, 0.3, chunk=3, rows=rows) - want[:, rows]).abs().max().item() < 1e-5


def test_lowered_recall_on_evenly_spaced_queries_beyond_recall_rows(monkeypatch):
    """Past RECALL_ROWS tokens the lowered hook measures recall on RECALL_ROWS evenly spaced queries (first and
    last included): the reference's per-token recall averaged over exactly those queries; the KL is unchanged."""
    from m3compile import ops as msa
    from m3compile.kernels.indexer.naive import select_blocks
    from m3compile.kernels.sparse_kl.naive import index_kl

    torch.manual_seed(0)
    B, Hkv, G, T, D, bs, K = 1, 2, 3, 43, 16, 8, 2
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    q_idx, k_idx = torch.randn(B, T, Hkv, 8), torch.randn(B, T, 8)
    blocks = select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=K)
    monkeypatch.setattr(msa, "RECALL_ROWS", 10)
    rows = msa.recall_rows(T)
    assert rows.tolist()[0] == 0 and rows.tolist()[-1] == T - 1 and len(set(rows.tolist())) == 10
    kl, recall = msa.LOWERING[msa.msa_index_kl](q, k, q_idx, k_idx, blocks, bs, D**-0.5, True)
    want_kl, want_recall = index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=bs, sparse=True,
                                    scale=D**-0.5)
    assert abs(kl.item() - want_kl.mean().item()) < 1e-5
    assert abs(recall.item() - want_recall[..., rows].mean().item()) < 1e-5
    assert abs(recall.item() - want_recall.mean().item()) > 1e-4  # a subset, not the full mean


