"""Triton kernels of kernels/sparse_attention/__init__.py (imported only when a kernel is launched). See that module."""
import triton
import triton.language as tl

from m3compile.kernels._common import autotune, configs
from m3compile.kernels._tl_common import csr_segment, lse_merge


@triton.jit
def _segment_block(seg, pid, tile_start, seg_off, k, v, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                   stride_vt, T, HKV: tl.constexpr, NB, D: tl.constexpr, DP: tl.constexpr,
                   BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr):
    """A program's CSR entries [start, end) of segment `seg` = (batch, KV head, key block j), and that block's K/V.
    NB (key blocks per sequence) is a constexpr of the training kernels and a runtime value of the forward's."""
    start, end, i_b, i_h, j = csr_segment(seg, pid, tile_start, seg_off, HKV, NB, CHUNK)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    o_key = j * BS + o_n
    m_key = (o_n < BS) & (o_key < T)
    m_kd = m_key[:, None] & m_d[None, :]
    b_k = tl.load(k + i_b * stride_kb + i_h * stride_kh + o_key[:, None].to(tl.int64) * stride_kt + o_d[None, :],
                  mask=m_kd, other=0.0)
    b_v = tl.load(v + i_b * stride_vb + i_h * stride_vh + o_key[:, None].to(tl.int64) * stride_vt + o_d[None, :],
                  mask=m_kd, other=0.0)
    return start, end, i_b, i_h, o_d, m_d, o_key, m_key, m_kd, b_k, b_v


def _prune(cfgs, named_args, **kw):
    """Tiles of whole tokens: ROWS >= GP heads where a listed tile allows (the kernels round a smaller ROWS up to
    one token of GP rows, which also covers a single config, where the autotuner skips pruning)."""
    gp = named_args["GP"] if "GP" in named_args else kw["GP"]
    return [c for c in cfgs if c.kwargs["ROWS"] >= gp] or cfgs[-1:]


