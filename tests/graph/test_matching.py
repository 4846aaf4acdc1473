"""The matcher: what it recovers from each attention form, and the node it names when a pattern breaks."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import m3compile
from m3compile import MSAConfig
from m3compile.graph.matching import find_attention
from m3compile.graph.tracing import propagate_shapes, trace
from m3compile.models import Decoder, PRESETS
from m3compile.models.decoder import Attention, MSALayerArgs
from m3compile.ops import apply_rope


@pytest.mark.parametrize("form,expected", [("sdpa_gqa", "sdpa"), ("sdpa_repeat", "sdpa_repeat"), ("eager", "eager")])
def test_recovers_projections_heads_norms_rope(form, expected):
    model = Decoder(PRESETS["m3-tiny"].replace(attn_impl=form))
    gm = trace(model)
    propagate_shapes(gm)
    matches, failures = find_attention(gm)
    assert not failures and len(matches) == 4
    m = matches[2]
    assert (m.form, m.layer, m.prefix) == (expected, 2, "model.layers.2.self_attn")
    assert (m.q_proj, m.k_proj, m.v_proj) == tuple(f"model.layers.2.self_attn.{p}_proj" for p in "qkv")
    assert (m.q_norm, m.k_norm) == ("model.layers.2.self_attn.q_norm", "model.layers.2.self_attn.k_norm")
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.rope_dim) == (8, 2, 16, 8)
    assert m.scale == pytest.approx(16**-0.5)


class _Broken(nn.Module):
    """A one-layer model whose attention breaks the causal GQA pattern in a chosen way."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(16, 32)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, ids):
        x = self.embed(ids)
        B, T, _ = x.shape
        pos = torch.arange(T, device=ids.device)[None, :, None].float() * torch.ones(4, device=ids.device)
        cos, sin = pos.cos(), pos.sin()
        q = apply_rope(self.q_proj(x).view(B, T, 4, 8), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(B, T, 2, 8), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(B, T, 2, 8).transpose(1, 2)
        if self.how == "not_causal":
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif self.how == "bidirectional_mask":
            s = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(2, 3)) * 0.35
            s = s + torch.zeros((T, T), device=ids.device)
            o = torch.matmul(F.softmax(s, dim=-1), v.repeat_interleave(2, dim=1))
        else:  # "no_rope": q is not rotated
            q = self.q_proj(x).view(B, T, 4, 8).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, T, 32)


@pytest.mark.parametrize("how,message", [
    ("not_causal", r"node 'scaled_dot_product_attention' \(call_function scaled_dot_product_attention\) is not causal"),
    ("bidirectional_mask", r"node 'zeros' .* is an attention mask that is not causal"),
    ("no_rope", r"node 'view_\d+' \(call_method view\) is not the rotary embedding"),
])
def test_unmatched_attention_names_the_node(how, message):
    with pytest.raises(m3compile.M3CompileError, match=message):
        m3compile.convert(_Broken(how), MSAConfig(dense_layers=()))


def test_mixed_model_keeps_existing_msa_layers():
    """A model that already has MSA layers (M3) is recognised; converting its dense layers adds MSA there only."""
    args = PRESETS["m3-tiny"].replace(
        sparse_layers=(False, False, True, True),
        msa=MSALayerArgs(index_heads=2, index_dim=16, block_size=8, topk=4),
    )
    model = Decoder(args).eval()
    gm, report = m3compile.convert(model, MSAConfig(block_size=8, topk=4, dense_layers=(0,)))
    assert report.passes[0].replaced == 1
    assert [r["attention"] for r in report.layers] == ["dense", "msa", "msa", "msa"]
    with pytest.raises(m3compile.M3CompileError, match="mix settings"):
        m3compile.convert(model, MSAConfig(block_size=16, topk=4, dense_layers=(0,)))
    assert isinstance(model.model.layers[2].self_attn, Attention)


def test_apply_rope_keeps_the_dtype_of_its_input():
    """Under CUDA autocast q/k are bf16 while the RoPE tables follow the fp32 embeddings: fp32 tables must not
    promote q/k to fp32 (every later kernel then runs its fp32 path: the likely cause, not re-measured, of a
    distill run with fp32 weights at ~3.6 s per step where the bench with bf16 weights took 0.26 s)."""
    x = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, apply_rope(x, cos.bfloat16(), sin.bfloat16()), rtol=0, atol=0)
