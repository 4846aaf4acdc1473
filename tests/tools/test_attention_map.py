"""m3c attention-map: the picture is written, its figures agree with the recall reference, bad input is refused."""
import json

import pytest
import torch

from m3compile.kernels.causal_lse import naive as ref
from m3compile import load
from m3compile.tools.attention_map import attention_map
from m3compile.data import load_tokens
from tests.conftest import EVAL_DATA, LLAMA_BYTE
from tests.cli.test_cli import assert_clean_failure, run




def test_map_figures_match_the_recall_reference(byte_msa):
    model = load(byte_msa, dtype="float32")
    tokens = load_tokens(EVAL_DATA, 256)
    amap = attention_map(model, tokens, layer=2, group=1, seq_len=200, offset=1000)
    assert amap.attention.shape == (200, 200) and amap.selected.shape == (200, 13)
    torch.testing.assert_close(amap.attention.sum(1), torch.ones(200))
    assert bool((amap.attention.triu(1) == 0).all())
    assert bool(amap.selected.sum(1).le(4).all()) and bool(amap.selected[torch.arange(200), torch.arange(200) // 16].all())
    # the same group's recall straight from the reference, on the layer's own q/k/blocks
    seen = {}
    model.model.layers[2].self_attn.observer = lambda a, q, k, b, lse: seen.update(q=q, k=k, b=b)
    with torch.no_grad():
        model(tokens[None, 1000:1200])
    r = ref.block_recall(seen["q"], seen["k"], seen["b"], block_size=16, scale=24**-0.5)
    assert amap.group_recall == pytest.approx(float(r[0, 1].mean()), abs=1e-5)
    assert amap.recall[2] == pytest.approx(float(r.mean()), abs=1e-5)
    assert sorted(amap.recall) == [1, 2, 3, 4, 5]


def test_cli_writes_a_png(byte_msa, tmp_path):
    out = tmp_path / "maps" / "layer1.png"
    code, output = run("attention-map", byte_msa, "--data", EVAL_DATA, "--layer", 1, "--group", 0, "--out", out,
                       "--seq-len", 128, "--json")
    assert code == 0, output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    figures = json.loads(output)
    assert figures["layer"] == 1 and 0 < figures["group_recall"] <= 1 and set(figures["recall"]) == {"1", "2", "3", "4", "5"}
    assert not list(out.parent.glob(".*partial*"))


@pytest.mark.parametrize("args,needle", [
    (["--layer", 0], "layer 0 is not an MSA layer"),
    (["--layer", 1, "--group", 2], "group 2 does not exist"),
    (["--layer", 1, "--seq-len", 100000], "--seq-len must be in"),
    (["--layer", 1, "--offset", 10**6], "runs past it"),
])
def test_bad_input(byte_msa, tmp_path, args, needle):
    out = tmp_path / "map.png"
    code, output = run("attention-map", byte_msa, "--data", EVAL_DATA, "--out", out, *args)
    assert_clean_failure(code, output, out, needle)


def test_unconverted_model(tmp_path):
    out = tmp_path / "map.png"
    code, output = run("attention-map", LLAMA_BYTE, "--data", EVAL_DATA, "--layer", 1, "--out", out)
    assert_clean_failure(code, output, out, "never converted")
