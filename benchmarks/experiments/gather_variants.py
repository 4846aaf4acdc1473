"""Where gather-Q's forward pass spends its time (issue 17, item 4: G = 4 sparse attention at 0.35 of ideal).

A copy of gather_q_fwd_kernel (kernels/_tl_sparse.py, bf16 path) with switches that leave one stage out or do it
another way, timed on one GPU at Llama-3-8B attention shapes (32 query / 8 KV heads, d 128, block 128, top-16, the
fused indexer's selection on random index inputs, one sequence). The differences between rows place the time:

    base      the production loop (next tile's gathered Q loaded before this tile's matmuls)
    nostore   no partial-output store (the log-sum-exp is still stored)
    nopv      no P V matmul (P's row sums are stored as the output)
    noexp     no exponential: P = the shifted scores (timing only)
    contig    Q rows read from consecutive tokens instead of the gathered ones (no indirection)
    bf16exp   exp2 on packed bf16 pairs (PTX ex2.approx.ftz.bf16x2, sm_90): P is rounded to bf16 for P V anyway
    pipe      no manual prefetch: Triton's own software pipeline over the loop (tl.range, num_stages)
    dsplit    P V in two halves of the head dim, each half stored before the next is computed
    entry     partials in CSR entry order (row = entry * GP + head): a tile's rows are one contiguous range
    entry_dsplit, entry_tma   entry order with dsplit, or with whole tiles stored by TMA (host tensor descriptor)
    noprefetch  each tile's gathered Q loaded at the top of its own iteration
    rowsum    P V computed, only its row sums stored (P V without the output store)
    ahead     production since session 15: entry_tma with the payload and the tile's first token (which decides
              the unmasked path) loaded two tiles ahead, the log-sum-exps in entry order too
    ahead_lsetma  ahead with a whole tile's log-sum-exps stored by TMA as well (a 1-D descriptor): the masked store
              of them costs a cross-warp layout conversion (shared memory + barrier) per tile; not yet timed

each at the tile configs listed, with registers, spills and shared memory per program from the compiled kernel, and
the largest difference of the partial outputs from base (bf16exp, pipe, dsplit, noprefetch, and the entry-order
variants through the CSR's layout; the others compute something else). Base is the production loop up to session
13; session 14 made `entry_tma` production (its gather stage, CSR build included, is timed too), session 15
`ahead`. Prints one JSON object. H200 figures: BENCHMARKS.md, sessions 14 and 15.

    python benchmarks/experiments/gather_variants.py [--length 131072] [--variants base,nostore,...]
        [--configs 64x4x2,128x8x2]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from m3compile.kernels import sparse_attention as sa
from m3compile.kernels._common import next_pow2
from m3compile.kernels.sparse_attention._tl_sparse import _segment_block
from m3compile.kernels.indexer import select_blocks
from m3compile.tools.bench_common import median_ms

VARIANTS = {"base": 0, "nostore": 1, "nopv": 2, "noexp": 3, "contig": 4, "bf16exp": 5, "pipe": 6, "dsplit": 7,
            "entry": 8, "entry_dsplit": 9, "entry_tma": 10, "noprefetch": 11, "rowsum": 12, "ahead": 13,
            "ahead_lsetma": 14}
# variants that write the partials in CSR entry order ([entries, GP, D]: a tile's rows are one contiguous range)
ENTRY = (8, 9, 10, 13, 14)


@triton.jit
def _ex2_bf16(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)


@triton.jit
def _tile(b_q, b_k, b_v, b_v1, pl, m_row, o_r, o_hq, o_d, m_d, o_key, m_key, part_o, part_lse, t0, i_b, past,
          open_block, scale_log2, stride_pb, stride_pt, stride_ps, stride_ph, stride_lb, stride_lt, stride_ls, e0, end,
          desc, lse_e, lse_desc, first,
          K: tl.constexpr, V: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr):
    o_tl = pl // K
    o_slot = pl % K
    o_t = t0 + o_tl
    s = tl.dot(b_q, tl.trans(b_k))
    if V >= 13:  # production since session 15: the tile's first token (its smallest), loaded two tiles ahead
        unmasked = open_block & (t0 + first // K >= past)
    else:
        unmasked = open_block & (tl.min(tl.where(m_row, o_t, past)) >= past)
    if unmasked:
        m = tl.max(s, 1) * scale_log2
        x = s * scale_log2 - m[:, None]
    else:
        s = tl.where(m_key[None, :] & (o_key[None, :] <= o_t[:, None]), s * scale_log2, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(m == float("-inf"), 0.0, m)
        x = s - m[:, None]
    if V == 3:
        p = x
    elif V == 5:
        p = _ex2_bf16(x.to(tl.bfloat16)).to(tl.float32)
    else:
        p = tl.math.exp2(x)
    l = tl.sum(p, 1)
    l = tl.where(l == 0.0, 1.0, l)
    o_row = (e0 + o_r // GP) * GP + o_r % GP  # entry-order row of each tile row
    if V == 7 or V == 9:  # P V in two halves of the head dim, each stored before the next is computed
        pb = p.to(tl.bfloat16)
        inv = (1.0 / l)[:, None]
        HD: tl.constexpr = D // 2
        o_h = tl.arange(0, HD)
        o0 = tl.dot(pb, b_v) * inv
        if V == 9:
            tl.store(part_o + o_row[:, None].to(tl.int64) * D + o_h[None, :], o0.to(part_o.dtype.element_ty),
                     mask=m_row[:, None])
        else:
            tl.store(part_o + i_b * stride_pb + o_tl[:, None].to(tl.int64) * stride_pt + o_slot[:, None] * stride_ps
                     + o_hq[:, None] * stride_ph + o_h[None, :], o0.to(part_o.dtype.element_ty), mask=m_row[:, None])
        o1 = tl.dot(pb, b_v1) * inv
        if V == 9:
            tl.store(part_o + o_row[:, None].to(tl.int64) * D + HD + o_h[None, :], o1.to(part_o.dtype.element_ty),
                     mask=m_row[:, None])
        else:
            tl.store(part_o + i_b * stride_pb + o_tl[:, None].to(tl.int64) * stride_pt + o_slot[:, None] * stride_ps
                     + o_hq[:, None] * stride_ph + HD + o_h[None, :], o1.to(part_o.dtype.element_ty),
                     mask=m_row[:, None])
    elif V == 2:
        o = tl.zeros_like(b_q).to(tl.float32) + l[:, None]
    else:
        o = tl.dot(p.to(b_v.dtype), b_v)
        o = o * (1.0 / l)[:, None]
    if V == 12:
        lse = m + tl.math.log2(l) + tl.sum(o, 1)
        p_l = part_lse + i_b * stride_lb + o_tl.to(tl.int64) * stride_lt + o_slot * stride_ls + o_hq
        tl.store(p_l, lse, mask=m_row)
    elif V == 8:
        tl.store(part_o + o_row[:, None].to(tl.int64) * D + o_d[None, :], o.to(part_o.dtype.element_ty),
                 mask=m_row[:, None] & m_d[None, :])
    elif V == 10 or V >= 13:
        if e0 + TOK <= end:
            desc.store([e0 * GP, 0], o.to(tl.bfloat16))
        else:
            tl.store(part_o + o_row[:, None].to(tl.int64) * D + o_d[None, :], o.to(part_o.dtype.element_ty),
                     mask=m_row[:, None] & m_d[None, :])
    elif V != 1 and V != 7 and V != 9:
        p_o = (part_o + i_b * stride_pb + o_tl[:, None].to(tl.int64) * stride_pt + o_slot[:, None] * stride_ps
               + o_hq[:, None] * stride_ph + o_d[None, :])
        tl.store(p_o, o.to(part_o.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
    lse = m + tl.math.log2(l)
    if V >= 13:  # entry order, as production; ahead_lsetma stores a whole tile's log-sum-exps by TMA too
        if V == 14 and e0 + TOK <= end:
            lse_desc.store([e0 * GP], lse)
        else:
            tl.store(lse_e + o_row, lse, mask=m_row)
    else:
        p_l = part_lse + i_b * stride_lb + o_tl.to(tl.int64) * stride_lt + o_slot * stride_ls + o_hq
        tl.store(p_l, lse, mask=m_row)


@triton.jit
def variant_kernel(
    q, k, v, part_o, part_lse, tile_seg, tile_start, seg_off, payload, desc, lse_e, lse_desc,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_pb, stride_pt, stride_ps, stride_ph, stride_lb, stride_lt, stride_ls,
    T, t0, n_seg, scale_log2,
    HKV: tl.constexpr, NB: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    ROWS: tl.constexpr, V: tl.constexpr, NS: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        start, end, i_b, i_h, o_d, m_d, o_key, m_key, m_kd, b_k, b_v = _segment_block(
            seg, pid, tile_start, seg_off, k, v, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            T, HKV, NB, D, DP, BS, BN, CHUNK)
        b_v1 = b_v
        if V == 7 or V == 9:  # V as two head-dim halves (the whole block's load above is then unused)
            HD: tl.constexpr = D // 2
            o_h = tl.arange(0, HD)
            p_v = v + i_b * stride_vb + i_h * stride_vh + o_key[:, None].to(tl.int64) * stride_vt + o_h[None, :]
            b_v = tl.load(p_v, mask=m_key[:, None], other=0.0)
            b_v1 = tl.load(p_v + HD, mask=m_key[:, None], other=0.0)
        TOK: tl.constexpr = ROWS // GP if ROWS >= GP else 1
        o_r = tl.arange(0, TOK * GP)
        o_g = o_r % GP
        o_hq = i_h * G + o_g
        past = (seg % NB + 1) * BS
        open_block = (BN == BS) & (past <= T)
        if V >= 13:  # production's loop since session 15: payload and first token two tiles ahead
            o_e = start + o_r // GP
            m_next = (o_e < end) & (o_g < G)
            pl_next = tl.load(payload + o_e, mask=m_next, other=0)
            q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                             + (t0 + pl_next // K)[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                             mask=m_next[:, None] & m_d[None, :], other=0.0)
            m_after = (o_e + TOK < end) & (o_g < G)
            pl_after = tl.load(payload + o_e + TOK, mask=m_after, other=0)
            tok_next = tl.load(payload + start, mask=start < end, other=0)
            tok_after = tl.load(payload + start + TOK, mask=start + TOK < end, other=0)
            for e0 in range(start, end, TOK):
                m_row, pl, b_q = m_next, pl_next, q_next
                m_next, pl_next = m_after, pl_after
                q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                                 + (t0 + pl_next // K)[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                                 mask=m_next[:, None] & m_d[None, :], other=0.0)
                o_e = e0 + 2 * TOK + o_r // GP
                m_after = (o_e < end) & (o_g < G)
                pl_after = tl.load(payload + o_e, mask=m_after, other=0)
                tok = tok_next
                tok_next = tok_after
                tok_after = tl.load(payload + e0 + 2 * TOK, mask=e0 + 2 * TOK < end, other=0)
                _tile(b_q, b_k, b_v, b_v1, pl, m_row, o_r, o_hq, o_d, m_d, o_key, m_key, part_o, part_lse, t0, i_b,
                      past, open_block, scale_log2, stride_pb, stride_pt, stride_ps, stride_ph, stride_lb, stride_lt,
                      stride_ls, e0, end, desc, lse_e, lse_desc, tok, K, V, GP, D, TOK)
        elif V == 6 or V == 11:
            for e0 in tl.range(start, end, TOK, num_stages=NS if V == 6 else 1):
                o_e = e0 + o_r // GP
                m_row = (o_e < end) & (o_g < G)
                pl = tl.load(payload + o_e, mask=m_row, other=0)
                b_q = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                              + (t0 + pl // K)[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                              mask=m_row[:, None] & m_d[None, :], other=0.0)
                _tile(b_q, b_k, b_v, b_v1, pl, m_row, o_r, o_hq, o_d, m_d, o_key, m_key, part_o, part_lse, t0, i_b,
                      past, open_block, scale_log2, stride_pb, stride_pt, stride_ps, stride_ph, stride_lb, stride_lt,
                      stride_ls, e0, end, desc, lse_e, lse_desc, 0, K, V, GP, D, TOK)
        else:
            o_e = start + o_r // GP
            m_next = (o_e < end) & (o_g < G)
            pl_next = tl.load(payload + o_e, mask=m_next, other=0)
            if V == 4:
                q_tok = (o_e % T)
            else:
                q_tok = t0 + pl_next // K
            q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh + q_tok[:, None].to(tl.int64) * stride_qt
                             + o_d[None, :], mask=m_next[:, None] & m_d[None, :], other=0.0)
            for e0 in range(start, end, TOK):
                m_row, pl, b_q = m_next, pl_next, q_next
                o_e = e0 + TOK + o_r // GP
                m_next = (o_e < end) & (o_g < G)
                pl_next = tl.load(payload + o_e, mask=m_next, other=0)
                if V == 4:
                    q_tok = (o_e % T)
                else:
                    q_tok = t0 + pl_next // K
                q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                                 + q_tok[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                                 mask=m_next[:, None] & m_d[None, :], other=0.0)
                _tile(b_q, b_k, b_v, b_v1, pl, m_row, o_r, o_hq, o_d, m_d, o_key, m_key, part_o, part_lse, t0, i_b,
                      past, open_block, scale_log2, stride_pb, stride_pt, stride_ps, stride_ph, stride_lb, stride_lt,
                      stride_ls, e0, end, desc, lse_e, lse_desc, 0, K, V, GP, D, TOK)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--configs", default="64x4x2", help="ROWSxWARPSxSTAGES[xMAXNREG], comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = a.device
    T, H, Hkv, D, bs, topk = a.length, a.heads, a.kv_heads, 128, 128, 16
    G = H // Hkv
    GP, DP, NB = next_pow2(G), D, -(-T // bs)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v = (rnd(1, T, n, D).transpose(1, 2) for n in (H, Hkv, Hkv))
    blocks = select_blocks(rnd(1, T, Hkv, 128), rnd(1, T, 128), block_size=bs, topk=topk)
    chunk = sa._chunk(GP)
    csr = sa.block_csr(blocks, NB, chunk)
    part_o = torch.empty(1, T, topk, H, D, dtype=torch.bfloat16, device=dev)
    part_lse = torch.empty(1, T, topk, H, dtype=torch.float32, device=dev)
    scale_log2 = D ** -0.5 * math.log2(math.e)
    n_all = Hkv * T * topk  # CSR entries, -1 slots included (sorted last)
    part_e = torch.empty(n_all * GP, D, dtype=torch.bfloat16, device=dev)  # entry order: row = entry * GP + head
    lse_e = torch.empty(n_all * GP, dtype=torch.float32, device=dev)  # entry order too (the ahead variants)
    # the 64-row configs' tiles (under the interpreter a smoke run: its bf16 descriptor stores are wrong)
    desc = TensorDescriptor.from_tensor(part_e, block_shape=[64, D])
    lse_desc = TensorDescriptor.from_tensor(lse_e, block_shape=[64])
    grid = (csr.tile_seg.numel(),)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), part_o.stride(0), part_o.stride(1), part_o.stride(2),
              part_o.stride(3), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    consts = dict(HKV=Hkv, NB=NB, K=topk, G=G, GP=GP, D=D, DP=DP, BS=bs, BN=bs, CHUNK=chunk)

    def base_run():  # the pre-session-14 production loop: partials per (token, slot, head)
        variant_kernel[grid](q, k, v, part_o, part_lse, csr.tile_seg, csr.tile_start, csr.seg_off, csr.payload, desc,
                             lse_e, lse_desc, *common, T, 0, Hkv * NB, scale_log2, **consts, ROWS=64, V=0, NS=2, num_warps=4,
                             num_stages=2)

    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "T": T, "heads": H, "kv_heads": Hkv, "rows": []}
    # production (kernels/_tl_sparse.py: since session 14 the partials in CSR entry order, whole tiles by TMA)
    prod_ms = median_ms(lambda: sa.forward_stage(q, k, v, blocks, block_size=bs, stage="gather"), steps=a.reps,
                        warmup=2, device=dev)[0]
    base_run()
    ref_o = part_o.clone()  # what every variant's partials are compared with
    ref_lse = part_lse.clone()
    res["production_gather_stage_ms"] = prod_ms
    # matmul FLOPs on whole blocks and bytes of gathered Q + partial writes (what the pass must move)
    n_entries = int(csr.seg_off[-1].item())
    res["tflop"] = 4 * n_entries * G * bs * D / 1e12
    res["gbytes"] = n_entries * G * (2 * D * 2 + 4) / 1e9
    print(json.dumps({"production_gather_stage_ms": prod_ms}), flush=True)
    for cfg in a.configs.split(","):
        parts = [int(x) for x in cfg.split("x")]
        rows, warps, stages = parts[:3]
        extra = {"maxnreg": parts[3]} if len(parts) > 3 else {}
        for name in a.variants.split(","):
            V = VARIANTS[name]
            compiled = []

            def run():
                c = variant_kernel[grid](q, k, v, part_e if V in ENTRY else part_o, part_lse, csr.tile_seg,
                                         csr.tile_start, csr.seg_off, csr.payload, desc, lse_e, lse_desc, *common,
                                         T, 0, Hkv * NB,
                                         scale_log2, **consts, ROWS=rows, V=V,
                                         NS=stages, num_warps=warps, num_stages=stages, **extra)
                if not compiled:
                    compiled.append(c)

            try:
                ms = median_ms(run, steps=a.reps, warmup=2, device=dev)[0]
            except Exception as e:  # a config that does not compile or fit is a row too
                row = {"variant": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                continue
            c = compiled[0]
            row = {"variant": name, "config": cfg, "ms": ms, "tflops": res["tflop"] / ms * 1e3,
                   "tb_s": res["gbytes"] / ms}
            if c is not None:  # None under the interpreter
                row.update(n_regs=c.n_regs, n_spills=c.n_spills, shared_kb=c.metadata.shared / 1024)
            if name in ("base", "bf16exp", "pipe", "dsplit", "noprefetch"):
                row["max_abs_diff_vs_base"] = max(
                    (part_o[:, i:i + 4096].float() - ref_o[:, i:i + 4096].float()).abs().max().item()
                    for i in range(0, T, 4096))
            if V in ENTRY:  # a sample of live entries against production's (token, slot, head) layout
                i = torch.randint(0, n_entries, (1 << 20,), device=dev, generator=g)
                seg = torch.searchsorted(csr.seg_off, i.int(), right=True) - 1
                h, pl = (seg // NB) % Hkv, csr.payload[i]
                heads = (h * G)[:, None] + torch.arange(G, device=dev)
                want = ref_o[0, (pl // topk)[:, None], (pl % topk)[:, None], heads]
                got = part_e.view(n_all, GP, D)[i, :G]
                row["max_abs_diff_vs_base"] = (got.float() - want.float()).abs().max().item()
                if V >= 13:  # their log-sum-exps are in entry order as well
                    want_l = ref_lse[0, (pl // topk)[:, None], (pl % topk)[:, None], heads]
                    got_l = lse_e.view(n_all, GP)[i, :G]
                    row["lse_max_abs_diff_vs_base"] = (got_l - want_l).abs().max().item()
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
