"""Triton kernels of kernels/decode/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import (e4m3_scale, lse_merge, online_softmax_block, quantize_rows_e4m3, to_e4m3,
                                          to_int8)


# Arguments that grow with the context (page counts, the strides of per-page tables) are not specialised: a context of
# another length runs the same binaries, no compile
@triton.jit(do_not_specialize=["max_pages", "stride_tb", "stride_ob", "stride_oh"])
def _paged_index_scores(
    q_idx, idx_cache, idx_scale, block_table, seq_lens, scores,
    stride_qb, stride_qh, stride_cp, stride_ct, stride_sp, stride_tb, stride_ob, stride_oh,
    max_pages,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, FP8_DOT: tl.constexpr, NPG: tl.constexpr, PPP: tl.constexpr,
):
    # one program: PPP tiles of NPG consecutive pages of one sequence; one matmul per tile over its NPG pages'
    # keys (gathered through the block table), then one block score per (index head, page) = max over its keys
    i_b = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)
    n_pages = tl.cdiv(seq_len, BS)
    o_h = tl.arange(0, HP)
    o_d = tl.arange(0, DP)
    o_n = tl.arange(0, NPG * BN)
    o_pg = o_n // BN  # page of each key row inside the tile
    o_in = o_n % BN
    o_g = tl.arange(0, NPG)
    m_d = o_d < D
    b_q = tl.load(q_idx + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :],
                  mask=(o_h < H)[:, None] & m_d[None, :], other=0.0)
    if HAS_SCALE:  # fp8 mode: the query row is quantized here, as naive_common.quantize_index_keys does (its scale,
        # one per (sequence, head), cannot change that head's ranking, so it is not applied)
        b_q = quantize_rows_e4m3(b_q, FP8_DOT)
    first = tl.program_id(1) * PPP * NPG
    for p0 in range(first, tl.minimum(first + PPP * NPG, n_pages), NPG):
        page = p0 + o_pg
        m_key = (o_in < BS) & (page < n_pages) & (page * BS + o_in < seq_len)
        phys = tl.load(block_table + i_b * stride_tb + page, mask=page < n_pages, other=0).to(tl.int64)
        b_k = tl.load(idx_cache + phys[:, None] * stride_cp + o_in[:, None] * stride_ct + o_d[None, :],
                      mask=m_key[:, None] & m_d[None, :], other=0.0)
        if HAS_SCALE and not FP8_DOT:  # fp8 query and keys widened to fp16 (exact) for the matmul
            b_k = b_k.to(tl.float16)
        if IEEE:
            s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        else:
            s = tl.dot(b_q, tl.trans(b_k))
        if HAS_SCALE:
            s = s * tl.load(idx_scale + phys * stride_sp + o_in, mask=m_key, other=0.0)[None, :]
        s = tl.where(m_key[None, :], s, float("-inf"))
        s = tl.max(tl.reshape(s, [HP, NPG, BN]), 2)  # [HP, NPG]
        tl.store(scores + i_b * stride_ob + o_h[:, None] * stride_oh + (p0 + o_g)[None, :], s,
                 mask=(o_h < H)[:, None] & ((p0 + o_g) < n_pages)[None, :])


def _scores_tuner(default: dict):
    return autotune(
        configs=configs(
            [dict(NPG=n, PPP=p, num_warps=w, num_stages=s) for n in (1, 2, 4) for p in (1, 2, 4, 8, 16) for w in (4, 8)
             for s in (2, 3)],
            interpret=dict(NPG=2, PPP=2, num_warps=4, num_stages=1),
            default=default,
        ),
        key=["HP", "DP", "BN", "HAS_SCALE", "IEEE", "FP8_DOT"],
    )(_paged_index_scores)


# one kernel, two tuned entry points: a bf16 and an fp8 index cache pick different tiles, and with M3C_AUTOTUNE=0 each
# runs the one the H200 sweep chose for it (M3 shapes, 2026-11-29 decode run: bf16 NPG 1 / PPP 2 / 2 stages, fp8
# NPG 1 / PPP 4 / 3 stages; one default for both left the fp8 selection 31% slower at 1M; the 2026-12-03 sweep of
# the fp8 scoring up to 16 pages a program: PPP 16 / 3 stages 0.303 ms against PPP 4's 0.356 at 1M, BENCHMARKS.md)
# fp8 keys of at most 64 dims (the llama3-8b preset's index dim 64: 8 KB a page) gain from two pages a tile: NPG 2 /
# PPP 8 / 2 stages 0.0270 ms against 0.0322 at 128K, batch 8, 8 index heads (H200 sweep of 2026-12-03)
paged_index_scores_kernel = _scores_tuner(dict(NPG=1, PPP=2, num_warps=4, num_stages=2))
paged_index_scores_fp8_kernel = _scores_tuner(dict(NPG=1, PPP=16, num_warps=4, num_stages=3))
paged_index_scores_fp8_narrow_kernel = _scores_tuner(dict(NPG=2, PPP=8, num_warps=4, num_stages=2))


# The top-k of each (sequence, index head) row of block scores, in two stages. One program per row, as a single pass
# over the whole row, is TOPK serial reductions over every page: at 1M tokens (8192 pages) and batch 8 that is 32
# programs on 132 SMs, each reducing 8192 values 16 times. Stage 1 (`topk_chunk_kernel`) gives each program one
# chunk of CHUNK pages and keeps its best min(TOPK, CHUNK) blocks; stage 2 (`topk_merge_kernel`, one program per row)
# takes the best TOPK of those candidates. A row's top TOPK lies among its chunks' top TOPKs, so the result is the
# single pass's. Rows of at most CHUNK pages run stage 1 alone, writing the selection (FINAL).
# Scores travel as int64 keys (`_page_keys`): one max picks the best block and, among equal scores, the lowest page
# (tl.argmax's and torch.topk's tie rule), where a (value, index) pair would need a max and an argmax, and a
# candidate carries its page with it. Keys are distinct (one page each), so the taken one is masked out by equality.
_NINF_HI = tl.constexpr(-2139095041)  # the high word of the key of a -inf score (`_page_keys` of 0xFF800000)
_EMPTY = tl.constexpr(-(2**63))  # below every key: a slot taken or past the row


@triton.jit
def _page_keys(x, page):
    # fp32 scores and their pages -> int64 keys ordered as (score, then the lower page): the high word holds the
    # score's bits made order-preserving as a signed int (negative floats: magnitude bits flipped), the low word
    # 2^31 - 1 - page. NaN ranks above +inf, as in torch.topk
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as it compares
    b = x.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) + (2147483647 - page).to(tl.int64)


@triton.jit
def _key_page(key):
    # the page of a key; -1 for a -inf score (a page past the sequence) or a slot no block filled
    page = 2147483647 - (key - ((key >> 32) << 32))
    return tl.where((key >> 32) <= _NINF_HI, -1, page).to(tl.int32)


@triton.jit
def _chunk_keys(scores, o_p, q_block, max_pages, INIT: tl.constexpr, LOCAL: tl.constexpr):
    # the keys of pages o_p of one row: forced blocks applied (init -> FLT_MAX, local -> +inf), pages past the
    # sequence -> -inf
    visible = (o_p <= q_block) & (o_p < max_pages)
    x = tl.load(scores + o_p, mask=visible, other=float("-inf"))
    x = tl.where(visible & (o_p < INIT), 3.4028234663852886e38, x)
    x = tl.where(visible & (o_p > q_block - LOCAL), float("inf"), x)
    return _page_keys(x, o_p)


@triton.jit
def _larger(keys, other):
    # per key, how many of `other` are larger (keys are distinct: summed over all of a row's keys, the count is the
    # key's slot in the best-first order)
    return tl.sum((other[None, :] > keys[:, None]).to(tl.int32), 1)


@triton.jit(do_not_specialize=["max_pages", "stride_sb", "stride_sh", "stride_cb", "stride_ch"])
def topk_chunk_kernel(
    scores, seq_lens, cand, out, max_pages, stride_sb, stride_sh, stride_cb, stride_ch, stride_ob, stride_oh,
    BS: tl.constexpr, CHUNK: tl.constexpr, KC: tl.constexpr, TOPK: tl.constexpr, INIT: tl.constexpr,
    LOCAL: tl.constexpr, FINAL: tl.constexpr, RANK: tl.constexpr,
):
    # one program: pages [i_c * CHUNK, (i_c + 1) * CHUNK) of one (sequence, index head) row, with the forced blocks
    # applied (init blocks -> FLT_MAX, local blocks -> +inf: when they outnumber the slots, local blocks win, then
    # the lower pages), pages past the sequence -> -inf. Not FINAL: its best KC keys to cand [B, H, n_chunks * KC];
    # chunks past the sequence write nothing (stage 2 reads only the sequence's chunks). FINAL (the row is one
    # chunk): its best TOPK pages to out [B, H, TOPK], -1 where no visible block is left.
    # RANK: every key's rank counted against the chunk's others (CHUNK x CHUNK comparisons, no serial step), each of
    # the best KC stored at its rank; else KC maxima in turn, each taken key masked out
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_c = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)
    q_block = (seq_len - 1) // BS
    if i_c * CHUNK <= q_block:
        p_s = scores + i_b * stride_sb + i_h * stride_sh
        o_p = i_c * CHUNK + tl.arange(0, CHUNK)
        keys = _chunk_keys(p_s, o_p, q_block, max_pages, INIT, LOCAL)
        if RANK:
            RC: tl.constexpr = 32 if CHUNK > 32 else CHUNK
            rank = tl.zeros([CHUNK], tl.int32)
            for c0 in range(0, CHUNK, RC):  # the chunk's keys again, RC at a time
                rank += _larger(keys, _chunk_keys(p_s, i_c * CHUNK + c0 + tl.arange(0, RC), q_block, max_pages,
                                                  INIT, LOCAL))
            if FINAL:
                tl.store(out + i_b * stride_ob + i_h * stride_oh + rank, _key_page(keys), mask=rank < KC)
                for i in range(CHUNK, KC):  # slots past the chunk's pages
                    tl.store(out + i_b * stride_ob + i_h * stride_oh + i, -1)
            else:
                tl.store(cand + i_b * stride_cb + i_h * stride_ch + i_c * KC + rank, keys, mask=rank < KC)
        else:
            for i in range(KC):
                best = tl.max(keys, 0)
                if FINAL:
                    tl.store(out + i_b * stride_ob + i_h * stride_oh + i, _key_page(best))
                else:
                    tl.store(cand + i_b * stride_cb + i_h * stride_ch + i_c * KC + i, best)
                keys = tl.where(keys == best, _EMPTY, keys)


@triton.jit(do_not_specialize=["stride_cb", "stride_ch", "rank_max"])
def topk_merge_kernel(
    cand, seq_lens, out, stride_cb, stride_ch, stride_ob, stride_oh, rank_max,
    BS: tl.constexpr, CHUNK: tl.constexpr, KC: tl.constexpr, TOPK: tl.constexpr, MT: tl.constexpr,
    TOPKP: tl.constexpr,
):
    # one program: one row's candidates (KC keys from each chunk holding a visible page) -> its TOPK pages, best
    # first, -1 where fewer blocks are visible. n <= rank_max: each candidate's rank counted against the others
    # (n x n comparisons in 256 x 32 tiles, no serial step) and the best TOPK stored at their ranks. Else up to MT
    # candidates (a fixed tile, so no context length compiles a new binary): held in registers, TOPK maxima over
    # them; more: each slot re-reads them in MT-wide tiles (from L1/L2) for the largest key below the slot before's
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    seq_len = tl.load(seq_lens + i_b)
    n = tl.cdiv((seq_len - 1) // BS + 1, CHUNK) * KC
    p_c = cand + i_b * stride_cb + i_h * stride_ch
    p_o = out + i_b * stride_ob + i_h * stride_oh
    o_m = tl.arange(0, MT)
    if n <= rank_max:
        RT: tl.constexpr = 256 if MT > 256 else MT
        o_r = tl.arange(0, RT)
        for r0 in range(0, n, RT):
            m_r = r0 + o_r < n
            keys = tl.load(p_c + r0 + o_r, mask=m_r, other=_EMPTY)
            rank = tl.zeros([RT], tl.int32)
            for c0 in range(0, n, 32):  # the candidates again, 32 at a time (from L1/L2)
                rank += _larger(keys, tl.load(p_c + c0 + tl.arange(0, 32), mask=c0 + tl.arange(0, 32) < n,
                                              other=_EMPTY))
            tl.store(p_o + rank, _key_page(keys), mask=m_r & (rank < TOPK))
        o_k = tl.arange(0, TOPKP)
        tl.store(p_o + o_k, tl.full([TOPKP], -1, tl.int32), mask=(o_k >= n) & (o_k < TOPK))  # fewer candidates
    elif n <= MT:
        keys = tl.load(p_c + o_m, mask=o_m < n, other=_EMPTY)
        for i in range(TOPK):
            best = tl.max(keys, 0)
            tl.store(p_o + i, _key_page(best))
            keys = tl.where(keys == best, _EMPTY, keys)
    else:
        prev = tl.full([], 2**63 - 1, tl.int64)
        for i in range(TOPK):
            best = tl.full([], _EMPTY, tl.int64)
            for t in range(0, n, MT):
                keys = tl.load(p_c + t + o_m, mask=t + o_m < n, other=_EMPTY)
                best = tl.maximum(best, tl.max(tl.where(keys < prev, keys, _EMPTY), 0))
            tl.store(p_o + i, _key_page(best))
            prev = best


# fp16 queries over an fp8 cache: the value scales are applied as _V_UNIT * v_scale (a power of two: exact), as a
# scale is a row's largest magnitude / 448 and p * v_scale could fall below fp16's smallest normal (6e-5); times 2^8
# it stays below fp16's largest for any row an fp16 model holds (65504 / 448 * 2^8 < 65504). bf16 needs no unit.
_V_UNIT = tl.constexpr(256.0)


@triton.jit(do_not_specialize=["K", "PPS", "stride_bb", "stride_bh", "stride_tb"])
def paged_attention_split_kernel(
    q, k_cache, v_cache, k_scale, v_scale, rot, blocks, block_table, seq_lens, part_o, part_lse,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_sp, stride_st, stride_bb, stride_bh, stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    scale_log2, K, PPS,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, IEEE: tl.constexpr, HAS_SCALE: tl.constexpr, ROTATE: tl.constexpr,
):
    # one program: PPS slots of one (sequence, KV group); online softmax over their pages, one partial + LSE.
    # ROTATE: the cache's rows are stored times a rotation (an int8 cache's; 1: rot [D, D] fp32, 2: the Walsh-Hadamard
    # matrix, made in registers: _rotated): the query rows are multiplied by it here (fp32, then the query's dtype),
    # and the merge multiplies the output back
    # HAS_SCALE: fp8 K/V pages with one fp32 scale per (token, head) (k_scale / v_scale [P, BS, Hkv], strides
    # stride_sp, stride_st, 1): the fp8 tiles are cast to the query's dtype as they are (exact) and the scales applied
    # to the [G, BN] scores and probabilities (online_softmax_block's KV_FACTORS), not to [BN, D] tiles in fp32
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, DP)
    o_n = tl.arange(0, BN)
    m_d = o_d < D
    m_g = o_g < G
    b_q = tl.load(q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :],
                  mask=m_g[:, None] & m_d[None, :], other=0.0)
    if ROTATE:
        b_q = _rotated(b_q, rot, o_d, m_d, D, False, ROTATE).to(b_q.dtype)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for s in range(i_s * PPS, tl.minimum(i_s * PPS + PPS, K)):
        blk = tl.load(blocks + i_b * stride_bb + i_h * stride_bh + s)
        if blk >= 0:
            phys = tl.load(block_table + i_b * stride_tb + blk).to(tl.int64)
            m_key = (o_n < BS) & (blk * BS + o_n < seq_len)
            m_kd = m_key[:, None] & m_d[None, :]
            b_k = tl.load(k_cache + phys * stride_kp + o_n[:, None] * stride_kt + i_h * stride_kh + o_d[None, :],
                          mask=m_kd, other=0.0)
            b_v = tl.load(v_cache + phys * stride_vp + o_n[:, None] * stride_vt + i_h * stride_vh + o_d[None, :],
                          mask=m_kd, other=0.0)
            if HAS_SCALE:
                o_s = phys * stride_sp + o_n * stride_st + i_h
                v_fac = tl.load(v_scale + o_s, mask=m_key, other=0.0)
                if b_q.dtype == tl.float16:
                    v_fac = v_fac * _V_UNIT  # undone below
                m_i, l_i, acc = online_softmax_block(
                    b_q, b_k.to(b_q.dtype), b_v.to(b_q.dtype), m_i, l_i, acc, m_key[None, :], scale_log2, True, IEEE,
                    tl.load(k_scale + o_s, mask=m_key, other=0.0), v_fac, KV_FACTORS=True)
            else:
                m_i, l_i, acc = online_softmax_block(b_q, b_k, b_v, m_i, l_i, acc, m_key[None, :], scale_log2, True,
                                                     IEEE)
    if HAS_SCALE:
        if b_q.dtype == tl.float16:
            acc = acc * (1.0 / _V_UNIT)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    # the G rows only (GP pads G for the matmul: a group of 4 would write and the merge read 4x the bytes)
    tl.store(part_o + i_b * stride_pb + i_h * stride_ph + i_s * stride_ps + o_g[:, None] * DP + o_d[None, :],
             acc / l_safe[:, None], mask=m_g[:, None])
    tl.store(part_lse + i_b * stride_lb + i_h * stride_lh + i_s * GP + o_g, m_i + tl.math.log2(l_safe), mask=m_g)


@triton.jit
def _rotated(x, rot, o_d, m_d, D: tl.constexpr, TRANSPOSED: tl.constexpr, ROTATE: tl.constexpr):
    """Rows x [M, DP] times the rotation -> [M, DP] fp32 (the padding columns stay 0). ROTATE 1: rot [D, D] fp32
    row-major (or its transpose), a tf32x3 product (three tf32 tensor-core products, within a few fp32 units in the
    last place; the FMA loop of "ieee" held the [D, D] tile in registers and spilled: the int8 K/V write of the
    llama3-8b preset at 128K, batch 8, took 160 us a layer on the H200, BENCHMARKS.md). ROTATE 2: the Walsh-Hadamard
    matrix over sqrt(D) (D a power of two; symmetric), its signs (-1)^popcount(i & j) made in registers, nothing
    loaded: each row over its largest magnitude split into two fp16 parts (22 bits of mantissa), each times the
    signs exactly (fp16 tensor-core products, fp32 sums), then times that magnitude over sqrt(D). (fp16, not bf16:
    the interpreter's bf16 products are wrong, Triton 3.9; the scaling keeps fp16 in range.)"""
    if ROTATE == 2:
        p = o_d[:, None] & o_d[None, :]
        p = p ^ (p >> 8)
        p = p ^ (p >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        h = tl.where(m_d[:, None] & m_d[None, :], tl.where((p & 1) == 0, 1.0, -1.0), 0.0).to(tl.float16)
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), 1)
        amax = tl.where(amax == 0.0, 1.0, amax)
        xn = xf / amax[:, None]
        hi = xn.to(tl.float16)
        y = tl.dot(hi, h) + tl.dot((xn - hi.to(tl.float32)).to(tl.float16), h)
        return y * (amax / tl.math.sqrt_rn(tl.full([], D, tl.float32)))[:, None]
    m = m_d[:, None] & m_d[None, :]
    if TRANSPOSED:  # r[i, j] = rot[j, i]
        r = tl.load(rot + o_d[None, :] * D + o_d[:, None], mask=m, other=0.0)
    else:
        r = tl.load(rot + o_d[:, None] * D + o_d[None, :], mask=m, other=0.0)
    return tl.dot(x.to(tl.float32), r, input_precision="tf32x3")


