"""The GQA -> MSA pass: equivalence, idempotence, saved output, and the index initialisation."""
import json

import numpy as np
import pytest
import torch

import m3compile
from m3compile import MSAConfig
from m3compile.graph.matching import msa_nodes
from m3compile.graph.pass_manager import PassManager
from m3compile.models import Decoder, PRESETS
from m3compile.ops import index_branch, msa_select, op_args
from m3compile.passes import GQAToMSA
from tests.conftest import EVAL_DATA, LLAMA_BYTE

FORMS = ["sdpa_gqa", "sdpa_repeat", "eager"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_heads", [1, 2, 8], ids=["G8", "G4", "G1"])
def test_full_topk_equals_dense(form, kv_heads):
    """topk * block_size >= T: every visible block is selected, so MSA is dense causal attention (1e-5)."""
    model = m3compile.from_preset("m3-tiny", attn_impl=form)
    args = model.args.replace(n_kv_heads=kv_heads)
    model = Decoder(args).eval()
    gm, report = m3compile.convert(model, MSAConfig(block_size=8, topk=8, dense_layers=()))
    assert report.passes[0].replaced == args.n_layers and len(msa_nodes(gm)) == args.n_layers
    x = torch.randint(0, 256, (2, 61))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_group_size_three():
    args = PRESETS["m3-tiny"].replace(n_heads=6, n_kv_heads=2, mlp_layer_types=None)
    model = Decoder(args).eval()
    gm, _ = m3compile.convert(model, MSAConfig(block_size=4, topk=16, dense_layers=()))
    x = torch.randint(0, 256, (1, 50))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_rewrite_is_sparse_and_idempotent(tmp_path):
    model = m3compile.from_preset("m3-tiny")
    cfg = MSAConfig(block_size=4, topk=2, dense_layers=(0, 2))
    gm, report = m3compile.convert(model, cfg)
    assert [row["attention"] for row in report.layers] == ["dense", "msa", "dense", "msa"]
    assert report.passes[0].replaced == 2 and report.passes[0].added > 0 and report.passes[0].removed > 0
    x = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max() > 1e-3  # really sparse at 40 tokens, 2 blocks of 4
    code_before = gm.code
    again = PassManager([GQAToMSA(cfg)]).run(gm)
    assert not again[0].modified and again[0].added == again[0].removed == again[0].replaced == 0
    assert gm.code == code_before
    # saved, reloaded natively (no tracing): the same logits as the rewritten graph
    m3compile.save(gm, report, tmp_path / "out")
    reloaded = m3compile.load(tmp_path / "out", dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), gm(x), rtol=1e-6, atol=1e-6)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    sac = config["sparse_attention_config"]
    assert sac["sparse_attention_freq"] == [0, 1, 0, 1] and sac["sparse_block_size"] == 4
    assert sac["sparse_topk_blocks"] == 2 and sac["sparse_num_index_heads"] == 2 and sac["sparse_score_type"] == "max"
    assert "def forward" in (tmp_path / "out" / "graph" / "module.py").read_text()
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["index_params"] > 0


