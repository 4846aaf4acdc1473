"""m3c inspect: figures parsed from its JSON for known models, the graph formats, and bad input."""
import json
import shutil

import pytest

from m3compile.tools.inspect import attention_cost, inspect
from m3compile.models.decoder import PRESETS
from tests.conftest import LLAMA_BYTE
from tests.cli.test_cli import run


def test_byte_llama_from_headers():
    code, output = run("inspect", LLAMA_BYTE, "--format", "json", "--context", 8192, "--block-size", 64, "--topk", 8)
    assert code == 0, output
    r = json.loads(output)
    assert r["tensors_checked"] == 57 and r["params"] == 2_050_224  # 1,980,864 + 69,360 index parameters
    assert [row["attention"] for row in r["layers"]] == ["dense"] + ["msa"] * 5
    assert [row["converted_now"] for row in r["layers"]] == [False] + [True] * 5
    assert r["passes"][0]["name"] == "gqa_to_msa" and r["passes"][0]["replaced"] == 5
    assert r["nodes_after"] - r["nodes_before"] == r["passes"][0]["added"] - r["passes"][0]["removed"]
    assert r["ops_before"].get("msa_attention", 0) == 0 and r["ops_after"]["msa_attention"] == 5
    assert r["ops_after"]["msa_select"] == 5 and r["ops_before"]["scaled_dot_product_attention"] == 6
    # detach, the 4 index weights, index_branch, its 2 outputs, msa_select
    assert all(row["index_branch_nodes"] == 9 for row in r["layers"][1:])
    depths = [row["attention_depth"] for row in r["layers"]]
    assert depths == sorted(depths) and len(set(depths)) == 6
    c = r["cost"]
    # per MSA layer at N = 8192: dense 2*8*24*N, MSA 2*24*N + 4*8*24*8*64  ->  ratio 4.0
    assert c["dense_prefill_flops_per_token"] == 6 * 2 * 8 * 24 * 8192
    assert c["msa_prefill_flops_per_token"] == 2 * 8 * 24 * 8192 + 5 * (2 * 24 * 8192 + 4 * 8 * 24 * 8 * 64)
    assert c["prefill_ratio_per_msa_layer"] == pytest.approx(4.0)
    assert c["kv_cache_bytes_per_token"] == 6 * 2 * 2 * 24 * 2 and c["index_k_cache_bytes_per_token"] == 5 * 24 * 2
    assert c["index_params"] == 69_360


def test_m3_preset_matches_the_spec_flop_model():
    """docs/msa.md section 8: 28.4x fewer attention FLOPs per token at 1M in an MSA layer (64 q / 4 kv heads,
    d 128, top-16 x 128)."""
    r = inspect(preset="m3", context=2**20)
    assert r.cost["prefill_ratio_per_msa_layer"] == pytest.approx(28.44, abs=0.01)
    assert [row["attention"] for row in r.layers[:4]] == ["dense", "dense", "dense", "msa"]
    assert r.cost["msa_layers"] == 57 and r.params > 4.2e11
    assert attention_cost(PRESETS["m3"], 2**20)["prefill_ratio_per_msa_layer"] is None  # the dense preset itself


def test_a_converted_checkpoint_is_shown_as_it_is(tmp_path):
    code, _ = run("convert", LLAMA_BYTE, tmp_path / "msa", "--block-size", 64, "--topk", 8)
    assert code == 0
    r = inspect(tmp_path / "msa", context=8192)
    assert r.passes == [] and r.tensors_checked == 77 and r.nodes_before == r.nodes_after
    assert [row["attention"] for row in r.layers] == ["dense"] + ["msa"] * 5


def test_a_stored_answer_budget_is_counted_in_the_decode(tmp_path):
    """A model converted with a decode budget of 32 blocks (the prompt at 8): the decode column counts 32 blocks, the
    prefill 8; the table's title names both budgets."""
    code, _ = run("convert", LLAMA_BYTE, tmp_path / "msa", "--block-size", 64, "--topk", 8, "--answer-budget", "k32")
    assert code == 0
    r = inspect(tmp_path / "msa", context=8192)
    c = r.cost
    assert (c["blocks_per_query"], c["decode_blocks_per_query"], c["answer_budget"], c["answer_tokens"]) == \
        (8, 32, "k32", 128)
    plain = inspect(tmp_path / "msa", context=8192, blocks=8).cost  # the prompt's blocks given: the decode at them
    assert plain["decode_blocks_per_query"] == 8 and c["msa_decode_flops"] > plain["msa_decode_flops"]
    assert c["msa_prefill_flops_per_token"] == plain["msa_prefill_flops_per_token"]
    code, output = run("inspect", tmp_path / "msa", "--context", 8192)
    assert code == 0 and "question: the last 128 tokens at k32" in " ".join(output.split()), output


@pytest.mark.parametrize("fmt,head", [("dot", 'digraph "layer_1"'), ("mermaid", "flowchart TD")])
def test_graph_formats(fmt, head, tmp_path):
    out = tmp_path / f"layer1.{fmt}"
    code, output = run("inspect", LLAMA_BYTE, "--format", fmt, "--out", out)
    assert code == 0, output
    text = out.read_text()
    assert text.startswith(head) and "msa_select" in text and "msa_attention" in text
    assert ("fillcolor" if fmt == "dot" else ":::added") in text  # nodes the pass added are marked


def test_svg(tmp_path):
    code, output = run("inspect", LLAMA_BYTE, "--format", "svg", "--out", tmp_path / "g.svg")
    if shutil.which("dot"):
        assert code == 0 and (tmp_path / "g.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    else:
        assert code == 2 and "Graphviz" in output and not (tmp_path / "g.svg").exists()


def test_bad_input(tmp_path):
    code, output = run("inspect", tmp_path / "nowhere")
    assert code == 2 and output.startswith("error: ")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((LLAMA_BYTE / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    for f in LLAMA_BYTE.glob("*.safetensors*"):
        (bad / f.name).symlink_to(f)
    code, output = run("inspect", bad)
    assert code == 2 and "config.json implies" in output
    code, output = run("inspect", "--preset", "m3", "--format", "dot", "--layer", 99)
    assert code == 2 and "layer 99 does not exist" in output
    code, output = run("inspect", "--format", "png")
    assert code == 2
