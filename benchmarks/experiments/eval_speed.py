"""Where `m3c eval`'s time goes (issue 16: "m3c eval runs at the forward's speed").

On one model (a preset with random weights, or a checkpoint directory), the same windows: the bare dense forward
(what one pass of eval costs at the least), then `tools.evaluate.evaluate` with and without the oracle pass, each
timed after a warm-up call (compilation excluded), and each pass of one window profiled: the top kernels by GPU time.
Prints one JSON object; the ratio `per_pass` is eval's tokens/s times its number of forwards over the dense forward's.

    python benchmarks/experiments/eval_speed.py [--model smollm2-135m] [--windows 8] [--seq-len 8192] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.tools import evaluate as ev
from m3compile.bench.common import bench_models, median_ms, sync


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    dense, sparse, what, _ = bench_models(a.model, device="cuda", dtype=a.dtype, block=a.block, topk=a.topk)
    del dense
    g = torch.Generator().manual_seed(0)
    n = a.windows * a.seq_len + 1
    tokens = torch.randint(0, sparse.args.vocab_size, (n,), generator=g)
    x = tokens[: a.seq_len].view(1, -1).cuda()
    out = {"model": what, "dtype": a.dtype, "windows": a.windows, "seq_len": a.seq_len, "batch": a.batch}

    def fwd(sparse_on: bool, selection="index"):
        def f():
            with torch.no_grad(), sparse.using_kernels(True):
                sparse.set_sparse(sparse_on)
                sparse.set_selection(selection)
                sparse(x)
                sparse.set_sparse(True)
                sparse.set_selection("index")
        return f

    for name, f in (("dense forward", fwd(False)), ("sparse forward", fwd(True)), ("oracle forward", fwd(True, "oracle"))):
        ms, _ = median_ms(f, steps=5, warmup=2, device="cuda")
        out[name + " ms/window"] = round(ms, 2)
    for oracle in (False, True):
        ev.evaluate(sparse, tokens, a.seq_len, oracle=oracle, batch=a.batch)  # warm-up: compiles
        sync("cuda")
        t0 = time.perf_counter()
        rep = ev.evaluate(sparse, tokens, a.seq_len, oracle=oracle, batch=a.batch)
        sync("cuda")
        s = time.perf_counter() - t0
        passes = 3 if oracle else 2
        key = "eval" + ("" if oracle else " --no-oracle")
        out[key + " s"] = round(s, 3)
        out[key + " ms/window"] = round(s * 1e3 / a.windows, 2)
        out[key + " per_pass_ratio"] = round(out["dense forward ms/window"] * passes / (s * 1e3 / a.windows), 3)
        out[key + " seconds (reported)"] = round(rep.seconds, 3)
    from torch.profiler import ProfilerActivity, profile
    one = tokens[: a.seq_len + 1]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ev.evaluate(sparse, one, a.seq_len, oracle=True)
        sync("cuda")
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append((t / 1e3, e.count, e.key[:90]))
    rows.sort(reverse=True)
    out["profile one window, top kernels (ms, count, name)"] = [list(r) for r in rows[:25]]
    out["profile total kernel ms"] = round(sum(r[0] for r in rows if not r[2].startswith(("aten::", "m3c", "cuda"))), 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
