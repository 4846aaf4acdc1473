"""Generation over the paged caches (m3compile.generate): greedy tokens and logits against full forwards, the Triton
kernels against the references, and bad input.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so these tests execute the same kernel
code the GPU runs, at small shapes.
"""
import json

import pytest
import torch

import m3compile
from m3compile import M3CompileError, MSAConfig
from tests.conftest import LLAMA_BYTE, with_sparse_config

TINY = MSAConfig(block_size=8, topk=2, dense_layers=(0,))




@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama") / "msa"
    m3compile.convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=2, dense_layers=(0,)))
    return out


def test_generate_equals_greedy_recompute(llama_dir):
    """Paged prefill + decode (torch references) == argmax of a full forward over the growing sequence."""
    model = m3compile.load(llama_dir, dtype="float32")
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (23,)).tolist()]
    res = m3compile.generate(model, prompts, 5, kernels=False)
    for b, prompt in enumerate(prompts):
        seq = list(prompt)
        for step in range(5):
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0, -1]
            if step:
                assert (logits - res.step_logits[step - 1, b]).abs().max().item() < 1e-4
            seq.append(int(logits.argmax()))
        assert res.tokens[b] == seq[len(prompt):]


def test_generate_with_an_index_head_narrower_than_rope(tmp_path):
    """Index dim 24 below the rotary width 32: the decode path's index keys get the same cut-table RoPE
    as the prefill, so paged generation (torch references and Triton kernels) follows transformers' greedy logits."""
    from tests.models.test_hf_parity import m3_index_rope_model

    hf = m3_index_rope_model(24)
    hf.save_pretrained(tmp_path / "m3")
    model = m3compile.load(tmp_path / "m3", dtype="float32")
    prompts = [torch.randint(0, 64, (45,)).tolist(), torch.randint(0, 64, (20,)).tolist()]  # 45 + 6 > 3 blocks of 16
    slow = m3compile.generate(model, prompts, 6, kernels=False)
    fast = m3compile.generate(model, prompts, 6)
    assert fast.tokens == slow.tokens
    for b, prompt in enumerate(prompts):
        seq = prompt + slow.tokens[b]
        with torch.no_grad():
            want = hf(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:]
        for res in (slow, fast):
            assert (res.prefill_logits[b] - want[0]).abs().max().item() < 1e-4
            assert (res.step_logits[:, b] - want[1:]).abs().max().item() < 1e-4


def test_generate_with_triton_kernels_matches_reference(tiny_msa):
    model = m3compile.load(tiny_msa)
    prompts = [torch.randint(0, 256, (29,)).tolist(), torch.randint(0, 256, (9,)).tolist(), [5]]
    fast = m3compile.generate(model, prompts, 4)  # interpreter: the Triton kernels
    slow = m3compile.generate(model, prompts, 4, kernels=False)
    assert fast.tokens == slow.tokens
    assert (fast.step_logits - slow.step_logits).abs().max().item() < 1e-4
    fp8 = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8")
    fp8_ref = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8", kernels=False)
    assert fp8.tokens == fp8_ref.tokens


def test_decode_graph_capture_needs_cuda_and_cpu_stays_eager(tiny_msa):
    """The captured decode step (CUDA graph) cannot run on a CPU: asked for, it is a one-line error; by default a CPU
    runs the eager step (the GPU check, graph logits == eager logits, is in `m3c bench model`)."""
    from m3compile.runtime import DecodeStep, PagedCache, graph_unavailable

    model = m3compile.load(tiny_msa)
    assert "CUDA" in graph_unavailable(model, "cpu")
    with pytest.raises(M3CompileError, match="cannot capture the decode step"):
        m3compile.generate(model, [[1, 2, 3]], 3, cuda_graph=True)
    cache = PagedCache(model, 1, 16, 8, "cpu", torch.float32, torch.float32)
    assert DecodeStep(model, cache, 1).graph is None
    res = m3compile.generate(model, [[1, 2, 3]], 12, kernels=False)  # > 8 steps: still eager on a CPU
    assert len(res.tokens[0]) == 12