def tile_rows(rows: int, gp: int) -> int:
    """Matmul rows of a tile: TOK = ROWS // GP whole tokens (at least one) of GP head rows each."""
    return max(1, rows // gp) * gp


def _descriptor_block(nargs):
    """Autotune pre-hook: the partial-output descriptor's box is one tile of the config being launched."""
    desc = nargs["o_desc"]
    if hasattr(desc, "block_shape"):  # a TensorDescriptor (TMA on), else the partials' pointer
        desc.block_shape = [tile_rows(nargs["ROWS"], nargs["GP"]), nargs["DP"]]


@autotune(
    configs=configs(
        [dict(ROWS=r, num_warps=w, num_stages=s) for r in (16, 32, 64, 128) for w in (4, 8) for s in (2, 3)],
        interpret=dict(ROWS=32, num_warps=4, num_stages=1),
        default=dict(ROWS=64, num_warps=4, num_stages=2),
        pre_hook=_descriptor_block,
    ),
    key=["GP", "DP", "BN", "CHUNK", "IEEE", "LSE_ONLY", "TMA", "tune_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)
# NB, like T, is a runtime value: a prompt of another length (in blocks) runs the same binary, no compile
@triton.jit(do_not_specialize=["T", "t0", "q_start", "n_seg", "tune_bucket", "NB", "stride_lb"])
def gather_q_fwd_kernel(
    q, k, v, part_o, part_lse, o_desc, tile_seg, tile_start, seg_off, payload,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_lb, stride_lt, stride_ls,
    T, t0, q_start, n_seg, scale_log2, tune_bucket, NB,
    HKV: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, LSE_ONLY: tl.constexpr, TMA: tl.constexpr, ROWS: tl.constexpr,
):
    # one program: one (batch, KV head, key block) segment of the CSR, up to CHUNK of the queries that chose it;
    # K/V of the block are loaded once and every TOK-token x G-head tile of gathered queries sweeps them.
    # Partial outputs and log-sum-exps are written in CSR entry order (row = entry * GP + head: a tile's rows are
    # one contiguous range, stored whole by TMA where TMA is on); LSE_ONLY writes its log-sum-exps per (token,
    # slot, head) instead, for a torch merge. T keys; query row r (of q, the selection) is at position q_start + r
    pid = tl.program_id(0)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        start, end, i_b, i_h, o_d, m_d, o_key, m_key, m_kd, b_k, b_v = _segment_block(
            seg, pid, tile_start, seg_off, k, v, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            T, HKV, NB, D, DP, BS, BN, CHUNK)
        TOK: tl.constexpr = ROWS // GP if ROWS >= GP else 1  # gathered tokens per tile (tile_rows), G heads each
        o_r = tl.arange(0, TOK * GP)
        o_g = o_r % GP
        o_hq = i_h * G + o_g
        # the first tile's gathered rows and the second tile's payload; inside the loop the next tile's rows are
        # loaded before this tile's matmuls, so the indirect loads of one tile overlap the compute of the previous
        # one, and the payload two tiles ahead, so the rows' addresses never wait on a load issued just before
        o_e = start + o_r // GP
        m_next = (o_e < end) & (o_g < G)
        pl_next = tl.load(payload + o_e, mask=m_next, other=0)
        q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                         + (t0 + pl_next // K)[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                         mask=m_next[:, None] & m_d[None, :], other=0.0)
        m_after = (o_e + TOK < end) & (o_g < G)
        pl_after = tl.load(payload + o_e + TOK, mask=m_after, other=0)
        tok_next = tl.load(payload + start, mask=start < end, other=0)
        tok_after = tl.load(payload + start + TOK, mask=start + TOK < end, other=0)
        # tiles whose every token lies past a full key block see all of it: no mask, and the scale rides in the
        # exponent's FMA. A segment's tokens are sorted, so only its first tiles hold the block's own tokens, and a
        # tile's first token is its smallest: its payload, loaded two tiles ahead (`tok`), decides, not a reduction
        # over the tile's rows
        past = (seg % NB + 1) * BS
        open_block = (BN == BS) & (past <= T)
        for e0 in range(start, end, TOK):
            m_row, pl, b_q = m_next, pl_next, q_next
            m_next, pl_next = m_after, pl_after
            q_next = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh
                             + (t0 + pl_next // K)[:, None].to(tl.int64) * stride_qt + o_d[None, :],
                             mask=m_next[:, None] & m_d[None, :], other=0.0)
            o_e = e0 + 2 * TOK + o_r // GP
            m_after = (o_e < end) & (o_g < G)
            pl_after = tl.load(payload + o_e, mask=m_after, other=0)
            tok = tok_next
            tok_next = tok_after
            tok_after = tl.load(payload + e0 + 2 * TOK, mask=e0 + 2 * TOK < end, other=0)
            o_tl = pl // K  # token index inside the query chunk
            o_slot = pl % K
            o_t = q_start + t0 + o_tl  # positions
            if IEEE:
                s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
            else:
                s = tl.dot(b_q, tl.trans(b_k))
            if open_block & (q_start + t0 + tok // K >= past):
                m = tl.max(s, 1) * scale_log2
                p = tl.math.exp2(s * scale_log2 - m[:, None])
                l = tl.sum(p, 1)
            else:
                s = tl.where(m_key[None, :] & (o_key[None, :] <= o_t[:, None]), s * scale_log2, float("-inf"))
                # a row that sees no key of the block (a block past its token's own) keeps m = -inf, so its stored
                # log-sum-exp is -inf and the merge gives it no weight, as the reference does
                m = tl.max(s, 1)
                p = tl.math.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
                l = tl.sum(p, 1)
                l = tl.where(l == 0.0, 1.0, l)
            if not LSE_ONLY:  # LSE_ONLY: the per-block log-sum-exps alone (the KL's teacher), no P V
                if IEEE:
                    o = tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
                else:
                    o = tl.dot(p.to(b_v.dtype), b_v)
                o = (o * (1.0 / l)[:, None]).to(part_o.dtype.element_ty)
                o_row = (e0 + o_r // GP).to(tl.int64) * GP + o_g  # entry e0 + r // GP, head r % GP
                p_o = part_o + o_row[:, None] * D + o_d[None, :]
                if TMA:
                    if e0 + TOK <= end:  # a whole tile; padding heads (GP > G) land in rows nothing reads
                        o_desc.store([e0 * GP, 0], o)
                    else:  # a segment's last tile: the rows past it are the next segment's
                        tl.store(p_o, o, mask=m_row[:, None] & m_d[None, :])
                else:
                    tl.store(p_o, o, mask=m_row[:, None] & m_d[None, :])
                tl.store(part_lse + o_row, m + tl.math.log2(l), mask=m_row)
            else:
                p_l = part_lse + i_b * stride_lb + o_tl.to(tl.int64) * stride_lt + o_slot * stride_ls + o_hq
                tl.store(p_l, m + tl.math.log2(l), mask=m_row)


@triton.jit
def _token_group(C, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Grid (B * C, Hkv) of the per-token kernels: this program's batch, token in the chunk, KV group, its head rows
    and head-dim columns with their masks, and the query heads of the group."""
    pid = tl.program_id(0)
    i_h = tl.program_id(1)
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, DP)
    m_g = o_g < G
    m_gd = m_g[:, None] & (o_d < D)[None, :]
    return (pid // C).to(tl.int64), (pid % C).to(tl.int64), i_h, o_g, o_d, m_g, m_gd, i_h * G + o_g


@triton.jit(do_not_specialize=["C", "t0", "stride_bb", "stride_bh", "stride_xb"])
def combine_kernel(
    part_o, part_lse, entry, blocks, out, lse_out,
    stride_bb, stride_bh, stride_bt, stride_ob, stride_ot, stride_oh, stride_xb, stride_xt,
    C, t0,
    HKV: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STORE_LSE: tl.constexpr, UNROLL: tl.constexpr, TOK: tl.constexpr = 1,
):
    # one program: one (batch, query token, KV group); log-sum-exp merge of the token's per-block partials, found
    # through `entry` (the CSR position of each (batch, head, token, slot)). The slots go in groups of UNROLL, each
    # unrolled so that its partial loads are independent and issue together; a loop over the groups bounds the
    # registers in flight (all K slots unrolled at once spill past about 16: top-45 combined 3x slower).
    # TOK > 1 (the interpreter's: COMBINE_TOKENS_INTERPRETED): TOK consecutive tokens a program, TOK x GP rows, the
    # same merge per row; the interpreter's cost is per program and per operation, not per row
    if TOK == 1:
        i_b, i_tl, i_h, o_g, o_d, m_g, m_gd, o_hq = _token_group(C, G, GP, D, DP)
        m_acc = tl.full([GP], float("-inf"), tl.float32)
        l_acc = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        p_blk = blocks + i_b * stride_bb + i_h * stride_bh + (t0 + i_tl) * stride_bt
        p_ent = entry + ((i_b * HKV + i_h) * C + i_tl) * K
        for s0 in range(0, K, UNROLL):
            for u in tl.static_range(UNROLL):
                s = s0 + u
                slot = tl.load(p_blk + s, mask=s < K, other=-1)
                valid = (tl.zeros([GP], tl.int32) + slot) >= 0  # the slot's block id, per row
                o_row = tl.load(p_ent + s, mask=s < K, other=0).to(tl.int64) * GP + o_g
                lse = tl.load(part_lse + o_row, mask=m_g & valid, other=float("-inf"))
                o = tl.load(part_o + o_row[:, None] * D + o_d[None, :], mask=m_gd & valid[:, None],
                            other=0.0).to(tl.float32)
                m_acc, l_acc, acc = lse_merge(m_acc, l_acc, acc, lse, o)
        l_acc = tl.where(l_acc == 0.0, 1.0, l_acc)
        p_out = out + i_b * stride_ob + (t0 + i_tl) * stride_ot + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_out, (acc / l_acc[:, None]).to(out.dtype.element_ty), mask=m_gd)
        if STORE_LSE:  # the token's log-sum-exp over all its blocks (base 2, scale included), kept for backward
            tl.store(lse_out + i_b * stride_xb + (t0 + i_tl) * stride_xt + o_hq, m_acc + tl.math.log2(l_acc),
                     mask=m_g)
    else:
        n_tiles = tl.cdiv(C, TOK)
        i_b = (tl.program_id(0) // n_tiles).to(tl.int64)
        i_h = tl.program_id(1)
        o_r = tl.arange(0, TOK * GP)
        i_tl = ((tl.program_id(0) % n_tiles) * TOK + o_r // GP).to(tl.int64)  # each row's token in the chunk
        o_g = o_r % GP
        o_hq = i_h * G + o_g
        o_d = tl.arange(0, DP)
        m_r = (i_tl < C) & (o_g < G)
        m_rd = m_r[:, None] & (o_d < D)[None, :]
        m_acc = tl.full([TOK * GP], float("-inf"), tl.float32)
        l_acc = tl.zeros([TOK * GP], tl.float32)
        acc = tl.zeros([TOK * GP, DP], tl.float32)
        p_blk = blocks + i_b * stride_bb + i_h * stride_bh + (t0 + i_tl) * stride_bt
        p_ent = entry + ((i_b * HKV + i_h) * C + i_tl) * K
        for s0 in range(0, K, UNROLL):
            for u in tl.static_range(UNROLL):
                s = s0 + u
                m_s = m_r & (o_r * 0 + s < K)
                valid = tl.load(p_blk + s, mask=m_s, other=-1) >= 0
                o_row = tl.load(p_ent + s, mask=m_s, other=0).to(tl.int64) * GP + o_g
                lse = tl.load(part_lse + o_row, mask=m_r & valid, other=float("-inf"))
                o = tl.load(part_o + o_row[:, None] * D + o_d[None, :], mask=m_rd & valid[:, None],
                            other=0.0).to(tl.float32)
                m_acc, l_acc, acc = lse_merge(m_acc, l_acc, acc, lse, o)
        l_acc = tl.where(l_acc == 0.0, 1.0, l_acc)
        p_out = out + i_b * stride_ob + (t0 + i_tl)[:, None] * stride_ot + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_out, (acc / l_acc[:, None]).to(out.dtype.element_ty), mask=m_rd)
        if STORE_LSE:
            tl.store(lse_out + i_b * stride_xb + (t0 + i_tl) * stride_xt + o_hq, m_acc + tl.math.log2(l_acc),
                     mask=m_r)


@autotune(
    configs=configs(
        [dict(ROWS=r, num_warps=w, num_stages=s) for r in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)],
        interpret=dict(ROWS=32, num_warps=4, num_stages=1),
        default=dict(ROWS=64, num_warps=8, num_stages=2),
    ),
    key=["GP", "DP", "BN", "CHUNK", "IEEE", "DQ_PARTS", "tune_bucket"],
    prune_configs_by={"early_config_prune": _prune},
    reset_to_zero=["dq", "dk", "dv"],  # the kernel accumulates into them: every timed config starts from zero
)
@triton.jit(do_not_specialize=["T", "t0", "n_seg", "tune_bucket"])
def gather_q_bwd_kernel(
    q, k, v, do, lse, delta, dq, dk, dv, tile_seg, tile_start, seg_off, payload,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_ot, stride_oh, stride_xb, stride_xt, stride_gb, stride_gt, stride_gs, stride_gh,
    stride_db, stride_dh, stride_dt,
    T, t0, n_seg, scale, scale_log2, tune_bucket,
    HKV: tl.constexpr, NB: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, DQ_PARTS: tl.constexpr, ROWS: tl.constexpr,
):
    # one program: the same (batch, KV head, key block) segment chunk as the forward. With the forward's LSE the
    # probabilities are exact per block, so dK/dV of the block accumulate on chip over the gathered queries and
    # each query row's dQ share is added to dq (relaxed fp32 atomics: a row gets one share per selected block).
    # Scores are kept transposed, keys x gathered rows ([BN, ROWS]), so the dK/dV accumulators are the natural
    # result layout of their matmuls and only small [BN, ROWS] tiles live beside them.
    pid = tl.program_id(0)
    seg = tl.load(tile_seg + pid)
    if seg < n_seg:
        start, end, i_b, i_h, o_d, m_d, o_key, m_key, m_kd, b_k, b_v = _segment_block(
            seg, pid, tile_start, seg_off, k, v, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            T, HKV, NB, D, DP, BS, BN, CHUNK)
        if IEEE:
            b_k = b_k.to(tl.float32)
            b_v = b_v.to(tl.float32)
        acc_dk = tl.zeros([BN, DP], tl.float32)
        acc_dv = tl.zeros([BN, DP], tl.float32)
        TOK: tl.constexpr = ROWS // GP if ROWS >= GP else 1
        o_r = tl.arange(0, TOK * GP)
        o_g = o_r % GP
        o_hq = i_h * G + o_g
        for e0 in range(start, end, TOK):
            o_e = e0 + o_r // GP
            m_row = (o_e < end) & (o_g < G)
            pl = tl.load(payload + o_e, mask=m_row, other=0)
            o_tl = pl // K  # token inside the query chunk
            o_t = t0 + o_tl
            m_rd = m_row[:, None] & m_d[None, :]
            b_q = tl.load(q + i_b * stride_qb + o_hq[:, None] * stride_qh + o_t[:, None].to(tl.int64) * stride_qt
                          + o_d[None, :], mask=m_rd, other=0.0)
            b_do = tl.load(do + i_b * stride_ob + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh
                           + o_d[None, :], mask=m_rd, other=0.0)
            b_lse = tl.load(lse + i_b * stride_xb + o_t.to(tl.int64) * stride_xt + o_hq, mask=m_row, other=0.0)
            b_delta = tl.load(delta + i_b * stride_xb + o_t.to(tl.int64) * stride_xt + o_hq, mask=m_row, other=0.0)
            m_s = m_key[:, None] & m_row[None, :] & (o_key[:, None] <= o_t[None, :])  # [BN, ROWS]
            if IEEE:
                b_q = b_q.to(tl.float32)
                b_do = b_do.to(tl.float32)
                s_t = tl.dot(b_k, tl.trans(b_q), input_precision="ieee")
                p_t = tl.where(m_s, tl.math.exp2(s_t * scale_log2 - b_lse[None, :]), 0.0)
                acc_dv += tl.dot(p_t, b_do, input_precision="ieee")
                dp_t = tl.dot(b_v, tl.trans(b_do), input_precision="ieee")
                ds_t = p_t * (dp_t - b_delta[None, :]) * scale  # d(score), softmax scale folded in
                acc_dk += tl.dot(ds_t, b_q, input_precision="ieee")
                dq_part = tl.dot(tl.trans(ds_t), b_k, input_precision="ieee")
            else:
                s_t = tl.dot(b_k, tl.trans(b_q))
                p_t = tl.where(m_s, tl.math.exp2(s_t * scale_log2 - b_lse[None, :]), 0.0)
                acc_dv += tl.dot(p_t.to(b_do.dtype), b_do)
                dp_t = tl.dot(b_v, tl.trans(b_do))
                ds_t = (p_t * (dp_t - b_delta[None, :]) * scale).to(b_q.dtype)
                acc_dk += tl.dot(ds_t, b_q)
                dq_part = tl.dot(tl.trans(ds_t), b_k)
            if DQ_PARTS:  # one share per (token, slot, head), summed by sum_slots_kernel: no atomics
                tl.store(dq + i_b * stride_gb + o_tl[:, None].to(tl.int64) * stride_gt + (pl % K)[:, None] * stride_gs
                         + o_hq[:, None] * stride_gh + o_d[None, :], dq_part.to(dq.dtype.element_ty), mask=m_rd)
            else:
                tl.atomic_add(dq + i_b * stride_gb + o_t[:, None].to(tl.int64) * stride_gt
                              + o_hq[:, None] * stride_gh + o_d[None, :], dq_part, mask=m_rd, sem="relaxed")
        p_dk = dk + i_b * stride_db + i_h * stride_dh + o_key[:, None].to(tl.int64) * stride_dt + o_d[None, :]
        tl.atomic_add(p_dk, acc_dk, mask=m_kd, sem="relaxed")
        p_dv = dv + i_b * stride_db + i_h * stride_dh + o_key[:, None].to(tl.int64) * stride_dt + o_d[None, :]
        tl.atomic_add(p_dv, acc_dv, mask=m_kd, sem="relaxed")


@triton.jit(do_not_specialize=["C", "t0"])
def sum_slots_kernel(
    part, blocks, out, stride_pb, stride_pt, stride_ps, stride_ph, stride_bb, stride_bh, stride_bt,
    stride_ob, stride_ot, stride_oh, C, t0,
    K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    # one program: one (batch, query token, KV group); the fp32 sum of the token's per-slot dQ shares, -1 slots
    # skipped (never written)
    i_b, i_tl, i_h, o_g, o_d, m_g, m_gd, o_hq = _token_group(C, G, GP, D, DP)
    acc = tl.zeros([GP, DP], tl.float32)
    p_blk = blocks + i_b * stride_bb + i_h * stride_bh + (t0 + i_tl) * stride_bt
    for s in tl.static_range(K):
        valid = (tl.zeros([GP], tl.int32) + tl.load(p_blk + s)) >= 0  # the slot's block id, per row
        acc += tl.load(part + i_b * stride_pb + i_tl * stride_pt + s * stride_ps + o_hq[:, None] * stride_ph
                       + o_d[None, :], mask=m_gd & valid[:, None], other=0.0).to(tl.float32)
    tl.store(out + i_b * stride_ob + (t0 + i_tl) * stride_ot + o_hq[:, None] * stride_oh + o_d[None, :],
             acc.to(out.dtype.element_ty), mask=m_gd)


# ----------------------------------------------------------------------------------------------------------------
# The CSR of a selection (sparse_attention.build_csr): sort keys, segment offsets and payload, the tile schedule


@triton.jit(do_not_specialize=["n", "C", "t0", "NB", "stride_bb", "stride_bh"])
def csr_keys_kernel(blocks, key, stride_bb, stride_bh, stride_bt, n, C, t0, NB, HKV: tl.constexpr,
                    K: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK (batch, head, token, slot) entries of the query range [t0, t0 + C); the sort key of each:
    # its segment (batch, head, block), and n_seg (past every segment) for -1 slots
    o_e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o_e < n
    slot = o_e % K
    tok = (o_e // K) % C
    bh = o_e // (K * C)
    p = blocks + (bh // HKV) * stride_bb + (bh % HKV) * stride_bh + (t0 + tok) * stride_bt + slot
    sel = tl.load(p, mask=m, other=-1).to(tl.int64)
    n_seg = (n // (K * C)) * NB  # batch x heads x blocks
    k = tl.where(sel >= 0, bh * NB + sel, n_seg)
    tl.store(key + o_e, k.to(key.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n", "n_seg", "ck", "chunk", "seg_programs", "steps"])
def csr_segments_kernel(key, order, payload, entry, seg_off, tiles, n, n_seg, ck, chunk, seg_programs, steps,
                        BLOCK: tl.constexpr):
    # programs < seg_programs: BLOCK segments each; a segment's first entry in the sorted segment keys by binary
    # search (lower bound), and its tile count; the others: the payload (token * K + slot) of BLOCK entries, from
    # the sort's permutation (entry = (batch * heads + head) * C*K + token * K + slot), and the permutation's
    # inverse (`entry`: each entry's CSR position, where the forward writes its partials)
    pid = tl.program_id(0)
    if pid < seg_programs:
        s = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = s <= n_seg
        lo = tl.zeros([BLOCK], tl.int64)
        hi = tl.zeros([BLOCK], tl.int64) + n
        lo1 = tl.zeros([BLOCK], tl.int64)
        hi1 = tl.zeros([BLOCK], tl.int64) + n
        for _ in range(steps):  # ceil(log2(n + 1)) halvings find both bounds
            mid = (lo + hi) // 2
            right = (tl.load(key + mid, mask=m & (lo < hi), other=0).to(tl.int64) < s) & (lo < hi)
            left = (lo < hi) & ~right
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(left, mid, hi)
            mid1 = (lo1 + hi1) // 2
            right1 = (tl.load(key + mid1, mask=m & (lo1 < hi1), other=0).to(tl.int64) < s + 1) & (lo1 < hi1)
            left1 = (lo1 < hi1) & ~right1
            lo1 = tl.where(right1, mid1 + 1, lo1)
            hi1 = tl.where(left1, mid1, hi1)
        tl.store(seg_off + s, lo.to(tl.int32), mask=m)
        tl.store(tiles + s, ((lo1 - lo + chunk - 1) // chunk).to(tl.int32), mask=s < n_seg)
    else:
        o_e = (pid - seg_programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o_e < n
        live = tl.load(key + o_e, mask=m, other=0).to(tl.int64) < n_seg  # -1 slots, sorted last, get payload 0
        src = tl.load(order + o_e, mask=m, other=0)
        tl.store(payload + o_e, tl.where(live, src % ck, 0).to(tl.int32), mask=m)
        tl.store(entry + src, o_e.to(tl.int32), mask=m)  # where each (batch, head, token, slot) sits in the CSR


@triton.jit(do_not_specialize=["n_seg", "n_tiles", "chunk", "seg_programs"])
def csr_tiles_kernel(seg_off, tiles, tile_end, tile_seg, tile_start, n_seg, n_tiles, chunk, seg_programs,
                     BLOCK: tl.constexpr):
    # programs < seg_programs: BLOCK segments each write their tiles (segment id, first entry); the others mark the
    # tiles past the last busy one idle (segment id n_seg)
    pid = tl.program_id(0)
    if pid < seg_programs:
        s = pid * BLOCK + tl.arange(0, BLOCK)
        m = s < n_seg
        nt = tl.load(tiles + s, mask=m, other=0)
        first = tl.load(tile_end + s, mask=m, other=0) - nt
        off = tl.load(seg_off + s, mask=m, other=0)
        for i in range(0, tl.max(nt, 0)):
            mi = m & (i < nt)
            tl.store(tile_seg + first + i, s, mask=mi)
            tl.store(tile_start + first + i, off + i * chunk, mask=mi)
    else:
        p = (pid - seg_programs) * BLOCK + tl.arange(0, BLOCK)
        busy = tl.load(tile_end + n_seg - 1)
        m = (p < n_tiles) & (p >= busy)
        tl.store(tile_seg + p, tl.zeros([BLOCK], tl.int32) + n_seg, mask=m)
        tl.store(tile_start + p, tl.zeros([BLOCK], tl.int32), mask=m)
