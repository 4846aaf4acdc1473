"""Where a CUDA-graphed whole-model decode step spends its time (issue 17, item 5).

Builds the Llama-3-8B-shaped preset (random bf16 weights on the GPU; converted block 128 / top-16, layer 0 dense,
lowered, as `m3c bench --model` does), fills paged caches at T tokens for a batch, captures `generate`'s decode step
as a CUDA graph for the dense and the MSA model, times replays (median ms of 20, CUDA events) and profiles one
replay: the kernels by name (total ms, count), their union on the device time line against the replay's wall
time (the gap is idle time between kernels). Prints one JSON object.

    python benchmarks/experiments/decode_profile.py [--cases 131072x6,32768x8] [--model llama3-8b]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.tools.bench_common import bench_models, profile_run
from m3compile.tools.bench_model import _fill, _steps_ms
from m3compile.tools.generate import DecodeStep, PagedCache


def _kernels(prof, top: int) -> dict:
    work = [d for d in prof.device_events if d.time_range.elapsed_us() > 0 and "Memcpy" not in d.name]
    names: dict[str, list[float]] = {}
    for d in work:
        names.setdefault(d.name, []).append(d.time_range.elapsed_us() / 1e3)
    spans = sorted((d.time_range.start, d.time_range.end) for d in work)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    first, last = (spans[0][0], max(b for _, b in spans)) if spans else (0, 0)
    rows = sorted(((n, sum(v), len(v)) for n, v in names.items()), key=lambda r: -r[1])
    return {"kernels": len(work), "kernel_ms": round(sum(r[1] for r in rows), 4), "busy_ms": round(busy / 1e3, 4),
            "span_ms": round((last - first) / 1e3, 4),
            "top": [{"name": n[:90], "ms": round(ms, 4), "count": c} for n, ms, c in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cases", default="131072x6,32768x8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    dense, sparse, what, _ = bench_models(a.model, device="cuda", dtype="bfloat16", block=128, topk=16)
    out = {"model": what, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "cases": []}
    for case in a.cases.split(","):
        T, B = (int(x) for x in case.split("x"))
        cache = PagedCache(sparse, B, T + a.steps + 8, 128, "cuda", torch.bfloat16, torch.bfloat16)
        _fill(cache, 0)
        tokens = torch.randint(0, sparse.args.vocab_size, (B,), device="cuda")
        row = {"T": T, "batch": B}
        with torch.no_grad():
            for name, model in (("dense", dense), ("msa", sparse)):
                cache.seq_lens.fill_(T)
                step = DecodeStep(model, cache, B, graph=True)
                ms = _steps_ms(step, tokens, cache, T, a.steps, "cuda")
                cache.seq_lens.fill_(T)
                prof = profile_run(lambda: step(tokens), "cuda")
                cache.seq_lens.fill_(T)
                row[name] = {"graph_ms": round(ms, 4), "profiled_wall_ms": round(prof.wall_ms, 4)} | _kernels(prof, a.top)
                print(json.dumps({"T": T, "batch": B, "model": name, **row[name]}), flush=True)
                del step
        row["speedup"] = round(row["dense"]["graph_ms"] / row["msa"]["graph_ms"], 3)
        out["cases"].append(row)
        del cache
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
