"""Design experiment behind kernels/sparse_attention.py's backward (H200 run in BENCHMARKS.md, 2026-12-01).

Times the backward alone (forward done once) at M3 shapes with dQ as fp32 atomics vs per-(token, slot) shares,
and 64 / 128 / 256 tokens per program; autotune limited to rows 32/64 x warps 4/8 x 2 stages.

    PYTHONPATH=. python benchmarks/experiments/backward_dq_paths.py 32768,131072 OUT.json
    PYTHONPATH=. M3C_AUTOTUNE=0 ncu --clock-control none -k regex:gather_q_bwd --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis python benchmarks/experiments/backward_dq_paths.py 32768 ncu
"""
import json, sys, time
import torch
import triton
import triton.testing as tt
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels.sparse_attention import _tl_sparse
from m3compile.kernels.indexer import select_blocks

lengths = [int(x) for x in sys.argv[1].split(",")]
ncu = len(sys.argv) > 2 and sys.argv[2] == "ncu"
if not ncu:
    tuner = _tl_sparse.gather_q_bwd_kernel
    tuner.configs = [triton.Config(dict(ROWS=r), num_warps=w, num_stages=s) for r in (32, 64) for w in (4, 8)
                     for s in (2,)]
H, Hkv, D, Di, bs, K = 64, 4, 128, 128, 128, 16
dev, dt = "cuda", torch.bfloat16
res = []
orig_chunk = sa._chunk
for T in lengths:
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    qi = torch.randn(1, T, Hkv, Di, device=dev, dtype=dt, generator=g)
    ki = torch.randn(1, T, Di, device=dev, dtype=dt, generator=g)
    d_out = torch.randn(1, H, T, D, device=dev, dtype=dt, generator=g)
    blocks = select_blocks(qi, ki, block_size=bs, topk=K)
    scale = D ** -0.5
    out, lse = sa._forward(q, k, v, blocks, bs, scale, sa.PARTIAL_BYTES, None, "all", True)
    fwd = lambda: sa._forward(q, k, v, blocks, bs, scale, sa.PARTIAL_BYTES, None, "all", True)
    row = dict(T=T)
    if not ncu:
        row["fwd_ms"] = tt.do_bench(fwd, rep=200, return_mode="median")
    ref = None
    variants = [("atomics", False, 64)] if ncu else [("atomics", False, 64), ("parts", True, 64), ("parts", True, 128), ("parts", True, 256)]
    if ncu:
        variants.append(("parts", True, 64))
    for name, parts, chunk in variants:
        sa._chunk = lambda gp, backward=False, c=chunk: c
        fn = lambda: sa._backward(q, k, v, blocks, bs, scale, out, lse, d_out, dq_parts=parts)
        t0 = time.time()
        got = fn()
        torch.cuda.synchronize()
        tune_s = time.time() - t0
        if ncu:
            continue
        ms = tt.do_bench(fn, rep=300, return_mode="median")
        if ref is None:
            ref = got
        err = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
        cfg = {str(k_): str(v_) for k_, v_ in _tl_sparse.gather_q_bwd_kernel.cache.items()}
        row[f"{name}_chunk{chunk}"] = dict(ms=ms, tune_s=tune_s, rel_to_atomics=err)
        print(T, name, chunk, f"{ms:.2f} ms", err, flush=True)
    sa._chunk = orig_chunk
    row["autotune"] = {str(k_): str(v_) for k_, v_ in _tl_sparse.gather_q_bwd_kernel.cache.items()}
    res.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, out, lse, d_out, blocks
    torch.cuda.empty_cache()
if not ncu:
    json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/exp_bwd.json", "w"), indent=1)
