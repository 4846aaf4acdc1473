"""The decode attention kernel (`paged_attention_split_kernel` + its merge) at Llama-3-8B decode shapes, over launch
variants: bf16 and fp8 K/V caches, num_warps, a register cap (maxnreg), against the bytes its selected pages hold;
and a multi-page variant of the kernel (defined here, `pages_tile_kernel`) for the dense layer's loop.

A top-k decode step reads TOPK pages of K and V per (sequence, KV head): at batch 8, 8 KV heads, 16 pages of 128
tokens x 128 dims, that is 33.5 MB a layer in fp8 (67 MB in bf16), scattered over the cache. The kernel runs one
program per (sequence, KV head, page): three dependent loads (slot, page table, K/V tiles) and a [G, 128] x [128, 128]
online softmax. This script times each variant as CUDA-graph replays (the merge included), checks its output against
the default launch's, and prints one JSON row per variant (ms, TB/s of the page + scale bytes).

The dense layer (every page, `paged_attention` with ~64 splits of K / 64 pages) is where an fp8 cache streams at
half a bf16 cache's rate: each iteration of its loop waits on three dependent loads for one page, and an fp8 page
holds half the bytes. `pages_tile_kernel` gathers NPG pages per iteration into one [NPG * BS, D] tile (the slot and
page-table loads as vectors, masks instead of the `if blk >= 0` branch, so nothing stops the pipeliner), one online-
softmax step per tile. `--dense` times it against the product kernel over every page of the context.

    python benchmarks/experiments/paged_attention_variants.py [--batch 8] [--context 131072] [--topk 16] [--dense]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl
import triton.testing as tt

from m3compile.kernels import decode as dk
from m3compile.kernels._common import next_pow2
from m3compile.kernels._tl_common import online_softmax_block
from m3compile.kernels.decode.naive import quantize_kv


@triton.jit
def pages_tile_kernel(
    q, k_cache, v_cache, k_scale, v_scale, blocks, block_table, seq_lens, part_o, part_lse,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_sp, stride_st, stride_bb, stride_bh, stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    scale_log2, K, PPS,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    HAS_SCALE: tl.constexpr, NPG: tl.constexpr,
):
    # paged_attention_split_kernel's program (PPS slots of one (sequence, KV group), one partial + LSE), NPG slots a
    # tile; bf16 queries (the fp16 unit of the product kernel left out)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, DP)
    o_n = tl.arange(0, NPG * BN)
    o_pg = o_n // BN
    o_in = o_n % BN
    m_d = o_d < D
    m_g = o_g < G
    b_q = tl.load(q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :],
                  mask=m_g[:, None] & m_d[None, :], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    end = tl.minimum(i_s * PPS + PPS, K)
    for s0 in range(i_s * PPS, end, NPG):
        slot = s0 + o_pg
        blk = tl.load(blocks + i_b * stride_bb + i_h * stride_bh + slot, mask=slot < end, other=-1)
        phys = tl.load(block_table + i_b * stride_tb + blk, mask=blk >= 0, other=0).to(tl.int64)
        m_key = (o_in < BS) & (blk >= 0) & (blk * BS + o_in < seq_len)
        m_kd = m_key[:, None] & m_d[None, :]
        b_k = tl.load(k_cache + phys[:, None] * stride_kp + o_in[:, None] * stride_kt + i_h * stride_kh + o_d[None, :],
                      mask=m_kd, other=0.0)
        b_v = tl.load(v_cache + phys[:, None] * stride_vp + o_in[:, None] * stride_vt + i_h * stride_vh + o_d[None, :],
                      mask=m_kd, other=0.0)
        if HAS_SCALE:
            o_s = phys * stride_sp + o_in * stride_st + i_h
            m_i, l_i, acc = online_softmax_block(
                b_q, b_k.to(b_q.dtype), b_v.to(b_q.dtype), m_i, l_i, acc, m_key[None, :], scale_log2, True, False,
                tl.load(k_scale + o_s, mask=m_key, other=0.0), tl.load(v_scale + o_s, mask=m_key, other=0.0),
                KV_FACTORS=True)
        else:
            m_i, l_i, acc = online_softmax_block(b_q, b_k, b_v, m_i, l_i, acc, m_key[None, :], scale_log2, True, False)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(part_o + i_b * stride_pb + i_h * stride_ph + i_s * stride_ps + o_g[:, None] * DP + o_d[None, :],
             acc / l_safe[:, None])
    tl.store(part_lse + i_b * stride_lb + i_h * stride_lh + i_s * GP + o_g, m_i + tl.math.log2(l_safe))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--dense", action="store_true", help="every page (the dense layer), with the multi-page tiles")
    a = ap.parse_args()
    from m3compile.kernels.decode._tl_decode import paged_attention_split_kernel, paged_merge_kernel

    dev = "cuda"
    B, Hq, Hkv, D, bs = a.batch, a.heads, a.kv_heads, a.dim, a.block
    pages = -(-a.context // bs)
    K = pages if a.dense else a.topk
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k16 = torch.randn(B * pages, bs, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    v16 = torch.randn(B * pages, bs, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(B * pages, device=dev, generator=g).to(torch.int32).view(B, pages)
    lens = torch.full((B,), a.context, device=dev, dtype=torch.int32)
    if a.dense:
        blocks = torch.arange(pages, device=dev, dtype=torch.int32).expand(B, Hkv, pages).contiguous()
    else:
        blocks = torch.stack([torch.randperm(pages, device=dev, generator=g)[:K] for _ in range(B * Hkv)])
        blocks = blocks.view(B, Hkv, K).to(torch.int32).contiguous()
    G, GP, DP = Hq // Hkv, max(16, next_pow2(Hq // Hkv)), max(16, next_pow2(D))
    # (kernel, NPG, pages per split, warps, register cap, stages): the product launch first
    product_pps = 1 if K <= 64 else -(-K // 64)
    variants = [("product", 1, product_pps, w, r, st) for w in (4, 8) for r in (None, 168) for st in (2,)]
    if a.dense:
        variants += [("pages_tile", n, pps, w, None, st) for n in (1, 2, 4) for pps in (product_pps, 4 * product_pps)
                     for w in (4, 8) for st in (2, 3)]
    rows = []
    for cache in ("bf16", "fp8"):
        fp8 = cache == "fp8"
        if fp8:
            (kc, k_s), (vc, v_s) = quantize_kv(k16), quantize_kv(v16)
        else:
            kc, vc = k16, v16
        page_bytes = B * Hkv * K * bs * D * kc.element_size() * 2 + (B * Hkv * K * bs * 4 * 2 if fp8 else 0)
        want = dk.paged_attention(q, kc, vc, blocks, table, lens, **(dict(k_scale=k_s, v_scale=v_s) if fp8 else {}))
        for kernel, npg, pps, warps, regs, stages in variants:
            splits = -(-K // pps)
            part_o = torch.empty(B, Hkv, splits, GP, DP, dtype=torch.float32, device=dev)
            part_lse = torch.empty(B, Hkv, splits, GP, dtype=torch.float32, device=dev)
            ks, vs = (k_s, v_s) if fp8 else (part_lse, part_lse)
            out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
            extra = dict(maxnreg=regs) if regs else {}
            fn = paged_attention_split_kernel if kernel == "product" else pages_tile_kernel
            consts = dict(IEEE=False) if kernel == "product" else dict(NPG=npg)

            if kernel == "product":  # (no rotation: the product kernel's rot argument is unread)
                consts.update(ROTATE=False)
            rot = (part_lse,) if kernel == "product" else ()

            def run():
                fn[(B, Hkv, splits)](
                    q, kc, vc, ks, vs, *rot, blocks, table, lens, part_o, part_lse,
                    q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                    vc.stride(0), vc.stride(1), vc.stride(2), ks.stride(0), ks.stride(1) if fp8 else 0,
                    blocks.stride(0), blocks.stride(1), table.stride(0), part_o.stride(0), part_o.stride(1),
                    part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
                    D**-0.5 * math.log2(math.e), K, pps,
                    G=G, GP=GP, D=D, DP=DP, BS=bs, BN=max(16, next_pow2(bs)), HAS_SCALE=fp8,
                    num_warps=warps, num_stages=stages, **consts, **extra)
                paged_merge_kernel[(B, Hkv)](
                    part_o, part_lse, out, part_lse, part_o.stride(0), part_o.stride(1), part_o.stride(2),
                    part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), splits,
                    G=G, GP=GP, GM=next_pow2(G), SC=max(1, 4096 // (next_pow2(G) * DP)), D=D, DP=DP, ROTATE=False)

            row = dict(cache=cache, kernel=kernel, NPG=npg, pps=pps, warps=warps, maxnreg=regs, stages=stages)
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
    print(json.dumps({"batch": B, "context": a.context, "pages_read": K, "rows": len(rows)}))


if __name__ == "__main__":
    main()
