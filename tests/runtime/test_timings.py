"""Where generation's time goes (runtime/timings.py): the phases of generate(timings=True) and m3c generate
--timings, and the kernel census that checks a prompt's length launches no new Triton binary."""
import json

import pytest

import torch
from click.testing import CliRunner

import m3compile
from m3compile import cli
from m3compile.kernels import decode as dk
from m3compile.kernels.indexer import select_blocks
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs
from m3compile.runtime.timings import Timings, kernel_census

from tests.conftest import LLAMA_BYTE

PHASES = ("setup", "cache", "prefill", "graph_capture", "decode", "release")


def _prefill_and_decode(T: int, page: int = 4, topk: int = 2):
    """An MSA layer's kernels at a context of T tokens (one sequence): selection and sparse attention of the prompt,
    then a decode step's selection and attention over the selected pages and over every page (a dense layer)."""
    torch.manual_seed(T)
    q, k, v = torch.randn(1, 2, T, 16), torch.randn(1, 1, T, 16), torch.randn(1, 1, T, 16)
    q_idx, k_idx = torch.randn(1, T, 1, 16), torch.randn(1, T, 16)
    blocks = select_blocks(q_idx, k_idx, block_size=page, topk=topk)
    sparse_attention(q, k, v, blocks, block_size=page)
    pages = -(-T // page)
    table, seq_lens = torch.arange(pages, dtype=torch.int32)[None], torch.tensor([T], dtype=torch.int32)
    k_cache, v_cache = torch.randn(pages, page, 1, 16), torch.randn(pages, page, 1, 16)
    chosen = dk.paged_select(q_idx[:, -1], torch.randn(pages, page, 16), table, seq_lens, topk=topk)
    dk.paged_attention(q[:, :, -1], k_cache, v_cache, chosen, table, seq_lens)
    dk.paged_attention(q[:, :, -1], k_cache, v_cache, table[:, None], table, seq_lens)


def test_a_prompt_length_adds_no_kernel_variant():
    """Two contexts of different lengths (in blocks and pages, odd and even) launch the same specialisations: on a
    GPU a new prompt length compiles nothing. A dense layer's decode (every page) shares the sparse one's
    binary."""
    runs = []
    for T in (19, 30):
        with kernel_census() as census:
            _prefill_and_decode(T)
        runs.append(dict(census.variants))
    assert runs[0] == runs[1]
    assert census.per_kernel()["paged_attention_split_kernel"] == 1
    assert {"index_topk_kernel", "gather_q_fwd_kernel", "paged_attention_split_kernel"} <= set(runs[0])


def tiny_msa():
    args = ModelArgs(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=48, sparse_layers=(False, True),
                     msa=MSALayerArgs(index_heads=2, index_dim=8, block_size=4, topk=2))
    torch.manual_seed(0)
    return Decoder(args).eval()


def test_generate_reports_its_phases_and_changes_nothing():
    model, prompt = tiny_msa(), [3, 1, 4, 1, 5, 9]
    plain = m3compile.generate(model, [prompt], 4, kernels=True)  # the Triton kernels (interpreted)
    timed = m3compile.generate(model, [prompt], 4, kernels=True, timings=True)
    assert plain.timings is None and timed.tokens == plain.tokens
    t = timed.timings
    assert all(t[p] >= 0 for p in PHASES) and t["prefill"] > 0 and t["decode"] > 0
    assert t["prompt_tokens"] == 6 and t["decode_steps"] == 3 and t["decode_per_token"] == round(t["decode"] / 3, 5)
    assert t["batch"] == 1 and t["new_tokens"] == 4 and t["new_tokens_per_s"] == round(4 / t["decode"], 2)
    assert t["compiles"] == 0 and t["compile"] == 0  # the interpreter compiles nothing
    assert t["kernel_variants"] == sum(t["kernel_variants_per_kernel"].values()) > 0  # the decode kernels ran


def test_a_batch_reports_its_size_and_the_tokens_of_all_its_sequences():
    """new_tokens_per_s counts every sequence's new tokens over the decode seconds, so a batch compares with one
    prompt; a sequence that stops at its end-of-sequence token adds only the tokens it made."""
    model = tiny_msa()
    free = m3compile.generate(model, [[3, 1, 4], [1, 5, 9, 2, 6], [5]], 5, timings=True)
    t = free.timings
    assert t["batch"] == 3 and t["new_tokens"] == 15 and t["decode_steps"] == 4
    assert t["new_tokens_per_s"] == round(15 / t["decode"], 2)
    eos = free.tokens[1][1]  # the second sequence stops at its second token
    stopped = m3compile.generate(model, [[3, 1, 4], [1, 5, 9, 2, 6], [5]], 5, eos_token_id=eos, timings=True)
    assert stopped.timings["new_tokens"] == sum(map(len, stopped.tokens)) < 15


def test_a_phase_excludes_the_compiles_inside_it():
    clock = Timings("cpu")
    clock.mark("prefill")
    clock.compile_seconds["prefill"] += 5.0  # as the compile hook adds a compile's seconds to the current phase
    clock.mark("decode")
    clock.stop()
    d = clock.to_dict()
    assert d["compile"] == d["compile_prefill"] == 5.0 and -5.0 <= d["prefill"] < -4.9 and d["decode"] >= 0
    assert d["timed"] == pytest.approx(d["prefill"] + d["decode"] + d["compile"], abs=1e-3)  # phases and compiles


def test_cli_timings_print_one_json_object_on_stderr():
    r = CliRunner().invoke(cli.main, ["generate", str(LLAMA_BYTE), "--prompt", "def f(x):", "--max-new-tokens", "3",
                                      "--timings"])
    assert r.exit_code == 0, r.stderr
    t = json.loads(r.stderr.strip().splitlines()[-1])
    assert all(t[p] >= 0 for p in ("import", "load", "tokenize") + PHASES)
    assert t["decode_steps"] == 2 and t["prompt_tokens"] == 9
    assert t["batch"] == 1 and t["new_tokens"] == 3 and t["new_tokens_per_s"] > 0
    assert t["total"] >= t["import"] + t["load"] + t["prefill"] + t["decode"]
    phases = ("import", "kernel_cache_s", "load", "tokenize", "output", "compile") + PHASES  # and the rest, untimed
    assert t["untimed"] == pytest.approx(t["total"] - sum(t[p] for p in phases), abs=1e-3) and 0 <= t["untimed"] < 0.5
    assert t["timed"] + t["untimed"] == pytest.approx(t["total"], abs=1e-3)
    assert "{" not in r.stdout and "import" not in r.stdout  # the text alone on stdout


def test_timings_name_the_kernels_compiled_anew(tmp_path, monkeypatch):
    """What Triton writes to its persistent cache inside the watched run (a compile, not a load) is named:
    "compiled_anew" (the kernel binaries) and "modules_built" (C modules); a run that only loads names none."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.runtime.cache import FileCacheManager

    t = Timings("cpu")
    with t.watch():
        t.mark("prefill")
        FileCacheManager("k" * 32).put(b"binary", "gather_q_fwd_kernel.cubin")
        FileCacheManager("k" * 32).put(b"{}", "gather_q_fwd_kernel.json", binary=False)
        FileCacheManager("m" * 32).put(b"so", "__triton_launcher.so")
    got = t.to_dict()
    assert got["compiled_anew"] == ["gather_q_fwd_kernel"] and got["modules_built"] == 1
    assert FileCacheManager.put.__name__ == "put"  # the hook is gone after the run
    t = Timings("cpu")
    with t.watch():
        t.mark("prefill")
    assert t.to_dict()["compiled_anew"] == [] and t.to_dict()["modules_built"] == 0
