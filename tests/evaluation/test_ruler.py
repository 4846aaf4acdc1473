"""The RULER-style suite (m3c eval ruler) and the runtime selections it compares.

A hand-built two-layer retriever (embeddings, one MSA attention layer and an unembedding set by hand) follows a chain
of needles planted far back in a haystack: dense and oracle selection answer every hop, a window of the most recent
blocks answers none, through the suite's own runner (one prefill, then the paged cached decode). The oracle and
dense selections of prefill + decode give the model forward's logits. Every task fills the asked length and plants
its answers; scoring is RULER's string_match_all. A small random model with Qwen2.5-Coder's features (Qwen2
layout, q/k/v biases, 14 query / 2 KV heads, tied embeddings, RoPE theta 1e6, a chat template) goes through convert,
eval (loss and ruler), remote code and generate; bad input gets a one-line error."""
import dataclasses
import json
import random
from collections import Counter

import pytest
import torch
import transformers
from click.testing import CliRunner
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import m3compile
from m3compile import MSAConfig, cli, convert_checkpoint, generate
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs
from m3compile.io.tokenizer import PromptCodec, read_chat_template
from m3compile.evaluation.ruler import RulerReport, run_samples, score
from m3compile.evaluation.ruler_tasks import TASKS, Haystacks, Sample, build_samples
from tests.conftest import EVAL_DATA
from tests.export.test_remote_code import assert_same_model

SYMBOLS = 8  # "A".."H": the keys and values of the needle chains


