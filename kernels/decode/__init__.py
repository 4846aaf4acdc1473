"""MSA decode over paged caches: index scores + top-k, then split-K sparse attention with a log-sum-exp merge.

Caches are paged with page = MSA key block (docs/msa.md section 5: a block size that differs from the page size
silently selects tokens instead of blocks, so the page size *is* the block size here):
    k_cache, v_cache  [P, BS, Hkv, D]   main KV cache
    idx_cache         [P, BS, Di]       index-key cache (one shared index key per token), bf16/fp16/fp32 or fp8 e4m3
    idx_scale         [P, BS] fp32      scale of each fp8 index key (None otherwise): the graph's caches hold one
                                        scale per page (= key block), repeated over its tokens (`paged_index_write`)
    k_scale, v_scale  [P, BS, Hkv] fp32 scale of each fp8 K/V row (None otherwise): one per token and head
                                        (`quantize_kv`), written with the token (`paged_kv_write`)
    block_table       [B, max_pages]    int32 physical page of each logical block of each sequence
    seq_lens          [B]               int32 tokens in each sequence, the token being decoded included

Each sequence decodes one token. `paged_select` scores every cached page of each sequence (split over pages, one
block score per page and index head), then takes the top-k per (sequence, index head) with the local block (the
page holding the newest token) and the first `init_blocks` blocks forced; -1 fills slots short sequences cannot.
The top-k (`top_blocks`) runs in two stages past TOPK_CHUNK pages: the best blocks of each chunk of pages, one
program per chunk, then one merge per row, so a 1M-token row is not 16 serial reductions of 8192 values in one
program.
`paged_attention` runs one program per (sequence, KV group, split of the selected slots), each an online softmax over
its pages, and merges the partials by log-sum-exp. Sequences of different lengths share one launch. An fp8 (e4m3) KV
cache is dequantised in registers as its pages are loaded (each row times its scale, then the query's dtype), so a
step reads half the bytes of a bf16 cache. Its scales are per (token, head), not per page as the index keys': a new
token is then quantised alone (`paged_kv_write`), where a per-page scale would re-quantise the newest page of K and
V in every layer at every step (and keep an unquantised copy of it), and one large row (an attention-sink token)
does not cost the other rows of its page their precision; the scales add 4 bytes per 128-value row (3%).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from m3compile.kernels._common import launch_fp8, next_pow2, use_triton
from m3compile.kernels.decode.naive import (KV_QUANTISED, adaptive_decode, dequantize_kv, index_logit_scale,
                                            paged_attention_reference,
                                            paged_block_scores_reference, paged_index_write_reference,
                                            paged_kv_write_reference, paged_oracle_select, paged_recent_select,
                                            paged_select_reference, quantize_kv, quantize_pages,
                                            top_blocks_reference)

__all__ = ["paged_select", "paged_select_launches", "top_blocks", "top_blocks_reference", "TOPK_CHUNK",
           "paged_attention", "paged_select_reference", "paged_attention_reference",
           "paged_block_scores_reference", "paged_index_write", "paged_index_write_reference", "quantize_pages",
           "paged_kv_write", "paged_kv_write_reference", "quantize_kv", "dequantize_kv", "KV_QUANTISED",
           "paged_oracle_select", "paged_recent_select", "adaptive_decode", "index_logit_scale"]


def _check_cache(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    if block_table.dim() != 2 or seq_lens.dim() != 1 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table must be [B, max_pages] and seq_lens [B]; got {tuple(block_table.shape)}, "
                         f"{tuple(seq_lens.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_table and seq_lens must be integer tensors")


def _check_select(q_idx, idx_cache, block_table, seq_lens, idx_scale) -> bool:
    """Whether the index cache is fp8 (then with idx_scale [P, BS])."""
    _check_cache(block_table, seq_lens, idx_cache.shape[1])
    if q_idx.dim() != 3 or idx_cache.dim() != 3 or q_idx.shape[-1] != idx_cache.shape[-1]:
        raise ValueError(f"q_idx must be [B, Hi, Di] and idx_cache [P, BS, Di]; got {tuple(q_idx.shape)}, "
                         f"{tuple(idx_cache.shape)}")
    fp8 = idx_cache.dtype == torch.float8_e4m3fn
    if fp8 and (idx_scale is None or idx_scale.shape != idx_cache.shape[:2]):
        raise ValueError("an fp8 index cache needs idx_scale [P, BS]")
    return fp8


# Pages per program of the top-k's first stage (a power of two; tests set it small to reach the merge). 256: at 1M
# tokens (8192 pages of 128) batch 1 with 4 index heads runs 4 x 32 = 128 programs (132 SMs), batch 8 runs 1024,
# each 16 maxima over 256 values in one warp; the merge then takes 32 x 16 = 512 candidates per row, within its
# register tile (4 x TOPK_CHUNK). 512 would leave half the SMs idle at batch 1 and make every maximum twice as wide;
# 128 would double the merge's candidates, and the merge is one program per row. At 128K (1024 pages) a row is 4
# chunks: 128 programs at batch 8, then 64 candidates.
TOPK_CHUNK = 256
# Each stage finds its best keys one of two ways: TOPK maxima in turn (serial: each waits on a reduction), or every
# key's rank counted against all the others (n x n comparisons at once) and the best stored at their ranks. Stage 1
# ranks from TOPK_RANK_FROM slots (in 4 warps: CHUNK x CHUNK comparisons), the merge while its candidates n satisfy
# n * n <= topk * TOPK_RANK_MERGE (0: never). At the llama3-8b preset's index shapes, 128K, batch 8 (H100,
# benchmarks/experiments/decode_select_split.py --ways): top-16's top-k 10.3 -> 7.0 us a layer (stage 1 ranked
# too: 12.0), top-45's 23.7 -> 14.6 (the merge alone ranked: 14.2); the whole model's decode step at top-45,
# batch 4, 9.93 -> 9.68 ms.
TOPK_RANK_FROM = 32
TOPK_RANK_MERGE = 8192


def _top_blocks_launches(scores: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *, block_size: int,
                         topk: int, init_blocks: int, local_blocks: int) -> list[tuple[str, Callable[[], None]]]:
    """The launches that write the top-k of each row of `scores` [B, H, max_pages] into out [B, H, topk]: one
    (stage 1 as the final pass) where max_pages <= TOPK_CHUNK, else stage 1 over chunks then the merge. Scratch is
    allocated here, per call (a CUDA graph captures it as its own)."""
    from m3compile.kernels.decode._tl_decode import topk_chunk_kernel, topk_merge_kernel

    B, H, max_pages = scores.shape
    chunk = TOPK_CHUNK
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"TOPK_CHUNK must be a power of two, got {chunk}")
    n_chunks = -(-max_pages // chunk)
    common = dict(BS=block_size, CHUNK=chunk, TOPK=topk, INIT=init_blocks, LOCAL=local_blocks)
    # serial maxima: one warp per 256 pages, so a chunk's reductions stay in warp shuffles (no shared-memory round
    # trip between warps), which each of its TOPK serial maxima waits on; ranks: 4 warps share the comparisons
    kc = min(topk, chunk)
    rank = kc >= TOPK_RANK_FROM
    stage1_warps = 4 if rank else max(1, min(8, chunk // 256))
    if n_chunks == 1:
        return [("topk", lambda: topk_chunk_kernel[(B, H, 1)](
            scores, seq_lens, out, out, max_pages, scores.stride(0), scores.stride(1), 0, 0, out.stride(0),
            out.stride(1), KC=topk, FINAL=True, RANK=rank, num_warps=stage1_warps, **common))]
    cand = torch.empty(B, H, n_chunks * kc, dtype=torch.int64, device=scores.device)
    return [
        ("topk_chunks", lambda: topk_chunk_kernel[(B, H, n_chunks)](
            scores, seq_lens, cand, out, max_pages, scores.stride(0), scores.stride(1), cand.stride(0),
            cand.stride(1), out.stride(0), out.stride(1), KC=kc, FINAL=False, RANK=rank, num_warps=stage1_warps,
            **common)),
        ("topk_merge", lambda: topk_merge_kernel[(B, H)](
            cand, seq_lens, out, cand.stride(0), cand.stride(1), out.stride(0), out.stride(1),
            math.isqrt(topk * TOPK_RANK_MERGE), BS=block_size, CHUNK=chunk, KC=kc, TOPK=topk, MT=4 * chunk,
            TOPKP=next_pow2(topk), num_warps=4)),
    ]


def top_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, *, block_size: int, topk: int, init_blocks: int = 0,
               local_blocks: int = 1, backend: str = "auto") -> torch.Tensor:
    """Block scores [B, Hi, max_pages] (entries past each sequence's last page are not read) -> the `topk` best
    blocks [B, Hi, topk] int32, best first, equal scores to the lower page, with the local blocks (the newest
    token's) and the first `init_blocks` forced; -1 where a sequence has fewer blocks. The top-k half of
    `paged_select`."""
    if scores.dim() != 3 or scores.dtype != torch.float32 or seq_lens.shape != scores.shape[:1]:
        raise ValueError(f"scores must be fp32 [B, Hi, max_pages] and seq_lens [B]; got {tuple(scores.shape)} "
                         f"{scores.dtype}, {tuple(seq_lens.shape)}")
    if not use_triton(scores, backend=backend):
        return top_blocks_reference(scores, seq_lens, block_size=block_size, topk=topk, init_blocks=init_blocks,
                                    local_blocks=local_blocks)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    out = torch.empty(*scores.shape[:2], topk, dtype=torch.int32, device=scores.device)
    for _, launch in _top_blocks_launches(scores, seq_lens, out, block_size=block_size, topk=topk,
                                          init_blocks=init_blocks, local_blocks=local_blocks):
        launch()
    return out


def paged_select_launches(q_idx: torch.Tensor, idx_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, *, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                          idx_scale: torch.Tensor | None = None, top_p: float = 1.0,
                          min_blocks: int = 0) -> tuple[torch.Tensor, list[tuple[str, Callable]]]:
    """`paged_select`'s Triton launches, unrun: (the output [B, Hi, topk] they fill, [(name, launch)] in order:
    "scores", then "topk" or "topk_chunks" + "topk_merge", and with top_p < 1 "adaptive" (the budget's cut in place,
    one program per row: naive.adaptive_decode's meaning)). Each launch can be timed alone (it reads only what the launches before it
    wrote); paged_select runs them all."""
    fp8 = _check_select(q_idx, idx_cache, block_table, seq_lens, idx_scale)
    from m3compile.kernels.decode._tl_decode import (paged_index_scores_fp8_kernel,
                                                     paged_index_scores_fp8_narrow_kernel, paged_index_scores_kernel)

    B, H, D = q_idx.shape
    bs = idx_cache.shape[1]
    max_pages = block_table.shape[1]
    q = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()  # no 1/sqrt(Di): the ranking does not need it
    scores = torch.empty(B, H, max_pages, dtype=torch.float32, device=q_idx.device)
    scale = (idx_scale if idx_scale.dtype == torch.float32 and idx_scale.is_contiguous() else idx_scale.float().contiguous()) \
        if fp8 else scores.new_empty(1, 1)
    grid = lambda meta: (B, -(-max_pages // (meta["PPP"] * meta["NPG"])))  # noqa: E731

    DP = max(16, next_pow2(D))
    kernel = (paged_index_scores_fp8_narrow_kernel if DP <= 64 else paged_index_scores_fp8_kernel) if fp8 \
        else paged_index_scores_kernel

    def launch(fp8_dot):
        kernel[grid](
            q, idx_cache, scale, block_table, seq_lens, scores,
            q.stride(0), q.stride(1), idx_cache.stride(0), idx_cache.stride(1), scale.stride(0),
            block_table.stride(0), scores.stride(0), scores.stride(1),
            max_pages,
            H=H, HP=max(16, next_pow2(H)), D=D, DP=DP, BS=bs, BN=max(16, next_pow2(bs)), HAS_SCALE=fp8,
            IEEE=q_idx.dtype == torch.float32 and not fp8, FP8_DOT=fp8_dot,
        )

    out = torch.empty(B, H, topk, dtype=torch.int32, device=q_idx.device)
    launches = [("scores", lambda: launch_fp8(launch, fp8))] + _top_blocks_launches(
        scores, seq_lens, out, block_size=bs, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    if top_p < 1:  # the scores are q . k (fp8: of the e4m3 query row without its scale): the kernel scales them
        from m3compile.kernels.decode._tl_decode import adaptive_cut_kernel

        launches.append(("adaptive", lambda: adaptive_cut_kernel[(B, H)](
            q, scores, seq_lens, out, q.stride(0), q.stride(1), scores.stride(0), scores.stride(1), out.stride(0),
            out.stride(1), max_pages, D**-0.5, float(top_p), int(min_blocks), D=D, DP=DP, BS=bs, K=topk,
            KP=max(2, next_pow2(topk)), INIT=init_blocks, LOCAL=local_blocks, FP8=fp8,
            CHUNK=min(1024, max(16, next_pow2(max_pages))), num_warps=4)))
    return out, launches


def paged_select(q_idx: torch.Tensor, idx_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 topk: int, init_blocks: int = 0, local_blocks: int = 1, idx_scale: torch.Tensor | None = None,
                 top_p: float = 1.0, min_blocks: int = 0, backend: str = "auto") -> torch.Tensor:
    """q_idx [B, Hi, Di] of the newest token of each sequence -> selected blocks [B, Hi, topk] int32 (-1 = empty),
    best first, equal scores to the lower page; top_p < 1: the adaptive budget (docs/msa.md 2.8), the slots past it
    -1."""
    if not use_triton(q_idx, idx_cache, backend=backend):
        fp8 = _check_select(q_idx, idx_cache, block_table, seq_lens, idx_scale)
        return paged_select_reference(q_idx, idx_cache, block_table, seq_lens, topk=topk, init_blocks=init_blocks,
                                      local_blocks=local_blocks, idx_scale=idx_scale if fp8 else None, top_p=top_p,
                                      min_blocks=min_blocks)
    out, launches = paged_select_launches(q_idx, idx_cache, block_table, seq_lens, topk=topk,
                                          init_blocks=init_blocks, local_blocks=local_blocks, idx_scale=idx_scale,
                                          top_p=top_p, min_blocks=min_blocks)
    for _, launch in launches:
        launch()
    return out


def _check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, op: str) -> bool:
    """Whether the K/V caches are quantised, fp8 or int8 (then with scales [P, BS, Hkv] each, contiguous in the
    head)."""
    quantised = k_cache.dtype in KV_QUANTISED
    if (v_cache.dtype in KV_QUANTISED or k_cache.dtype in KV_QUANTISED) and v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: quantised K and V caches must have one dtype, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if quantised and any(s is None or s.shape != k_cache.shape[:3] or s.stride(-1) != 1
                         or s.stride() != k_scale.stride() for s in (k_scale, v_scale)):
        raise ValueError(f"{op}: {str(k_cache.dtype)[6:]} K/V caches need k_scale and v_scale [P, BS, Hkv] = "
                         f"{list(k_cache.shape[:3])} (alike, contiguous in the head); got "
                         f"{[None if s is None else tuple(s.shape) for s in (k_scale, v_scale)]}")
    if not quantised and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{op}: k_scale / v_scale go with fp8 or int8 K/V caches only, got {k_cache.dtype}")
    return quantised


def _check_rotation(rotation: torch.Tensor | None, hadamard: bool, D: int) -> int:
    """The kernels' ROTATE for a rotation argument: 0 none, 1 a [D, D] fp32 matrix they load, 2 the Walsh-Hadamard
    matrix (hadamard=True: D a power of two; its signs made in registers, exact, so no [D, D] tile is loaded: on the
    H200 the int8 decode attention of the llama3-8b preset's MSA layer took 81 us with the loaded matrix against
    30 us unrotated, BENCHMARKS.md)."""
    if rotation is None:
        if hadamard:
            raise ValueError("hadamard=True needs the rotation matrix (the reference multiplies by it)")
        return 0
    if rotation.shape != (D, D) or rotation.dtype != torch.float32:
        raise ValueError(f"rotation must be [D, D] = [{D}, {D}] fp32, got {tuple(rotation.shape)} {rotation.dtype}")
    if hadamard and D & (D - 1):
        raise ValueError(f"hadamard=True needs a power-of-two head dim, got {D}")
    return 2 if hadamard else 1


def default_slots_per_split(K: int) -> int:
    """Selected pages per program of `paged_attention`: one page each up to a top-k of 16, two up to 64, about 64
    splits past that (dense attention over every page). At the llama3-8b preset's shapes, 128K, fp8 pages (H100,
    benchmarks/experiments/decode_slots_per_split.py): two pages a program took top-32 / 45 / 64 from 60.3 / 81.6 /
    109.9 to 56.5 / 74.5 / 103.0 us at batch 8 and top-45 from 21.6 to 18.3 at batch 1, where one page stays best at
    top-16 (10.5 against 11.9 us at batch 1, 33.1 against 33.4 at batch 8). Larger programs gained at batch 8 (8
    pages: 70.3 us at top-45) but lost at batch 1 (33.3), where too few programs are left to fill the GPU."""
    return 1 if K <= 16 else 2 if K <= 64 else -(-K // 64)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    rotation: torch.Tensor | None = None, hadamard: bool = False,
                    slots_per_split: int | None = None, backend: str = "auto") -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence), blocks [B, Hkv, K] -> [B, Hq, D]. Pass every page as `blocks` for
    dense attention over the whole cache. slots_per_split: the selected pages one program reads (default
    `default_slots_per_split(K)`). fp8 (e4m3) and int8 caches need k_scale and v_scale [P, BS, Hkv] fp32 (one
    per token and head: `paged_kv_write`); their tiles are cast to the query's dtype as loaded (exact: e4m3 and
    8-bit integers are bf16 and fp16 values) and the scales applied to scores and probabilities. rotation [D, D]
    fp32 (an int8 cache's, runtime.key_shift.rotation): the cached keys and values are rows times it, so the kernel
    multiplies the queries by it and the output by its transpose (the reference: the same products in torch).
    hadamard: `rotation` is the Walsh-Hadamard matrix over sqrt(D) (runtime.key_shift.rotation of a power-of-two D):
    the kernels make its signs in registers instead of loading it (`_check_rotation`)."""
    _check_cache(block_table, seq_lens, k_cache.shape[1])
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or q.shape[-1] != k_cache.shape[-1] \
            or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q must be [B, Hq, D] and k/v caches [P, BS, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    fp8 = _check_kv_scales(k_cache, v_cache, k_scale, v_scale, "paged_attention")
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    if blocks.dim() != 3 or blocks.shape[:2] != (B, Hkv):
        raise ValueError(f"blocks must be [B, Hkv, K] = [{B}, {Hkv}, K], got {tuple(blocks.shape)}")
    scale = D**-0.5 if scale is None else scale
    rotate = _check_rotation(rotation, hadamard, D)
    if not use_triton(q, k_cache, v_cache, backend=backend):
        return paged_attention_reference(q, k_cache, v_cache, blocks, block_table, seq_lens, scale=scale,
                                         k_scale=k_scale, v_scale=v_scale, rotation=rotation)
    from m3compile.kernels.decode._tl_decode import paged_attention_split_kernel, paged_merge_kernel

    G, K = Hq // Hkv, blocks.shape[-1]
    GP, DP = max(16, next_pow2(G)), max(16, next_pow2(D))
    pps = default_slots_per_split(K) if slots_per_split is None else int(slots_per_split)
    if pps < 1:
        raise ValueError(f"slots_per_split must be >= 1, got {slots_per_split}")
    # (K, pps and the split count are runtime arguments: every context length runs the same two binaries)
    splits = -(-K // pps)
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    part_o = torch.empty(B, Hkv, splits, GP, DP, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, Hkv, splits, GP, dtype=torch.float32, device=q.device)
    k_s, v_s = (k_scale, v_scale) if fp8 else (part_lse, part_lse)  # (unread without scales)
    rot = part_lse if rotation is None else rotation.contiguous()  # (unread without a rotation)
    # fp8 pages: a 168-register cap (more programs resident to hide the dependent loads) took the dense layer of the
    # llama3-8b preset at 128K, batch 8, from 1.323 to 1.131 ms on the H200; with bf16 pages it costs time (1.152 ->
    # 1.333), BENCHMARKS.md
    paged_attention_split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, k_s, v_s, rot, blocks, block_table, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_s.stride(0), k_s.stride(1) if fp8 else 0,
        blocks.stride(0), blocks.stride(1), block_table.stride(0), part_o.stride(0), part_o.stride(1),
        part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale * math.log2(math.e), K, pps,
        G=G, GP=GP, D=D, DP=DP, BS=bs, BN=max(16, next_pow2(bs)), IEEE=q.dtype == torch.float32,
        HAS_SCALE=fp8, ROTATE=rotate, num_warps=4,
        **({"maxnreg": 168} if k_cache.dtype == torch.float8_e4m3fn and q.is_cuda else {}),
    )
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    GM = GP if rotation is not None else next_pow2(G)  # (the rotation is a matmul: 16 rows at least)
    # the merge folds SC partials a load where they are small (H200, 2026-12-03: the llama3-8b preset's group of 4,
    # 8 a load: its merges 0.30 -> 0.18 ms a step); M3's group of 16 (a [16, 128] partial) one a load (2 a load took
    # its decode attention from 0.021 to 0.029 ms)
    sc = 4096 // (GM * DP)
    paged_merge_kernel[(B, Hkv)](
        part_o, part_lse, out, rot, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), splits,
        G=G, GP=GP, GM=GM, SC=sc if sc >= 4 else 1, D=D, DP=DP, ROTATE=rotate,
    )
    return out


def paged_index_write(idx_cache: torch.Tensor, idx_scale: torch.Tensor, tail: torch.Tensor, k_idx: torch.Tensor,
                      rows: torch.Tensor, pos: torch.Tensor, block_table: torch.Tensor, *,
                      backend: str = "auto") -> None:
    """Append one index key per sequence to an fp8 index-key cache quantised with one scale per page, in place.

    A page is an MSA key block, and the prefill's fp8 scoring quantises keys with one scale per key block
    (naive_common.quantize_index_keys(k, block_size)). So that a page holds those same fp8 values once it is
    full, `tail` [B, BS, Di] (the model's dtype) keeps each sequence's keys of its newest page unquantised: the new
    key k_idx[n] [Di] goes to tail[rows[n], pos[n] % BS], and the page's rows up to the new one hold the quantisation
    of its tail rows up to it (rows after it are untouched: past the sequence's length, never read). The page's scale
    is that of its rows so far, so where the new key's own scale is not larger (most steps) the kernel writes the
    new row alone; a larger one, or a page's first row, quantises the page again. A page's scale starts at zero
    (`PagedCache`), or as the prefill wrote it. Until it fills, a page is its newest token's own block, which the
    selection forces whatever its score. rows [N] (distinct), pos [N]: the sequences and their new tokens' positions;
    idx_cache [P, BS, Di] fp8, idx_scale [P, BS] fp32."""
    if idx_cache.dtype != torch.float8_e4m3fn or idx_scale.shape != idx_cache.shape[:2] \
            or tail.shape[1:] != idx_cache.shape[1:] or k_idx.shape != (rows.shape[0], idx_cache.shape[2]):
        raise ValueError(f"paged_index_write needs an fp8 idx_cache [P, BS, Di], idx_scale [P, BS], tail [B, BS, Di] "
                         f"and k_idx [N, Di]; got {tuple(idx_cache.shape)} {idx_cache.dtype}, "
                         f"{tuple(idx_scale.shape)}, {tuple(tail.shape)}, {tuple(k_idx.shape)}")
    if not use_triton(idx_cache, tail, k_idx, backend=backend):
        paged_index_write_reference(idx_cache, idx_scale, tail, k_idx, rows, pos, block_table)
        return
    from m3compile.kernels.decode._tl_decode import index_write_kernel

    bs, D = idx_cache.shape[1], idx_cache.shape[2]
    k_idx = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    if not (tail.is_contiguous() and idx_cache.is_contiguous() and idx_scale.is_contiguous()):
        raise ValueError("paged_index_write needs contiguous tail, idx_cache and idx_scale")
    index_write_kernel[(rows.shape[0],)](
        k_idx, tail, idx_cache, idx_scale, rows, pos, block_table,
        k_idx.stride(0), tail.stride(0), tail.stride(1), idx_cache.stride(0), idx_cache.stride(1), idx_scale.stride(0),
        block_table.stride(0), BS=bs, BSP=next_pow2(bs), D=D, DP=next_pow2(D), num_warps=4,
    )


def paged_kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: torch.Tensor,
                   off: torch.Tensor, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   k_shift: torch.Tensor | None = None, rotation: torch.Tensor | None = None, hadamard: bool = False,
                   backend: str = "auto") -> None:
    """Store N tokens' keys and values in paged K/V caches, in place: k[n], v[n] [Hkv, D] to slot off[n] of physical
    page page[n] ([N] each, distinct slots). fp8 (e4m3) and int8 caches (with k_scale / v_scale [P, BS, Hkv] fp32)
    store each (token, head) row quantised with its own scale (`quantize_kv`): one kernel for K and V, on CUDA or
    under the interpreter; other caches take the values cast to their dtype. k_shift [Hkv, D] fp32 (a quantised
    cache's key shift, runtime.key_shift): the keys less it; rotation [D, D] fp32 (an int8 cache's): then keys and
    values times it, in fp32, before they are quantised (in the same kernel); hadamard as in `paged_attention`."""
    fp8 = _check_kv_scales(k_cache, v_cache, k_scale, v_scale, "paged_kv_write")
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or page.shape != off.shape \
            or page.shape != k.shape[:1]:
        raise ValueError(f"paged_kv_write needs k/v [N, Hkv, D] = [N, {k_cache.shape[2]}, {k_cache.shape[3]}] and "
                         f"page/off [N]; got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(page.shape)}, "
                         f"{tuple(off.shape)}")
    H, D = k.shape[1], k.shape[2]
    if k_shift is not None and (k_shift.shape != (H, D) or k_shift.dtype != torch.float32):
        raise ValueError(f"k_shift must be [Hkv, D] = [{H}, {D}] fp32, got {tuple(k_shift.shape)} {k_shift.dtype}")
    rotate = _check_rotation(rotation, hadamard, D)
    if not fp8 or not use_triton(k_cache, k, backend=backend):
        paged_kv_write_reference(k_cache, v_cache, k, v, page, off, k_scale, v_scale, k_shift, rotation)
        return
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_kv_write needs K and V caches of the same strides, contiguous in D")
    if k.shape[0] == 0:
        return
    from m3compile.kernels.decode._tl_decode import kv_write_kernel

    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    shift = k_scale if k_shift is None else k_shift.contiguous()  # (unread without one)
    rot = k_scale if rotation is None else rotation.contiguous()
    kv_write_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, k_scale, v_scale, page, off, shift, rot,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), H=H, HP=max(16, next_pow2(H)) if rotation is not None else next_pow2(H),
        D=D, DP=next_pow2(D), INT8=k_cache.dtype == torch.int8, SHIFT=k_shift is not None, ROTATE=rotate,
        num_warps=4,
    )
