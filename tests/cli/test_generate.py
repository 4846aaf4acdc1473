"""m3c generate: streamed text from a prompt, greedy or sampled, on the CPU."""

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
    (["--prompt", "x", "--prompt-file", "y"], "exactly one of --prompt and --prompt-file"),
    ([], "exactly one of --prompt and --prompt-file"),
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
