"""fp8 index scoring as a model setting: MSAConfig.index_dtype "fp8" through conversion, the
saved config, loading, the reference and lowered graphs, generation, `m3c convert/eval --index-dtype` and export.

The kernels themselves are tested against their reference in tests/kernels/test_triton.py; here the question is
whether every path of a model that asks for fp8 scoring actually scores in fp8, and only such a model does.
"""
import dataclasses
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import m3compile
from m3compile import M3CompileError, MSAConfig, cli
from m3compile.graph.tracing import trace
from m3compile.ops import msa_select, op_args
from tests.conftest import with_sparse_config

FP8 = MSAConfig(block_size=8, topk=2, dense_layers=(0, 1), index_dtype="fp8")  # two MSA layers: keeps it quick


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "msa"
    m3compile.convert_checkpoint(None, out, FP8, preset="m3-tiny", dtype="float32")
    return out


def _tokens(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_config_validates_and_writes_the_key_only_for_fp8():
    with pytest.raises(M3CompileError, match="index_dtype"):
        MSAConfig(index_dtype="int4")
    assert MSAConfig.from_json(FP8.to_json()) == FP8
    assert FP8.m3_config(2, 2, 16, [False, True])["sparse_index_dtype"] == "fp8"
    assert "sparse_index_dtype" not in MSAConfig().m3_config(2, 2, 16, [False, True])  # M3's keys only


def test_fp8_setting_survives_saving_loading_and_lowering(fp8_dir):
    cfg = json.loads((fp8_dir / "config.json").read_text())
    assert cfg["sparse_attention_config"]["sparse_index_dtype"] == "fp8"
    model = m3compile.load(fp8_dir)
    assert model.args.msa.index_dtype == "fp8"
    code = (fp8_dir / "graph" / "module.py").read_text()
    assert code.count("index_dtype = 'fp8'") == 2 and "index_dtype = 'auto'" not in code  # both MSA layers
    graph = m3compile.load_module(fp8_dir)  # the generated graph code, run as written
    x = _tokens(40)  # 5 blocks of 8 > top-2: selection matters (at 30, fp8 and bf16 happen to pick the same)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(graph(x), want)
        traced = trace(model)
        assert [op_args(n)["index_dtype"] for n in traced.graph.nodes if n.target is msa_select] == ["fp8"] * 2
        assert (m3compile.lower(model)(x) - want).abs().max().item() < 1e-4  # the fp8 kernel (interpreter) == the
        assert (m3compile.lower(traced)(x) - want).abs().max().item() < 1e-4  # fp8 reference, eager and traced
        model.set_index_dtype("auto")
        assert model.args.msa.index_dtype == "auto"
        assert (model(x) - want).abs().max().item() > 1e-3  # scoring really changed: other blocks somewhere
        model.set_index_dtype("fp8")
        assert torch.equal(model(x), want)


def test_generation_of_an_fp8_model_scores_in_fp8(fp8_dir):
    """Prefill selects with fp8 scoring and the index-key cache is fp8 by default: prefill logits equal the fp8
    model's forward, decode logits the forward of the grown sequence (fp8 decode scores, same blocks)."""
    model = m3compile.load(fp8_dir)
    # 3 blocks of 8: past the top-2, so the prefill selects; decode fills pages 3 to 6 (one fp8 scale per page,
    # requantised from its unquantised keys as it fills) and scores them once full. Quantised per token instead,
    # as the cache was before, the decode logits of this case differ by 0.54
    prompt = _tokens(22, seed=1)[0].tolist()
    res = m3compile.generate(model, [prompt], 26, kernels=False)  # the kernels' agreement: tests/kernels
    seq = prompt + res.tokens[0]
    with torch.no_grad():
        want = model(torch.tensor([seq[:-1]]))[0, len(prompt) - 1:]
    assert (res.prefill_logits[0] - want[0]).abs().max().item() < 1e-4
    assert (res.step_logits[:, 0] - want[1:]).abs().max().item() < 1e-4


def test_inspect_counts_fp8_index_keys(fp8_dir):
    from m3compile.tools.inspect import attention_cost

    args = m3compile.load(fp8_dir).args
    cost = attention_cost(args, 1024)
    assert cost["index_k_cache_bytes_per_token"] == 2 * (args.msa.index_dim + 4)  # 2 MSA layers: e4m3 + fp32 scale
    auto = args.replace(msa=dataclasses.replace(args.msa, index_dtype="auto"))
    assert attention_cost(auto, 1024)["index_k_cache_bytes_per_token"] == 2 * args.msa.index_dim * 2  # bf16


def test_export_refuses_fp8_scoring(fp8_dir, tmp_path):
    with pytest.raises(M3CompileError, match="no ONNX form"):
        m3compile.export_onnx(fp8_dir, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_cli_convert_and_eval_index_dtype(tmp_path):
    runner = CliRunner()
    out = tmp_path / "msa"
    r = runner.invoke(cli.main, ["convert", "--preset", "m3-tiny", "--out", str(out), "--block-size", "8", "--topk", "2",
                                 "--index-dtype", "fp8", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["config"]["index_dtype"] == "fp8"
    data = tmp_path / "d.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, 200).astype(np.int64))
    results = {}
    for choice in (None, "auto", "fp8"):
        args = ["eval", "loss", str(out), "--data", str(data), "--seq-len", "64", "--max-windows", "1", "--no-oracle", "--json"]
        r = runner.invoke(cli.main, args + (["--index-dtype", choice] if choice else []))
        assert r.exit_code == 0, r.output
        results[choice] = json.loads(r.output)
    assert results[None]["sparse_loss"] == results["fp8"]["sparse_loss"]  # the checkpoint's own setting
    assert results["auto"]["dense_loss"] == results["fp8"]["dense_loss"]
    assert results["auto"]["sparse_loss"] != results["fp8"]["sparse_loss"]
    r = runner.invoke(cli.main, ["eval", "loss", str(out), "--data", str(data), "--index-dtype", "int4"])
    assert r.exit_code == 2 and "int4" in r.output


def test_a_bad_index_dtype_in_config_json_is_one_line(fp8_dir, tmp_path):
    bad = with_sparse_config(fp8_dir, tmp_path / "bad", sparse_index_dtype="int4")
    r = CliRunner().invoke(cli.main, ["eval", "loss", str(bad), "--data", str(bad / "config.json"), "--seq-len", "8"])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "sparse_index_dtype" in lines[0], r.output
