"""m3compile.generate end to end on a preset with random weights, dense against MSA: one long random prompt, then
greedy new tokens, through the function `m3c generate` calls (paged caches, the prefill in the chunks the memory
count picks, the decode step replayed as a CUDA graph).

The preset (default llama3-8b) is built with random weights on the device and converted in memory, as
`m3c bench model PRESET --index-dim 64 --index-dtype fp8` does it (m3compile.bench.common.bench_models: block 128,
top-16, layer 0 dense; the MSA model shares the dense one's weights). Each model first generates from a short
prompt, untimed, once in one prefill pass and once in two chunks, so that the timed run finds its Triton kernels
compiled (the timed run's own compiles, if any, are reported as compile_s). Then the timed run: CUDA synchronised
before and after; prefill_s and decode_s are m3compile.generate's phase timings (runtime/timings.py), total_s the
wall time of the whole call (cache allocation and graph capture included). Prints one JSON line:

    {"preset", "device", "dtype", "prompt_tokens", "new_tokens", "kv_cache", "index_dim", "index_dtype", "layers",
     "dense": {"prefill_s", "decode_s", "total_s", "tokens_per_s", "decode_tokens_per_s", "compile_s", "warmup_s"},
     "msa": {...}, "dense_over_msa": {"prefill", "decode", "total"}, "seconds"}

tokens_per_s = (prompt + new tokens) / total_s; decode_tokens_per_s = the decode steps / decode_s.

    python benchmarks/generate_preset.py                       # llama3-8b, 128K prompt, 64 new tokens (~3 min on an H200)
    python benchmarks/generate_preset.py --kv-cache fp8        # the same over fp8 K/V caches
    python benchmarks/generate_preset.py --preset smollm2-135m --length 256 --new 4 --device cpu --layers 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("M3C_AUTOTUNE", "0")  # as m3c generate: the recorded tiles, no tuning sweep on a first run

import torch  # noqa: E402

from m3compile import generate  # noqa: E402
from m3compile.bench.common import bench_models, sync  # noqa: E402
from m3compile.errors import M3CompileError  # noqa: E402


def _length(text: str) -> int:
    """A token count: 131072, 128K or 1M."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 131072 or 128K, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a token count >= 1, got {text!r}")
    return n


def _run(model, prompt: list[int], new: int, kv_cache: str, chunk: int | None = None) -> tuple[float, dict]:
    """(wall seconds, generate's timings) of one generation of `new` tokens after `prompt` (no end token)."""
    sync(next(model.parameters()).device)
    start = time.perf_counter()
    result = generate(model, [prompt], new, kv_cache_dtype=kv_cache, prefill_chunk=chunk, timings=True)
    sync(next(model.parameters()).device)
    assert len(result.tokens[0]) == new
    return time.perf_counter() - start, result.timings


def measure(model, prompt: list[int], new: int, kv_cache: str, warmup: int) -> dict:
    """One model's row: two untimed short runs (one prefill pass, then two chunks), then the timed run."""
    start = time.perf_counter()
    short = prompt[:warmup]
    _run(model, short, new, kv_cache)
    if len(short) > 1:
        _run(model, short, new, kv_cache, chunk=-(-len(short) // 2))
    warm = time.perf_counter() - start
    total, t = _run(model, prompt, new, kv_cache)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    steps = t.get("decode_steps", 0)
    return {"prefill_s": round(t["prefill"], 4), "decode_s": round(t["decode"], 4), "total_s": round(total, 4),
            "tokens_per_s": round((len(prompt) + new) / total, 1),
            "decode_tokens_per_s": round(steps / t["decode"], 2) if steps and t["decode"] else None,
            "graph_capture_s": round(t.get("graph_capture", 0.0), 4), "compile_s": t["compile"],
            "warmup_s": round(warm, 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b", help="A preset of m3compile.models.decoder.PRESETS.")
    ap.add_argument("--length", type=_length, default=131072, help="Prompt tokens (random ids), e.g. 128K.")
    ap.add_argument("--new", type=int, default=64, help="New tokens (greedy; no end token stops them).")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="The weights' dtype.")
    ap.add_argument("--index-dim", type=int, default=64, help="The conversion's index head dim.")
    ap.add_argument("--index-dtype", default="fp8", choices=["auto", "fp8"], help="Index scoring (fp8: e4m3).")
    ap.add_argument("--kv-cache", default="auto", choices=["auto", "bf16", "fp8"],
                    help="K/V cache dtype of both models (auto: the weights' dtype).")
    ap.add_argument("--layers", type=int, default=None, help="Only the preset's first layers [default: all].")
    ap.add_argument("--warmup", type=_length, default=4096, help="Prompt tokens of the untimed runs.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the weights and the prompt.")
    a = ap.parse_args(argv)
    if a.new < 1:
        ap.error("--new must be >= 1")
    start = time.perf_counter()
    torch.manual_seed(a.seed)
    dense, msa, what, check = bench_models(a.preset, device=a.device, dtype=a.dtype, n_layers=a.layers,
                                           index_dtype=a.index_dtype, index_dim=a.index_dim)
    if check is not None and not check["ok"]:
        raise M3CompileError(f"conversion put tensors off the model's device or dtype: {check['mismatched'][:3]}")
    msa.fuse_projections(dense)  # as generate would fuse each, but with the weights still shared by both models
    vocab = dense.args.vocab_size
    prompt = torch.randint(0, vocab, (a.length,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    rows = {name: measure(model, prompt, a.new, a.kv_cache, min(a.warmup, a.length))
            for name, model in (("dense", dense), ("msa", msa))}
    ratio = lambda key: round(rows["dense"][key] / rows["msa"][key], 3) if rows["msa"][key] else None  # noqa: E731
    out = {"preset": a.preset, "model": what, "device": str(a.device), "dtype": a.dtype, "prompt_tokens": a.length,
           "new_tokens": a.new, "kv_cache": a.kv_cache, "index_dim": a.index_dim, "index_dtype": a.index_dtype,
           "layers": dense.args.n_layers, "dense": rows["dense"], "msa": rows["msa"],
           "dense_over_msa": {"prefill": ratio("prefill_s"), "decode": ratio("decode_s"), "total": ratio("total_s")},
           "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    try:
        main()
    except M3CompileError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
