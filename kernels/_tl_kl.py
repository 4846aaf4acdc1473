"""Triton kernels of kernels/sparse_kl.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

LN2 = 0.6931471805599453


@triton.jit
def _slot_logits(q, k, qi, kidx, blk, i_b, i_h, t, T,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_ib, stride_it,
                 scale_log2, iscale_log2, o_g, o_d, o_e, o_n, G: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
                 BS: tl.constexpr, IEEE: tl.constexpr):
    """Teacher logits [GP, BN] of the group's heads and student logits [BN] (both base 2) over one selected block;
    keys after the token or past T are -inf."""
    o_key = blk * BS + o_n
    m_key = (o_n < BS) & (o_key <= t) & (o_key < T)
    b_q = tl.load(q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + t * stride_qt + o_d[None, :],
                  mask=(o_g < G)[:, None] & (o_d < D)[None, :], other=0.0)
    b_k = tl.load(k + i_b * stride_kb + i_h * stride_kh + o_key[:, None].to(tl.int64) * stride_kt + o_d[None, :],
                  mask=m_key[:, None] & (o_d < D)[None, :], other=0.0)
    if IEEE:
        s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        s = tl.dot(b_q, tl.trans(b_k))
    s = tl.where(m_key[None, :], s.to(tl.float32) * scale_log2, float("-inf"))
    b_ki = tl.load(kidx + i_b * stride_ib + o_key[:, None].to(tl.int64) * stride_it + o_e[None, :],
                   mask=m_key[:, None] & (o_e < DI)[None, :], other=0.0).to(tl.float32)
    z = tl.where(m_key, tl.sum(b_ki * qi[None, :], 1) * iscale_log2, float("-inf"))
    return s, z, b_ki, o_key, m_key


@triton.jit(do_not_specialize=["T"])
def sparse_kl_fwd_kernel(
    q, k, qidx, kidx, blocks, kl, lse_t, lse_s,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_xb, stride_xt, stride_xh,
    stride_ib, stride_it, stride_bb, stride_bh, stride_bt, stride_lb, stride_lh,
    T, scale_log2, iscale_log2,
    HKV: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    DI: tl.constexpr, DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):
    # one program: one (batch, group, token). Pass 1: the teacher's per-head and the student's log-sum-exp over the
    # selected blocks; pass 2: KL(P || Q) with P = mean over the group's heads. Nothing larger than a block is held.
    t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, DP)
    o_e = tl.arange(0, DIP)
    o_n = tl.arange(0, BN)
    qi = tl.load(qidx + i_b * stride_xb + t * stride_xt + i_h * stride_xh + o_e, mask=o_e < DI, other=0.0).to(tl.float32)
    p_blk = blocks + i_b * stride_bb + i_h * stride_bh + t * stride_bt
    m_t = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([GP], tl.float32)
    m_s = float("-inf")
    l_s = 0.0
    for slot in range(K):
        blk = tl.load(p_blk + slot)
        if blk >= 0:
            s, z, _, _, _ = _slot_logits(q, k, qi, kidx, blk, i_b, i_h, t, T, stride_qb, stride_qh, stride_qt,
                                         stride_kb, stride_kh, stride_kt, stride_ib, stride_it, scale_log2,
                                         iscale_log2, o_g, o_d, o_e, o_n, G, D, DI, BS, IEEE)
            m_new = tl.maximum(m_t, tl.max(s, 1))
            l_t = l_t * tl.math.exp2(m_t - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
            m_t = m_new
            mz = tl.maximum(m_s, tl.max(z, 0))
            l_s = l_s * tl.math.exp2(m_s - mz) + tl.sum(tl.math.exp2(z - mz), 0)
            m_s = mz
    lt = m_t + tl.math.log2(tl.where(l_t == 0.0, 1.0, l_t))
    ls = m_s + tl.math.log2(l_s)
    acc = 0.0
    for slot in range(K):
        blk = tl.load(p_blk + slot)
        if blk >= 0:
            s, z, _, _, m_key = _slot_logits(q, k, qi, kidx, blk, i_b, i_h, t, T, stride_qb, stride_qh, stride_qt,
                                             stride_kb, stride_kh, stride_kt, stride_ib, stride_it, scale_log2,
                                             iscale_log2, o_g, o_d, o_e, o_n, G, D, DI, BS, IEEE)
            p = tl.sum(tl.where((o_g < G)[:, None], tl.math.exp2(s - lt[:, None]), 0.0), 0) / G  # [BN]
            log_p = tl.log(tl.where(p > 0.0, p, 1.0))
            log_q = (z - ls) * LN2
            acc += tl.sum(tl.where(m_key & (p > 0.0), p * (log_p - log_q), 0.0), 0)
    tl.store(kl + i_b * stride_lb + i_h * stride_lh + t, acc)
    tl.store(lse_t + (i_b * HKV + i_h) * GP * T + o_g * T + t, lt)
    tl.store(lse_s + i_b * stride_lb + i_h * stride_lh + t, ls)


@triton.jit(do_not_specialize=["T"])
def sparse_kl_bwd_kernel(
    q, k, qidx, kidx, blocks, lse_t, lse_s, dkl, dqidx, dkidx,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_xb, stride_xt, stride_xh,
    stride_ib, stride_it, stride_bb, stride_bh, stride_bt, stride_lb, stride_lh, stride_gb, stride_gt, stride_gh,
    stride_db, stride_dt,
    T, scale_log2, iscale_log2, iscale,
    HKV: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    DI: tl.constexpr, DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):
    # one program: one (batch, group, token); dKL/dz = Q - P on the support: dq_idx for the token, dk_idx shares
    # added to the selected keys (fp32 atomics)
    t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, DP)
    o_e = tl.arange(0, DIP)
    o_n = tl.arange(0, BN)
    qi = tl.load(qidx + i_b * stride_xb + t * stride_xt + i_h * stride_xh + o_e, mask=o_e < DI, other=0.0).to(tl.float32)
    lt = tl.load(lse_t + (i_b * HKV + i_h) * GP * T + o_g * T + t)
    ls = tl.load(lse_s + i_b * stride_lb + i_h * stride_lh + t)
    g = tl.load(dkl + i_b * stride_lb + i_h * stride_lh + t) * iscale
    p_blk = blocks + i_b * stride_bb + i_h * stride_bh + t * stride_bt
    dq = tl.zeros([DIP], tl.float32)
    for slot in range(K):
        blk = tl.load(p_blk + slot)
        if blk >= 0:
            s, z, b_ki, o_key, m_key = _slot_logits(q, k, qi, kidx, blk, i_b, i_h, t, T, stride_qb, stride_qh,
                                                    stride_qt, stride_kb, stride_kh, stride_kt, stride_ib,
                                                    stride_it, scale_log2, iscale_log2, o_g, o_d, o_e, o_n, G, D,
                                                    DI, BS, IEEE)
            p = tl.sum(tl.where((o_g < G)[:, None], tl.math.exp2(s - lt[:, None]), 0.0), 0) / G
            dz = tl.where(m_key, tl.math.exp2(z - ls) - p, 0.0) * g  # [BN]
            dq += tl.sum(dz[:, None] * b_ki, 0)
            tl.atomic_add(dkidx + i_b * stride_db + o_key[:, None].to(tl.int64) * stride_dt + o_e[None, :],
                          dz[:, None] * qi[None, :], mask=m_key[:, None] & (o_e < DI)[None, :])
    tl.store(dqidx + i_b * stride_gb + t * stride_gt + i_h * stride_gh + o_e, dq, mask=o_e < DI)
