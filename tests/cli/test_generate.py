"""m3c generate: streamed text from a prompt, greedy or sampled, and a batch of prompts decoded together, on the
CPU."""
import json
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers

from m3compile import cli, generate, load
from m3compile.io.load import auto_dtype
from m3compile.io.weights import read_checkpoint
from m3compile.runtime.generate import _pick

from tests.conftest import LLAMA_BYTE

PROMPT = "def add(a, b):"
# prompts of different lengths from the standard library's source, as the byte model saw in training: with the
# converted fixture's 16-token blocks and top-4, the two longer ones select blocks (past 64 tokens) from the prefill on
_SOURCE = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
BATCH = [PROMPT, _SOURCE[1000:1200], _SOURCE[3000:3090], "import os\n"]


def _invoke(*args):
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def byte_model():
    return load(LLAMA_BYTE, dtype="float32")  # as the CLI computes by default


def test_greedy_bytes_match_the_api(byte_model):
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompt", PROMPT, "--max-new-tokens", 6)
    assert code == 0, err
    want = generate(byte_model, [list(PROMPT.encode())], 6, eos_token_id=0).tokens[0]
    assert out == bytes(want).decode("utf-8", errors="replace") + "\n"


def test_eager_flag_gives_the_same_text(byte_model):
    """--eager only turns off the CUDA-graph replay of the decode step (a CPU decodes eagerly anyway)."""
    runs = [_invoke("generate", LLAMA_BYTE, "--prompt", PROMPT, "--max-new-tokens", 3, *flag) for flag in ([], ["--eager"])]
    assert runs[0][0] == 0 and runs[0] == runs[1]


def test_sampling_is_seeded(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    runs = [_invoke("generate", LLAMA_BYTE, "--prompt-file", prompt, "--max-new-tokens", 4, "--temperature", 1.0,
                    "--top-p", 0.9, "--seed", 3) for _ in range(2)]
    assert runs[0][0] == 0 and runs[0] == runs[1]


def test_pick():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert _pick(logits, 0.0, 1.0, None).tolist() == [1, 0]
    assert _pick(logits, 1.0, 1e-6, torch.Generator().manual_seed(0)).tolist() == [1, 0]  # nucleus of one
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([_pick(logits, 5.0, 1.0, g) for _ in range(200)])
    assert len(set(draws[:, 0].tolist())) == 3  # a hot temperature reaches every token


def test_tokenizer_model(tmp_path):
    words = ["def", "return", "x", "(", ")", ":"]
    cfg = dict(vocab_size=7, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(tmp_path / "m")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    code, out, err = _invoke("generate", tmp_path / "m", "--prompt", "def x ( ) :", "--max-new-tokens", 5)
    assert code == 0, err
    assert set(out.split()) <= set(words) | {"[UNK]"} and out.strip(), out


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "x", "--prompt-file", "y"], "give exactly one source of prompts: --prompt, --prompt-file (one or "
                                               "more) or --prompts-jsonl, not --prompt and --prompt-file"),
    ([], "give exactly one source of prompts"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--device", "cuda"], "CUDA is not available"),
])
def test_bad_generate_input(args, needle):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    code, out, err = _invoke("generate", LLAMA_BYTE, *args)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoints_on_a_gpu():
    """--dtype auto (the default): float32 on a CPU; where a CUDA device would run it, config.json's torch_dtype
    (or dtype), else the dtype the tensors are stored in. The byte model is stored in bf16."""
    ck = read_checkpoint(LLAMA_BYTE)
    assert ck.config["torch_dtype"] == "bfloat16" and ck.dtype == torch.bfloat16
    assert auto_dtype(ck.config, ck.dtype, "cpu") == torch.float32
    assert auto_dtype(ck.config, ck.dtype, "cuda:1") == torch.bfloat16
    assert auto_dtype({"dtype": "float16"}, torch.bfloat16, "cuda") == torch.float16
    assert auto_dtype({"torch_dtype": "auto"}, torch.float32, torch.device("cuda", 0)) == torch.float32
    assert auto_dtype({}, torch.bfloat16, "cuda") == torch.bfloat16
    dtype = lambda model: next(model.parameters()).dtype  # noqa: E731
    assert dtype(load(LLAMA_BYTE, dtype="auto")) == torch.float32  # stored in bf16, run in float32 on a CPU
    code, out, err = _invoke("generate", "--help")
    assert code == 0 and "[default: auto]" in " ".join(out.split()), out


# ----------------------------------------------------------------------------------------------------------------
# A batch of prompts


