"""Every supported model type, built small from a random `transformers` config, saved in bf16 and converted with a
real selection (blocks of 16, top-2, 103 tokens = 7 blocks): the ONNX export (onnxruntime) and the generated
graph/module.py (load_module) both match m3compile.load in fp32, and the checkpoint loaded in its own dtype (bf16)
then cast with .float() is exactly the fp32 model: the RoPE frequencies stay fp32 through the casts."""
import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers

from m3compile import MSAConfig, convert_checkpoint, load, load_module
from tests.models.test_hf_parity import _randomise_norms
from tests.cli.test_cli import run

BLOCK, TOPK, LENGTH = 16, 2, 103
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=512)
CASES = {
    "llama": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3-rope": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0})),
    "mistral": (transformers.MistralConfig, dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None)),
    # the layout where bf16 RoPE frequencies showed: head_dim 64, q/k/v bias, theta 1e5, untied head
    "qwen2-bias": (transformers.Qwen2Config, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                  rope_theta=1e5, tie_word_embeddings=False)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "minimax_m3_vl_text": (transformers.MiniMaxM3VLTextConfig, dict(
        intermediate_size=16, dense_intermediate_size=48, shared_intermediate_size=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2,
        index_head_dim=16, index_block_size=BLOCK, index_topk_blocks=TOPK, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
        bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


def _hf_model(case):
    cls, extra = CASES[case]
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**BASE, **extra})).eval()
    _randomise_norms(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    _hf_model(request.param).to(torch.bfloat16).save_pretrained(root / "src")
    convert_checkpoint(root / "src", root / "msa", MSAConfig(block_size=BLOCK, topk=TOPK, dense_layers=(0,)))
    model = load(root / "msa", dtype="float32")
    assert model.args.msa is not None and model.args.sparse_layers == (False, True)
    return root, model


def _inputs():
    return torch.randint(0, BASE["vocab_size"], (2, LENGTH))


def test_onnx_matches_pytorch(converted):
    root, model = converted
    code, output = run("export-onnx", root / "msa", root / "onnx")
    assert code == 0, output
    session = ort.InferenceSession(str(root / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    x = _inputs()
    (got,) = session.run(None, {"input_ids": x.numpy()})
    with torch.no_grad():
        want = model(x).numpy()
        model.set_selection("dense")
        dense = model(x).numpy()
        model.set_selection("index")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - dense).max() > 1e-2  # the selection really dropped blocks


def test_standalone_module_matches_pytorch(converted):
    root, model = converted
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(load_module(root / "msa", dtype=torch.float32)(x), model(x), rtol=0, atol=0)


def test_bf16_checkpoint_cast_to_fp32_is_the_fp32_model(converted):
    """load(...) in the checkpoint's bf16 keeps inv_freq fp32; rounded to bf16 it moved every RoPE angle."""
    root, model = converted
    x = _inputs()
    with torch.no_grad():
        want = model(x)
        for loaded in (load(root / "msa"), load_module(root / "msa")):
            assert next(loaded.parameters()).dtype == torch.bfloat16
            assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
            torch.testing.assert_close(loaded.float()(x), want, rtol=0, atol=0)