def test_generate_rejects_bad_input(tiny_msa):
    model = m3compile.load(tiny_msa)
    with pytest.raises(M3CompileError, match="at least one token"):
        m3compile.generate(model, [[1, 2], []], 2)
    with pytest.raises(M3CompileError, match="outside the vocabulary"):
        m3compile.generate(model, [[1, 999]], 2)
    with pytest.raises(M3CompileError, match="must equal the MSA block size"):
        m3compile.generate(model, [[1, 2]], 2, page_size=16)
    with pytest.raises(M3CompileError, match="index_cache_dtype"):
        m3compile.generate(model, [[1, 2]], 2, index_cache_dtype="int4")


def _recording(model):
    """Each call of the model's forward: (tokens, first position, the MSA budget (topk, top_p, min_blocks))."""
    calls, forward = [], model.model.forward

    def record(tokens, positions, *args, **kwargs):
        m = model.args.msa
        calls.append((tokens.shape[1], int(positions[0, 0]), (m.topk, m.top_p, m.min_blocks)))
        return forward(tokens, positions, *args, **kwargs)

    model.model.forward = record
    return calls


def test_an_answer_budget_selects_the_prompts_tail_and_every_new_token(llama_dir):
    """The prompt at the model's budget up to its last answer_tokens tokens, those and the decode at the answer
    budget, in two prefill passes per prompt; the model's own budget back afterwards."""
    model = m3compile.load(llama_dir, dtype="float32")
    calls = _recording(model)
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (9,)).tolist()]
    m3compile.generate(model, prompts, 3, kernels=False, answer_budget="p0.9:1:4", answer_tokens=20)
    own, answer = (2, 1.0, model.args.msa.min_blocks), (4, 0.9, 1)
    assert calls == [(50, 0, own), (20, 50, answer),  # prompt 1: body, then its tail
                     (9, 0, answer),  # prompt 2 is shorter than the tail: all of it at the answer budget
                     (1, 70, answer), (1, 71, answer)]  # two decode steps (the third token needs none)
    assert (model.args.msa.topk, model.args.msa.top_p) == (2, 1.0)
    for module in model.modules():  # every layer's settings back too
        if getattr(module, "msa", None) is not None:
            assert module.msa.topk == 2 and module.msa.top_p == 1.0


def test_a_decode_budget_selects_every_new_token_apart_from_the_question(llama_dir):
    """The question's tail at the answer budget, every new token at the decode budget; a decode budget alone leaves
    the prompt in one pass at the model's budget; the model's budget back afterwards."""
    model = m3compile.load(llama_dir, dtype="float32")
    calls = _recording(model)
    prompt = torch.randint(0, 256, (70,)).tolist()
    m3compile.generate(model, [prompt], 3, kernels=False, answer_budget="k4", answer_tokens=20, decode_budget="k3")
    own = (2, 1.0, model.args.msa.min_blocks)
    assert calls == [(50, 0, own), (20, 50, (4, 1.0, 0)), (1, 70, (3, 1.0, 0)), (1, 71, (3, 1.0, 0))]
    calls.clear()
    alone = m3compile.generate(model, [prompt], 3, kernels=False, decode_budget="p0.9:1:4")
    assert calls == [(70, 0, own), (1, 70, (4, 0.9, 1)), (1, 71, (4, 0.9, 1))]
    assert (model.args.msa.topk, model.args.msa.top_p) == (2, 1.0)
    same = m3compile.generate(model, [prompt], 3, kernels=False, answer_budget="p0.9:1:4", answer_tokens=0)
    assert same.tokens == alone.tokens  # an answer budget of no question tokens: the same run
    torch.testing.assert_close(alone.step_logits, same.step_logits, rtol=1e-5, atol=1e-5)