def _files(tmp_path: Path, texts: list[str]) -> list[Path]:
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"p{i}.txt")
        paths[-1].write_text(text)
    return paths


def _jsonl(path: Path, lines: list[str] | bytes) -> Path:
    path.write_bytes(lines if isinstance(lines, bytes) else "".join(line + "\n" for line in lines).encode())
    return path


@pytest.fixture(params=["dense", "msa"])
def model_dir(request):
    """The byte model as trained, and converted (16-token blocks, top-4: its decode selects blocks)."""
    return LLAMA_BYTE if request.param == "dense" else request.getfixturevalue("byte_msa")


def test_a_batch_continues_each_prompt_as_it_would_alone(model_dir, tmp_path):
    """The key property of batched generation: greedy, every prompt of a batch gets the tokens and the text it gets
    alone (one decode step for all, sequences of different lengths in one paged cache). Text mode prints each
    continuation after a line naming its file; --json gives the same text and the new token ids."""
    files = _files(tmp_path, BATCH)
    alone = []
    for f in files:
        code, out, err = _invoke("generate", model_dir, "--prompt-file", f, "--max-new-tokens", 16)
        assert code == 0, err
        alone.append(out)  # streamed, then a newline
    args = [a for f in files for a in ("--prompt-file", f)]
    code, out, err = _invoke("generate", model_dir, *args, "--max-new-tokens", 16)
    assert code == 0, err
    assert out == "".join(f"--- prompt {i} ({f}) ---\n{text}" for i, (f, text) in enumerate(zip(files, alone), 1))
    code, out, err = _invoke("generate", model_dir, *args, "--max-new-tokens", 16, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_index"] for r in rows] == [1, 2, 3, 4] and [r["source"] for r in rows] == list(map(str, files))
    assert [r["text"] + "\n" for r in rows] == alone
    model = load(model_dir, dtype="float32")
    for r, text in zip(rows, BATCH):
        want = generate(model, [list(text.encode())], 16, eos_token_id=0).tokens[0]
        assert r["tokens"] == want and r["prompt_tokens"] == len(text.encode())
        assert r["finish"] == ("eos" if want[-1] == 0 else "length")


def test_prompts_from_a_jsonl_file(tmp_path):
    """--prompts-jsonl: one JSON string per line (escapes, non-ASCII, a CRLF line end), each named FILE:LINE, with the
    continuations of the same prompts given as files; one prompt in it is streamed as --prompt is."""
    texts = [PROMPT, 'print("é")\n\tx = 1', "import os\n"]
    path = _jsonl(tmp_path / "p.jsonl", [json.dumps(texts[0]), json.dumps(texts[1], ensure_ascii=False) + "\r",
                                         json.dumps(texts[2])])
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompts-jsonl", path, "--max-new-tokens", 6, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["source"] for r in rows] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    files = [a for f in _files(tmp_path, texts) for a in ("--prompt-file", f)]
    code, out, err = _invoke("generate", LLAMA_BYTE, *files, "--max-new-tokens", 6, "--json")
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == [r["tokens"] for r in rows]
    one = _jsonl(tmp_path / "one.jsonl", [json.dumps(PROMPT)])
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompts-jsonl", one, "--max-new-tokens", 6)
    assert (code, out) == _invoke("generate", LLAMA_BYTE, "--prompt", PROMPT, "--max-new-tokens", 6)[:2]


def test_one_prompt_with_json_is_one_line():
    code, streamed, err = _invoke("generate", LLAMA_BYTE, "--prompt", PROMPT, "--max-new-tokens", 6)
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompt", PROMPT, "--max-new-tokens", 6, "--json")
    assert code == 0 and len(out.splitlines()) == 1, err
    row = json.loads(out)
    assert row["prompt_index"] == 1 and row["source"] == "--prompt" and row["text"] + "\n" == streamed


def test_timings_give_the_batch_and_its_tokens_per_second(tmp_path):
    files = [a for f in _files(tmp_path, BATCH[:3]) for a in ("--prompt-file", f)]
    code, out, err = _invoke("generate", LLAMA_BYTE, *files, "--max-new-tokens", 4, "--timings")
    assert code == 0, err
    t = json.loads(err.strip().splitlines()[-1])
    assert t["batch"] == 3 and t["new_tokens"] == 12 and t["new_tokens_per_s"] == round(12 / t["decode"], 2)
    assert out.count("--- prompt ") == 3 and "{" not in out


def _not_loaded(*args, **kwargs):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize("content,needle", [
    (['"a"', '{"text": "b"}'], 'line 2: expected a JSON string (a prompt), got an object ({"text": "b"})'),
    (['"a"', "7"], "line 2: expected a JSON string (a prompt), got a number (7)"),
    (["null"], "line 1: expected a JSON string (a prompt), got null"),
    (['["a", "b"]'], "line 1: expected a JSON string (a prompt), got an array"),
    (['"a"', '"b'], "line 2: not valid JSON (Unterminated string"),
    (["def f(x):"], "line 1: not valid JSON"),
    (['"a"', "", '"b"'], "line 2: a blank line"),
    (['"a"', "   "], "line 2: a blank line"),
    (['"\\ud800 x"'], "line 1: the string holds a lone surrogate (\\ud800)"),
    (b"", ": no prompts (the file is empty"),
    (b'"caf\xe9"\n', ": not UTF-8 text (invalid byte at offset 4)"),
    (['"a"'] * 1025, ": 1,025 prompts, past the ceiling of 1,024 sequences in one batch"),
])
def test_a_bad_jsonl_file_is_one_line_naming_the_file_and_line(tmp_path, monkeypatch, content, needle):
    """Nothing is loaded or generated: the whole file is read and checked first."""
    monkeypatch.setattr(cli, "load_model", _not_loaded)
    path = _jsonl(tmp_path / "bad.jsonl", content)
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompts-jsonl", path)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}") and needle in err, err


