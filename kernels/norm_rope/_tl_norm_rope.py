"""Triton kernels of kernels/norm_rope/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl


@triton.jit
def _rows(n_rows, T, heads, q_heads, D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows (token, head), their token's batch and position, whether each is a query head (norm
    weight wq), and per channel its RoPE partner, sign and whether it is rotated."""
    o_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = o_r < n_rows
    o_r = o_r.to(tl.int64)
    tok = o_r // heads
    head = o_r % heads
    o_d = tl.arange(0, DP)
    HALF: tl.constexpr = W // 2
    rotated = o_d < W
    partner = tl.where(o_d < HALF, o_d + HALF, tl.where(rotated, o_d - HALF, o_d))
    sign = tl.where(o_d < HALF, -1.0, 1.0)
    m = m_r[:, None] & (o_d < D)[None, :]
    return o_r, m_r, tok // T, tok % T, head, head < q_heads, o_d, rotated, partner, sign, m


@triton.jit
def _norm_scale(b_x, b_xp, w_q, w_k, is_q, o_d, partner, m, eps, D: tl.constexpr):
    """(x * rsqrt(mean(x^2) + eps)) for the row and its partner channels, the Gemma factors 1 + w of both."""
    xf = tl.where(m, b_x.to(tl.float32), 0.0)
    r = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    wq = tl.load(w_q + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    wk = tl.load(w_k + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    wqp = tl.load(w_q + partner, mask=partner < D, other=0.0).to(tl.float32)
    wkp = tl.load(w_k + partner, mask=partner < D, other=0.0).to(tl.float32)
    g = 1.0 + tl.where(is_q[:, None], wq[None, :], wk[None, :])
    gp = 1.0 + tl.where(is_q[:, None], wqp[None, :], wkp[None, :])
    return xf * r[:, None], b_xp.to(tl.float32) * r[:, None], g, gp, r


@triton.jit(do_not_specialize=["n_rows", "T"])
def norm_rope_fwd_kernel(
    x, w_q, w_k, cos, sin, out, stride_xt, stride_cb, stride_ct, stride_sb, stride_st, n_rows, T, heads, q_heads, eps,
    D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
):
    # one program: ROWS (token, head) rows; [Gemma RMSNorm, rounded to the dtype,] then RoPE with the reference's
    # roundings: each product, then their sum. x: a token's heads side by side, tokens stride_xt apart (a slice of
    # a wider projection); out: contiguous
    o_r, m_r, i_b, i_t, head, is_q, o_d, rotated, partner, sign, m = _rows(n_rows, T, heads, q_heads, D, DP, W, ROWS)
    dt = out.dtype.element_ty
    p_x = x + ((i_b * T + i_t) * stride_xt + head * D)[:, None]
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0)
    b_xp = tl.load(p_x + partner[None, :], mask=m, other=0.0)
    if NORM:
        n, n_p, g, gp, _ = _norm_scale(b_x, b_xp, w_q, w_k, is_q, o_d, partner, m, eps, D)
        n = (n * g).to(dt).to(tl.float32)
        n_p = (n_p * gp).to(dt).to(tl.float32)
    else:
        n = b_x.to(tl.float32)
        n_p = b_xp.to(tl.float32)
    m_rot = m_r[:, None] & rotated[None, :]
    c = tl.load(cos + (i_b * stride_cb + i_t * stride_ct)[:, None] + o_d[None, :], mask=m_rot, other=0.0)
    s = tl.load(sin + (i_b * stride_sb + i_t * stride_st)[:, None] + o_d[None, :], mask=m_rot, other=0.0)
    a = (n * c.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    b = (sign[None, :] * n_p * s.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y = tl.where(rotated[None, :], a + b, n)
    tl.store(out + o_r[:, None] * D + o_d[None, :], y.to(dt), mask=m)


@triton.jit(do_not_specialize=["n_rows", "T"])
def norm_rope_bwd_kernel(
    g_q, g_k, x, w_q, w_k, cos, sin, dx, dw, stride_gb, stride_gt, stride_gh, stride_kb, stride_kt,
    stride_cb, stride_ct, stride_sb, stride_st, n_rows, T, heads, q_heads, eps,
    D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
):
    # one program: the same rows. RoPE's transpose: d(n)[p] = g[p] cos[p] + sign[q] g[q] sin[q], q = partner(p);
    # then the RMSNorm backward (fp32); the norm weights' gradient summed over this program's rows into dw[pid]
    o_r, m_r, i_b, i_t, head, is_q, o_d, rotated, partner, sign, m = _rows(n_rows, T, heads, q_heads, D, DP, W, ROWS)
    dt = dx.dtype.element_ty
    p_gq = g_q + i_b * stride_gb + i_t * stride_gt + head * stride_gh
    p_gk = g_k + i_b * stride_kb + i_t * stride_kt
    p_g = tl.where(is_q, p_gq, p_gk)[:, None]
    b_g = tl.load(p_g + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_gp = tl.load(p_g + partner[None, :], mask=m, other=0.0).to(tl.float32)
    m_rot = m_r[:, None] & rotated[None, :]
    p_c = cos + (i_b * stride_cb + i_t * stride_ct)[:, None]
    p_s = sin + (i_b * stride_sb + i_t * stride_st)[:, None]
    c = tl.load(p_c + o_d[None, :], mask=m_rot, other=0.0).to(dt).to(tl.float32)
    s_p = tl.load(p_s + partner[None, :], mask=m_rot, other=0.0).to(dt).to(tl.float32)
    sign_p = tl.where(partner < W // 2, -1.0, 1.0)
    if NORM:
        d_n = tl.where(rotated[None, :], b_g * c + sign_p[None, :] * b_gp * s_p, b_g)
        p_x = x + o_r[:, None] * D
        b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0)
        n_hat, _, g, _, r = _norm_scale(b_x, b_x, w_q, w_k, is_q, o_d, partner, m, eps, D)
        d_w = tl.where(m, d_n * n_hat, 0.0)
        dw_q = tl.sum(tl.where(is_q[:, None], d_w, 0.0), 0)
        dw_k = tl.sum(tl.where(is_q[:, None], 0.0, d_w), 0)
        pid = tl.program_id(0).to(tl.int64)
        tl.store(dw + pid * 2 * D + o_d, dw_q, mask=o_d < D)
        tl.store(dw + pid * 2 * D + D + o_d, dw_k, mask=o_d < D)
        d_hat = tl.where(m, d_n * g, 0.0)
        d_x = r[:, None] * (d_hat - n_hat * (tl.sum(d_hat * n_hat, 1) / D)[:, None])
    else:  # the reference's roundings: each product, then their sum
        a = (b_g * c).to(dt).to(tl.float32)
        b = (sign_p[None, :] * b_gp * s_p).to(dt).to(tl.float32)
        d_x = tl.where(rotated[None, :], a + b, b_g)
    tl.store(dx + o_r[:, None] * D + o_d[None, :], d_x.to(dt), mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_kernel(x, w, out, n_rows, eps, D: tl.constexpr, DP: tl.constexpr, GEMMA: tl.constexpr,
                    ROWS: tl.constexpr):
    # one program: ROWS rows of D; the reference's roundings (x_hat to x's dtype, then the weight's product)
    o_r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    o_d = tl.arange(0, DP)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + o_r[:, None] * D + o_d[None, :], mask=m, other=0.0)
    _rms_rows(b_x, w, out, o_r, o_d, m, eps, D, GEMMA)


@triton.jit(do_not_specialize=["n_rows"])
def add_rms_norm_kernel(x, d, s, w, out, n_rows, eps, D: tl.constexpr, DP: tl.constexpr, GEMMA: tl.constexpr,
                        ROWS: tl.constexpr):
    # rms_norm_kernel of s = x + d (one rounding to x's dtype, as torch adds), s stored too: a residual add and the
    # next norm in one launch
    o_r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    o_d = tl.arange(0, DP)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0)
    b_s = (b_x.to(tl.float32) + tl.load(d + p, mask=m, other=0.0).to(tl.float32)).to(b_x.dtype)
    tl.store(s + p, b_s, mask=m)
    _rms_rows(b_s, w, out, o_r, o_d, m, eps, D, GEMMA)


@triton.jit
def _rms_rows(b_x, w, out, o_r, o_d, m, eps, D: tl.constexpr, GEMMA: tl.constexpr):
    xf = b_x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    if GEMMA:
        y = (xf * r[:, None]) * (1.0 + b_w[None, :])
    else:
        y = b_w[None, :] * (xf * r[:, None]).to(b_x.dtype).to(tl.float32)
    tl.store(out + o_r[:, None] * D + o_d[None, :], y.to(out.dtype.element_ty), mask=m)