def test_counted_decode_blocks_are_the_selections_kept_blocks(llama_dir, monkeypatch):
    """count_blocks: the blocks every decode step's MSA layers kept (the adaptive cut's -1 slots and those past a
    sequence's end left out), counted on the device, equal a count of the selections themselves; the fixed top-2
    keeps 2 wherever 2 blocks are visible; nothing is counted unless asked."""
    from m3compile.runtime import paged_cache

    model = m3compile.load(llama_dir, dtype="float32")
    seen = []
    select = paged_cache.paged.paged_select

    def spy(*args, **kwargs):
        blocks = select(*args, **kwargs)
        seen.append(blocks.clone())
        return blocks

    monkeypatch.setattr(paged_cache.paged, "paged_select", spy)
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (21,)).tolist()]
    n_msa = sum(model.args.sparse_layers)
    for budget in (None, "p0.9:1:4"):
        seen.clear()
        r = m3compile.generate(model, prompts, 5, kernels=False, decode_budget=budget, count_blocks=True)
        steps = r.step_logits.shape[0]
        assert len(seen) == steps * n_msa
        assert r.block_counts == (sum(int((b >= 0).sum()) for b in seen), 2 * model.args.n_kv_heads * len(seen))
        if budget is None:
            assert r.decode_blocks == 2.0
        else:
            assert 1.0 <= r.decode_blocks <= 4.0 and r.decode_blocks != 2.0
    assert m3compile.generate(model, prompts, 3, kernels=False).block_counts is None


