"""Our loaders + reference model against `transformers`, the independent reference (fp32, 1e-4)."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import m3compile
from m3compile.io.tensor_names import to_release_names
from tests.conftest import LLAMA_BYTE

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=512)


def _randomise_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)


def _compare(hf_model, path, tokens=37, **save_kwargs):
    hf_model.eval().save_pretrained(path, **save_kwargs)
    ours = m3compile.load(path, dtype="float32")
    x = torch.randint(0, hf_model.config.vocab_size, (2, tokens))
    with torch.no_grad():
        want = hf_model(x).logits
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return ours


HF_CASES = {
    "llama-g3": (transformers.LlamaConfig, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8)),
    "llama-g1": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama3-rope": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "mistral": (transformers.MistralConfig, dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None)),
    "qwen2-bias-tied": (transformers.Qwen2Config, dict(num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_match_transformers(case, tmp_path):
    cls, extra = HF_CASES[case]
    config = cls(**BASE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise_norms(model)
    _compare(model, tmp_path / case)


def test_sharded_checkpoint(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, num_attention_heads=4, num_key_value_heads=2))
    _randomise_norms(model)
    _compare(model, tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()


def test_dense_llama_byte_matches_transformers():
    hf = transformers.LlamaForCausalLM.from_pretrained(LLAMA_BYTE, dtype=torch.float32).eval()
    ours = m3compile.load(LLAMA_BYTE, dtype="float32")
    x = torch.randint(0, 256, (1, 300))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# minimax_m3_vl: the text model with its MSA layers active, in both layouts


def _m3_text_model(block=4, topk=2, local=1):
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_block_size=block, index_topk_blocks=topk,
        index_local_blocks=local, layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    return _randomise_m3(transformers.MiniMaxM3VLForCausalLM(cfg).eval())


def _randomise_m3(model):
    with torch.no_grad():  # non-trivial norms and router bias
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("local", [1, 2])
def test_m3_text_logits_and_selection_match_transformers(tmp_path, local):
    hf = _m3_text_model(local=local)
    ours = _compare(hf, tmp_path / "m3", tokens=29)  # 29 tokens, 8 blocks of 4, top-2: really sparse
    assert ours.args.msa is not None and ours.args.sparse_layers == (False, True, True)
    x = torch.randint(0, 64, (2, 29))
    theirs, mine = {}, {}
    hooks = [hf.model.layers[i].self_attn.indexer.register_forward_hook(
        lambda mod, inp, out, i=i: theirs.__setitem__(i, out)) for i in (1, 2)]
    for i in (1, 2):
        ours.model.layers[i].self_attn.observer = lambda attn, q, k, blocks, lse, i=i: mine.__setitem__(i, blocks)
    with torch.no_grad():
        hf(x)
        ours(x)
    for h in hooks:
        h.remove()
    for i in (1, 2):
        a, b = theirs[i], mine[i]
        assert a.shape[:3] == b.shape[:3]
        for row_a, row_b in zip(a.reshape(-1, a.shape[-1]).tolist(), b.reshape(-1, b.shape[-1]).tolist()):
            assert {x for x in row_a if x >= 0} == {x for x in row_b if x >= 0}


def test_m3_release_layout_and_vl_wrapper(tmp_path):
    """The same weights written in M3's release naming under a minimax_m3_vl config load to the same logits."""
    hf = _m3_text_model()
    hf.save_pretrained(tmp_path / "tf")
    ours = m3compile.load(tmp_path / "tf", dtype="float32")
    release = to_release_names(ours.state_dict(), prefix="language_model.")
    release = {k.replace("language_model.model.", "language_model.model.", 1): v for k, v in release.items()}
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in release)
    assert any(".self_attn.index_q_proj.weight" in k for k in release)
    text_cfg = json.loads((tmp_path / "tf" / "config.json").read_text())
    for k in ("layer_types", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
              "index_local_blocks", "mlp_layer_types", "rope_parameters"):
        text_cfg.pop(k)
    text_cfg.update(rotary_dim=4, rope_theta=10000.0, moe_layer_freq=[0, 1, 1], sparse_attention_config={
        "use_sparse_attention": True, "sparse_num_index_heads": 2, "sparse_index_dim": 8, "sparse_block_size": 4,
        "sparse_topk_blocks": 2, "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": 1,
        "sparse_attention_freq": [0, 1, 1], "sparse_disable_index_value": [1, 1, 1]})
    vl = tmp_path / "release"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl", "text_config": text_cfg}))
    save_file(release, str(vl / "model.safetensors"))
    loaded = m3compile.load(vl, dtype="float32")
    x = torch.randint(0, 64, (1, 29))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), hf(x).logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The index head against the rotary width: transformers' indexer applies RoPE with the main table cut to