@triton.jit(do_not_specialize=["SPLITS"])
def paged_merge_kernel(
    part_o, part_lse, out, rot, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    SPLITS, G: tl.constexpr, GP: tl.constexpr, GM: tl.constexpr, SC: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, ROTATE: tl.constexpr,
):
    # one program: one (sequence, KV group); its SPLITS partials folded by log-sum-exp, SC splits a load (the
    # llama3-8b preset's dense layer: 64 splits in 8 dependent loads, not 64). GM rows: the group's G padded to a
    # power of two (GP, the matmul's 16, where the output is rotated back); the split kernel writes each partial's G
    # rows (GP apart)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_g = tl.arange(0, GM)
    o_d = tl.arange(0, DP)
    o_c = tl.arange(0, SC)
    m_g = o_g < G
    m_acc = tl.full([GM], float("-inf"), tl.float32)
    l_acc = tl.zeros([GM], tl.float32)
    acc = tl.zeros([GM, DP], tl.float32)
    if SC == 1:  # one split a load (2D tiles: a [GM, DP] partial fills the program already)
        for s in range(SPLITS):
            lse = tl.load(part_lse + i_b * stride_lb + i_h * stride_lh + s * GP + o_g, mask=m_g, other=float("-inf"))
            o = tl.load(part_o + i_b * stride_pb + i_h * stride_ph + s * stride_ps + o_g[:, None] * DP + o_d[None, :],
                        mask=m_g[:, None], other=0.0)
            m_acc, l_acc, acc = lse_merge(m_acc, l_acc, acc, lse, o)
    else:
        for s0 in range(0, SPLITS, SC):
            m = ((s0 + o_c) < SPLITS)[:, None] & m_g[None, :]
            lse = tl.load(part_lse + i_b * stride_lb + i_h * stride_lh + (s0 + o_c)[:, None] * GP + o_g[None, :],
                          mask=m, other=float("-inf"))  # [SC, GM]
            o = tl.load(part_o + i_b * stride_pb + i_h * stride_ph + (s0 + o_c)[:, None, None] * stride_ps
                        + o_g[None, :, None] * DP + o_d[None, None, :], mask=m[:, :, None], other=0.0)  # [SC, GM, DP]
            m_new = tl.maximum(m_acc, tl.max(lse, 0))  # lse_merge over SC partials at once
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_acc - m_use)
            w = tl.math.exp2(lse - m_use[None, :])
            l_acc = l_acc * alpha + tl.sum(w, 0)
            acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
            m_acc = m_new
    l_acc = tl.where(l_acc == 0.0, 1.0, l_acc)
    o = acc / l_acc[:, None]
    if ROTATE:  # the values were stored times rot: the output back in the model's basis (times rot^T)
        o = _rotated(o, rot, o_d, o_d < D, D, True, ROTATE)
    tl.store(out + i_b * stride_ob + (i_h * G + o_g)[:, None] * stride_oh + o_d[None, :],
             o.to(out.dtype.element_ty), mask=m_g[:, None] & (o_d < D)[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def index_write_kernel(
    k_idx, tail, idx_cache, idx_scale, rows, pos, block_table,
    stride_kn, stride_tb, stride_tt, stride_cp, stride_ct, stride_sp, stride_bt,
    BS: tl.constexpr, BSP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    # one program: one sequence's new index key into its tail row, then rows 0..off of that sequence's newest page as
    # the quantisation of its tail rows 0..off (one scale, their largest magnitude -> 448). The page's scale (row 0's)
    # is its rows' so far: where the new key's scale is not larger, the other rows keep their bytes and only the new
    # row is written (most steps); a larger one, or a new page (off 0), quantises rows 0..off again
    n = tl.program_id(0)
    b = tl.load(rows + n).to(tl.int64)
    p = tl.load(pos + n).to(tl.int64)
    off = p % BS
    page = tl.load(block_table + b * stride_bt + p // BS).to(tl.int64)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    key = tl.load(k_idx + n * stride_kn + o_d, mask=m_d, other=0.0).to(tail.dtype.element_ty)
    tl.store(tail + b * stride_tb + off * stride_tt + o_d, key, mask=m_d)
    key = key.to(tl.float32)
    new_scale = e4m3_scale(tl.maximum(tl.max(tl.abs(key), 0), 1e-12))
    old_scale = tl.load(idx_scale + page * stride_sp)
    if (off > 0) & (new_scale <= old_scale):
        tl.store(idx_cache + page * stride_cp + off * stride_ct + o_d, to_e4m3(key, old_scale), mask=m_d)
        tl.store(idx_scale + page * stride_sp + off, old_scale)
    else:
        o_r = tl.arange(0, BSP)
        p_t = tail + b * stride_tb + o_r[:, None] * stride_tt + o_d[None, :]
        x = tl.load(p_t, mask=(o_r < off)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        x = tl.where((o_r == off)[:, None], key[None, :], x)
        scale = e4m3_scale(tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12))
        m_r = o_r <= off
        tl.store(idx_cache + page * stride_cp + o_r[:, None] * stride_ct + o_d[None, :], to_e4m3(x, scale),
                 mask=m_r[:, None] & m_d[None, :])
        tl.store(idx_scale + page * stride_sp + o_r, tl.zeros([BSP], tl.float32) + scale, mask=m_r)


@triton.jit
def kv_write_kernel(
    k, v, k_cache, v_cache, k_scale, v_scale, page, off, shift, rot,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_cp, stride_ct, stride_ch, stride_sp, stride_st,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, INT8: tl.constexpr, SHIFT: tl.constexpr,
    ROTATE: tl.constexpr,
):
    # one program: one token's K and V rows [H, D] quantised with one scale per head (e4m3: the row's largest
    # magnitude -> 448; INT8: -> 127; as naive.quantize_kv) and stored with their scales at slot off of physical
    # page `page`. SHIFT: the keys less shift [H, D] fp32 first; ROTATE: both times the rotation (_rotated)
    n = tl.program_id(0)
    p = tl.load(page + n).to(tl.int64)
    o = tl.load(off + n).to(tl.int64)
    o_h = tl.arange(0, HP)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    m = (o_h < H)[:, None] & m_d[None, :]
    p_c = p * stride_cp + o * stride_ct + o_h[:, None] * stride_ch + o_d[None, :]
    p_s = p * stride_sp + o * stride_st + o_h
    x = tl.load(k + n * stride_kn + o_h[:, None] * stride_kh + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if SHIFT:
        x = x - tl.load(shift + o_h[:, None] * D + o_d[None, :], mask=m, other=0.0)
    if ROTATE:
        x = _rotated(x, rot, o_d, m_d, D, False, ROTATE)
    _store_row(x, k_cache + p_c, k_scale + p_s, m, o_h < H, INT8)
    x = tl.load(v + n * stride_vn + o_h[:, None] * stride_vh + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if ROTATE:
        x = _rotated(x, rot, o_d, m_d, D, False, ROTATE)
    _store_row(x, v_cache + p_c, v_scale + p_s, m, o_h < H, INT8)


@triton.jit
def _store_row(x, p_x, p_s, m, m_h, INT8: tl.constexpr):
    """fp32 rows [HP, DP] quantised with one scale per row (kv_write_kernel) and stored with their scales."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-12)
    if INT8:
        x8, scale = to_int8(x, amax)
    else:
        scale = e4m3_scale(amax)
        x8 = to_e4m3(x, scale[:, None])
    tl.store(p_x, x8, mask=m)
    tl.store(p_s, scale, mask=m_h)


@triton.jit(do_not_specialize=["max_pages", "stride_qb", "stride_sb", "stride_sh", "stride_bb", "stride_bh"])
def adaptive_cut_kernel(
    q_idx, scores, seq_lens, blocks,
    stride_qb, stride_qh, stride_sb, stride_sh, stride_bb, stride_bh,
    max_pages, sm_scale, top_p, min_blocks,
    D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, INIT: tl.constexpr,
    LOCAL: tl.constexpr, FP8: tl.constexpr, CHUNK: tl.constexpr,
):
    # one program per (sequence, index head): the adaptive budget's cut of its fixed selection (naive.adaptive_decode)
    # in place. The logits are the scoring kernel's block scores times sm_scale (and, FP8, the query row's own e4m3
    # scale); the candidates' log-sum-exp streams over the row's pages; a slot's rank and the mass before it come
    # from comparing every slot with every other (K x K: ties to the lower slot, as a stable sort), so no sort
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    seq_len = tl.load(seq_lens + i_b)
    n_pages = tl.cdiv(seq_len, BS)
    q_block = (seq_len - 1) // BS
    scale = sm_scale
    if FP8:
        o_d = tl.arange(0, DP)
        q = tl.load(q_idx + i_b * stride_qb + i_h * stride_qh + o_d, mask=o_d < D, other=0.0).to(tl.float32)
        scale = scale * e4m3_scale(tl.maximum(tl.max(tl.abs(q), 0), 1e-12))
    p_s = scores + i_b * stride_sb + i_h * stride_sh
    o_c = tl.arange(0, CHUNK)
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in range(0, max_pages, CHUNK):
        page = start + o_c
        cand = (page < n_pages) & (page >= INIT) & (page <= q_block - LOCAL)
        s = tl.where(cand, tl.load(p_s + page, mask=cand, other=0.0) * scale, float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
    m_row = tl.max(m, 0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    total = tl.sum(acc * tl.exp(m - m_row_safe), 0)
    o_k = tl.arange(0, KP)
    p_b = blocks + i_b * stride_bb + i_h * stride_bh + o_k
    ids = tl.load(p_b, mask=o_k < K, other=-1)
    valid = ids >= 0
    forced = valid & ((ids > q_block - LOCAL) | (ids < INIT))
    cand = valid & ~forced
    logit = tl.where(cand, tl.load(p_s + ids, mask=cand, other=0.0) * scale, float("-inf"))
    prob = tl.where(cand, tl.exp(logit - m_row_safe) / tl.maximum(total, 1e-30), 0.0)
    # slot j is ahead of slot i: a higher logit, or the same one in a lower slot
    li, lj = logit[:, None], logit[None, :]
    ahead = cand[None, :] & ((lj > li) | ((lj == li) & (o_k[None, :] < o_k[:, None])))
    before = tl.sum(tl.where(ahead, prob[None, :], 0.0), 1)
    rank = tl.sum(ahead.to(tl.int32), 1)
    n_forced = tl.sum(forced.to(tl.int32), 0)
    keep = forced | (cand & ((before < top_p) | (n_forced + rank < min_blocks)))
    tl.store(p_b, tl.where(keep, ids, -1), mask=o_k < K)
