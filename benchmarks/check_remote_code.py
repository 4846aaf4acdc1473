"""The converted model in transformers (remote code) on a GPU: logits and greedy tokens against m3compile.

    python3 scripts/code_data.py data
    python3 benchmarks/check_remote_code.py data/eval.bin --device cuda --out remote.json

Converts checkpoints/byte-llama (block 64 / top-8, layer 0 dense), loads it with
AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True) in fp32 and compares, on the first --tokens bytes
of EVAL (held-out code bytes): logits with msa_backend "auto" (m3compile's Triton kernels on CUDA) and "torch" against
m3compile.load's reference forward (max abs. difference, bound 1e-4), then greedy generate() from a --prompt-tokens
prompt against m3compile.generate (its Triton paged decode on CUDA), and times each forward. Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

import m3compile
from m3compile.data import load_tokens


def _timed(fn, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eval", type=Path, help="held-out code bytes (scripts/code_data.py's eval.bin)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "device": a.device}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-msa"
        m3compile.convert_checkpoint(Path(__file__).resolve().parents[1] / "checkpoints" / "byte-llama", path,
                                     m3compile.MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
        hf = hf.to(a.device).eval()
        module = __import__(type(hf).__module__, fromlist=["m3c_sparse"])
        result["kernels_importable"] = module.m3c_sparse is not None
        ours = m3compile.load(path, dtype="float32", device=a.device)
        text = load_tokens(a.eval, 256).long()
        x = text[: a.tokens][None].to(a.device)
        with torch.no_grad():
            want, result["m3compile_reference_s"] = _timed(lambda: ours(x), a.device)
            for backend in ("auto", "torch"):
                hf.model.msa_backend = backend
                hf(x[:, :256])  # warm-up (autotune, first launches)
                got, seconds = _timed(lambda: hf(x).logits, a.device)
                result[f"logits_{backend}"] = {"max_abs_diff": float((got - want).abs().max()), "seconds": seconds}
            hf.model.msa_backend = "auto"
            prompt = text[: a.prompt_tokens].tolist()
            out, result["hf_generate_s"] = _timed(lambda: hf.generate(
                torch.tensor([prompt], device=a.device), max_new_tokens=a.new_tokens, do_sample=False), a.device)
        theirs = out[0, len(prompt):].tolist()
        mine = m3compile.generate(ours, [prompt], a.new_tokens).tokens[0]
        result["generate"] = {"tokens_equal": theirs == mine, "hf": theirs, "m3compile": mine}
    result["pass"] = (result["generate"]["tokens_equal"]
                      and all(result[f"logits_{b}"]["max_abs_diff"] <= 1e-4 for b in ("auto", "torch")))
    text = json.dumps(result, indent=2)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
