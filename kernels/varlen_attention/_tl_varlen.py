"""Triton kernel of kernels/varlen_attention/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import dot


@triton.jit
def _key_block(b_qa, b_qb, k, v, o_n, m_n, i_h, stride_kt, stride_kh, stride_vt, stride_vh, o_a, o_b, m_a, m_b,
               m_i, l_i, acc_a, acc_b, scale_log2, MASKED: tl.constexpr, HAS_B: tl.constexpr, A_FULL: tl.constexpr,
               B_FULL: tl.constexpr, IEEE: tl.constexpr):
    """One key block of the online softmax. The head dim is split into a power-of-two part A and a small part B
    (80 = 64 + 16 for M3's ViT), so no matmul runs on padding up to the next power of two (128). The softmax scale
    (base 2) is applied in one fused multiply-add with the running max (the row max of raw scores times a positive
    scale is the max of scaled ones)."""
    p_k = k + o_n[:, None].to(tl.int64) * stride_kt + i_h * stride_kh
    p_v = v + o_n[:, None].to(tl.int64) * stride_vt + i_h * stride_vh
    if MASKED or not A_FULL:
        b_ka = tl.load(p_k + o_a[None, :], mask=m_n[:, None] & m_a[None, :], other=0.0)
        b_va = tl.load(p_v + o_a[None, :], mask=m_n[:, None] & m_a[None, :], other=0.0)
    else:  # whole key block, no padded head-dim column: unmasked (vectorised) loads
        b_ka = tl.load(p_k + o_a[None, :])
        b_va = tl.load(p_v + o_a[None, :])
    s = dot(b_qa, tl.trans(b_ka), IEEE)
    if HAS_B:
        if MASKED or not B_FULL:
            b_kb = tl.load(p_k + o_b[None, :], mask=m_n[:, None] & m_b[None, :], other=0.0)
            b_vb = tl.load(p_v + o_b[None, :], mask=m_n[:, None] & m_b[None, :], other=0.0)
        else:
            b_kb = tl.load(p_k + o_b[None, :])
            b_vb = tl.load(p_v + o_b[None, :])
        s += dot(b_qb, tl.trans(b_kb), IEEE)
    if MASKED:
        s = tl.where(m_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.math.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p if IEEE else p.to(b_va.dtype)
    acc_a = acc_a * alpha[:, None] + dot(pv, b_va.to(pv.dtype), IEEE)
    if HAS_B:
        acc_b = acc_b * alpha[:, None] + dot(pv, b_vb.to(pv.dtype), IEEE)
    return m_new, l_i, acc_a, acc_b


@autotune(
    configs=configs(
        [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)],
        interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1),
        default=dict(BLOCK_N=64, num_warps=4, num_stages=2),
    ),
    key=["H", "DA", "DB", "BLOCK_M", "IEEE"],
)
@triton.jit(do_not_specialize=["n_seg"])
def varlen_fwd_kernel(
    q, k, v, out, cu_seqlens, tile_seg, tile_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    n_seg, scale_log2,
    H: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # one program: BLOCK_M queries of one segment x one head; bidirectional softmax over the segment's keys only
    pid = tl.program_id(0)
    i_h = tl.program_id(1)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        HAS_B: tl.constexpr = DB > 0
        DBP: tl.constexpr = DB if DB > 0 else 16
        seg_start = tl.load(cu_seqlens + seg)
        seg_end = tl.load(cu_seqlens + seg + 1)
        m0 = tl.load(tile_start + pid)
        o_m = m0 + tl.arange(0, BLOCK_M)
        o_a = tl.arange(0, DA)
        o_b = DA + tl.arange(0, DBP)
        m_m = o_m < seg_end
        m_a = o_a < D
        m_b = o_b < D
        p_q = q + o_m[:, None].to(tl.int64) * stride_qt + i_h * stride_qh
        b_qa = tl.load(p_q + o_a[None, :], mask=m_m[:, None] & m_a[None, :], other=0.0)
        b_qb = tl.load(p_q + o_b[None, :], mask=m_m[:, None] & m_b[None, :], other=0.0)
        A_FULL: tl.constexpr = DA <= D
        B_FULL: tl.constexpr = DA + DB == D
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
        acc_b = tl.zeros([BLOCK_M, DBP], tl.float32)
        o_n0 = tl.arange(0, BLOCK_N)
        # whole key blocks first (no mask), then the segment's ragged tail
        n_full = seg_start + ((seg_end - seg_start) // BLOCK_N) * BLOCK_N
        for n0 in range(seg_start, n_full, BLOCK_N):
            o_n = n0 + o_n0
            m_i, l_i, acc_a, acc_b = _key_block(b_qa, b_qb, k, v, o_n, o_n0 < BLOCK_N, i_h, stride_kt, stride_kh,
                                                stride_vt, stride_vh, o_a, o_b, m_a, m_b, m_i, l_i, acc_a, acc_b,
                                                scale_log2, False, HAS_B, A_FULL, B_FULL, IEEE)
        if n_full < seg_end:
            o_n = n_full + o_n0
            m_i, l_i, acc_a, acc_b = _key_block(b_qa, b_qb, k, v, o_n, o_n < seg_end, i_h, stride_kt, stride_kh,
                                                stride_vt, stride_vh, o_a, o_b, m_a, m_b, m_i, l_i, acc_a, acc_b,
                                                scale_log2, True, HAS_B, A_FULL, B_FULL, IEEE)
        p_o = out + o_m[:, None].to(tl.int64) * stride_ot + i_h * stride_oh
        tl.store(p_o + o_a[None, :], (acc_a / l_i[:, None]).to(out.dtype.element_ty), mask=m_m[:, None] & m_a[None, :])
        if HAS_B:
            tl.store(p_o + o_b[None, :], (acc_b / l_i[:, None]).to(out.dtype.element_ty),
                     mask=m_m[:, None] & m_b[None, :])
