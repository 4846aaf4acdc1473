"""An index head wider than a fully rotated dense head (more index capacity): index rope "tile".

Every one of its Di/2 channel pairs turns at one of the model's R/2 frequencies (each at least once, the lowest
ones again: kernels/norm_rope/index_rope.py's tile_pairs), so a dense pair with r index pairs is fitted with r shared-key ranks
(models/index_init.py): with r >= the KV head count the index logits are the group-mean dense logits exactly. The
converter writes sparse_attention_config.sparse_index_rope "tile", and every path (traced graph, reload, lowered
kernels, remote code, decode) runs the same rule.
"""
import pytest
import torch

from m3compile.kernels.norm_rope.index_rope import index_rope_rule, index_rope_tables, tile_pairs
from m3compile.ops import apply_rope
from m3compile.models.index_init import UNFITTED_KEY_NORM, init_index_weights
from tests.models.test_index_rope_low import apply_index_rope, every_path, scores, tables


@pytest.mark.parametrize("Di", [24, 32, 48])
def test_tile_rule_is_a_rotation_over_every_frequency(Di):
    """Scores under "tile" depend on t - s only; every main-table frequency turns at least once, the extra pairs at
    the lowest frequencies; at Di = R the table is the main one; an odd or narrower index dim is refused."""
    torch.manual_seed(0)
    R, T = 16, 24
    q, k = torch.randn(Di, dtype=torch.float64), torch.randn(Di, dtype=torch.float64)
    cos, sin = tables(T, R)
    torch.testing.assert_close(scores(q, k, cos, sin, "tile"), scores(q, k, *tables(T, R, offset=57), "tile"),
                               rtol=0, atol=1e-10)
    pairs = tile_pairs(R, Di)
    counts = torch.bincount(pairs, minlength=R // 2)
    assert counts.min() >= 1 and counts.sum() == Di // 2
    assert bool((counts[1:] >= counts[:-1]).all())  # more copies only toward the low frequencies (high pair ids)
    c, _ = index_rope_tables(cos, sin, Di, "tile")
    torch.testing.assert_close(c, torch.cat((cos[..., pairs], cos[..., pairs]), -1))
    torch.testing.assert_close(index_rope_tables(cos, sin, R, "tile")[0], cos)
    for bad in (R + 1, R - 2):
        with pytest.raises(ValueError, match="even index dim of at least"):
            index_rope_tables(cos, sin, bad, "tile")


def test_the_converter_rule():
    assert index_rope_rule(64, 64, 128) == "tile" and index_rope_rule(64, 64, 96) == "tile"
    assert index_rope_rule(64, 64, 64) == "m3" and index_rope_rule(64, 64, 32) == "low"
    assert index_rope_rule(64, 32, 128) == "m3"  # partial RoPE: the extra channels stay non-rotated


def _logit_errors(Di, kv_heads=2, moment=False):
    """Relative error of the index logits against the group-mean dense logits, per KV group, at every pair of
    positions (RoPE applied), for an init at index dim Di."""
    torch.manual_seed(2)
    hidden, D, G, T = 20, 16, 3, 19
    Hq = kv_heads * G
    wq, wk = torch.randn(Hq * D, hidden, dtype=torch.float64), torch.randn(kv_heads * D, hidden, dtype=torch.float64)
    x = torch.randn(T, hidden, dtype=torch.float64) * torch.linspace(0.2, 2.0, hidden, dtype=torch.float64)
    extra = dict(x_moment=x.T @ x / T) if moment else {}
    wqi, wki = init_index_weights(wq, wk, n_heads=Hq, n_kv_heads=kv_heads, head_dim=D, rope_dim=D, index_dim=Di,
                                  **extra)
    rope = index_rope_rule(D, D, Di)
    cos, sin = tables(T, D)
    qi = apply_index_rope((x @ wqi.T).view(1, T, kv_heads, Di), cos, sin, rope)[0]  # [T, Hkv, Di]
    ki = apply_index_rope((x @ wki.T).view(1, T, 1, Di), cos, sin, rope)[0, :, 0]
    qd = apply_rope((x @ wq.T).view(1, T, Hq, D), cos, sin)[0].view(T, kv_heads, G, D).mean(2)
    kd = apply_rope((x @ wk.T).view(1, T, kv_heads, D), cos, sin)[0]
    index = torch.einsum("tgd,sd->gts", qi, ki)
    dense = torch.einsum("tgd,sgd->gts", qd, kd)
    return ((index - dense).norm() / dense.norm()).item(), (wqi, wki)


@pytest.mark.parametrize("moment", [False, True], ids=["weight-only", "calibrated"])
def test_tiled_init_fits_every_group_exactly_at_rank_kv_heads(moment):
    """Two KV heads, index dim twice the head dim: two shared-key ranks per dense pair fit both groups' logits
    exactly, where one (index dim = head dim) cannot; 1.5x lies between."""
    exact, _ = _logit_errors(32, moment=moment)
    mid, _ = _logit_errors(24, moment=moment)
    rank1, _ = _logit_errors(16, moment=moment)
    assert exact < 1e-9 and rank1 > 0.05 and exact < mid < rank1


def test_tiled_init_leaves_ranks_past_the_kv_heads_unfitted():
    """One KV head at three times the head dim: rank 1 is already exact; the other two index pairs per dense pair
    have nothing to fit and start as the unfitted slots do (zero query rows, small seeded random key rows)."""
    err, (wqi, wki) = _logit_errors(48, kv_heads=1)
    assert err < 1e-9
    zero = wqi.abs().sum(-1) == 0
    assert int(zero.sum()) == 32 and bool((wki[zero].norm(dim=-1) > 0).all())
    ratio = wki[zero].norm(dim=-1).mean() / wki[~zero].norm(dim=-1).mean()
    torch.testing.assert_close(ratio.item(), UNFITTED_KEY_NORM, rtol=1e-6, atol=0)


def test_tiled_index_head_on_every_path(tmp_path):
    """A Llama with head dim 16 (6 query / 2 KV heads) converted with index dim 32 (block 8, top-2; 45 tokens):
    the config says "tile", and the in-memory graph, the streamed checkpoint reloaded, its lowered kernels and
    transformers with the remote code and the ONNX export all give the same logits, and decoding from the paged
    caches the same greedy tokens."""
    every_path(tmp_path, 32, "tile", onnx=True)
