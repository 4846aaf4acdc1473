"""The selection budget on the command line: convert --top-p / --min-blocks, the eval overrides (--topk, --top-p,
--min-blocks) and the blocks each layer kept, inspect --blocks; which layers stay dense, by measurement (convert
--dense-costliest, eval layers); their bad inputs are one line and write nothing."""
import json

import pytest
from click.testing import CliRunner

from m3compile import cli
from tests.conftest import CALIB_DATA, EVAL_DATA, LLAMA_BYTE


def _invoke(*args):
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    return r.exit_code, r.output, r.stderr


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "msa"
    code, output, _ = _invoke("convert", LLAMA_BYTE, out, "--block-size", 16, "--topk", 8, "--top-p", 0.7,
                              "--min-blocks", 2)
    assert code == 0, output
    assert "top-p 0.7 of 2-8 blocks" in " ".join(output.split())  # the layer table says the budget
    return out


def test_eval_reports_the_blocks_kept_and_takes_another_budget(adaptive):
    """The adaptive model keeps fewer blocks per query than its ceiling, more at a higher p, all 8 at p = 1; the
    oracle keeps fewer than the ceiling too; the table shows the columns."""
    args = ["eval", "loss", adaptive, "--data", EVAL_DATA, "--seq-len", 512, "--max-windows", 1]
    runs = {}
    for extra in ([], ["--top-p", 0.95], ["--top-p", 1]):
        code, out, err = _invoke(*args, "--json", *extra)
        assert code == 0, err
        runs[tuple(extra)] = json.loads(out)
    own, high, fixed = runs[()], runs[("--top-p", 0.95)], runs[("--top-p", 1)]
    assert own["mean_blocks"] < high["mean_blocks"] < fixed["mean_blocks"] <= 8
    assert all(2 <= v <= 8 for v in own["blocks"].values()) and own["blocks_p90"].keys() == own["blocks"].keys()
    assert all(v < 8 for v in own["oracle_blocks"].values())
    assert fixed["sparse_loss"] != own["sparse_loss"]
    code, out, err = _invoke(*args, "--topk", 4, "--top-p", 1, "--json")
    assert code == 0 and json.loads(out)["mean_blocks"] <= 4, err
    code, out, err = _invoke(*args)
    assert code == 0 and "block recall and blocks kept per MSA layer" in " ".join(out.split()), err
    assert f"{own['mean_blocks']:.2f}" in out


def test_inspect_counts_the_blocks_given(adaptive):
    code, out, err = _invoke("inspect", adaptive, "--context", 4096, "--format", "json")
    assert code == 0, err
    ceiling = json.loads(out)["cost"]
    code, out, err = _invoke("inspect", adaptive, "--context", 4096, "--format", "json", "--blocks", 3.5)
    measured = json.loads(out)["cost"]
    assert ceiling["blocks_per_query"] == 8 and ceiling["adaptive"] and measured["blocks_per_query"] == 3.5
    assert measured["prefill_ratio"] > ceiling["prefill_ratio"] and measured["decode_ratio"] > ceiling["decode_ratio"]


