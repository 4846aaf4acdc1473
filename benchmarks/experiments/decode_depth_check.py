"""How far the depth-extrapolated decode step (m3c bench model, a batch whose caches do not fit) is from a measured
one: at a batch that fits, the decode step of both models measured on their first L1 and L2 layers, extrapolated
linearly to the whole depth (bench_model.extrapolate_depth), against the whole model measured at the same batch and
context. Prints one JSON object (the rows, and the extrapolation's error per model and for the speedup).

    python benchmarks/experiments/decode_depth_check.py [--model llama3-8b] [--length 131072] [--batch 7]
        [--depths 14,29]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.bench import model as bm
from m3compile.bench.common import bench_models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=7)
    ap.add_argument("--depths", default="14,29")
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (a small checkpoint as --model)")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    cfg = bm.ModelBenchConfig(a.model, prefill_lengths=(), decode_lengths=(a.length,), batch=a.batch,
                              index_dim=a.index_dim, index_dtype="fp8", index_cache="fp8", device=a.device,
                              dtype=a.dtype, decode_steps=8 if a.device == "cpu" else 32)
    dense, sparse, what, _ = bench_models(a.model, device=a.device, dtype=a.dtype, index_dim=a.index_dim,
                                          index_dtype="fp8")
    page, dtype = sparse.args.msa.block_size, next(sparse.parameters()).dtype
    max_len = a.length + cfg.decode_steps + 8
    depths = [int(x) for x in a.depths.split(",")]
    rows = {}
    for n in depths + [sparse.args.n_layers]:
        pair = bm._decode_pair(bm.shallow(dense, n), bm.shallow(sparse, n), a.length, a.batch, max_len, page, dtype,
                               torch.float8_e4m3fn, cfg, print)
        rows[n] = {name: {k: pair[name][k] for k in ("graph_ms", "eager_ms")} for name in pair}
        if a.device == "cpu":  # no CUDA graph: compare the eager steps
            for r in rows[n].values():
                r["graph_ms"] = r["eager_ms"]
    L = sparse.args.n_layers
    res = {"model": what, "T": a.length, "batch": a.batch, "depths": depths, "layers": L, "gpu":
           torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "rows": {str(n): r for n, r in rows.items()}}
    for name in ("dense", "msa"):
        (l1, l2) = depths
        g1, g2 = rows[l1][name]["graph_ms"], rows[l2][name]["graph_ms"]
        est = g2 + (L - l2) * (g2 - g1) / (l2 - l1)
        res[f"{name}_graph_ms_measured"] = rows[L][name]["graph_ms"]
        res[f"{name}_graph_ms_extrapolated"] = round(est, 4)
        res[f"{name}_error"] = round(est / rows[L][name]["graph_ms"] - 1, 4)
    res["speedup_measured"] = round(res["dense_graph_ms_measured"] / res["msa_graph_ms_measured"], 3)
    res["speedup_extrapolated"] = round(res["dense_graph_ms_extrapolated"] / res["msa_graph_ms_extrapolated"], 3)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
