"""Triton kernel of kernels/causal_lse/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import dot


def _prune(cfgs, named_args, **kw):
    gp = named_args["GP"] if "GP" in named_args else kw["GP"]
    return [c for c in cfgs if c.kwargs["ROWS"] >= gp] or cfgs[-1:]


@autotune(
    configs=configs(
        [dict(ROWS=r, BN=n, num_warps=w, num_stages=s) for r in (64, 128) for n in (64, 128) for w in (4, 8)
         for s in (2, 3)],
        interpret=dict(ROWS=16, BN=16, num_warps=4, num_stages=1),
        default=dict(ROWS=128, BN=64, num_warps=8, num_stages=2),
    ),
    key=["GP", "DP", "RECALL", "IEEE", "tune_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit(do_not_specialize=["R", "T", "tune_bucket"])
def causal_lse_kernel(
    q, k, rows, sel, out,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_sb, stride_st, stride_ob, stride_or,
    R, T, scale_log2, tune_bucket,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    RECALL: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
):
    # one program: TOK query rows x the G heads of one KV group; keys streamed up to the tile's last row
    i_r = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows (last positions) start first
    bh = tl.program_id(1)
    i_b = (bh // HKV).to(tl.int64)
    i_h = bh % HKV
    TOK: tl.constexpr = ROWS // GP if ROWS >= GP else 1
    o_x = tl.arange(0, TOK * GP)
    o_row = i_r * TOK + o_x // GP
    o_g = o_x % GP
    m_row = (o_row < R) & (o_g < G)
    o_hq = i_h * G + o_g
    pos = tl.load(rows + o_row, mask=o_row < R, other=0)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    b_q = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh + pos[:, None] * stride_qt + o_d[None, :],
                  mask=m_row[:, None] & m_d[None, :], other=0.0)
    m_i = tl.full([TOK * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([TOK * GP], tl.float32)
    last = tl.max(tl.where(m_row, pos, 0), 0)  # rows ascend: the tile's last visible key
    o_n = tl.arange(0, BN)
    p_k = k + i_b * stride_kb + i_h * stride_kh + o_d[None, :]
    for j0 in range(0, last + 1, BN):
        o_key = j0 + o_n
        b_k = tl.load(p_k + o_key[:, None].to(tl.int64) * stride_kt, mask=(o_key < T)[:, None] & m_d[None, :],
                      other=0.0)
        s = dot(b_q, tl.trans(b_k), IEEE) * scale_log2
        s = tl.where(m_row[:, None] & (o_key[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    lse = m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0))
    if RECALL:  # mean over the group's heads of exp2(selected - dense): [TOK * GP] -> [TOK]
        b_sel = tl.load(sel + i_b * stride_sb + pos * stride_st + o_hq, mask=m_row, other=0.0)
        share = tl.where(m_row, tl.math.exp2(b_sel - lse), 0.0)
        recall = tl.sum(tl.reshape(share, (TOK, GP)), 1) * (1.0 / G)
        o_t = i_r * TOK + tl.arange(0, TOK)
        tl.store(out + i_b * stride_ob + o_t.to(tl.int64) * stride_or + i_h, recall, mask=o_t < R)
    else:
        tl.store(out + i_b * stride_ob + o_row.to(tl.int64) * stride_or + o_hq, lse, mask=m_row)
