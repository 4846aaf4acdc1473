"""Decoder.fuse_projections: one matmul for each layer's q/k/v (+ index q/k) and one for gate/up, every Linear's
parameters views of the fused tensors. The same logits and tokens as the separate Linears (forward, prefill,
decode, generate), no extra parameter memory, the separate Linears again after `.to()` or where a gradient is
needed, and a saved checkpoint with the same tensors. Tiny fp32 models: Llama-like, Qwen2-like (q/k/v biases,
group 7, tied embeddings) and MSA (dense layer 0, two MSA layers)."""
import copy

import pytest
import torch
from safetensors.torch import load_file

import m3compile
from m3compile import MSAConfig
from m3compile.models.decoder import Attention, Decoder, ModelArgs, MSALayerArgs, MLP
from m3compile.ops import lowering

ARGS = {
    "llama": ModelArgs(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       intermediate_size=48),
    "qwen2": ModelArgs(vocab_size=64, hidden_size=28, n_layers=2, n_heads=7, n_kv_heads=1, head_dim=4,
                       intermediate_size=40, qkv_bias=True, tie_embeddings=True),
    "msa": ModelArgs(vocab_size=64, hidden_size=32, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
                     intermediate_size=48, sparse_layers=(False, True, True),
                     msa=MSALayerArgs(index_heads=2, index_dim=8, block_size=4, topk=2)),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [2, 7, 1, 8, 2, 8, 1]]  # 13 > topk * block: sparse


def _model(name):
    torch.manual_seed(0)
    model = Decoder(ARGS[name]).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight") and m.weight.dim() == 1:  # norms off their init
                m.weight.add_(0.2 * torch.randn_like(m.weight))
    return model


def _calls(model):
    """Counts of the separate q_proj / gate_proj Linears' calls (0 while the fused matmuls run)."""
    n = [0]
    for m in model.modules():
        if isinstance(m, Attention):
            m.q_proj.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        if isinstance(m, MLP):
            m.gate_proj.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    return n


def _storage_bytes(*models):
    seen = {}
    for model in models:
        for p in model.parameters():
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name", list(ARGS))
def test_fused_model_runs_as_the_separate_linears(name, monkeypatch):
    ref, fused = _model(name), _model(name)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    fused.fuse_projections()
    fused.fuse_projections()  # a no-op once fused
    # one storage per fused group, holding the Linears' rows: no parameter byte added
    assert _storage_bytes(fused) == param_bytes
    assert fused.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), ref.state_dict().values()))
    calls = _calls(fused)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), ref(ids), rtol=0, atol=1e-5)
    assert calls[0] == 0  # the fused matmuls ran
    with monkeypatch.context() as m:  # the reference: generate with the separate Linears (the reference ops: the
        # paged kernels under the interpreter would cost seconds, and read q/k/v and the index keys the same way)
        m.setattr(Decoder, "fuse_projections", lambda self, *twins: None)
        want = m3compile.generate(ref, PROMPTS, 5, kernels=False)
    got = m3compile.generate(fused, PROMPTS, 5, kernels=False)
    assert calls[0] == 0
    assert got.tokens == want.tokens
    torch.testing.assert_close(torch.stack(got.prefill_logits), torch.stack(want.prefill_logits), rtol=0, atol=1e-5)
    torch.testing.assert_close(got.step_logits, want.step_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("B, T", [(2, 5), (3, 1)], ids=["prefill", "decode"])
def test_fused_msa_layer_on_the_kernels(B, T):
    """With the lowered ops (Triton interpreter): RoPE and the index norm + RoPE kernel read the fused matmul's
    parts in place."""
    ref, fused = _model("msa"), _model("msa")
    fused.fuse_projections()
    x = torch.randn(B, T, 32)
    cos, sin = ref.model.rotary_emb(x, torch.arange(T)[None])
    with torch.no_grad(), lowering():
        want = ref.model.layers[1].self_attn.project(x, cos, sin)
        got = fused.model.layers[1].self_attn.project(x, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_separate_linears_after_to_and_where_a_gradient_is_needed():
    ref, fused = _model("qwen2"), _model("qwen2")
    fused.fuse_projections()
    calls = _calls(fused)
    ids = torch.tensor([PROMPTS[1]])
    fused(ids).sum().backward()  # a gradient is needed: the separate Linears, gradients on each
    assert calls[0] == 2 * 2 and fused.model.layers[0].self_attn.k_proj.weight.grad is not None
    calls[0] = 0
    fused.to(torch.float64)  # each parameter gets a tensor of its own: the fused ones are dropped
    assert all(m._fused is None for m in fused.modules() if isinstance(m, (Attention, MLP)))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), ref.double()(ids), rtol=0, atol=1e-10)
    assert calls[0] == 2 * 2


def test_dense_twin_keeps_sharing_the_weights():
    """As `m3c bench model` builds them: a converted model and its dense twin on the same tensors, fused together."""
    sparse = _model("msa")
    with torch.device("meta"):
        dense = Decoder(ARGS["msa"].replace(sparse_layers=None, msa=None))
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if ".index_" not in k}, strict=False,
                          assign=True)
    dense.model.rotary_emb.inv_freq = sparse.model.rotary_emb.inv_freq
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = dense(ids)
    shared = _storage_bytes(sparse, dense)
    sparse.fuse_projections(dense)
    assert _storage_bytes(sparse, dense) == shared  # the twin reads the converted model's fused rows
    layer = dense.model.layers[1].self_attn
    assert layer._fused is not None
    assert layer.q_proj.weight.data_ptr() == sparse.model.layers[1].self_attn.q_proj.weight.data_ptr()
    calls = _calls(dense)
    with torch.no_grad():
        torch.testing.assert_close(dense(ids), want, rtol=0, atol=1e-5)
    assert calls[0] == 0


def test_save_after_fusing_writes_the_same_tensors(tmp_path):
    model = _model("llama")
    gm, report = m3compile.convert(model, MSAConfig(block_size=4, topk=2))
    want = {k: v.clone() for k, v in gm.state_dict().items()}
    model.fuse_projections()  # the graph shares the model's Linears: their weights are now views of fused tensors
    assert gm.get_submodule("model.layers.1.self_attn.k_proj").weight.untyped_storage().nbytes() > 32 * 8 * 4
    m3compile.save(gm, report, tmp_path / "out")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved.keys() == want.keys() - {"model.rotary_emb.inv_freq"}
    assert all(torch.equal(saved[k], want[k]) for k in saved)
    reloaded = m3compile.load(tmp_path / "out", dtype="float32")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), gm(ids), rtol=0, atol=1e-6)