def test_m3_tensor_names_and_dtype_preserved(tmp_path):
    report = m3compile.convert_checkpoint(LLAMA_BYTE, tmp_path / "msa", MSAConfig(block_size=64, topk=8))
    assert report.passes[0].replaced == 5
    from safetensors import safe_open

    with safe_open(str(tmp_path / "msa" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.index_q_proj.weight").dtype == torch.bfloat16
        assert tuple(f.get_tensor("model.layers.1.self_attn.index_q_proj.weight").shape) == (2 * 24, 192)
        assert tuple(f.get_tensor("model.layers.1.self_attn.index_k_proj.weight").shape) == (24, 192)
    for leaf in ("index_q_proj.weight", "index_k_proj.weight", "index_q_norm.weight", "index_k_norm.weight"):
        assert f"model.layers.5.self_attn.{leaf}" in names
        assert f"model.layers.0.self_attn.{leaf}" not in names


def test_index_branch_reads_detached_input():
    model = m3compile.from_preset("m3-tiny")
    gm, _ = m3compile.convert(model, MSAConfig(block_size=4, topk=2))
    for node in gm.graph.nodes:
        if node.target is msa_select:
            branch = op_args(node)["q_idx"].args[0]  # q_idx, k_idx = index_branch(...)
            assert branch.target is index_branch and op_args(node)["k_idx"].args[0] is branch
            x = op_args(branch)["x"]
            assert x.op == "call_method" and x.target == "detach"
    x = torch.randint(0, 256, (1, 24))
    gm(x).sum().backward()
    assert all(p.grad is None for n, p in gm.named_parameters() if ".index_" in n)  # top-k is hard: no LM gradient


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), ("cpu", torch.float16), ("meta", torch.bfloat16)])
def test_convert_keeps_the_models_device_and_dtype(device, dtype):
    """The tensors conversion adds (index projections and norms) take the model's device and dtype; nothing else
    changes (RoPE frequencies stay fp32 by design). The GPU run of `m3c bench model` checks the same on CUDA."""
    with torch.device(device):
        model = Decoder(PRESETS["m3-tiny"].replace(mlp_layer_types=None)).to(dtype).eval()
    gm, _ = m3compile.convert(model, MSAConfig(block_size=8, topk=2, dense_layers=(0,)))
    added = {n: t for n, t in gm.named_parameters() if ".index_" in n}
    assert len(added) == 3 * 4
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        assert t.device.type == device, name
        assert t.dtype == (torch.float32 if name.endswith("inv_freq") else dtype), (name, t.dtype)


def test_m3_preset_traces_on_meta():
    model = m3compile.from_preset("m3")
    gm, report = m3compile.convert(model, MSAConfig(dense_layers=(0, 1, 2)))
    assert report.passes[0].replaced == 57
    assert report.index_params == 57 * (6144 * 4 * 128 + 6144 * 128 + 2 * 128)
    with pytest.raises(m3compile.M3CompileError, match="meta device"):
        m3compile.save(gm, report, "/nonexistent/never-written")


def test_index_init_recall_beats_random_on_real_checkpoint():
    """Selection is useful before training: the weight-derived init beats a random index branch clearly."""
    model = m3compile.load(LLAMA_BYTE, dtype="float32")
    gm, _ = m3compile.convert(model, MSAConfig(block_size=64, topk=4, dense_layers=(0,)))
    tokens = torch.from_numpy(np.fromfile(EVAL_DATA, dtype=np.uint8)[:1024].astype(np.int64))
    recall = _recall(gm, model, tokens)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in gm.named_parameters():
            if ".index_q_proj" in n or ".index_k_proj" in n:
                p.normal_(0, 0.05)
    random_recall = _recall(gm, model, tokens)
    assert recall > 0.75 and recall > random_recall + 0.1, (recall, random_recall)


def _recall(gm, model, tokens) -> float:
    """Mean block recall over the MSA layers, through a native model carrying the graph's index weights."""
    args = gm.meta["model_args"]
    native = Decoder(args).eval()
    native.load_state_dict({k: v for k, v in gm.state_dict().items() if k in native.state_dict()})
    report = m3compile.evaluate(native, tokens, seq_len=tokens.numel() - 1, oracle=False)  # recall only
    return report.mean_recall


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3-8b", "qwen2.5-7b", "m3-tiny"])
def test_preset_config_reads_back_as_the_same_model(name):
    """A converted preset's config.json describes the preset itself: the dense Llama-shaped presets as Llama configs
    (RMSNorm w * x, SiLU; they were written as M3 text models with intermediate_size 0, which then failed to load),
    m3-tiny as an M3 text model."""
    from m3compile.io.hf_config import args_from_config
    from m3compile.conversion.save import config_for_preset
    from m3compile.models.decoder import PRESETS

    want = PRESETS[name]
    got, _ = args_from_config(config_for_preset(want))
    fields = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
              "norm_style", "mlp_act", "qk_norm", "tie_embeddings", "rope_theta", "rope_dim", "n_experts", "qkv_bias",
              "o_bias")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