def retriever(block: int = 16, topk: int = 4) -> Decoder:
    """A byte-level model whose weights implement lookup: byte 128 + 8x + y is a needle "x -> y"; at a symbol
    byte 65 + x, its MSA layer attends to the needle keyed x (content match on dims the RoPE leaves alone) and its
    unembedding emits 65 + y. Layer 0 is dense and does nothing. With the needle out of sight, it emits byte 0."""
    args = ModelArgs(vocab_size=256, hidden_size=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                     intermediate_size=8, rotary_dim=2, sparse_layers=(False, True),
                     msa=MSALayerArgs(index_heads=1, index_dim=8, block_size=block, topk=topk))
    model = Decoder(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight  # dims: 0-7 symbol, 8-15 needle key, 16-23 needle value, 24 filler
        emb[:, 24] = 1.0
        attn = model.model.layers[1].self_attn
        for x in range(SYMBOLS):
            emb[65 + x, 24], emb[65 + x, x] = 0.0, 1.0
            for y in range(SYMBOLS):
                emb[128 + SYMBOLS * x + y, 24] = 0.0
                emb[128 + SYMBOLS * x + y, 8 + x] = emb[128 + SYMBOLS * x + y, 16 + y] = 1.0
            for h in range(2):  # query: the symbol; key: the needle's key (head dims 2-9: not rotated)
                attn.q_proj.weight[16 * h + 2 + x, x] = 3.0
                attn.o_proj.weight[32 + x, 16 * h + x] = 1.0  # the needle's value, to dims 32-39
            attn.k_proj.weight[2 + x, 8 + x] = 1.0
            attn.v_proj.weight[x, 16 + x] = 1.0
            model.lm_head.weight[65 + x, 32 + x] = 10.0
        torch.nn.init.normal_(attn.index_q_proj.weight)  # an untrained index branch
        torch.nn.init.normal_(attn.index_k_proj.weight)
    return model


def chain(rng: random.Random, length: int, hops: int = 3) -> Sample:
    """Noise bytes with `hops` needles a -> b -> c -> d in the first half, ending with the symbol a: the answers
    b, c, d come one per generated token (the first from the prefill, the others from decode steps)."""
    noise = list(b"the grass is green. the sky is blue. the sun is yellow. here we go. there and back again.\n")
    names = rng.sample(range(SYMBOLS), hops + 1)
    ids = [noise[i % len(noise)] for i in range(length - 1)]
    for (x, y), at in zip(zip(names, names[1:]), rng.sample(range(4, length // 2), hops)):
        ids[at] = 128 + SYMBOLS * x + y
    return Sample(ids + [65 + names[0]], tuple(chr(65 + y) for y in names[1:]))


def test_recent_blocks_fail_where_dense_and_oracle_retrieve():
    """Batched prompts of different lengths (18-21 blocks of 16; the recent window sees the last 4): dense and
    oracle selection follow every hop, the recent window none; the untrained index branch is somewhere between."""
    model = retriever()
    rng = random.Random(0)
    samples = [chain(rng, n) for n in (300, 257, 333, 280)]
    text = lambda ids: bytes(i for i in ids if i < 256).decode("latin-1")  # noqa: E731
    got = {sel: run_samples(model, samples, 3, text, stop_ids=[], selection=sel, batch=3, kernels=False)
           for sel in ("dense", "oracle", "recent", "index")}
    assert got["dense"] == got["oracle"] == [1.0] * 4
    assert got["recent"] == [0.0] * 4
    assert all(0.0 <= v <= 1.0 for v in got["index"])


def qwen_like_decoder() -> Decoder:
    args = ModelArgs(vocab_size=64, hidden_size=56, n_layers=2, n_heads=14, n_kv_heads=2, head_dim=4,
                     intermediate_size=48, qkv_bias=True, rope_theta=1e6, tie_embeddings=True,
                     sparse_layers=(False, True),
                     msa=MSALayerArgs(index_heads=2, index_dim=8, block_size=4, topk=3, init_blocks=1))
    model = Decoder(args).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)  # sharp attention: the selection matters
    return model


@pytest.mark.parametrize("selection", ["oracle", "dense"])
def test_prefill_and_decode_selection_match_the_forward(selection):
    """generate(selection=...) over prompts of 23 and 17 tokens (blocks of 4, top-3): the prefill's and every decode
    step's logits equal the model's forward over the whole text with that selection (oracle: Decoder's own oracle,
    from each layer's q/k; dense: every MSA layer dense), so the paged decode's oracle is the forward's."""
    model = qwen_like_decoder()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (23, 17)]
    res = generate(model, prompts, 5, kernels=False, selection=selection)
    for b, p in enumerate(prompts):
        model.set_selection(selection)
        with torch.no_grad():
            want = model(torch.tensor(p + res.tokens[b][:-1])[None])[0, len(p) - 1:].float()
        model.set_selection("index")
        got = torch.stack([res.prefill_logits[b]] + [res.step_logits[s, b] for s in range(4)])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    index = generate(model, prompts, 5, kernels=False)
    assert any(not torch.allclose(index.step_logits[:, b], res.step_logits[:, b], atol=1e-3) for b in range(2))


def test_score_is_string_match_all():
    assert score(" 1234567.", ["1234567"]) == 1.0
    assert score("are: 1234567 and 76", ["1234567", "7654321"]) == 0.5
    assert score("Answer: ABCDE\x00FGHIJ", ["abcde", "fghij", "klmno", "pqrst"]) == 0.5
    assert score("", ("x",)) == 0.0


@pytest.fixture(scope="module")
def code_text():
    return EVAL_DATA.read_bytes()[:120_000].decode("utf-8", errors="replace")


def test_every_task_fills_the_length_and_plants_its_answers(tmp_path, code_text):
    """Byte prompts (no tokenizer: plain completion) of 8,192 tokens: each within the budget (length - the task's
    max_new_tokens) and within 3% of it (a code line is up to 2% of it), every expected answer in the prompt (cwe's common words 30 times, fwe's
    coded words most often after "..."), the same prompts from the same seed and different ones per sample."""
    codec = PromptCodec(tmp_path, 256)
    assert not codec.chat and codec.encode_batch(["ab"]) == [[97, 98]]
    hay = Haystacks(code_text)
    render = lambda inst: codec.prompt(inst.question, inst.answer_prefix)  # noqa: E731
    length = 8192
    for name, task in TASKS.items():
        samples = build_samples(task, length, 2, 0, hay, render, codec.encode_batch)
        budget = length - task.max_new_tokens
        assert len(samples) == 2 and samples[0].ids != samples[1].ids, name
        for s in samples:
            assert budget * 0.97 <= len(s.ids) <= budget, (name, len(s.ids), budget)
            text = codec.decode(s.ids)
            words = text.replace(".", " ").split()
            assert all(a in text for a in s.answers), name
            if name == "cwe":
                assert len(s.answers) == 10 and all(words.count(a) >= 30 for a in s.answers)
            if name == "fwe":
                body = text.split("coded words. ")[1]
                assert [w for w, _ in Counter(body.split()).most_common(4)][1:] == list(s.answers)
        assert build_samples(task, length, 1, 0, hay, render, codec.encode_batch)[0] == samples[0], name
    niah = build_samples(TASKS["niah_multiquery"], length, 1, 0, hay, render, codec.encode_batch)[0]
    assert len(niah.answers) == 4 and "What are all the special magic numbers for" in codec.decode(niah.ids)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_template_sources(tmp_path):
    """tokenizer_config.json's chat_template (a string, or the "default" of a list) before chat_template.jinja."""
    assert read_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert read_chat_template(tmp_path) == "{{ messages[0]['content'] }}!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    assert read_chat_template(tmp_path) == CHATML
    codec = PromptCodec(tmp_path, 256)
    assert codec.prompt("hi", " A:") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n A:"


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A random Qwen2ForCausalLM with Qwen2.5-Coder-0.5B's features at toy size (hidden 112, 2 layers, 14 query / 2
    KV heads, q/k/v biases, tied embeddings, RoPE theta 1e6, context 1,024), a byte-level BPE tokenizer with the
    ChatML special tokens and a chat template in chat_template.jinja (as the real checkpoint ships it), converted
    at block 16 / top-4 with layer 0 dense."""
    root = tmp_path_factory.mktemp("qwen-like")
    src = root / "src"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    cfg = transformers.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=112, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                                   rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=1024,
                                   bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.eval().save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (src / "chat_template.jinja").write_text(CHATML)
    convert_checkpoint(src, root / "msa", MSAConfig(block_size=16, topk=4, dense_layers=(0,)))
    data = root / "code.txt"
    data.write_text(EVAL_DATA.read_bytes()[:60_000].decode("utf-8", errors="replace"))
    return root / "msa", data


def _invoke(*args):
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_qwen_shaped_model_converts_evaluates_and_generates(qwen_like, monkeypatch):
    """The features survive conversion; m3c eval's loss runs; transformers with remote code gives m3compile's logits
    and greedy tokens past the top-k; m3c generate streams text."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU references, as on a reader's machine
    path, data = qwen_like
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["num_key_value_heads"] == 2 and cfg["num_attention_heads"] == 14
    model = m3compile.load(path)
    assert model.args.qkv_bias and model.args.tie_embeddings and model.args.rope_theta == 1e6
    assert model.args.is_sparse(1) and not model.args.is_sparse(0) and (path / "chat_template.jinja").is_file()
    code, out, err = _invoke("eval", "loss", path, "--data", data, "--seq-len", 64, "--max-windows", 2, "--json")
    assert code == 0, err
    assert json.loads(out)["oracle_loss"] is not None
    x = torch.randint(0, 256, (1, 70))
    assert_same_model(path, x, x[0, :60].tolist(), 3)  # 60 tokens: 4 blocks of 16, top-4 -> decode past it
    code, out, err = _invoke("generate", path, "--prompt", "def f(", "--max-new-tokens", 4)
    assert code == 0 and out.endswith("\n"), err


def test_ruler_cli_json_table_and_heatmap(qwen_like, tmp_path, monkeypatch):
    """--json: the scores of every selection, task and length in [0, 100], the chat template used, the random
    model's failed tasks excluded (and said so in the table); --plot writes the PNG. (The random model never ends
    its answer: its tasks generate 8 tokens here, not RULER's 128.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in ("niah_single_1", "niah_single_3"):
        monkeypatch.setitem(TASKS, name, dataclasses.replace(TASKS[name], max_new_tokens=8))
    path, data = qwen_like
    args = ["eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 2, "--tasks",
            "niah_single_1,niah_single_3"]
    code, out, err = _invoke(*args, "--json", "--plot", tmp_path / "r.png")
    assert code == 0, err
    d = json.loads(out)
    assert d["tasks"] == ["niah_single_1", "niah_single_3"] and d["lengths"] == [1024] and d["chat"]
    assert d["selections"] == ["dense", "index", "oracle"] and d["context"] == 1024
    for t in d["tasks"]:
        assert all(0 <= d["scores"][t][s]["1024"] <= 100 for s in d["selections"])
    assert set(d["excluded"]) == {t for t in d["tasks"] if d["scores"][t]["dense"]["1024"] < 50}
    assert 0.9 * (1024 - 8) < d["prompt_tokens"]["1024"] <= 1024 - 8 and (tmp_path / "r.png").stat().st_size > 1000
    report = RulerReport([1024], ["vt"], ["dense", "recent"], 1, 0, False, scores={"vt": {"dense": {1024: 80.0},
                                                                                          "recent": {1024: 0.0}}})
    assert report.to_dict()["average"] == {"dense": {"1024": 80.0, "all": 80.0}, "recent": {"1024": 0.0, "all": 0.0}}
    for sel, by_len in d["stderr"].items():  # a standard error wherever an average (here: tasks the dense model fails)
        assert all((v is None) == (d["average"][sel][n] is None) and (v is None or v >= 0) for n, v in by_len.items())
    two = RulerReport([1024, 2048], ["a", "b"], ["dense"], 10, 0, False,
                      scores={"a": {"dense": {1024: 90.0, 2048: 70.0}}, "b": {"dense": {1024: 60.0, 2048: 50.0}}},
                      variances={"a": {"dense": {1024: 9.0, 2048: 21.0}}, "b": {"dense": {1024: 16.0, 2048: 24.0}}})
    assert two.stderr("dense", 1024) == pytest.approx(5.0 / 2) and two.stderr("dense") == pytest.approx(70**0.5 / 4)
    one = RulerReport([1024], ["vt", "cwe"], ["dense"], 10, 0, False, scores={"vt": {"dense": {1024: 90.0}},
                                                                               "cwe": {"dense": {1024: 60.0}}},
                      variances={"vt": {"dense": {1024: 9.0}}, "cwe": {"dense": {1024: 16.0}}})
    assert one.to_dict()["variances"] == {"vt": {"dense": {"1024": 9.0}},  # for averages over another run's tasks
                                          "cwe": {"dense": {"1024": 16.0}}}
    code, out, err = _invoke(*args[:-1], "niah_single_1", "--samples", 1, "--selections", "dense,recent")
    assert code == 0 and "niah_single_1 (excluded)" in out and "dense / recent" in out, err
    assert "excluded from the averages (dense below 50 at 1K): niah_single_1" in " ".join(out.split())


@pytest.mark.parametrize("extra, needle", [
    (["--lengths", "2K"], "length 2048 is above the model's context (1024 tokens"),
    (["--tasks", "niah_single_1,haystack"], "unknown ruler task 'haystack'"),
    (["--samples", 0], "--samples must be >= 1"),
    (["--selections", "dense,best"], "unknown selection 'best'"),
    (["--tasks", "niah_single_2", "--short-data"], "too short to fill a 1024-token niah_single_2 haystack"),
    (["--plot", "scores.jpg"], "name the file *.png"),
    (["--answer-budget", "p0.9"], "the answer budget is kN (the fixed top-N blocks) or pP:FLOOR:CEILING"),
    (["--answer-budget", "p0.9:200:300"], "min_blocks (200), the adaptive budget's floor, exceeds the 64 blocks"),
], ids=["length-above-context", "unknown-task", "zero-samples", "unknown-selection", "short-data", "plot-not-png",
        "answer-budget-form", "answer-budget-range"])
def test_ruler_bad_input(qwen_like, tmp_path, monkeypatch, extra, needle):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path, data = qwen_like
    if "--short-data" in extra:
        extra = extra[:-1]
        data = tmp_path / "short.txt"
        data.write_text("def alpha_beta(gamma, delta):\n    return gamma + delta\n" * 5)
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", *extra)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


def test_ruler_over_an_fp8_kv_cache(qwen_like, monkeypatch):
    """--kv-cache fp8: every prefill and decode of the suite runs over an fp8 K/V cache and the JSON says so."""
    from m3compile.runtime import generate as generate_module

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setitem(TASKS, "niah_single_1", dataclasses.replace(TASKS["niah_single_1"], max_new_tokens=4))
    made = []

    class Spy(generate_module.PagedCache):
        def __init__(self, model, batch, max_len, page, device, dtype, index_dtype):
            made.append(dtype)
            super().__init__(model, batch, max_len, page, device, dtype, index_dtype)

    monkeypatch.setattr(generate_module, "PagedCache", Spy)
    path, data = qwen_like
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 1,
                             "--tasks", "niah_single_1", "--selections", "index", "--kv-cache", "fp8", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["kv_cache"] == "fp8" and d["selections"] == ["index"]
    assert 0 <= d["scores"]["niah_single_1"]["index"]["1024"]
    assert made == [torch.float8_e4m3fn]


def test_ruler_with_an_answer_budget(qwen_like, monkeypatch):
    """--answer-budget: the index rows prefill each prompt in two parts and decode at that budget, the dense rows in
    one part at the model's; the JSON names the budget."""
    from m3compile.runtime import forward

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setitem(TASKS, "niah_single_1", dataclasses.replace(TASKS["niah_single_1"], max_new_tokens=3))
    starts = []
    prefill = forward.prefill

    def spy(model, cache, b, prompt, chunk=None, selection="index", start=0):
        starts.append((selection, start, model.args.msa.topk))
        return prefill(model, cache, b, prompt, chunk, selection, start)

    monkeypatch.setattr("m3compile.runtime.generate.prefill", spy)
    path, data = qwen_like
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 1,
                             "--tasks", "niah_single_1", "--selections", "dense,index", "--answer-budget", "k5",
                             "--answer-tokens", 40, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["answer_budget"] == "k5" and d["answer_tokens"] == 40
    own = m3compile.load(path).args.msa.topk
    (dense_sel, dense_start, _), *index = starts
    assert dense_sel == "dense" and dense_start == 0
    assert [(s, k) for s, _, k in index] == [("index", own), ("index", 5)]  # the prompt, then its last 40 tokens
    assert index[1][1] == d["prompt_tokens"]["1024"] - 40
    starts.clear()  # --decode-budget: the answer at its own budget, named in the JSON; a bad one stops first
    budgets = []
    step = forward.decode_step

    def decode_spy(model, *args, **kwargs):
        budgets.append(model.args.msa.topk)
        return step(model, *args, **kwargs)

    monkeypatch.setattr("m3compile.runtime.cuda_graph.decode_step", decode_spy)
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 1,
                             "--tasks", "niah_single_1", "--selections", "index", "--answer-budget", "k5",
                             "--decode-budget", "k3", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["answer_budget"] == "k5" and d["decode_budget"] == "k3"
    assert [k for _, _, k in starts] == [own, 5] and budgets and set(budgets) == {3}
    assert d["decode_blocks"] == {"1024": 3.0}  # the answer's blocks as counted in its decode steps
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 1,
                             "--tasks", "niah_single_1", "--selections", "index", "--answer-budget", "k5",
                             "--answer-tokens", 40, "--decode-budget", "k3")
    assert code == 0 and "index rows: the last 40 prompt tokens at k5, the answer at k3" in out, err
    code, out, err = _invoke("eval", "ruler", path, "--data", data, "--lengths", "1K", "--samples", 1,
                             "--tasks", "niah_single_1", "--selections", "index", "--decode-budget", "k0", "--json")
    assert code != 0 and out == "" and "topk must be >= 1" in err
