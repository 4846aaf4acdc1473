"""Triton kernel of kernels/indexer/__init__.py (imported only when a kernel is launched).
See that module for the design."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import e4m3_scale, quantize_rows_e4m3

I64_MIN = tl.constexpr(-9223372036854775807 - 1)
I64_MAX = tl.constexpr(9223372036854775807)


@triton.jit
def _pack(score, j):
    # a block score and its id as one int64 ordered as the score (ties: the later block): the float's bits made
    # monotone as a signed int32, shifted over the id. -inf (nothing visible) packs below every slot and never enters
    bits = score.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(score == float("-inf"), I64_MIN, (key.to(tl.int64) << 32) | j)


@triton.jit
def _unpack_score(pk):
    # the score of a packed slot (_pack's map is its own inverse on the high word)
    key = (pk >> 32).to(tl.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _insert(pk, new):
    # replace each row's smallest slot by `new` where it is larger: one min and one select over the slots (every
    # slot's value is distinct: ids in the low word, distinct sentinels in the empty ones)
    cur = tl.min(pk, 1)
    return tl.where((new > cur)[:, None] & (pk == cur[:, None]), new[:, None], pk)


@triton.jit
def _block_scores(b_q, p_k, p_s0, j, o_key, m_key, o_tok, m_d, CAUSAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                  BLOCK_SCALE: tl.constexpr, IEEE: tl.constexpr):
    # key block j's score per row: token scores, causal / length mask, max. p_s0: the key scales, one per key
    # (applied to every token score) or, with BLOCK_SCALE, one per key block (> 0, so applied after the max).
    # fp8 scoring: b_q is fp8 (keys stay fp8: an fp8 x fp8 matmul, fp32 accumulation) or fp16 (keys widened, exact)
    b_k = tl.load(p_k, mask=m_key[:, None] & m_d[None, :], other=0.0).to(b_q.dtype)
    if IEEE:
        s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        s = tl.dot(b_q, tl.trans(b_k))
    if HAS_SCALE and not BLOCK_SCALE:
        s = s * tl.load(p_s0 + o_key, mask=m_key, other=0.0)[None, :]
    m = m_key[None, :]
    if CAUSAL:
        m = m & (o_key[None, :] <= o_tok[:, None])
    score = tl.max(tl.where(m, s, float("-inf")), 1)
    if BLOCK_SCALE:
        score = score * tl.load(p_s0 + j)
    return score

@triton.jit
def _candidate_lse(m, l, logit, cand):
    # one key block's logit [ROWS] into the running max m and sum l of exp(logit - m) over the candidate blocks
    logit = tl.where(cand, logit, float("-inf"))
    m_new = tl.maximum(m, logit)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l * tl.exp(m - m_safe) + tl.exp(logit - m_safe)


def _prune(cfgs, named_args, **kw):
    hp = named_args["HP"] if "HP" in named_args else kw["HP"]
    return [c for c in cfgs if c.kwargs["ROWS"] >= hp] or cfgs[-1:]


def _tuned(default: dict):
    """The kernel's autotuner, with `default` as its one config under M3C_AUTOTUNE=0."""
    return autotune(
        configs=configs(
            [dict(ROWS=r, num_warps=w, num_stages=s) for r in (64, 128, 256) for w in (4, 8) for s in (2, 3)],
            interpret=dict(ROWS=64, num_warps=4, num_stages=1), default=default),
        key=["HP", "DP", "BS", "KP", "HAS_SCALE", "BLOCK_SCALE", "FP8_DOT", "ADAPT", "tune_bucket"],
        prune_configs_by={"early_config_prune": _prune},
    )


