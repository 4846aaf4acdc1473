"""The decode attention kernel (`paged_attention_split_kernel` + its merge) at Llama-3-8B decode shapes, over launch
variants: bf16 and fp8 K/V caches, num_warps, a register cap (maxnreg), against the bytes its selected pages hold.

A top-k decode step reads TOPK pages of K and V per (sequence, KV head): at batch 8, 8 KV heads, 16 pages of 128
tokens x 128 dims, that is 33.5 MB a layer in fp8 (67 MB in bf16), scattered over the cache. The kernel runs one
program per (sequence, KV head, page): three dependent loads (slot, page table, K/V tiles) and a [G, 128] x [128, 128]
online softmax. This script times each variant as CUDA-graph replays (the merge included), checks its output against
the default launch's, and prints one JSON row per variant (ms, TB/s of the page + scale bytes).

    python benchmarks/experiments/paged_attention_variants.py [--batch 8] [--context 131072] [--topk 16]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing as tt

from m3compile.kernels import decode as dk
from m3compile.kernels._common import next_pow2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    a = ap.parse_args()
    from m3compile.kernels.decode._tl_decode import paged_attention_split_kernel, paged_merge_kernel

    dev = "cuda"
    B, Hq, Hkv, D, bs, K = a.batch, a.heads, a.kv_heads, a.dim, a.block, a.topk
    pages = -(-a.context // bs)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k16 = torch.randn(B * pages, bs, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    v16 = torch.randn(B * pages, bs, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(B * pages, device=dev, generator=g).to(torch.int32).view(B, pages)
    lens = torch.full((B,), a.context, device=dev, dtype=torch.int32)
    blocks = torch.stack([torch.randperm(pages, device=dev, generator=g)[:K] for _ in range(B * Hkv)]).view(B, Hkv, K)
    blocks = blocks.to(torch.int32).contiguous()
    G, GP, DP = Hq // Hkv, max(16, next_pow2(Hq // Hkv)), max(16, next_pow2(D))
    rows = []
    for cache in ("bf16", "fp8"):
        fp8 = cache == "fp8"
        if fp8:
            amax_k = k16.float().abs().amax(-1).clamp_min(1e-12)
            amax_v = v16.float().abs().amax(-1).clamp_min(1e-12)
            k_s, v_s = (amax_k / 448.0).contiguous(), (amax_v / 448.0).contiguous()
            kc = (k16.float() / k_s[..., None]).to(torch.float8_e4m3fn)
            vc = (v16.float() / v_s[..., None]).to(torch.float8_e4m3fn)
        else:
            kc, vc = k16, v16
        part_o = torch.empty(B, Hkv, K, GP, DP, dtype=torch.float32, device=dev)
        part_lse = torch.empty(B, Hkv, K, GP, dtype=torch.float32, device=dev)
        ks, vs = (k_s, v_s) if fp8 else (part_lse, part_lse)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
        page_bytes = B * Hkv * K * bs * D * kc.element_size() * 2 + (B * Hkv * K * bs * 4 * 2 if fp8 else 0)
        want = dk.paged_attention(q, kc, vc, blocks, table, lens, **(dict(k_scale=k_s, v_scale=v_s) if fp8 else {}))
        for warps in (4, 8):
            for regs in (None, 168, 128):
                for stages in (2,):
                    extra = {} if regs is None else dict(maxnreg=regs)

                    def run():
                        paged_attention_split_kernel[(B, Hkv, K)](
                            q, kc, vc, ks, vs, blocks, table, lens, part_o, part_lse,
                            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                            vc.stride(0), vc.stride(1), vc.stride(2), ks.stride(0), ks.stride(1) if fp8 else 0,
                            blocks.stride(0), blocks.stride(1), table.stride(0), part_o.stride(0), part_o.stride(1),
                            part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
                            D**-0.5 * math.log2(math.e), K, 1,
                            G=G, GP=GP, D=D, DP=DP, BS=bs, BN=max(16, next_pow2(bs)), IEEE=False, HAS_SCALE=fp8,
                            num_warps=warps, num_stages=stages, **extra)
                        paged_merge_kernel[(B, Hkv)](
                            part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
                            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), K,
                            G=G, GP=GP, D=D, DP=DP)

                    row = dict(cache=cache, warps=warps, maxnreg=regs, stages=stages)
                    try:
                        run()
                        torch.cuda.synchronize()
                        err = float((out.float() - want.float()).abs().max())
                        ms = float(tt.do_bench_cudagraph(run, rep=100, return_mode="median"))
                        row.update(ms=round(ms, 4), tbps=round(page_bytes / ms / 1e9, 3), max_err=round(err, 5))
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row
                        row["error"] = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(json.dumps({"batch": B, "context": a.context, "topk": K, "rows": len(rows)}))


if __name__ == "__main__":
    main()
