"""Where a CUDA-graphed whole-model decode step spends its time (issue 17, item 5).

Builds the Llama-3-8B-shaped preset (random bf16 weights on the GPU; converted block 128 / top-16, layer 0 dense,
lowered, as `m3c bench --model` does), fills paged caches at T tokens for a batch, captures `generate`'s decode step
as a CUDA graph for the dense and the MSA model, times replays (ms per step over 20, CUDA events) and profiles one
replay: the kernels by name (total ms, count), their union on the device time line against the replay's wall
time (the gap is idle time between kernels). Prints one JSON object.

The backbone runs as `m3c bench --model` and `m3c generate` run it on CUDA: its fused kernels (DecodeStep's
default; Decoder.set_kernels: RMSNorm, RoPE, the index branch); each fused row checks its replay's logits against
an eager step on the reference modules from the same state (`vs_reference`: max abs. difference, largest logit,
share of equal argmax tokens). `--backbone fused,reference` also times the reference modules (the step before the
fused backbone), rows "dense_reference" / "msa_reference".

    python benchmarks/experiments/decode_profile.py [--cases 131072x6,32768x8] [--model llama3-8b]
        [--backbone fused|reference|fused,reference]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.tools.bench_common import bench_models, profile_run, union_us
from m3compile.tools.bench_model import _fill, _steps_ms
from m3compile.runtime import DecodeStep, PagedCache


def _kernels(prof, top: int) -> dict:
    work = [d for d in prof.device_events if d.time_range.elapsed_us() > 0 and "Memcpy" not in d.name]
    names: dict[str, list[float]] = {}
    for d in work:
        names.setdefault(d.name, []).append(d.time_range.elapsed_us() / 1e3)
    spans = sorted((d.time_range.start, d.time_range.end) for d in work)
    busy = union_us(spans)
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
    ap.add_argument("--backbone", default="fused", help="fused, reference or both (comma-separated)")
    a = ap.parse_args()
    backbones = a.backbone.split(",")
    if not backbones or any(b not in ("fused", "reference") for b in backbones):
        raise SystemExit(f"error: --backbone takes fused and/or reference, got {a.backbone!r}")
    dense, sparse, what, _ = bench_models(a.model, device="cuda", dtype="bfloat16", block=128, topk=16)
    out = {"model": what, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "cases": []}
    for case in a.cases.split(","):
        T, B = (int(x) for x in case.split("x"))
        cache = PagedCache(sparse, B, T + a.steps + 8, 128, "cuda", torch.bfloat16, torch.bfloat16)
        _fill(cache, 0)
        tokens = torch.randint(0, sparse.args.vocab_size, (B,), device="cuda")
        row = {"T": T, "batch": B}
        runs = [(name + ("" if bb == "fused" else "_reference"), model, bb == "fused")
                for bb in backbones for name, model in (("dense", dense), ("msa", sparse))]
        with torch.no_grad():
            for name, model, fused in runs:
                cache.seq_lens.fill_(T)
                step = DecodeStep(model, cache, B, graph=True, kernels=fused)
                ms = _steps_ms(step, tokens, cache, T, a.steps, "cuda")
                cache.seq_lens.fill_(T)
                prof = profile_run(lambda: step(tokens), "cuda")
                cache.seq_lens.fill_(T)
                row[name] = {"graph_ms": round(ms, 4), "profiled_wall_ms": round(prof.wall_ms, 4)} | _kernels(prof, a.top)
                if fused:  # the replay against an eager step on the reference modules, from the same state
                    want = DecodeStep(model, cache, B, kernels=False)(tokens).clone()
                    cache.seq_lens.fill_(T)
                    got = step(tokens).clone()
                    cache.seq_lens.fill_(T)
                    row[name]["vs_reference"] = {
                        "max_abs_diff": (got - want).abs().max().item(), "max_abs_logit": want.abs().max().item(),
                        "argmax_equal": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}
                print(json.dumps({"T": T, "batch": B, "model": name, **row[name]}), flush=True)
                del step
        for bb in backbones:
            tail = "" if bb == "fused" else "_reference"
            row["speedup" + tail] = round(row["dense" + tail]["graph_ms"] / row["msa" + tail]["graph_ms"], 3)
        out["cases"].append(row)
        del cache
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