# the index width, cos[..., :index_head_dim], and rotate_half pairs channels of that cut width.


def m3_index_rope_model(index_dim, partial=None):
    """An M3 text config to set the index head against the rotary width: 6 query / 3 KV heads of 32, `rotary_dim` 16
    (which transformers ignores: the table is 32 wide unless rope_parameters has partial_rotary_factor), block 16,
    top-3."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=48, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=32, rotary_dim=16,
        num_local_experts=4, num_experts_per_tok=2, index_n_heads=3, index_head_dim=index_dim, index_block_size=16,
        index_topk_blocks=3, index_local_blocks=1, layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"], bos_token_id=None, eos_token_id=None, rope_parameters=rope,
    )
    return _randomise_m3(transformers.MiniMaxM3VLForCausalLM(cfg).eval())


@pytest.mark.parametrize("index_dim,partial,rope_dim", [(24, None, 32), (32, None, 32), (40, None, 32), (12, 0.5, 16)],
                         ids=["below", "equal", "above", "below-partial"])
def test_m3_index_dim_against_rotary_width_matches_transformers(tmp_path, index_dim, partial, rope_dim):
    hf = m3_index_rope_model(index_dim, partial)
    ours = _compare(hf, tmp_path / "m3", tokens=70)  # 70 tokens, 5 blocks of 16, top-3: really sparse
    assert ours.args.rope_dim == rope_dim and ours.args.msa.index_dim == index_dim


def test_m3_narrow_index_head_on_every_path(tmp_path):
    """Index dim 24 < rotary width 32: the traced graph, the converted checkpoint (config round trip), its
    standalone module, the Triton-lowered model and the ONNX export all give transformers' logits."""
    from m3compile.export.onnx import export_onnx
    from m3compile.graph.tracing import trace
    from m3compile.ops import index_branch

    hf = m3_index_rope_model(24)
    hf.save_pretrained(tmp_path / "tf")
    ours = m3compile.load(tmp_path / "tf", dtype="float32")
    m3compile.convert_checkpoint(tmp_path / "tf", tmp_path / "conv", m3compile.MSAConfig(block_size=16, topk=3))
    reloaded = m3compile.load(tmp_path / "conv", dtype="float32")
    assert reloaded.args == ours.args
    gm = trace(ours)
    assert sum(n.target is index_branch for n in gm.graph.nodes) == 1  # the MSA layer's index branch
    x = torch.randint(0, 64, (2, 70))
    with torch.no_grad():
        want = hf(x).logits
        outputs = {"traced": gm(x), "reloaded": reloaded(x), "lowered": m3compile.lower(reloaded)(x),
                   "module": m3compile.load_module(tmp_path / "conv", dtype=torch.float32)(x)}
    import onnxruntime as ort
    export_onnx(tmp_path / "conv", tmp_path / "onnx")
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs["onnx"] = torch.from_numpy(session.run(None, {"input_ids": x.numpy()})[0])
    for name, got in outputs.items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_the_converted_m3_tiny_preset_loads_in_transformers_whole(tiny_msa):
    """The m3-tiny preset as `m3c convert` writes it (here block 8 / top-2, fp32) loads in transformers' own class
    for its model type with every tensor in place (none missing, none unexpected, no token id outside the
    vocabulary) and gives m3compile.load's logits, MSA layers selecting."""
    import warnings

    config = json.loads((tiny_msa / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl_text"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a bos_token_id outside the vocabulary
        hf, info = transformers.MiniMaxM3VLForCausalLM.from_pretrained(tiny_msa, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    assert hf.config.layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 3
    ids = (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id, hf.generation_config.bos_token_id)
    assert all(i is None or 0 <= i < 256 for i in ids), ids
    ours = m3compile.load(tiny_msa, dtype="float32")
    x = torch.randint(0, 256, (2, 41))  # 6 blocks of 8, top-2: really sparse
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, ours(x), rtol=1e-4, atol=1e-4)