def test_dense_layers_chosen_by_measurement(adaptive, tmp_path):
    """--dense-costliest 2 keeps dense the two layers whose oracle loss rises most alone sparse, and says so;
    eval layers measures a converted model's layers under both selections, costliest first."""
    code, out, err = _invoke("convert", LLAMA_BYTE, tmp_path / "c", "--block-size", 16, "--topk", 4,
                             "--dense-costliest", 2, "--calib", CALIB_DATA, "--calib-tokens", 1025,
                             "--calib-seq-len", 256)
    assert code == 0, err
    report = json.loads((tmp_path / "c" / "conversion_report.json").read_text())
    costs = report["layer_costs"]
    assert sorted(costs["costliest"]) == list(range(6)) and costs["windows"] == 4 and costs["seq_len"] == 256
    assert report["config"]["dense_layers"] == sorted(costs["costliest"][:2])
    rises = [costs["layers"][str(i)]["loss_increase"]["oracle"] for i in costs["costliest"]]
    assert rises == sorted(rises, reverse=True)
    assert [r["attention"] for r in report["layers"]].count("dense") == 2
    assert "dense by measured cost" in " ".join(out.split())
    code, out, err = _invoke("eval", "layers", adaptive, "--data", EVAL_DATA, "--seq-len", 256, "--max-windows", 1,
                             "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["selections"] == ["oracle", "index"] and set(d["layers"]) == {"1", "2", "3", "4", "5"}
    assert all(0 < f["recall"]["oracle"] <= 1 and 2 <= f["blocks"]["index"] <= 8 for f in d["layers"].values())


@pytest.mark.parametrize("args, needle", [
    (["convert", LLAMA_BYTE, "{t}/o", "--top-p", 0], "top_p must be a number in (0, 1]"),
    (["convert", LLAMA_BYTE, "{t}/o", "--top-p", 1.5], "top_p must be a number in (0, 1]"),
    (["convert", LLAMA_BYTE, "{t}/o", "--top-p", "nan"], "top_p must be a number in (0, 1]"),
    (["convert", LLAMA_BYTE, "{t}/o", "--top-p", 0.9, "--min-blocks", 17], "exceeds topk (16), its ceiling"),
    (["convert", LLAMA_BYTE, "{t}/o", "--dense-layers", "0,1,2,3,4,5,6"], "dense layer 6 does not exist"),
    (["convert", LLAMA_BYTE, "{t}/o", "--block-size", 128, "--topk", 128, "--top-p", 0.9, "--min-blocks", 65],
     "min_blocks (65), the adaptive budget's floor, exceeds the 64 blocks of the model's context (8,192 positions"),
    (["eval", "loss", "{m}", "--data", EVAL_DATA, "--seq-len", 64, "--topk", 700, "--min-blocks", 513],
     "exceeds the 512 blocks of the model's context (8,192 positions in blocks of 16)"),
    (["eval", "loss", "{m}", "--data", EVAL_DATA, "--seq-len", 48, "--min-blocks", 5],
     "min_blocks 5 is above the 3 blocks of 16 tokens in a window of --seq-len 48"),
    (["eval", "loss", "{m}", "--data", EVAL_DATA, "--seq-len", 64, "--top-p", 0], "top_p must be a number in (0, 1]"),
    (["eval", "loss", "{m}", "--data", EVAL_DATA, "--seq-len", 64, "--min-blocks", 9], "exceeds topk (8), its ceiling"),
    (["eval", "loss", LLAMA_BYTE, "--data", EVAL_DATA, "--seq-len", 64, "--top-p", 0.5], "has none"),
    (["inspect", LLAMA_BYTE, "--blocks", 0], "--blocks must be a number of blocks"),
    (["convert", LLAMA_BYTE, "{t}/o", "--dense-costliest", 6, "--calib", CALIB_DATA, "--calib-tokens", 600,
      "--calib-seq-len", 256], "the model has 6 layers; keep 0 to 5 of them dense"),
    (["convert", LLAMA_BYTE, "{t}/o", "--dense-costliest", 2], "give --calib"),
    (["convert", LLAMA_BYTE, "{t}/o", "--dense-costliest", 2, "--dense-layers", "0", "--calib", CALIB_DATA],
     "give --dense-layers or --dense-costliest, not both"),
    (["eval", "layers", "{m}", "--data", EVAL_DATA, "--selections", "dense"], "index or the oracle selection"),
], ids=["p-zero", "p-above-one", "p-nan", "floor-above-ceiling", "more-dense-layers-than-layers", "floor-above-the-positions",
        "eval-floor-above-the-positions",
        "floor-above-the-context", "eval-p-zero", "eval-floor-above-ceiling", "budget-on-a-dense-model",
        "inspect-no-blocks", "dense-costliest-every-layer", "dense-costliest-without-calib",
        "dense-costliest-and-dense-layers", "layers-dense-selection"])
def test_bad_budgets_are_one_line_and_write_nothing(adaptive, tmp_path, args, needle):
    argv = [str(a).format(t=tmp_path, m=adaptive) for a in args]
    code, out, err = _invoke(*argv)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (out, err)
    assert not (tmp_path / "o").exists()
