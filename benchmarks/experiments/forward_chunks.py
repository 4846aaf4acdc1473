"""Design experiment: the sparse forward at 64 / 128 / 256 tokens per program, whole pass vs gather pass alone
(the difference is the combine kernel). H200 run in BENCHMARKS.md, 2026-12-01.

    PYTHONPATH=. python benchmarks/experiments/forward_chunks.py 32768,131072 OUT.json
"""
import json, sys
import torch
import triton
import triton.testing as tt
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels.sparse_attention import _tl_sparse
from m3compile.kernels.indexer import select_blocks

_tl_sparse.gather_q_fwd_kernel.configs = [triton.Config(dict(ROWS=r), num_warps=w, num_stages=s)
                                          for r in (64, 128) for w in (4, 8) for s in (2,)]
H, Hkv, D, Di, bs, K = 64, 4, 128, 128, 128, 16
dev, dt = "cuda", torch.bfloat16
res = []
orig = sa._chunk
for T in [int(x) for x in sys.argv[1].split(",")]:
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g).transpose(1, 2)
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, generator=g)
    qi = torch.randn(1, T, Hkv, Di, device=dev, dtype=dt, generator=g)
    ki = torch.randn(1, T, Di, device=dev, dtype=dt, generator=g)
    blocks = select_blocks(qi, ki, block_size=bs, topk=K)
    row = dict(T=T)
    for chunk in (64, 128, 256):
        sa._chunk = lambda gp, backward=False, c=chunk: c
        for stage in ("all", "gather"):
            fn = lambda: sa._forward(q, k, v, blocks, bs, D**-0.5, sa.PARTIAL_BYTES, None, stage, True)
            fn(); torch.cuda.synchronize()
            row[f"{stage}_chunk{chunk}"] = tt.do_bench(fn, rep=300, return_mode="median")
            print(T, chunk, stage, row[f"{stage}_chunk{chunk}"], flush=True)
    sa._chunk = orig
    row["autotune"] = {str(k_): str(v_) for k_, v_ in _tl_sparse.gather_q_fwd_kernel.cache.items()}
    res.append(row)
    del q, k, v, blocks
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[2], "w"), indent=1)
