"""Triton kernel of kernels/sparse_attention/tile.py (imported only when a kernel is launched).
See that module for the design."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs


@autotune(
    configs=configs(
        [dict(num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)],
        interpret=dict(num_warps=4, num_stages=1),
        default=dict(num_warps=4, num_stages=2),
    ),
    key=["GP", "DP", "BN", "KP", "TILE", "IEEE", "tune_bucket"],
)
@triton.jit(do_not_specialize=["T", "tune_bucket"])
def tile_union_fwd_kernel(
    q, k, v, blocks, union, count, out, lse,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_sb, stride_sh, stride_st, stride_ub, stride_uh, stride_ut, stride_cb, stride_ch,
    stride_ob, stride_oh, stride_ot, stride_lb, stride_lt,
    T, scale_log2, tune_bucket,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):
    # one program: TILE consecutive query tokens x the G heads of one KV group (the matmul rows), looping over the
    # union of the blocks those tokens selected; each row keeps only its own token's blocks (and causal keys), so
    # its online softmax stays on chip from the first block to the output
    i_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows (last tokens) start first
    i_bh = tl.program_id(1)
    i_b = (i_bh // HKV).to(tl.int64)
    i_h = i_bh % HKV
    o_r = tl.arange(0, TILE * GP)
    o_t = i_tile * TILE + o_r // GP
    o_g = o_r % GP
    m_row = (o_t < T) & (o_g < G)
    o_hq = i_h * G + o_g
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    b_q = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh + o_t[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                  mask=m_row[:, None] & m_d[None, :], other=0.0)
    o_kp = tl.arange(0, KP)
    sel = tl.load(blocks + i_b * stride_sb + i_h * stride_sh + o_t[:, None].to(tl.int64) * stride_st + o_kp[None, :],
                  mask=m_row[:, None] & (o_kp[None, :] < K), other=-1)  # [rows, KP] the row's own blocks
    o_n = tl.arange(0, BN)
    m_i = tl.full([TILE * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE * GP], tl.float32)
    acc = tl.zeros([TILE * GP, DP], tl.float32)
    p_u = union + i_b * stride_ub + i_h * stride_uh + i_tile * stride_ut
    n_u = tl.load(count + i_b * stride_cb + i_h * stride_ch + i_tile)
    p_k0 = k + i_b * stride_kb + i_h * stride_kh + o_d[None, :]
    p_v0 = v + i_b * stride_vb + i_h * stride_vh + o_d[None, :]
    for u in range(0, n_u):
        j = tl.load(p_u + u)
        o_key = j * BS + o_n
        m_key = (o_n < BS) & (o_key < T)
        b_k = tl.load(p_k0 + o_key[:, None].to(tl.int64) * stride_kt, mask=m_key[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(p_v0 + o_key[:, None].to(tl.int64) * stride_vt, mask=m_key[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        else:
            s = tl.dot(b_q, tl.trans(b_k))
        chosen = tl.max((sel == j).to(tl.int32), 1) > 0  # this row's token selected block j
        keep = chosen[:, None] & m_key[None, :] & (o_key[None, :] <= o_t[:, None])
        s = tl.where(keep, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(b_v.dtype), b_v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + i_b * stride_ob + o_hq[:, None] * stride_oh + o_t[:, None].to(tl.int64) * stride_ot + o_d[None, :],
             o.to(out.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
    lse_row = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(lse + i_b * stride_lb + o_t.to(tl.int64) * stride_lt + o_hq, lse_row, mask=m_row)
