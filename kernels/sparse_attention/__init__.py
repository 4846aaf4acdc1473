"""MSA sparse prefill attention, KV-outer "gather Q" design (docs/msa.md section 5).

The selection [B, Hkv, T, K] is inverted into a CSR: for every (batch, KV head, key block) segment, the list of
(query token, slot) entries that chose it, sorted by token. One program takes one segment (at most CHUNK entries of
it), loads that key block's K and V once, and sweeps tiles of TOK gathered query tokens x G heads over them: the
matmul rows are TOK * G, not G as in the query-major design, so Hopper tensor cores get full tiles. Each tile writes
a normalised partial output and its log-sum-exp (base 2) per (CSR entry, head): a tile's rows are one contiguous
range of the partial buffer, stored whole by TMA on Hopper (H200, G = 4, 128K: the gather kernel 15.4 -> 13.4 ms
against per-(token, slot, head) rows; BENCHMARKS.md). Each tile's gathered rows are loaded one tile ahead, and their
payload (token * K + slot) two tiles ahead, so no tile waits on a load (13.4 -> 11.5 ms). A second kernel merges a
token's partials with a log-sum-exp combine, finding them through the CSR's inverse permutation (`BlockCSR.entry`)
and skipping -1 slots. Slot order carries no meaning and block ids need not be sorted. The query axis is processed
in chunks so that the partial buffers stay bounded at any length.

Shapes: q [B, Hq, T, D], k/v [B, Hkv, T, D] (any strides with unit last stride), blocks [B, Hkv, T, K]
-> [B, Hq, T, D] (a head-major view of a token-major [B, T, Hq, D] buffer, so `transpose(1, 2).reshape` is free).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from m3compile.kernels.naive_common import check_attention_inputs
from m3compile.kernels.sparse_attention import naive
from m3compile.kernels._common import interpreting, next_pow2, tune_bucket, use_triton

__all__ = ["sparse_attention", "sparse_attention_lse", "selected_lse", "forward_stage", "build_csr", "block_csr",
           "BlockCSR", "attention_chunk", "PARTIAL_BYTES"]

# bytes of partial outputs one query chunk may hold (per call); 8 GiB keeps 1M-token prefill within an H200
PARTIAL_BYTES = 8 << 30


class BlockCSR(NamedTuple):
    """The KV-outer layout of one selection over its whole query range (`block_csr`): what the gather kernels
    (attention, LSE-only pass, fused KL) take. Built once, it serves every kernel that walks the same selection
    with the same `chunk` (queries per program): the sparse attention's forward hands it to the layer's KL."""

    payload: torch.Tensor  # [n_entries] int32: token * K + slot, sorted by segment then token
    seg_off: torch.Tensor  # [n_seg + 1] int32
    tile_seg: torch.Tensor  # [n_tiles] int32 (n_seg = idle program)
    tile_start: torch.Tensor  # [n_tiles] int32
    entry: torch.Tensor  # [n_entries] int32: the CSR position of each (batch, head, token, slot), -1 slots included
    chunk: int


@functools.lru_cache(maxsize=32)
def _csr_constants(B: int, Hkv: int, n_blocks: int, C: int, K: int, chunk: int, device: torch.device):
    """Shape-only tensors of build_csr (cached: never written to): each (batch, head)'s segment base in key units,
    each (token, slot)'s payload, the segment boundaries in key units, and each tile's id and first entry offset."""
    n_seg, ck = B * Hkv * n_blocks, C * K
    n_tiles = B * Hkv * C * K // chunk + n_seg  # >= the tiles any selection needs: each segment wastes < one tile
    base = (torch.arange(B * Hkv, device=device, dtype=torch.int64) * (n_blocks * ck)).view(B, Hkv, 1, 1)
    slot = torch.arange(ck, device=device, dtype=torch.int64).view(1, 1, C, K)
    bounds = torch.arange(n_seg + 1, device=device, dtype=torch.int64) * ck
    pid = torch.arange(n_tiles, device=device, dtype=torch.int32)
    return base, slot, bounds, pid, pid * chunk, torch.tensor(n_seg * ck, device=device, dtype=torch.int64)


def build_csr(blocks: torch.Tensor, n_blocks: int, t0: int, t1: int, chunk: int):
    """CSR of the queries [t0, t1) per (batch, KV head, block) segment and a static-size tile schedule.

    Returns (payload [n_entries] int32 = token_in_chunk * K + slot sorted by segment then token,
    seg_off [n_seg + 1] int32, tile_seg [n_tiles] int32 (n_seg = idle program), tile_start [n_tiles] int32,
    entry [n_entries] int32: the inverse of the sort, the CSR position of entry ((b * Hkv + h) * C + t) * K + s;
    -1 slots sit past the last segment).
    The tile count is an upper bound known without reading the data back, so no host synchronisation happens.
    Where Triton runs, three small kernels around one sort build it (`_build_csr_triton`); elsewhere torch ops
    (`_build_csr_torch`, its reference): the same tensors.
    """
    if use_triton(blocks):
        return _build_csr_triton(blocks, n_blocks, t0, t1, chunk)
    return _build_csr_torch(blocks, n_blocks, t0, t1, chunk)


def _build_csr_torch(blocks: torch.Tensor, n_blocks: int, t0: int, t1: int, chunk: int):
    B, Hkv, T, K = blocks.shape
    C = t1 - t0
    n_seg, ck = B * Hkv * n_blocks, C * K
    base, slot, bounds, pid, pid_start, empty = _csr_constants(B, Hkv, n_blocks, C, K, chunk, blocks.device)
    sel = blocks if (t0, t1) == (0, T) else blocks[:, :, t0:t1]
    # sort key: segment (batch, head, block) major, then token and slot; -1 slots sort past every segment
    key, order = torch.where(sel >= 0, sel.long() * ck + base + slot, empty).view(-1).sort(stable=True)
    entry = torch.empty_like(order, dtype=torch.int32)
    entry[order] = torch.arange(order.numel(), device=order.device, dtype=torch.int32)
    seg_off = torch.searchsorted(key, bounds, out_int32=True)
    tiles = (seg_off[1:] - seg_off[:-1] + (chunk - 1)) // chunk  # tiles per segment
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    tile_seg = torch.searchsorted(tile_end, pid, right=True, out_int32=True)
    # a tile's first entry: its segment's first entry + chunk x (its rank among the segment's tiles); idle: 0
    seg_first = seg_off[:-1] - (tile_end - tiles) * chunk
    tile_start = torch.where(tile_seg < n_seg, seg_first[tile_seg.clamp(max=n_seg - 1)] + pid_start, 0)
    return (key % ck).to(torch.int32), seg_off, tile_seg, tile_start, entry


_CSR_BLOCK = 1024  # entries / segments per program of the CSR kernels


def _build_csr_triton(blocks: torch.Tensor, n_blocks: int, t0: int, t1: int, chunk: int):
    from m3compile.kernels.sparse_attention._tl_sparse import csr_keys_kernel, csr_segments_kernel, csr_tiles_kernel

    B, Hkv, T, K = blocks.shape
    C = t1 - t0
    n_seg, ck, n = B * Hkv * n_blocks, C * K, B * Hkv * C * K
    n_tiles = n // chunk + n_seg
    dev = blocks.device
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    # sort key: the entry's segment (n_seg for -1 slots), in the narrowest integer that holds it: a stable radix
    # sort then orders each segment's entries by token and slot in 2 passes of 8 bits (int16) instead of the 8 of
    # an int64 key that encodes the token too; the sort's permutation is the entries' (batch, head, token, slot)
    key = torch.empty(n, dtype=torch.int16 if n_seg < 2**15 - 1 else torch.int32, device=dev)
    csr_keys_kernel[(max(1, -(-n // _CSR_BLOCK)),)](blocks, key, blocks.stride(0), blocks.stride(1), blocks.stride(2),
                                                    n, C, t0, n_blocks, HKV=Hkv, K=K, BLOCK=_CSR_BLOCK)
    key, order = key.sort(stable=True)
    payload = torch.empty(n, dtype=torch.int32, device=dev)
    entry = torch.empty(n, dtype=torch.int32, device=dev)
    seg_off = torch.empty(n_seg + 1, dtype=torch.int32, device=dev)
    tiles = torch.empty(n_seg, dtype=torch.int32, device=dev)
    seg_programs = -(-(n_seg + 1) // _CSR_BLOCK)
    csr_segments_kernel[(seg_programs + -(-n // _CSR_BLOCK),)](
        key, order, payload, entry, seg_off, tiles, n, n_seg, ck, chunk, seg_programs,
        max(1, n + 1).bit_length() + 1, BLOCK=_CSR_BLOCK)
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    tile_seg = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_start = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    seg_programs = -(-n_seg // _CSR_BLOCK)
    csr_tiles_kernel[(seg_programs + -(-n_tiles // _CSR_BLOCK),)](
        seg_off, tiles, tile_end, tile_seg, tile_start, n_seg, n_tiles, chunk, seg_programs, BLOCK=_CSR_BLOCK)
    return payload, seg_off, tile_seg, tile_start, entry


def block_csr(blocks: torch.Tensor, n_blocks: int, chunk: int) -> BlockCSR:
    """build_csr over every query of `blocks` [B, Hkv, T, K], as one BlockCSR."""
    return BlockCSR(*build_csr(blocks, n_blocks, 0, blocks.shape[2], chunk), chunk=chunk)


def attention_chunk(G: int, entries: int = 0) -> int:
    """Queries one forward program of the gather kernels sweeps over one key block, for groups of G heads and a
    query chunk of `entries` CSR entries (batch x KV heads x tokens x slots): the chunk of the CSR the sparse
    attention builds (and hands to the KL)."""
    return _chunk(next_pow2(G), rows=entries * next_pow2(G))


def _forward(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk, stage, want_lse):
    """Gather pass + combine per query chunk. Returns (out [B, T, Hq, D], lse [B, T, Hq] base 2 or None).

    stage "lse" (with want_lse): only the per-head log-sum-exp over the selected keys (no P V, no output, partials
    of 4 bytes per (token, slot, head)), the fused KL's teacher normaliser; `out` is then a placeholder."""
    return _forward_csr(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk, stage, want_lse)[:2]


