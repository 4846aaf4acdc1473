"""Triton kernel of kernels/varlen_attention.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from kernels._common import configs
from kernels._tl_common import online_softmax_block


@triton.autotune(
    configs=configs(
        [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)],
        interpret=dict(BLOCK_N=16, num_warps=4, num_stages=1),
        default=dict(BLOCK_N=64, num_warps=4, num_stages=2),
    ),
    key=["H", "DP", "BLOCK_M", "IEEE"],
)
@triton.jit(do_not_specialize=["n_seg"])
def varlen_fwd_kernel(
    q, k, v, out, cu_seqlens, tile_seg, tile_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    n_seg, scale_log2,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # one program: BLOCK_M queries of one segment x one head; bidirectional softmax over the segment's keys only
    pid = tl.program_id(0)
    i_h = tl.program_id(1)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        seg_start = tl.load(cu_seqlens + seg)
        seg_end = tl.load(cu_seqlens + seg + 1)
        m0 = tl.load(tile_start + pid)
        o_m = m0 + tl.arange(0, BLOCK_M)
        o_d = tl.arange(0, DP)
        m_m = o_m < seg_end
        m_d = o_d < D
        b_q = tl.load(q + o_m[:, None].to(tl.int64) * stride_qt + i_h * stride_qh + o_d[None, :],
                      mask=m_m[:, None] & m_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        o_n0 = tl.arange(0, BLOCK_N)
        # whole key blocks first (no mask), then the segment's ragged tail
        n_full = seg_start + ((seg_end - seg_start) // BLOCK_N) * BLOCK_N
        for n0 in range(seg_start, n_full, BLOCK_N):
            o_n = n0 + o_n0
            b_k = tl.load(k + o_n[:, None].to(tl.int64) * stride_kt + i_h * stride_kh + o_d[None, :],
                          mask=m_d[None, :], other=0.0)
            b_v = tl.load(v + o_n[:, None].to(tl.int64) * stride_vt + i_h * stride_vh + o_d[None, :],
                          mask=m_d[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_block(b_q, b_k, b_v, m_i, l_i, acc, None, scale_log2, False, IEEE)
        if n_full < seg_end:
            o_n = n_full + o_n0
            m_n = o_n < seg_end
            b_k = tl.load(k + o_n[:, None].to(tl.int64) * stride_kt + i_h * stride_kh + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_v = tl.load(v + o_n[:, None].to(tl.int64) * stride_vt + i_h * stride_vh + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_block(b_q, b_k, b_v, m_i, l_i, acc, m_n[None, :], scale_log2, True, IEEE)
        acc = acc / l_i[:, None]
        tl.store(out + o_m[:, None].to(tl.int64) * stride_ot + i_h * stride_oh + o_d[None, :],
                 acc.to(out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
