"""The ops' switch (m3compile.ops.lowering): the whole layer on the lowered ops (RMSNorm, RoPE, the fused index
branch, MSA selection and attention), under Triton's interpreter here, against the reference ops; the decode step on
it, and what it saves.

A tiny fp32 model with QK norms, a dense layer 0 and MSA layers; the norm weights are moved off their init values
(ones / zeros) so the norms' weights matter; T = 19 is not a multiple of the block (4), > top-2 blocks.
"""
import pytest
import torch

import m3compile
from m3compile.graph.tracing import trace
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs, RMSNorm
from m3compile.ops import GRAPH_OPS, LOWERING, lowering, lowering_enabled
from m3compile.runtime import DecodeStep, PagedCache
from m3compile.bench.op_count import count_ops

LOWERED = set(LOWERING.values())


def tiny(layers=3, qk_norm="rms", heads=6, kv=2, index_heads=2, seed=0):
    args = ModelArgs(vocab_size=64, hidden_size=32, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=8,
                     intermediate_size=48, qk_norm=qk_norm, sparse_layers=(False,) + (True,) * (layers - 1),
                     msa=MSALayerArgs(index_heads=index_heads, index_dim=8, block_size=4, topk=2))
    torch.manual_seed(seed)
    model = Decoder(args).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
    return model


@pytest.mark.parametrize("qk_norm, heads, kv, index_heads", [("rms", 6, 2, 2), ("gemma", 3, 1, 1)],
                         ids=["qk-rms-group3-kv2", "qk-gemma-group3-kv1"])
def test_forward_with_kernels_matches_the_reference(qk_norm, heads, kv, index_heads):
    """The same forward inside and outside the switch; a weight changed in place reaches the next lowered forward
    (nothing of the weights is kept between calls)."""
    model = tiny(qk_norm=qk_norm, heads=heads, kv=kv, index_heads=index_heads)
    ids = torch.randint(0, 64, (2, 19))
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        want = model(ids)
        with lowering():
            assert lowering_enabled()
            got = model(ids)
            attn.index_k_proj.weight.add_(torch.randn_like(attn.index_k_proj.weight))  # in place
            changed = model(ids)
        assert not lowering_enabled()
        want_changed = model(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert (changed - want_changed).abs().max().item() < 1e-4
    assert (want_changed - want).abs().max().item() > 1e-3  # the changed weight did reach the selection or logits


def test_kernels_with_gradients_and_tracing():
    """With a gradient needed the norms keep their formula and the fused index branch is differentiable in both
    index weights; a trace made inside the switch records the reference ops, which run lowered or not as the
    switch says when the graph runs."""
    model = tiny()
    ids = torch.randint(0, 64, (1, 19))
    want = model(ids)
    layer = model.model.layers[1]
    attn = layer.self_attn
    with lowering():
        got = model(ids)
        got.square().mean().backward()
        assert layer.input_layernorm.weight.grad is not None and attn.q_norm.weight.grad is not None
        x = torch.randn(1, 19, 32)
        cos, sin = model.model.rotary_emb(x, torch.arange(19)[None])
        _, _, _, q_idx, k_idx = attn.project(x, cos, sin)  # the fused op, differentiable in both index weights
        (q_idx.sum() + k_idx.square().sum()).backward()
        assert attn.index_q_proj.weight.grad is not None and attn.index_k_proj.weight.grad is not None
        gm = trace(model)
    assert (got - want).abs().max().item() < 1e-4
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & LOWERED and targets & set(GRAPH_OPS)
    with torch.no_grad(), lowering():
        assert (gm(ids) - want).abs().max().item() < 1e-4


def test_generate_with_kernels_matches_the_reference():
    """Prefill and decode steps on the lowered ops (kernels=True: the backbone's and the paged runtime's, interpreted
    here) against the references; the switch is off again after."""
    model = tiny()
    prompts = [torch.randint(0, 64, (19,)).tolist(), torch.randint(0, 64, (6,)).tolist(), [7]]
    slow = m3compile.generate(model, prompts, 4, kernels=False)
    fast = m3compile.generate(model, prompts, 4, kernels=True)
    assert not lowering_enabled()
    assert fast.tokens == slow.tokens
    for a, b in zip(fast.prefill_logits, slow.prefill_logits):
        assert (a - b).abs().max().item() < 1e-4
    assert (fast.step_logits - slow.step_logits).abs().max().item() < 1e-4


def _step_counts(layers: int) -> dict[bool, int]:
    """Dispatches (aten ops + Triton launches) of one decode step of a `layers`-layer model (layer 0 dense), on the
    lowered ops (True) and on the references (False)."""
    model = tiny(layers=layers)
    out = {}
    for kernels in (False, True):
        cache = PagedCache(model, 2, 24, 4, "cpu", torch.float32, torch.float32)
        cache.seq_lens.copy_(torch.tensor([19, 13], dtype=torch.int32))
        step = DecodeStep(model, cache, 2, kernels=kernels)
        tokens = torch.tensor([3, 5])
        step(tokens)
        cache.seq_lens.copy_(torch.tensor([19, 13], dtype=torch.int32))
        c = count_ops(lambda: step(tokens))
        if kernels:  # the lowered step reads nothing back (a CUDA graph captures it); the references do
            assert c.syncs == 0
        out[kernels] = c.total
    return out


def test_decode_step_dispatches_per_layer_drop():
    """Per MSA layer (the difference of a 4- and a 2-layer model, over 2 layers), measured both ways in this run:
    the lowered step needs at most 70% of the references' dispatches."""
    two, four = _step_counts(2), _step_counts(4)
    per_layer = {k: (four[k] - two[k]) / 2 for k in (False, True)}
    assert per_layer[True] <= 0.7 * per_layer[False], per_layer
    assert four[True] < four[False] and two[True] < two[False]


def test_decode_step_leaves_the_switch_as_it_was():
    model = tiny(layers=2)
    cache = PagedCache(model, 1, 8, 4, "cpu", torch.float32, torch.float32)
    cache.seq_lens.fill_(3)
    step = DecodeStep(model, cache, 1, kernels=True)
    assert step.kernels and DecodeStep(model, cache, 1).kernels is False  # default: on for CUDA only
    step(torch.tensor([1]))
    assert not lowering_enabled()
    with lowering():
        DecodeStep(model, cache, 1, kernels=False)(torch.tensor([2]))
        assert lowering_enabled()
