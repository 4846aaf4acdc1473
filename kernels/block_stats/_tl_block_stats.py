"""Triton kernel of kernels/block_stats/__init__.py (imported only when a kernel is launched).
See that module for the design."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import dot


@triton.jit
def _teacher_block(b_q, p_k, o_key, m_key, m_kd, pos_q, scale_log2, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One key block for the tile: each teacher row's log-sum-exp (natural log, scale included). MASKED: keys after a
    row's position are dropped (the blocks that reach past the tile's first row); otherwise only the padding past
    the block (BN > BS)."""
    b_k = tl.load(p_k, mask=m_key[:, None] & m_kd, other=0.0)
    s = dot(b_q, tl.trans(b_k), IEEE) * scale_log2  # [TOK * GP, BN], base 2
    if MASKED:
        s = tl.where(m_key[None, :] & (o_key[None, :] <= pos_q[:, None]), s, float("-inf"))
    else:
        s = tl.where(m_key[None, :], s, float("-inf"))
    mx = tl.max(s, 1)
    mu = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(tl.math.exp2(s - mu[:, None]), 1)  # >= 1 where mx is finite, 0 where nothing is visible
    lse2 = mu + tl.math.log2(tl.where(total > 0.0, total, 1.0))
    LN2: tl.constexpr = 0.6931471805599453
    return tl.where(mx == float("-inf"), float("-inf"), lse2 * LN2)


@triton.jit
def _student_block(b_qi, p_ki, o_key, m_key, m_kdi, pos_i, iscale, MASKED: tl.constexpr, IEEE_IDX: tl.constexpr):
    """One key block for the tile: each student row's max score and the block offset of its key (masked as
    _teacher_block)."""
    b_ki = tl.load(p_ki, mask=m_key[:, None] & m_kdi, other=0.0)
    z = dot(b_qi, tl.trans(b_ki), IEEE_IDX) * iscale  # [TOK, BN]
    if MASKED:
        z = tl.where(m_key[None, :] & (o_key[None, :] <= pos_i[:, None]), z, float("-inf"))
    else:
        z = tl.where(m_key[None, :], z, float("-inf"))
    return tl.max(z, 1), tl.argmax(z, 1).to(tl.int32)  # argmax: the first key where every score is -inf


def _prune(cfgs, named_args, **kw):
    gp = named_args["GP"] if "GP" in named_args else kw["GP"]
    fits = [c for c in cfgs if c.kwargs["TOK"] * gp <= 256]  # teacher rows per matmul
    return fits or sorted(cfgs, key=lambda c: c.kwargs["TOK"])[:1]


