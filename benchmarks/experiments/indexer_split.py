"""Where the prefill indexer's time goes: scoring vs the running top-k, per tile config, bf16 vs fp8.

index_topk_kernel (kernels/indexer/_tl_indexer.py) computes, per key block, the [rows, block] token scores (one matmul),
their causal block max, and inserts that block score into a per-row top-k kept in registers as int64 keys
(order-preserving score bits << 32 | block id: one min reduction and one select over the k slots). This script times,
on one GPU, at Llama-3-8B index shapes (8 index heads, one shared key head, block 128), variants of the same loop that
differ only in what follows the block max:

    topk     the production kernel (index_topk_kernel itself, each config launched directly)
    scores   no top-k at all: a running max per row (a lower bound: the matmul, the causal mask and the block max)
    minarg   the top-k kept as separate scores and ids: a min, an argmin and two selects per block (the kernel's
             earlier insertion)
    write    the block scores written out [B, H, T, n_blocks] bf16 (the two-pass design), then torch.topk timed apart

and checks that `minarg` selects the production kernel's blocks (as sets per row). Prints one JSON object.
(The variants loop as production does, in two loops: one loop with a branch pipelines worse and bounds nothing.)

    python benchmarks/experiments/indexer_split.py [--lengths 32768,131072] [--modes topk,scores,minarg,write]
        [--topk 16] [--dim 128]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl

from m3compile.kernels._tl_common import quantize_rows_e4m3
from m3compile.kernels.indexer._tl_indexer import _block_scores, index_topk_kernel
from m3compile.kernels.indexer import quantize_index_keys, select_blocks_reference
from m3compile.kernels._common import next_pow2
from m3compile.bench.common import median_ms

MODES = {"topk": 0, "scores": 1, "minarg": 2, "write": 3}


@triton.jit
def _insert_minarg(vals, ids, score, j, o_kp):
    # replace each row's current minimum by `score` where it is larger; -inf never enters
    cur = tl.min(vals, 1)
    arg = tl.argmin(vals, 1)
    hit = (score > cur)[:, None] & (o_kp[None, :] == arg[:, None])
    return tl.where(hit, score[:, None], vals), tl.where(hit, j, ids)


@triton.jit
def _after(vals, ids, run, score, j, o_kp, p_sc, m_row, MODE: tl.constexpr):
    # what follows a key block's score in each variant
    if MODE == 1:
        run = tl.maximum(run, score)
    elif MODE == 2:
        vals, ids = _insert_minarg(vals, ids, score, j, o_kp)
    elif MODE == 3:
        tl.store(p_sc + j, score.to(tl.bfloat16), mask=m_row)
    return vals, ids, run


@triton.jit(do_not_specialize=["T"])
def variant_kernel(
    q, k, k_scale, out, sc,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_sb, stride_ob, stride_oh, stride_ot,
    T,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, NBP: tl.constexpr, LOCAL: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP8_DOT: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
):
    i_t = tl.num_programs(0) - 1 - tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    BLOCK_T: tl.constexpr = ROWS // HP
    o_r = tl.arange(0, ROWS)
    o_tok = i_t * BLOCK_T + o_r // HP
    o_h = o_r % HP
    m_row = (o_tok < T) & (o_h < H)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    p_q = q + i_b * stride_qb + o_tok[:, None].to(tl.int64) * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    if HAS_SCALE:
        b_q = quantize_rows_e4m3(b_q, FP8_DOT)
    q_block = o_tok // BS
    o_kp = tl.arange(0, KP)
    vals = tl.where(o_kp[None, :] < TOPK, tl.full([ROWS, KP], float("-inf"), tl.float32), float("inf"))
    ids = tl.full([ROWS, KP], -1, tl.int32)
    run = tl.full([ROWS], float("-inf"), tl.float32)
    t_first = i_t * BLOCK_T
    t_last = tl.minimum(t_first + BLOCK_T, T) - 1
    n_full = (t_first + 1) // BS
    n_all = t_last // BS + 1
    o_n = tl.arange(0, BN)
    p_k0 = k + i_b * stride_kb + o_d[None, :]
    p_s0 = k_scale + i_b * stride_sb
    p_sc = sc + i_b * stride_ob + o_h * stride_oh + o_tok.to(tl.int64) * stride_ot
    for j in range(0, n_full):  # two loops as in the production kernel (one loop with a branch pipelines worse)
        o_key = j * BS + o_n
        m_key = o_n < BS
        score = _block_scores(b_q, p_k0 + o_key[:, None].to(tl.int64) * stride_kt, p_s0, j, o_key, m_key,
                              o_tok, m_d, False, HAS_SCALE, False, False)
        score = tl.where(j > q_block - LOCAL, float("inf"), score)
        vals, ids, run = _after(vals, ids, run, score, j, o_kp, p_sc, m_row, MODE)
    for j in range(n_full, n_all):
        o_key = j * BS + o_n
        m_key = (o_n < BS) & (o_key < T)
        score = _block_scores(b_q, p_k0 + o_key[:, None].to(tl.int64) * stride_kt, p_s0, j, o_key, m_key,
                              o_tok, m_d, True, HAS_SCALE, False, False)
        score = tl.where((j <= q_block) & (j > q_block - LOCAL), float("inf"), score)
        vals, ids, run = _after(vals, ids, run, score, j, o_kp, p_sc, m_row, MODE)
    p_o = out + i_b * stride_ob + o_h[:, None] * stride_oh + o_tok[:, None].to(tl.int64) * stride_ot + o_kp[None, :]
    m_o = m_row[:, None] & (o_kp[None, :] < TOPK)
    if MODE == 1:
        tl.store(p_o, tl.where(o_kp[None, :] == 0, run[:, None], 0.0).to(tl.int32), mask=m_o)
    elif MODE == 2:
        tl.store(p_o, ids, mask=m_o)


def _inputs(T: int, H: int, D: int, fp8: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    if fp8:
        k, scale = quantize_index_keys(k)
        return q, k, scale.float().contiguous()
    return q, k, q.new_empty(1, dtype=torch.float32)


def _launch(mode: str, q, k, scale, out, sc, T, H, D, block, topk, cfg, fp8):
    rows, warps, stages = cfg
    HP = next_pow2(H)
    grid = (-(-T // (rows // HP)), q.shape[0])
    common = (q, k, scale, out)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), scale.stride(0) if fp8 else 0,
               out.stride(0), out.stride(1), out.stride(2))
    meta = dict(H=H, HP=HP, D=D, DP=max(16, next_pow2(D)), BS=block, BN=max(16, next_pow2(block)), TOPK=topk,
                KP=next_pow2(topk), HAS_SCALE=fp8, FP8_DOT=fp8, ROWS=rows, num_warps=warps, num_stages=stages)
    if mode == "topk":
        index_topk_kernel.fn[grid](*common, *strides, T, 0, 0, D**-0.5, 1.0, 0, INIT=0, LOCAL=1, IEEE=False,
                                   BLOCK_SCALE=False, ADAPT=False, **meta)
    else:
        variant_kernel[grid](*common, sc, *strides, T, NBP=sc.shape[-1], LOCAL=1, MODE=MODES[mode], **meta)


def _time(fn, reps: int) -> float:
    return median_ms(fn, steps=reps, warmup=1, device="cuda")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--modes", default="topk,scores,minarg,write")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", default="topk", help="modes whose every config is timed (others: default only)")
    a = ap.parse_args()
    H, D, block, topk = a.heads, a.dim, a.block, a.topk
    cfgs = list(itertools.product((64, 128, 256), (4, 8), (2, 3)))
    # the production defaults (kernels/indexer/_tl_indexer.py): index_topk_kernel_wide's from 64 slots
    default = (64, 4, 3) if next_pow2(topk) >= 64 else (128, 4, 2)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "shape": dict(heads=H, dim=D, block=block, topk=topk), "rows": []}
    for T in [int(x) for x in a.lengths.split(",")]:
        nb = -(-T // block)
        for fp8 in (False, True):
            q, k, scale = _inputs(T, H, D, fp8)
            out = torch.empty(1, H, T, topk, dtype=torch.int32, device="cuda")
            sc_small = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16, device="cuda")
            ref_blocks = None
            for mode in a.modes.split(","):
                sc = torch.empty(1, H, T, nb, dtype=torch.bfloat16, device="cuda") if mode == "write" else sc_small
                if mode == "write":  # the scores buffer's strides must match out's for the shared pointer math
                    out_w = torch.empty(1, H, T, nb, dtype=torch.int32, device="cuda")
                for cfg in (cfgs if mode in a.sweep.split(",") else [default]):
                    o = out_w if mode == "write" else out
                    try:
                        ms = _time(lambda: _launch(mode, q, k, scale, o, sc, T, H, D, block, topk, cfg, fp8), a.reps)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile (registers, smem)
                        result["rows"].append(dict(T=T, fp8=fp8, mode=mode, cfg=cfg, error=str(e).splitlines()[0][:160]))
                        continue
                    flops = 2 * H * D * (T * (T + 1) / 2)
                    row = dict(T=T, fp8=fp8, mode=mode, cfg=cfg, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
                    if mode == "topk" and cfg == default:
                        ref_blocks = out.clone()
                    if mode == "minarg" and cfg == default and ref_blocks is not None:
                        same = (out.sort(-1).values == ref_blocks.sort(-1).values).all(-1).float().mean().item()
                        row["rows_equal_to_topk"] = round(same, 5)
                    if mode == "write":
                        row["torch_topk_ms"] = round(_time(lambda: sc.topk(topk - 1, dim=-1), a.reps), 3)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
            if T <= 4096 and ref_blocks is not None:  # small case: the production kernel against the reference
                want = select_blocks_reference(q.float(), k.float() if not fp8 else k, block_size=block, topk=topk,
                                               k_scale=scale if fp8 else None)
                result["reference_equal"] = (want.sort(-1).values == ref_blocks.sort(-1).values).float().mean().item()
            del q, k, scale, out
            torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