def _forward_csr(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk, stage, want_lse, csr=None):
    """_forward that also returns the CSR it walked when one query chunk held every query (else None); `csr`, a
    BlockCSR of `blocks` at this kernel's chunk, is used instead of building one."""
    from m3compile.kernels.sparse_attention._tl_sparse import combine_kernel, gather_q_fwd_kernel

    B, Hq, T, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]  # Tk > T: the queries are the last T of Tk positions (a prompt chunk)
    G, K = Hq // Hkv, blocks.shape[-1]
    GP, DP = next_pow2(G), max(16, next_pow2(D))
    n_blocks = -(-Tk // block_size)
    n_seg = B * Hkv * n_blocks
    lse_only = stage == "lse"
    out = q.new_empty(1, 1, 1, 1) if lse_only else torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device) if want_lse else out.new_empty(1, 1)
    part_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    # partials per query token: K slots x Hkv groups x GP head rows of (D outputs +) one log-sum-exp
    row_bytes = K * Hq * 4 if lse_only else K * Hkv * GP * (D * part_dtype.itemsize + 4)
    C = max(1, min(T, max_partial_bytes // max(1, B * row_bytes), query_chunk or T))
    if lse_only:  # per (token, slot, head), merged in torch
        part_o = q.new_empty(1, 1)
        part_lse = torch.empty(B, C, K, Hq, dtype=torch.float32, device=q.device)
    else:  # in CSR entry order: row = entry * GP + head, entry = the CSR position of (batch, head, token, slot)
        part_o = torch.empty(B * Hkv * C * K * GP, D, dtype=part_dtype, device=q.device)
        part_lse = torch.empty(B * Hkv * C * K * GP, dtype=torch.float32, device=q.device)
    chunk = attention_chunk(G, B * Hkv * C * K)  # one for every query chunk, so a whole-range CSR is reusable
    tma = not lse_only and _tma_store(part_o, D, DP)
    o_desc = _descriptor(part_o, GP, DP) if tma else part_o
    lse_strides = part_lse.stride()[:3] if lse_only else (0, 0, 0)
    ieee = q.dtype == torch.float32
    whole = None
    for t0 in range(0, T, C):
        t1 = min(T, t0 + C)
        if C < T:
            payload, seg_off, tile_seg, tile_start, entry = build_csr(blocks, n_blocks, t0, t1, chunk)
        else:
            whole = csr if csr is not None and csr.chunk == chunk else block_csr(blocks, n_blocks, chunk)
            payload, seg_off, tile_seg, tile_start, entry = whole.payload, whole.seg_off, whole.tile_seg, \
                whole.tile_start, whole.entry
        if lse_only:
            part_lse.fill_(float("-inf"))  # -1 slots are never written: they must add nothing to the merge
        gather_q_fwd_kernel[(tile_seg.numel(),)](
            q, k, v, part_o, part_lse, o_desc, tile_seg, tile_start, seg_off, payload,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *lse_strides,
            Tk, t0, Tk - T, n_seg, scale * math.log2(math.e), tune_bucket(Tk),
            HKV=Hkv, NB=n_blocks, K=K, G=G, GP=GP, D=D, DP=DP, BS=block_size, BN=max(16, next_pow2(block_size)),
            CHUNK=chunk, IEEE=ieee, LSE_ONLY=lse_only, TMA=tma,
        )
        if stage == "gather":  # benchmarks time the gather pass alone through this
            continue
        if lse_only:  # merge the per-block log-sum-exps of each (token, head) in torch: [B, C, K, Hq] -> [B, C, Hq]
            lse[:, t0:t1] = torch.logsumexp(part_lse[:, : t1 - t0] * math.log(2.0), 2) / math.log(2.0)
            continue
        tok = COMBINE_TOKENS_INTERPRETED if interpreting() else 1
        combine_kernel[(B * -(-(t1 - t0) // tok), Hkv)](
            part_o, part_lse, entry, blocks, out, lse,
            blocks.stride(0), blocks.stride(1), blocks.stride(2), out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            t1 - t0, t0,
            HKV=Hkv, K=K, G=G, GP=GP, D=D, DP=DP, STORE_LSE=want_lse, UNROLL=min(K, COMBINE_UNROLL), TOK=tok,
            num_warps=combine_warps(GP, DP),
        )
    return out, (lse if want_lse else None), whole


# slots of a token the combine merges per unrolled group: at G = 4, 128K, top-45 all 45 unrolled at once spilled
# (45.7 ms against 6.1 at top-16, H100); top-16 and below stay one group, as before
COMBINE_UNROLL = 16
# tokens a combine program takes under the interpreter (a power of two), whose cost is per program and operation:
# one token a program made the combine the largest share of a small model's interpreted generate; on a GPU, one
COMBINE_TOKENS_INTERPRETED = 16


def combine_warps(GP: int, DP: int) -> int:
    """Warps of one combine program (one token's GP x DP head rows): one where that is at most 512 values (G <= 4 at
    head dim 128), else four. H200, 128K, random top-16 (BENCHMARKS.md): at G = 4 the combine takes
    4.27 ms at one warp against 4.61 at four; at G = 16 one warp was slower in the model's pass (10.38 ms against
    8.53), though not alone (benchmarks/experiments/combine_config.py), so larger programs keep four."""
    return 1 if GP * DP <= 512 else 4


def _tma_store(part_o: torch.Tensor, D: int, DP: int) -> bool:
    """Whether the forward stores its whole tiles of partial outputs by TMA: rows of 16-byte multiples with no
    column padding, on a Hopper-class GPU; under the interpreter fp32 and fp16 partials (its descriptor stores of
    bf16 come out wrong, Triton 3.9), so the CPU tests run this path too, and the masked one in bf16."""
    if D != DP or D * part_o.element_size() % 16:
        return False
    if interpreting():
        return part_o.dtype != torch.bfloat16
    return part_o.is_cuda and torch.cuda.get_device_capability(part_o.device)[0] >= 9


def _descriptor(part_o: torch.Tensor, GP: int, DP: int):
    """TMA descriptor of the partial outputs [rows, D]; its box is set per autotune config (_tl_sparse)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from m3compile.kernels.sparse_attention._tl_sparse import tile_rows

    return TensorDescriptor.from_tensor(part_o, block_shape=[tile_rows(64, GP), DP])


# gathered query rows (tokens x the group's heads) one forward program sweeps over its key block: each program loads
# the block's K and V once, so more rows per program re-read them less often, at the cost of a longer tail per segment
# and fewer programs. H200, 128K, random top-16 of blocks of 128 (BENCHMARKS.md): G = 4 512 / 1024 / 2048 / 4096 rows
# -> 22.60 / 21.71 / 20.96 / 20.93 ms; G = 16 39.46 / 38.27 / 37.59 / 37.32 ms. 4096 against 2048, measured again:
# 0.17-0.25 ms faster at 128K (G = 4, 7, 16), but 2% slower in SmolLM2's distillation step at 2 x 8K (0.8M entries:
# too few programs to fill the GPU). So a query chunk with at least LONG_ROWS gathered rows (entries x GP; 33M at
# 128K, G = 4 and 16) takes FORWARD_CHUNK_ROWS_LONG
FORWARD_CHUNK_ROWS = 2048
FORWARD_CHUNK_ROWS_LONG = 4096
LONG_ROWS = 1 << 24


def _chunk(gp: int, backward: bool = False, rows: int = 0) -> int:
    """Queries one program may sweep over one K/V block; `rows`: the gathered rows (CSR entries x gp) of the
    forward's query chunk. The backward takes up to 4x more (at most 256 tokens): each program also adds the block's
    dK/dV to memory once at the end (the choice is measured in BENCHMARKS.md)."""
    if backward:
        return max(8, min(256, 4096 // gp))
    return max(8, (FORWARD_CHUNK_ROWS_LONG if rows >= LONG_ROWS else FORWARD_CHUNK_ROWS) // gp)


def _backward(q, k, v, blocks, block_size, scale, out, lse, d_out, max_partial_bytes=PARTIAL_BYTES,
              dq_parts=None):
    """dq, dk, dv of the sparse attention (same CSR and tiles as the forward; fp32 accumulation).

    dK/dV of a block accumulate on chip over the queries that chose it (one fp32 atomic add per program). dQ gets
    one share per (token, slot): with `dq_parts` (default on a GPU) the shares are stored per (token, slot, head)
    in the input dtype, query chunk by chunk like the forward's partials, and summed in fp32 by a second kernel;
    otherwise they are added with fp32 atomics into one buffer."""
    from m3compile.kernels.sparse_attention._tl_sparse import gather_q_bwd_kernel, sum_slots_kernel

    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G, K = Hq // Hkv, blocks.shape[-1]
    GP, DP = next_pow2(G), max(16, next_pow2(D))
    n_blocks = -(-T // block_size)
    dq_parts = q.dtype != torch.float32 if dq_parts is None else dq_parts
    do = d_out.transpose(1, 2).contiguous()  # [B, T, Hq, D], the layout of `out`
    delta = (do.float() * out.float()).sum(-1)  # [B, T, Hq]: rowsum(dO * O)
    dk = torch.zeros(B, Hkv, T, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    if dq_parts:
        dq = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
        C = max(1, min(T, max_partial_bytes // max(1, B * K * Hq * D * q.element_size())))
        part = torch.empty(B, C, K, Hq, D, dtype=q.dtype, device=q.device)
        strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
    else:  # one fp32 buffer for the atomics; the slot stride is 0
        C, dq = T, torch.zeros(B, T, Hq, D, dtype=torch.float32, device=q.device)
        part, strides = dq, (dq.stride(0), dq.stride(1), 0, dq.stride(2))
    for t0 in range(0, T, C):
        t1 = min(T, t0 + C)
        payload, seg_off, tile_seg, tile_start, _ = build_csr(blocks, n_blocks, t0, t1, _chunk(GP, True))
        gather_q_bwd_kernel[(tile_seg.numel(),)](
            q, k, v, do, lse, delta, part, dk, dv, tile_seg, tile_start, seg_off, payload,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), *strides,
            dk.stride(0), dk.stride(1), dk.stride(2),
            T, t0, B * Hkv * n_blocks, scale, scale * math.log2(math.e), tune_bucket(T),
            HKV=Hkv, NB=n_blocks, K=K, G=G, GP=GP, D=D, DP=DP, BS=block_size, BN=max(16, next_pow2(block_size)),
            CHUNK=_chunk(GP, True), IEEE=q.dtype == torch.float32, DQ_PARTS=dq_parts,
        )
        if dq_parts:
            sum_slots_kernel[(B * (t1 - t0), Hkv)](
                part, blocks, dq, *strides, blocks.stride(0), blocks.stride(1), blocks.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2), t1 - t0, t0, K=K, G=G, GP=GP, D=D, DP=DP,
            )
    return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk):
        out, lse, csr = _forward_csr(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk, "all", True)
        ctx.save_for_backward(q, k, v, blocks, out, lse)
        ctx.block_size, ctx.scale, ctx.max_partial_bytes = block_size, scale, max_partial_bytes
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse, csr

    @staticmethod
    def backward(ctx, d_out, _d_lse, _d_csr=None):
        q, k, v, blocks, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, blocks, ctx.block_size, ctx.scale, out, lse, d_out, ctx.max_partial_bytes)
        return dq, dk, dv, None, None, None, None, None


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "auto",
    max_partial_bytes: int = PARTIAL_BYTES,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Exact causal attention of every query head over its group's selected key blocks; differentiable in q, k, v
    (the backward runs on the same CSR: dK/dV per block on chip, dQ as per-slot shares summed by a second kernel).

    q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] (any int dtype, -1 = empty) -> [B, Hq, T, D].
    A prompt chunk over its cached prefix (no gradient): k/v [B, Hkv, Tk, D] with Tk > T, the T queries (and their
    blocks) being those of the last T positions.
    query_chunk: queries per CSR pass (default: as many as `max_partial_bytes` of partial outputs allow). Smaller
    chunks keep the gathered query rows of one pass in L2 at the cost of re-reading each K/V block once per pass.
    """
    return _attention(q, k, v, blocks, block_size, scale, backend, max_partial_bytes, query_chunk, "all", False)[0]


def sparse_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    backend: str = "auto",
    max_partial_bytes: int = PARTIAL_BYTES,
    return_csr: bool = False,
):
    """`sparse_attention` that also returns each head's log-sum-exp over its selected keys: [B, T, Hq] fp32, base 2,
    softmax scale included, no gradient (the fused KL's teacher normaliser, kernels/sparse_kl/). The combine
    kernel writes it at no extra pass. None where the torch reference runs (CPU without the interpreter).
    With `return_csr`, also the BlockCSR the forward walked (None where it was not built whole: the reference, or
    several query chunks), which the fused KL over the same selection takes instead of building its own."""
    out = _attention(q, k, v, blocks, block_size, scale, backend, max_partial_bytes, None, "all", True)
    return out if return_csr else out[:2]


def selected_lse(q: torch.Tensor, k: torch.Tensor, blocks: torch.Tensor, *, block_size: int,
                 scale: float | None = None, csr: BlockCSR | None = None) -> torch.Tensor:
    """Each head's log-sum-exp over its selected keys, [B, T, Hq] fp32 base 2, by an LSE-only pass of the gather
    kernel (no P V; 4 B per token, slot and head): the fused KL's teacher normaliser when no attention forward gave
    it. CUDA (or the interpreter) only. `csr`: the selection's BlockCSR, if one was built already."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _forward_csr(q, k, k, blocks, block_size, scale, PARTIAL_BYTES, None, "lse", True, csr)[1]


def forward_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *, block_size: int,
                  scale: float | None = None, stage: str = "gather") -> torch.Tensor:
    """One stage of the sparse forward alone, for profiling: "gather" (partials, no combine) or "all"."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _forward(q, k, v, blocks, block_size, scale, PARTIAL_BYTES, None, stage, False)[0]


def _attention(q, k, v, blocks, block_size, scale, backend, max_partial_bytes, query_chunk, stage, want_lse):
    check_attention_inputs(q, k, v, cached_prefix=True)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if blocks.dim() != 4 or blocks.shape[:3] != (B, Hkv, T):
        raise ValueError(f"blocks must be [B, Hkv, T, K] = [{B}, {Hkv}, {T}, K], got {tuple(blocks.shape)}")
    scale = D**-0.5 if scale is None else scale
    if not use_triton(q, k, v, blocks, backend=backend):
        return naive.sparse_attention(q, k, v, blocks, block_size=block_size, scale=scale), None, None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last dimension")
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if k.shape[2] != T:
            raise ValueError("the sparse attention's backward needs one query per key (no cached prefix)")
        return _SparseAttention.apply(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk)
    out, lse, csr = _forward_csr(q, k, v, blocks, block_size, scale, max_partial_bytes, query_chunk, stage, want_lse)
    return out.transpose(1, 2), lse, csr