def test_an_answer_budget_like_the_models_changes_nothing(llama_dir):
    """Two prefill passes give the one pass's logits (the caches hold the body's keys), so the model's own budget as
    the answer budget generates the same tokens; the whole prompt as the tail equals the model at that budget."""
    model = m3compile.load(llama_dir, dtype="float32")
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (41,)).tolist()]
    plain = m3compile.generate(model, prompts, 6, kernels=False)
    same = m3compile.generate(model, prompts, 6, kernels=False, answer_budget="k2", answer_tokens=17)
    assert same.tokens == plain.tokens
    torch.testing.assert_close(torch.stack(same.prefill_logits), torch.stack(plain.prefill_logits), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(same.step_logits, plain.step_logits, rtol=1e-4, atol=1e-4)
    tail = m3compile.generate(model, prompts, 6, kernels=False, answer_budget="k3", answer_tokens=100)
    model.set_budget(topk=3)
    assert tail.tokens == m3compile.generate(model, prompts, 6, kernels=False).tokens


@pytest.mark.parametrize("budget, tokens, selection, needle", [
    ("q16", 128, "index", "the answer budget is kN (the fixed top-N blocks) or pP:FLOOR:CEILING"),
    ("p0.9:4", 128, "index", "got 'p0.9:4'"),
    ("k0", 128, "index", "topk must be >= 1"),
    ("p1.5:1:4", 128, "index", "top_p must be a number in (0, 1]"),
    ("p0.9:5:4", 128, "index", "min_blocks (5), the adaptive budget's floor, exceeds"),
    ("k4", -1, "index", "answer_tokens must be a whole number of tokens >= 0"),
    ("k4", 128, "oracle", "an answer budget is the index selection's; selection 'oracle' has its own"),
    ("decode:k0", 128, "index", "topk must be >= 1"),
    ("decode:x4", 128, "index", "the decode budget is kN (the fixed top-N blocks) or pP:FLOOR:CEILING"),
    ("decode:k4", 128, "dense", "a decode budget is the index selection's; selection 'dense' has its own"),
], ids=["unknown-form", "missing-ceiling", "zero-blocks", "p-above-1", "floor-above-ceiling", "negative-tokens",
        "oracle", "decode-zero-blocks", "decode-unknown-form", "decode-dense"])
def test_a_bad_answer_budget_is_one_error_before_any_work(llama_dir, budget, tokens, selection, needle):
    model = m3compile.load(llama_dir, dtype="float32")
    calls = _recording(model)
    budgets = {"decode_budget": budget.split(":", 1)[1]} if budget.startswith("decode:") else {"answer_budget": budget}
    with pytest.raises(M3CompileError, match=None) as e:
        m3compile.generate(model, [[1, 2, 3]], 2, kernels=False, answer_tokens=tokens, selection=selection, **budgets)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert calls == [] and (model.args.msa.topk, model.args.msa.top_p) == (2, 1.0)


def test_an_answer_budget_through_the_kernels_matches_the_references(llama_dir):
    """The Triton kernels (the interpreter here) with the prompt in two parts at two budgets: the tail's pass over the
    cached body and the decode at the answer budget give the references' tokens and logits."""
    model = m3compile.load(llama_dir, dtype="float32")
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (23,)).tolist()]
    want = m3compile.generate(model, prompts, 4, kernels=False, answer_budget="p0.9:1:4", answer_tokens=20)
    got = m3compile.generate(model, prompts, 4, kernels=True, answer_budget="p0.9:1:4", answer_tokens=20)
    assert got.tokens == want.tokens
    torch.testing.assert_close(torch.stack(got.prefill_logits), torch.stack(want.prefill_logits), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(got.step_logits, want.step_logits, rtol=1e-4, atol=1e-4)


def test_a_converted_answer_budget_is_stored_and_runs_by_default(tmp_path):
    """m3c convert --answer-budget/--answer-tokens/--decode-budget: config.json keeps them, load reads them, generate
    runs them when none is given; "off" runs the model's budget throughout, or (the decode budget) for the answer."""
    out = tmp_path / "msa"
    code, output = _cli("convert", LLAMA_BYTE, out, "--block-size", 16, "--topk", 2, "--answer-budget", "k4",
                        "--answer-tokens", 20, "--decode-budget", "p0.9:1:3")
    assert code == 0, output
    assert "stored for generation: the prompt's last 20 tokens at k4, the answer at p0.9:1:3" in " ".join(output.split())
    sparse = json.loads((out / "config.json").read_text())["sparse_attention_config"]
    assert (sparse["sparse_answer_budget"], sparse["sparse_answer_tokens"], sparse["sparse_decode_budget"]) == \
        ("k4", 20, "p0.9:1:3")
    model = m3compile.load(out, dtype="float32")
    assert (model.args.msa.answer_budget, model.args.msa.answer_tokens) == ("k4", 20)
    calls = _recording(model)
    prompt = torch.randint(0, 256, (70,)).tolist()
    m3compile.generate(model, [prompt], 2, kernels=False)
    own = (2, 1.0, 0)
    assert calls == [(50, 0, own), (20, 50, (4, 1.0, 0)), (1, 70, (3, 0.9, 1))]
    calls.clear()
    m3compile.generate(model, [prompt], 2, kernels=False, answer_budget="off")
    assert calls == [(70, 0, own), (1, 70, own)]
    calls.clear()
    m3compile.generate(model, [prompt], 2, kernels=False, decode_budget="off", answer_tokens=10)
    assert calls == [(60, 0, own), (10, 60, (4, 1.0, 0)), (1, 70, own)]
    calls.clear()
    m3compile.generate(model, [prompt], 2, kernels=False, selection="dense")  # the stored budgets: index only
    assert len(calls) == 2


@pytest.mark.parametrize("options, needle", [
    (("--answer-budget", "k0"), "MSAConfig.answer_budget k0: topk must be >= 1"),
    (("--answer-budget", "all"), "MSAConfig.answer_budget is kN (the fixed top-N blocks) or pP:FLOOR:CEILING"),
    (("--decode-budget", "p2:1:4"), "MSAConfig.decode_budget p2:1:4: top_p must be a number in (0, 1]"),
])
def test_a_bad_stored_budget_is_refused_before_any_output(tmp_path, options, needle):
    out = tmp_path / "msa"
    code, output = _cli("convert", LLAMA_BYTE, out, "--block-size", 16, "--topk", 2, *options)
    assert code != 0 and needle in output and "\n" not in output.strip() and not out.exists(), output


def test_a_config_with_a_bad_stored_budget_is_one_error_naming_its_key(llama_dir, tmp_path):
    bad = with_sparse_config(llama_dir, tmp_path / "bad", sparse_answer_budget="k0")
    with pytest.raises(M3CompileError) as e:
        m3compile.load(bad)
    assert "sparse_attention_config.sparse_answer_budget k0: topk must be >= 1" in str(e.value)
    with_sparse_config(bad, bad, sparse_answer_budget="k4", sparse_answer_tokens=-3)
    with pytest.raises(M3CompileError, match="sparse_answer_tokens"):
        m3compile.load(bad)


def _cli(*args):
    from click.testing import CliRunner

    from m3compile import cli

    result = CliRunner().invoke(cli.main, [str(a) for a in args])
    return result.exit_code, result.output
