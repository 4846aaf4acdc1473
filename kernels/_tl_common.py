"""Triton device functions shared by the kernels (inlined by the compiler)."""
import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b: in exact fp32 (inputs upcast, input_precision "ieee") for fp32 kernels, else on the tensor cores in the
    inputs' dtype."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def quantize_rows_e4m3(x, FP8_DOT: tl.constexpr):
    """Rows of x [M, D] quantised as naive_common.quantize_index_keys does (amax of each row mapped to 448, round to
    nearest even), the rows' scales dropped: positive and one per row, they cannot change a row's ranking. Returns
    float8e4nv, or (FP8_DOT False) the same values widened to fp16 (exact) for a matmul without fp8 operands.

    The rounding is done in fp32 arithmetic before the cast, so the cast itself is exact: adding and subtracting
    c = 1.5 * 2^20 * 2^max(e, -6), where 2^e is the binade of the value, leaves the value rounded to e4m3's ulp there
    (2^(e-3); 2^-9 for e4m3's subnormals). Triton's interpreter rounds fp32 -> fp8 itself without carrying a round-up
    into the exponent (7.8 became 4.0), so a plain cast would make the CPU tests disagree with the GPU."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), 1), 1e-12)
    q = to_e4m3(xf, e4m3_scale(amax)[:, None])
    if not FP8_DOT:
        q = q.to(tl.float16)
    return q


@triton.jit
def e4m3_scale(amax):
    """amax / 448 (the scale that maps a largest magnitude to e4m3's largest value) as an IEEE quotient, as the
    reference computes it (naive_common._over_fp8_max): on the GPU Triton turns `/ 448.0` into a product with the
    rounded reciprocal, a last bit off for some rows, and then a value that sits at a rounding tie lands on another
    e4m3 code."""
    return tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def to_e4m3(xf, scale):
    """fp32 values over their scale (broadcast to xf's shape; an IEEE quotient, as torch divides) -> float8e4nv."""
    return round_e4m3(tl.math.div_rn(xf, tl.zeros(xf.shape, tl.float32) + scale))


@triton.jit
def to_int8(xf, amax):
    """fp32 rows over their scale amax / 127 (both IEEE quotients, as naive.quantize_kv computes them), rounded half
    to even (adding and taking away 1.5 * 2^23 leaves the integer fp32 rounds to) -> (int8 values, fp32 scale)."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    x = tl.math.div_rn(xf, tl.zeros(xf.shape, tl.float32) + scale[:, None])
    x = (x + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(x, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def round_e4m3(xf):
    """fp32 values within e4m3's range -> float8e4nv, rounded to nearest even as torch's cast rounds (see
    quantize_rows_e4m3 for why the rounding is done in fp32 first), the sign kept where a value rounds to zero (the
    sum and difference give +0 for a tiny negative value; torch's cast gives -0, another byte)."""
    binade = tl.maximum(xf.to(tl.int32, bitcast=True) & 0x7F800000, 0x3C800000).to(tl.float32, bitcast=True)
    c = binade * 1572864.0
    r = ((xf + c) - c).to(tl.int32, bitcast=True) | (xf.to(tl.int32, bitcast=True) & -2147483648)
    return r.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def online_softmax_block(b_q, b_k, b_v, m_i, l_i, acc, s_mask, scale_log2, MASKED: tl.constexpr,
                         IEEE: tl.constexpr, k_fac=None, v_fac=None, KV_FACTORS: tl.constexpr = False):
    """One key block of an online softmax (base 2): scores of b_q [M, D] against b_k [N, D], keys outside s_mask
    [M, N] (when MASKED) dropped; returns the updated running max, sum and un-normalised output.

    KV_FACTORS: key j's row of b_k and of b_v stands for k_fac[j] * b_k[j] and v_fac[j] * b_v[j] (k_fac, v_fac [N]
    fp32: the scales of fp8 rows cast to the query's dtype as they are). The factors scale the scores [M, N] and the
    probabilities [M, N] instead of the [N, D] tiles: (s_k k) . q = s_k (k . q) and sum_j p_j (s_vj v_j) =
    sum_j (p_j s_vj) v_j, so no dequantised fp32 tile is held in registers."""
    if IEEE:
        s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        s = tl.dot(b_q, tl.trans(b_k))
    if KV_FACTORS:
        s = s * (k_fac * scale_log2)[None, :]
    else:
        s = s * scale_log2
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays empty, not NaN
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_FACTORS:
        p = p * v_fac[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
    return m_new, l_i, acc


@triton.jit
def lse_merge(m_acc, l_acc, acc, lse, o):
    """Fold one normalised partial output o [G, D] with log-sum-exp lse [G] (base 2; -inf = empty) into the
    running (max, weight sum, weighted output)."""
    m_new = tl.maximum(m_acc, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_acc - m_use)
    w = tl.math.exp2(lse - m_use)
    return m_new, l_acc * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def csr_segment(seg, pid, tile_start, seg_off, HKV: tl.constexpr, NB, CHUNK: tl.constexpr):
    """A program's CSR entries [start, end) (at most CHUNK) of segment `seg` = (batch, head, key block j) of the
    KV-outer layout (sparse_attention.build_csr), and that segment's batch, head and block."""
    start = tl.load(tile_start + pid)
    end = tl.minimum(tl.load(seg_off + seg + 1), start + CHUNK)
    bh = seg // NB
    return start, end, (bh // HKV).to(tl.int64), bh % HKV, seg % NB