@autotune(
    configs=configs(
        [dict(TOK=t, num_warps=w, num_stages=s) for t in (16, 32, 64) for w in (4, 8) for s in (2, 3)],
        interpret=dict(TOK=16, num_warps=4, num_stages=1),
        default=dict(TOK=16, num_warps=4, num_stages=2),
    ),
    key=["GP", "DP", "DIP", "BN", "IEEE", "IEEE_IDX", "INDEX", "tune_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit(do_not_specialize=["R", "T", "NB", "tune_bucket"])
def block_stats_kernel(
    q, k, qidx, kidx, rows, blse, score, arg,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_xb, stride_xt, stride_xh,
    stride_ib, stride_it, stride_lb, stride_lh, stride_lr, stride_sb, stride_sh, stride_sr,
    R, T, NB, scale_log2, iscale, tune_bucket,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DI: tl.constexpr,
    DIP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, IEEE_IDX: tl.constexpr,
    INDEX: tl.constexpr, TOK: tl.constexpr,
):
    # one program: TOK sampled query rows of one (batch, KV group): the teacher's TOK x G (row, head) pairs as one
    # matmul's rows, the group's index head's TOK rows as another's; key blocks up to the tile's last row's.
    # INDEX False: the teacher's half alone (qidx, kidx, score and arg are never read or written)
    i_r = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows (last positions) start first
    bh = tl.program_id(1)
    i_b = (bh // HKV).to(tl.int64)
    i_h = bh % HKV
    o_x = tl.arange(0, TOK * GP)
    o_row = i_r * TOK + o_x // GP
    o_hq = (i_h * G + o_x % GP).to(tl.int64)
    m_row = (o_row < R) & (o_x % GP < G)
    pos_q = tl.load(rows + o_row, mask=o_row < R, other=0)
    o_t = i_r * TOK + tl.arange(0, TOK)
    m_tok = o_t < R
    pos_i = tl.load(rows + o_t, mask=m_tok, other=0)
    o_d = tl.arange(0, DP)
    o_di = tl.arange(0, DIP)
    b_q = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh + pos_q[:, None] * stride_qt + o_d[None, :],
                  mask=m_row[:, None] & (o_d < D)[None, :], other=0.0)
    if INDEX:
        b_qi = tl.load(qidx + i_b * stride_xb + pos_i[:, None] * stride_xt + i_h * stride_xh + o_di[None, :],
                       mask=m_tok[:, None] & (o_di < DI)[None, :], other=0.0)
    first = tl.load(rows + i_r * TOK)
    last = tl.max(tl.where(m_tok, pos_i, 0), 0)  # rows ascend: the tile's last position
    n_full = (first + 1) // BS  # blocks every row of the tile sees whole
    n_vis = last // BS + 1
    p_l = blse + i_b * stride_lb + o_hq * stride_lh + o_row.to(tl.int64) * stride_lr
    p_s = i_b * stride_sb + i_h * stride_sh + o_t.to(tl.int64) * stride_sr
    o_n = tl.arange(0, BN)
    p_k0 = k + i_b * stride_kb + i_h * stride_kh + o_d[None, :]
    p_ki0 = kidx + i_b * stride_ib + o_di[None, :]
    m_kd = (o_d < D)[None, :]
    m_kdi = (o_di < DI)[None, :]
    for j in range(0, n_full):
        o_key = j * BS + o_n
        m_key = o_n < BS
        p_kj = p_k0 + o_key[:, None].to(tl.int64) * stride_kt
        tl.store(p_l + j, _teacher_block(b_q, p_kj, o_key, m_key, m_kd, pos_q, scale_log2, False, IEEE), mask=m_row)
        if INDEX:
            b_s, b_a = _student_block(b_qi, p_ki0 + o_key[:, None].to(tl.int64) * stride_it, o_key, m_key, m_kdi,
                                      pos_i, iscale, False, IEEE_IDX)
            tl.store(score + p_s + j, b_s, mask=m_tok)
            tl.store(arg + p_s + j, b_a + j * BS, mask=m_tok)
    for j in range(n_full, n_vis):
        o_key = j * BS + o_n
        m_key = (o_n < BS) & (o_key < T)
        p_kj = p_k0 + o_key[:, None].to(tl.int64) * stride_kt
        tl.store(p_l + j, _teacher_block(b_q, p_kj, o_key, m_key, m_kd, pos_q, scale_log2, True, IEEE), mask=m_row)
        if INDEX:
            b_s, b_a = _student_block(b_qi, p_ki0 + o_key[:, None].to(tl.int64) * stride_it, o_key, m_key, m_kdi,
                                      pos_i, iscale, True, IEEE_IDX)
            tl.store(score + p_s + j, b_s, mask=m_tok)
            tl.store(arg + p_s + j, b_a + j * BS, mask=m_tok)
    empty_l = tl.full([TOK * GP], float("-inf"), tl.float32)
    empty_s = tl.full([TOK], float("-inf"), tl.float32)
    for j in range(n_vis, NB):  # blocks after the tile's last row: nothing visible
        tl.store(p_l + j, empty_l, mask=m_row)
        if INDEX:
            tl.store(score + p_s + j, empty_s, mask=m_tok)
            tl.store(arg + p_s + j, tl.full([TOK], 0, tl.int32) + j * BS, mask=m_tok)