@pytest.mark.parametrize("sources,needle", [
    (["--prompt", "x", "--prompts-jsonl", "J"], "not --prompt and --prompts-jsonl"),
    (["--prompt-file", "F", "--prompts-jsonl", "J"], "not --prompt-file and --prompts-jsonl"),
    (["--prompt", "x", "--prompt-file", "F", "--prompt-file", "F"], "not --prompt and --prompt-file"),
    (["--prompts-jsonl", "J", "--prompts-jsonl", "J"], "give --prompts-jsonl once"),
])
def test_prompt_sources_do_not_mix(tmp_path, monkeypatch, sources, needle):
    monkeypatch.setattr(cli, "load_model", _not_loaded)
    files = {"F": _files(tmp_path, [PROMPT])[0], "J": _jsonl(tmp_path / "p.jsonl", [json.dumps(PROMPT)])}
    code, out, err = _invoke("generate", LLAMA_BYTE, *[str(files.get(a, a)) for a in sources])
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and needle in err, err


def test_an_empty_prompt_of_a_batch_is_named(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [json.dumps(PROMPT), '""'])
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompts-jsonl", path)
    assert code == 2 and out == "" and err == f"error: prompt 2 ({path}:2) is empty (no tokens)\n", err


def test_a_batch_past_the_models_positions_names_its_longest_prompt(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [json.dumps(PROMPT), json.dumps("x" * 8190)])
    code, out, err = _invoke("generate", LLAMA_BYTE, "--prompts-jsonl", path, "--max-new-tokens", 4)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "prompt 2 of 2: 8,190 prompt tokens + 4 new tokens (8,193 positions) is past the model's 8,192 " \
           "positions" in err


def test_a_batch_past_memory_is_refused_before_any_allocation(tmp_path, monkeypatch):
    """Memory for two of three prompts (their caches at the longest prompt's length plus the new tokens): one line
    that says how many of these prompts fit at once, and how many positions would; no cache is allocated."""
    import m3compile.runtime.generate as generate_module
    from m3compile import memory

    model = load(LLAMA_BYTE, dtype="float32")
    shape = memory.ModelShape.from_args(model.args)
    need = {b: memory.fitted_plan(shape, b, 100 + 8, 100, None, kv_dtype=torch.float32, index_dtype=torch.float32,
                                  model_dtype=torch.float32).need for b in (2, 3)}
    monkeypatch.setattr(memory, "available_bytes", lambda device: (need[2] + need[3]) / 2)

    def no_cache(*args, **kwargs):
        raise AssertionError("a cache was allocated")

    monkeypatch.setattr(generate_module, "PagedCache", no_cache)
    files = [a for f in _files(tmp_path, ["x" * 100, "y" * 60, "z"]) for a in ("--prompt-file", f)]
    code, out, err = _invoke("generate", LLAMA_BYTE, *files, "--max-new-tokens", 8)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: not enough memory: 3 x 108 positions need ")
    assert ", or 2 of these 3 prompts at once (" in err and "positions per sequence (prompt + new tokens)" in err
