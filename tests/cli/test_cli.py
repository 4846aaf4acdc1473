"""The command line: end to end on a small checkpoint, and every kind of bad input -> one line, exit 2, no output."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from m3compile import cli

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture
def small_ckpt(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    path = tmp_path / "dense"
    model.save_pretrained(path)
    return path


def run(*args):
    result = CliRunner().invoke(cli.main, [str(a) for a in args])
    return result.exit_code, result.output


def assert_clean_failure(code, output, out_dir, needle):
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], output
    if out_dir is not None:
        assert not out_dir.exists()
        assert not list(out_dir.parent.glob(f".{out_dir.name}.partial-*"))


def test_convert_then_eval(small_ckpt, tmp_path):
    out = tmp_path / "msa"
    code, output = run("convert", small_ckpt, out, "--block-size", 8, "--topk", 2, "--dense-layers", "0", "--json")
    assert code == 0, output
    report = json.loads(output)
    assert [r["attention"] for r in report["layers"]] == ["dense", "msa", "msa"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "conversion_report.json", "generation_config.json",
                                                     "graph", "model.safetensors", "modeling_m3compile.py"]
    # generation_config.json: copied; modeling_m3compile.py: the model for transformers (remote code)
    assert json.loads((out / "config.json").read_text())["sparse_attention_config"]["m3compile_format_version"] == 1
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.randint(0, 256, size=200).astype(np.int32))
    code, output = run("eval", "loss", out, "--data", data, "--seq-len", 64, "--json")
    assert code == 0, output
    result = json.loads(output)
    assert result["windows"] == 3 and result["sparse_loss"] is not None
    assert set(result["recall"]) == {"1", "2"} and all(0 < r <= 1 for r in result["recall"].values())
    code, output = run("eval", "loss", small_ckpt, "--data", data, "--seq-len", 64)
    assert code == 0 and "not converted" in output


def test_convert_default_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, output = run("convert")
    assert code == 0, output
    assert (tmp_path / "m3-tiny-msa" / "config.json").is_file()
    assert_clean_failure(*run("convert"), None, "already exists")
    assert run("convert", "--force")[0] == 0


def test_passes_lists_gqa_to_msa():
    code, output = run("passes")
    assert code == 0 and "gqa_to_msa" in output


def test_existing_output(small_ckpt, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = run("convert", small_ckpt, out)
    assert code == 2 and "already exists" in output and (out / "keep.txt").read_text() == "mine"


def test_missing_shard(small_ckpt, tmp_path):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (small_ckpt / "model.safetensors").rename(small_ckpt / "model-00001-of-00002.safetensors")
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (small_ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o", "model-00002-of-00002.safetensors")


def test_truncated_shard(small_ckpt, tmp_path):
    f = small_ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o", "cannot read safetensors")


def test_shape_disagrees_with_config(small_ckpt, tmp_path):
    state = load_file(small_ckpt / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(24, 32)
    save_file(state, str(small_ckpt / "model.safetensors"))
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o",
                         "model.layers.1.self_attn.k_proj.weight has shape [24, 32] but config.json implies [16, 32]")


def test_missing_tensor(small_ckpt, tmp_path):
    state = load_file(small_ckpt / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(small_ckpt / "model.safetensors"))
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o", "model.layers.2.mlp.up_proj.weight is missing")


def test_unsupported_model_type(small_ckpt, tmp_path):
    cfg = json.loads((small_ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (small_ckpt / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o", "unsupported model_type 'gpt2'")


def test_pickle_only_checkpoint(small_ckpt, tmp_path):
    (small_ckpt / "model.safetensors").unlink()
    (small_ckpt / "pytorch_model.bin").write_bytes(b"not unpickled")
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o"), tmp_path / "o", "only pickle checkpoints")


def test_bad_msa_options(small_ckpt, tmp_path):
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o", "--topk", 0), tmp_path / "o", "topk must be >= 1")
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o", "--index-heads", 3), tmp_path / "o",
                         "index_heads (3) must equal the KV head count (2)")
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o", "--dense-layers", "7"), tmp_path / "o",
                         "dense layer 7 does not exist")


def test_index_dim_below_the_rotary_width(small_ckpt, tmp_path):
    """Below the rotary width (full RoPE: 8; m3-tiny's partial: 8 of 16) the index head keeps the lowest RoPE
    frequencies (sparse_index_rope "low"); an odd index dim there is refused, and so is an M3-typed output."""
    assert_clean_failure(*run("convert", small_ckpt, tmp_path / "o", "--index-dim", 5), tmp_path / "o",
                         "index_dim (5) is below the model's rotary width (8) and odd")
    # an M3 checkpoint keeps its model type, whose transformers classes know only M3's rule: refused
    assert_clean_failure(*run("convert", "--preset", "m3-tiny", "--out", tmp_path / "p", "--index-dim", 6),
                         tmp_path / "p", "index_dim 6 is below the rotary width (8): an M3 checkpoint keeps its model type")
    code, out = run("convert", small_ckpt, tmp_path / "o", "--index-dim", 4)
    assert code == 0, out
    sparse = json.loads((tmp_path / "o" / "config.json").read_text())["sparse_attention_config"]
    assert sparse["sparse_index_dim"] == 4 and sparse["sparse_index_rope"] == "low"


@pytest.mark.parametrize("make,needle", [
    (lambda p: np.save(p, np.arange(10, dtype=np.int64)), "fewer than one sequence"),
    (lambda p: np.save(p, np.array([1, 2, 999] * 100, dtype=np.int64)), "token id 999 is outside"),
    (lambda p: np.save(p, np.ones(300, dtype=np.float32)), "must be integers"),
])
def test_eval_bad_data(small_ckpt, tmp_path, make, needle):
    data = tmp_path / "d.npy"
    make(data)
    assert_clean_failure(*run("eval", "loss", small_ckpt, "--data", data, "--seq-len", 64), None, needle)


def test_eval_text_needs_tokenizer(small_ckpt, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    assert_clean_failure(*run("eval", "loss", small_ckpt, "--data", data, "--seq-len", 16), None, "tokenizer.json")
    assert_clean_failure(*run("eval", "loss", small_ckpt, "--data", tmp_path / "x.csv", "--seq-len", 16), None, "no such data file")


@pytest.mark.parametrize("args, message", [
    (["eval", "M", "--data", "x", "--task", "ruler"], "'m3c eval --task ruler' is now 'm3c eval ruler MODEL ...'"),
    (["eval", "--task=retrieval", "M", "--data", "x"],
     "'m3c eval --task retrieval' is now 'm3c eval retrieval MODEL ...'"),
    (["eval", "M", "--data", "x", "--task", "loss"], "'m3c eval --task loss' is now 'm3c eval loss MODEL ...'"),
    (["eval", "M", "--data", "x"], "'m3c eval MODEL' is now 'm3c eval loss MODEL ...'"),
    (["eval", "M", "--data", "x", "--task", "nope"], "unknown --task 'nope': 'm3c eval' has the subcommands"),
], ids=["ruler", "retrieval-equals", "loss", "no-task", "unknown-task"])
def test_eval_refuses_the_single_command_form(args, message, tmp_path):
    """`m3c eval MODEL [--task T]` (eval before it had subcommands) names the subcommand to use: one line, exit 2."""
    code, output = run(*args)
    assert_clean_failure(code, output, None, message)


@pytest.mark.parametrize("sub, option", [
    ("loss", ["--probes", 3]), ("loss", ["--lengths", "4K"]), ("loss", ["--distances", "64"]),
    ("retrieval", ["--kv-cache", "fp8"]), ("retrieval", ["--no-oracle"]), ("retrieval", ["--selections", "index"]),
    ("ruler", ["--seq-len", 64]), ("ruler", ["--probes", 3]), ("ruler", ["--max-windows", 1]),
])
def test_each_eval_subcommand_takes_only_its_own_options(sub, option, tmp_path):
    code, output = run("eval", sub, tmp_path, "--data", tmp_path / "d.npy", *option)
    assert_clean_failure(code, output, None, f"No such option '{option[0]}'")


def test_eval_subcommands_list_their_own_options():
    shared = {"--data", "--dtype", "--index-dtype", "--device", "--json", "--topk", "--top-p", "--min-blocks"}
    own = {"loss": {"--seq-len", "--max-windows", "--batch", "--no-oracle", "--kv-cache"},
           "layers": {"--seq-len", "--max-windows", "--selections"},
           "retrieval": {"--seq-len", "--distances", "--probes", "--seed"},
           "ruler": {"--lengths", "--tasks", "--samples", "--seed", "--batch", "--selections", "--plot", "--kv-cache",
                     "--answer-budget", "--answer-tokens", "--decode-budget"}}
    for sub, options in own.items():
        code, output = run("eval", sub, "--help")
        assert code == 0, output
        listed = set(re.findall(r"^  (--[\w-]+)", output.split("\nOptions:\n")[1], re.M)) - {"--help"}
        assert listed == shared | options, (sub, listed)
