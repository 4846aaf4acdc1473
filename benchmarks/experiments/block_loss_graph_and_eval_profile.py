"""The block-ranking loss under --cuda-graph (the same as eager? its step cost) and where `m3c eval`'s time goes (one
profiled window of the lowered path), on a GPU: SmolLM2-135M shapes, random weights, 2 x 8K, block 64 / top-8.

    OUT=DIR python benchmarks/experiments/block_loss_graph_and_eval_profile.py   ->  DIR/session8_call5.json
"""
import json, os, copy, time
import torch
from m3compile.bench.common import bench_models, median_ms
from m3compile.train.distill import DistillConfig, DistillStep
out = {}
dense, sparse, _, _ = bench_models("smollm2-135m", device="cuda", dtype="bfloat16", block=64, topk=8)
x = torch.randint(0, 49152, (2, 8192), device="cuda")
for lam in (0.0, 1.0):
    cfg = DistillConfig(steps=1, seq_len=8192, batch=2, dtype="bfloat16", autocast="auto", block_loss=lam)
    res = {}
    for mode in ("warmup", "sparse"):
        e = DistillStep(copy.deepcopy(sparse), cfg, "cuda", mode)
        ms, peak = median_ms(lambda: e(x), steps=5, warmup=2, device="cuda")
        res[mode] = {"eager_ms": round(ms, 2), "peak_gb": round(peak, 2)}
        if lam:
            g = DistillStep(copy.deepcopy(sparse), cfg, "cuda", mode, cuda_graph=True)
            try:
                for _ in range(g.GRAPH_WARMUP + 1):
                    g(x)
                e2 = DistillStep(copy.deepcopy(sparse), cfg, "cuda", mode)
                with torch.no_grad():
                    for n, p in e2.params.items():
                        p.copy_(g.params[n])
                e2.opt.load_state_dict(copy.deepcopy(g.opt.state_dict()))
                a, b = e2(x), g(x)
                rel = lambda u, v: ((u.float() - v.float()).norm() / v.float().norm().clamp(min=1e-12)).item()
                res[mode]["graph_vs_eager"] = {"out_rel": [rel(u, v) for u, v in zip(a, b) if u is not None],
                                               "grad_rel_max": max(rel(g.params[n].grad, p.grad) for n, p in e2.params.items())}
                ms, _ = median_ms(lambda: g(x), steps=5, warmup=1, device="cuda")
                res[mode]["graph_ms"] = round(ms, 2)
            except Exception as err:  # noqa: BLE001
                res[mode]["graph_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        e = None  # frees the step before the next
        torch.cuda.empty_cache()
    out[f"block_loss_{lam}"] = res
    print(lam, res, flush=True)
# eval: one profiled window (lowered ops), top CUDA kernels and CPU ops
from m3compile.tools.evaluate import evaluate
m = sparse.eval()
tok = torch.randint(0, 49152, (2 * 8192 + 1,))
evaluate(m, tok, 8192, max_windows=2, oracle=False)
torch.cuda.synchronize(); t0 = time.perf_counter()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    r = evaluate(m, tok, 8192, max_windows=2, oracle=False)
torch.cuda.synchronize()
out["eval_profiled_s"] = round(time.perf_counter() - t0, 3)
out["eval_seconds"] = r.seconds
ka = prof.key_averages()
out["eval_top_cuda"] = [(e.key[:90], round(e.device_time_total / 1e3, 2)) for e in sorted(ka, key=lambda e: -e.device_time_total)[:25]]
out["eval_top_cpu"] = [(e.key[:90], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]]
print(json.dumps({k: out[k] for k in ("eval_profiled_s", "eval_seconds")}), flush=True)
json.dump(out, open(os.environ["OUT"] + "/session8_call5.json", "w"), indent=1)