# M3C_AUTOTUNE=0: the fastest of the sweep at Llama-3-8B index shapes (8 heads), 128K, top-16, bf16 and fp8 alike
# (28.7 / 22.9 ms against 35.1 / 28.2 for the earlier 128 / 8 / 3; benchmarks/experiments/indexer_split.py,
# BENCHMARKS.md); index_topk_kernel_wide (below) for 64 slots and more
@_tuned(dict(ROWS=128, num_warps=4, num_stages=2))
@triton.jit(do_not_specialize=["T", "q_start", "tune_bucket", "min_blocks", "stride_sb", "stride_ob", "stride_oh"])
def index_topk_kernel(
    q, k, k_scale, out,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_sb, stride_ob, stride_oh, stride_ot,
    T, q_start, tune_bucket, sm_scale, top_p, min_blocks,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_SCALE: tl.constexpr, IEEE: tl.constexpr, FP8_DOT: tl.constexpr,
    ADAPT: tl.constexpr, ROWS: tl.constexpr,
):
    # ADAPT (the adaptive budget, naive.adaptive_keep on chip): each candidate block's logit (score * sm_scale,
    # times the row's own fp8 scale where it scores in fp8) and the log-sum-exp of every candidate's (visible, not
    # forced) kept online over the key blocks; at the end a candidate slot stays while the better candidates'
    # probability mass is below top_p or fewer than min_blocks blocks rank above it (forced blocks lead and always
    # stay). The other slots are written -1.
    i_t = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows (last tokens) start first
    i_b = tl.program_id(1).to(tl.int64)
    BLOCK_T: tl.constexpr = ROWS // HP  # query tokens per program, each with all its index heads
    # T keys; the queries are the last T - q_start positions (q_start = 0: one per key), row r of q at q_start + r
    o_r = tl.arange(0, ROWS)
    o_tok = q_start + i_t * BLOCK_T + o_r // HP  # positions
    o_h = o_r % HP
    m_row = (o_tok < T) & (o_h < H)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    o_row = (o_tok - q_start)[:, None].to(tl.int64)
    p_q = q + i_b * stride_qb + o_row * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    row_scale = tl.full([ROWS], sm_scale, tl.float32)
    if HAS_SCALE:  # fp8 scoring: each (token, head) row quantised here, once per program
        if ADAPT:  # the row's scale, which the ranking does not need but the logits do
            row_scale = row_scale * e4m3_scale(tl.maximum(tl.max(tl.abs(b_q.to(tl.float32)), 1), 1e-12))
        b_q = quantize_rows_e4m3(b_q, FP8_DOT)
    m_c = tl.full([ROWS], float("-inf"), tl.float32)  # ADAPT: the candidates' running max and sum of exp
    l_c = tl.zeros([ROWS], tl.float32)
    q_block = o_tok // BS
    o_kp = tl.arange(0, KP)
    # the running top-k, packed (_pack): empty slots hold distinct values below any block's, padding slots (>= TOPK)
    # distinct values above them, so they are never the minimum that gets replaced
    pk = tl.where(o_kp[None, :] < TOPK, I64_MIN + o_kp[None, :].to(tl.int64),
                  I64_MAX - o_kp[None, :].to(tl.int64)) + tl.zeros([ROWS, KP], tl.int64)
    t_first = q_start + i_t * BLOCK_T
    t_last = tl.minimum(t_first + BLOCK_T, T) - 1
    n_full = (t_first + 1) // BS  # key blocks every row of the tile sees whole
    n_all = t_last // BS + 1
    o_n = tl.arange(0, BN)
    p_k0 = k + i_b * stride_kb + o_d[None, :]
    p_s0 = k_scale + i_b * stride_sb
    for j in range(0, n_full):
        o_key = j * BS + o_n
        m_key = o_n < BS
        score = _block_scores(b_q, p_k0 + o_key[:, None].to(tl.int64) * stride_kt, p_s0, j, o_key, m_key,
                              o_tok, m_d, False, HAS_SCALE, BLOCK_SCALE, IEEE)
        if ADAPT:
            m_c, l_c = _candidate_lse(m_c, l_c, score * row_scale, (j >= INIT) & (j <= q_block - LOCAL))
        score = tl.where(j < INIT, 3.4028234663852886e38, score)
        score = tl.where(j > q_block - LOCAL, float("inf"), score)
        pk = _insert(pk, _pack(score, j))
    for j in range(n_full, n_all):
        o_key = j * BS + o_n
        m_key = (o_n < BS) & (o_key < T)
        score = _block_scores(b_q, p_k0 + o_key[:, None].to(tl.int64) * stride_kt, p_s0, j, o_key, m_key,
                              o_tok, m_d, True, HAS_SCALE, BLOCK_SCALE, IEEE)
        if ADAPT:
            m_c, l_c = _candidate_lse(m_c, l_c, score * row_scale, (j >= INIT) & (j <= q_block - LOCAL))
        score = tl.where((j <= q_block) & (j < INIT), 3.4028234663852886e38, score)
        score = tl.where((j <= q_block) & (j > q_block - LOCAL), float("inf"), score)
        pk = _insert(pk, _pack(score, j))
    keep = (pk > I64_MIN + KP) & (o_kp[None, :] < TOPK)  # a block entered the slot
    if ADAPT:
        got = keep
        score = _unpack_score(pk)
        forced = got & (score >= 3.4028234663852886e38)
        lse = tl.where(l_c > 0, m_c + tl.log(tl.maximum(l_c, 1e-30)), float("-inf"))
        prob = tl.where(got & ~forced, tl.exp(score * row_scale[:, None] - lse[:, None]), 0.0)
        # per slot: the probability mass of the better candidates, and the blocks ranked above it (forced ones lead);
        # one pass over the slots (a sort of the slots costs as much on a GPU and 1,000x more under the interpreter)
        before = tl.zeros([ROWS, KP], tl.float32)
        above = tl.zeros([ROWS, KP], tl.int32)
        for j in range(TOPK):
            pk_j = tl.max(tl.where(o_kp[None, :] == j, pk, I64_MIN), 1)
            p_j = tl.sum(tl.where(o_kp[None, :] == j, prob, 0.0), 1)
            better = pk_j[:, None] > pk
            before += tl.where(better, p_j[:, None], 0.0)
            above += (better & (pk_j > I64_MIN + KP)[:, None]).to(tl.int32)
        keep = forced | (got & ((before < top_p) | (above < min_blocks)))
    o_out = i_b * stride_ob + o_h[:, None] * stride_oh + o_row * stride_ot + o_kp[None, :]
    ids = tl.where(keep, (pk & 0xFFFFFFFF).to(tl.int32), -1)
    tl.store(out + o_out, ids, mask=m_row[:, None] & (o_kp[None, :] < TOPK))


# the same kernel for top-k past 32 (KP >= 64 slots), whose running top-k takes twice the registers or more: at top-45,
# index dim 64, 128K, 64 rows a program in 4 warps and 3 stages ran in 28.9 / 33.6 ms (fp8 / bf16 scoring) against
# 38.6 / 34.9 at top-16's default (H100, 2026-12-07; benchmarks/experiments/indexer_split.py --topk 45, BENCHMARKS.md)
index_topk_kernel_wide = _tuned(dict(ROWS=64, num_warps=4, num_stages=3))(index_topk_kernel.fn)
