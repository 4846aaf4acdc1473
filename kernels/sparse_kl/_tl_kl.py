"""Triton kernels of kernels/sparse_kl/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import csr_segment, dot


@triton.jit
def _segment(seg, pid, tile_start, seg_off, k, kidx, stride_kb, stride_kh, stride_kt, stride_ib, stride_it, T,
             HKV: tl.constexpr, NB: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DI: tl.constexpr,
             DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr):
    """A program's CSR entries [start, end) of segment `seg` = (batch, group, key block j), and that block's teacher
    keys [BN, DP] and index keys [BN, DIP]."""
    start, end, i_b, i_h, j = csr_segment(seg, pid, tile_start, seg_off, HKV, NB, CHUNK)
    o_n = tl.arange(0, BN)
    o_key = j * BS + o_n
    m_key = (o_n < BS) & (o_key < T)
    o_d = tl.arange(0, DP)
    o_di = tl.arange(0, DIP)
    b_k = tl.load(k + i_b * stride_kb + i_h * stride_kh + o_key[:, None].to(tl.int64) * stride_kt + o_d[None, :],
                  mask=m_key[:, None] & (o_d < D)[None, :], other=0.0)
    b_ki = tl.load(kidx + i_b * stride_ib + o_key[:, None].to(tl.int64) * stride_it + o_di[None, :],
                   mask=m_key[:, None] & (o_di < DI)[None, :], other=0.0)
    return start, end, i_b, i_h, o_key, m_key, o_d, o_di, b_k, b_ki


@triton.jit
def _tile(q, qidx, tlse, b_k, b_ki, i_b, i_h, o_t, m_row, o_d, o_di, m_s,
          stride_qb, stride_qh, stride_qt, stride_xb, stride_xt, stride_xh, stride_lb, stride_lt, scale_log2,
          iscale_log2, TOK: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
          IEEE: tl.constexpr):
    """For TOK gathered tokens x the block's keys: the teacher's probability P (mean over the group's G heads of
    softmax with the attention's log-sum-exp; 0 outside the support), the student's logits z (base 2, -inf outside)
    and the tokens' index queries."""
    b_qi = tl.load(qidx + i_b * stride_xb + o_t[:, None].to(tl.int64) * stride_xt + i_h * stride_xh + o_di[None, :],
                   mask=m_row[:, None] & (o_di < DI)[None, :], other=0.0)
    z = tl.where(m_s, dot(b_qi, tl.trans(b_ki), IEEE) * iscale_log2, float("-inf"))
    p = tl.zeros([TOK, BN], tl.float32)
    m_qd = m_row[:, None] & (o_d < D)[None, :]
    for h in range(G):  # the group's heads one at a time: rows stay tokens, so P needs no cross-row reduction
        hq = i_h * G + h
        b_q = tl.load(q + i_b * stride_qb + hq * stride_qh + o_t[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                      mask=m_qd, other=0.0)
        b_l = tl.load(tlse + i_b * stride_lb + o_t.to(tl.int64) * stride_lt + hq, mask=m_row, other=0.0)
        s = dot(b_q, tl.trans(b_k), IEEE)
        p += tl.where(m_s, tl.math.exp2(s * scale_log2 - b_l[:, None]), 0.0)
    return p * (1.0 / G), z, b_qi


_FULL = [dict(TOK=t, num_warps=w, num_stages=s) for t in (16, 32, 64) for w in (4, 8) for s in (1, 2)]
_INTERPRET = dict(TOK=16, num_warps=4, num_stages=1)
# M3C_AUTOTUNE=0 defaults, the H200's tuned choices at SmolLM2 shapes (G 3, d 64, 8K; BENCHMARKS.md):
# the forward takes 64-token tiles (its warm-up KL 67 -> 51 ms per step), the backward keeps 32
_FWD_CONFIGS = dict(full=_FULL, interpret=_INTERPRET, default=dict(TOK=64, num_warps=4, num_stages=2))
_BWD_CONFIGS = dict(full=_FULL, interpret=_INTERPRET, default=dict(TOK=32, num_warps=4, num_stages=2))


@autotune(configs=configs(**_FWD_CONFIGS), key=["G", "DP", "DIP", "BN", "CHUNK", "IEEE", "tune_bucket"])
@triton.jit(do_not_specialize=["T", "n_seg", "tune_bucket"])
def sparse_kl_fwd_kernel(
    q, k, qidx, kidx, tlse, part_lse, part_stat, tile_seg, tile_start, seg_off, payload,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_xb, stride_xt, stride_xh,
    stride_ib, stride_it, stride_lb, stride_lt, stride_pb, stride_ph, stride_pt, stride_sb, stride_sh, stride_st,
    T, n_seg, scale_log2, iscale_log2, tune_bucket,
    HKV: tl.constexpr, NB: tl.constexpr, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    DI: tl.constexpr, DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, TOK: tl.constexpr,
):
    # one program: one (batch, group, key block) CSR segment chunk, the KV-outer layout of the attention kernels;
    # per gathered (token, slot): the student's log-sum-exp over the block, sum P ln P, sum P z and sum P
    pid = tl.program_id(0)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        start, end, i_b, i_h, o_key, m_key, o_d, o_di, b_k, b_ki = _segment(
            seg, pid, tile_start, seg_off, k, kidx, stride_kb, stride_kh, stride_kt, stride_ib, stride_it, T,
            HKV, NB, D, DP, DI, DIP, BS, BN, CHUNK)
        o_r = tl.arange(0, TOK)
        for e0 in range(start, end, TOK):
            m_row = e0 + o_r < end
            pl = tl.load(payload + e0 + o_r, mask=m_row, other=0)
            o_t = pl // K
            o_slot = pl % K
            m_s = m_row[:, None] & m_key[None, :] & (o_key[None, :] <= o_t[:, None])
            p, z, _ = _tile(q, qidx, tlse, b_k, b_ki, i_b, i_h, o_t, m_row, o_d, o_di, m_s,
                            stride_qb, stride_qh, stride_qt, stride_xb, stride_xt, stride_xh, stride_lb, stride_lt,
                            scale_log2, iscale_log2, TOK, BN, G, D, DI, IEEE)
            mz = tl.max(z, 1)
            mz = tl.where(mz == float("-inf"), 0.0, mz)
            lz = tl.sum(tl.math.exp2(z - mz[:, None]), 1)
            lse_blk = tl.where(lz > 0.0, mz + tl.math.log2(tl.where(lz > 0.0, lz, 1.0)), float("-inf"))
            plogp = tl.sum(tl.where(p > 0.0, p * tl.log(tl.where(p > 0.0, p, 1.0)), 0.0), 1)
            pz = tl.sum(p * tl.where(m_s, z, 0.0), 1)
            psum = tl.sum(p, 1)
            row = i_b * stride_pb + i_h * stride_ph + o_t.to(tl.int64) * stride_pt + o_slot
            tl.store(part_lse + row, lse_blk, mask=m_row)
            srow = i_b * stride_sb + i_h * stride_sh + o_t.to(tl.int64) * stride_st + o_slot * 3
            tl.store(part_stat + srow, plogp, mask=m_row)
            tl.store(part_stat + srow + 1, pz, mask=m_row)
            tl.store(part_stat + srow + 2, psum, mask=m_row)


@autotune(configs=configs(**_BWD_CONFIGS), key=["G", "DP", "DIP", "BN", "CHUNK", "IEEE", "SCALAR_GRAD", "tune_bucket"],
                 reset_to_zero=["dq", "dk"])
@triton.jit(do_not_specialize=["T", "n_seg", "tune_bucket"])
def sparse_kl_bwd_kernel(
    q, k, qidx, kidx, tlse, lse_s, psum, d_kl, dq, dk, tile_seg, tile_start, seg_off, payload,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_xb, stride_xt, stride_xh,
    stride_ib, stride_it, stride_lb, stride_lt, stride_rb, stride_rh, stride_gb, stride_gt, stride_gh,
    stride_hb, stride_ht,
    T, n_seg, scale_log2, iscale_log2, iscale, grad_scale, tune_bucket,
    HKV: tl.constexpr, NB: tl.constexpr, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    DI: tl.constexpr, DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, SCALAR_GRAD: tl.constexpr, TOK: tl.constexpr,
):
    # same segments and tiles as the forward; d(student logit) = d_kl * (Q * sum P - P) on the support: d(q_idx)
    # rows get one share per selected block (relaxed fp32 atomics), d(k_idx) of the block accumulates on chip
    pid = tl.program_id(0)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        start, end, i_b, i_h, o_key, m_key, o_d, o_di, b_k, b_ki = _segment(
            seg, pid, tile_start, seg_off, k, kidx, stride_kb, stride_kh, stride_kt, stride_ib, stride_it, T,
            HKV, NB, D, DP, DI, DIP, BS, BN, CHUNK)
        acc_dk = tl.zeros([BN, DIP], tl.float32)
        o_r = tl.arange(0, TOK)
        for e0 in range(start, end, TOK):
            m_row = e0 + o_r < end
            o_t = tl.load(payload + e0 + o_r, mask=m_row, other=0) // K
            m_s = m_row[:, None] & m_key[None, :] & (o_key[None, :] <= o_t[:, None])
            p, z, b_qi = _tile(q, qidx, tlse, b_k, b_ki, i_b, i_h, o_t, m_row, o_d, o_di, m_s,
                               stride_qb, stride_qh, stride_qt, stride_xb, stride_xt, stride_xh, stride_lb,
                               stride_lt, scale_log2, iscale_log2, TOK, BN, G, D, DI, IEEE)
            r = i_b * stride_rb + i_h * stride_rh + o_t.to(tl.int64)
            b_ls = tl.load(lse_s + r, mask=m_row, other=0.0)
            b_ps = tl.load(psum + r, mask=m_row, other=0.0)
            if SCALAR_GRAD:  # the gradient of the mean: one value for every row, times 1 / n_rows
                b_g = tl.zeros([TOK], tl.float32) + tl.load(d_kl).to(tl.float32) * grad_scale
            else:
                b_g = tl.load(d_kl + r, mask=m_row, other=0.0)
            qs = tl.math.exp2(z - b_ls[:, None])  # 0 outside the support (z = -inf there)
            ds = tl.where(m_s, (qs * b_ps[:, None] - p) * (b_g * iscale)[:, None], 0.0)
            ds = ds.to(b_ki.dtype)  # the index keys' dtype (fp32 in fp32 kernels: no rounding there)
            dq_part = dot(ds, b_ki, IEEE)
            acc_dk += dot(tl.trans(ds), b_qi, IEEE)
            tl.atomic_add(dq + i_b * stride_gb + o_t[:, None].to(tl.int64) * stride_gt + i_h * stride_gh
                          + o_di[None, :], dq_part, mask=m_row[:, None] & (o_di < DI)[None, :], sem="relaxed")
        tl.atomic_add(dk + i_b * stride_hb + o_key[:, None].to(tl.int64) * stride_ht + o_di[None, :], acc_dk,
                      mask=m_key[:, None] & (o_di < DI)[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["N", "T"])
def sparse_kl_merge_kernel(
    part_lse, part_stat, blocks, kl, lse_s, psum, stride_bb, stride_bh, stride_bt, N, T, HI: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, CLEAN: tl.constexpr,
):
    # one program: ROWS (batch, group, token) rows; merges each row's per-slot partials (-1 slots skipped, never
    # written): the student's log-sum-exp (base 2), sum P ln P, sum P z and sum P, then the row's KL. CLEAN: the
    # -1 slots' sum P set to 0, so part_stat[..., 2] is the teacher's mass per slot
    o_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = o_r < N
    o_r = o_r.to(tl.int64)
    o_k = tl.arange(0, KP)
    i_b = o_r // (HI * T)
    i_h = (o_r // T) % HI
    i_t = o_r % T
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    ids = tl.load(blocks + (i_b * stride_bb + i_h * stride_bh + i_t * stride_bt)[:, None] + o_k[None, :], mask=m_rk,
                  other=-1)
    valid = m_rk & (ids >= 0)
    p = o_r[:, None] * K + o_k[None, :]
    b_lse = tl.load(part_lse + p, mask=valid, other=float("-inf"))
    mx = tl.max(b_lse, 1)
    mu = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(tl.math.exp2(b_lse - mu[:, None]), 1)
    lse = tl.where(total > 0.0, mu + tl.math.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    plogp = tl.sum(tl.load(part_stat + p * 3, mask=valid, other=0.0), 1)
    pz = tl.sum(tl.load(part_stat + p * 3 + 1, mask=valid, other=0.0), 1)
    mass = tl.load(part_stat + p * 3 + 2, mask=valid, other=0.0)
    ps = tl.sum(mass, 1)
    if CLEAN:
        tl.store(part_stat + p * 3 + 2, mass, mask=m_rk & (ids < 0))
    LN2: tl.constexpr = 0.6931471805599453
    tl.store(kl + o_r, plogp - LN2 * pz + LN2 * tl.where(ps > 0.0, lse, 0.0) * ps, mask=m_r)
    tl.store(lse_s + o_r, lse, mask=m_r)
    tl.store(psum + o_r, ps, mask=m_r)
