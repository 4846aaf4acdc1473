"""Every Triton kernel compiles for Hopper (sm_90) at M3 shapes, here, without a GPU.

The interpreter tests run kernels as Python, so what only the compiler rejects (a non-constexpr global, a shape
that is not a power of two, a constexpr expression it cannot fold) would first show on the GPU machine. This
compiles each kernel with the installed Triton down to a cubin (Triton's bundled ptxas) at its recorded default
tile configuration and at an edge one. The suite runs with TRITON_INTERPRET=1, under which @triton.jit yields
interpreted functions, so the compiles run in one child process without it (this file run as a script).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BF, F32, I32, I64, FP8, I8 = "*bf16", "*fp32", "*i32", "*i64", "*fp8e4nv", "*i8"
SPARSE = dict(HKV=4, NB=64, K=16, G=16, GP=16, D=128, DP=128, BS=128, BN=128, CHUNK=64, IEEE=False)
SPARSE_FWD = {k: v for k, v in SPARSE.items() if k != "NB"}  # the forward takes the block count at run time
KL = dict(HKV=4, NB=64, K=16, G=16, D=128, DP=128, DI=128, DIP=128, BS=128, BN=128, CHUNK=256, IEEE=False)

# (name, "op_folder.module.kernel", pointer args and their element types, constexprs, fp32 scalar args, launch options)
KERNELS = [
    ("index_topk", "indexer._tl_indexer.index_topk_kernel",
     dict(q=BF, k=BF, k_scale=F32, out=I32),
     dict(H=4, HP=4, D=128, DP=128, BS=128, BN=128, TOPK=16, KP=16, INIT=0, LOCAL=1, HAS_SCALE=False,
          BLOCK_SCALE=False, IEEE=False,
          FP8_DOT=False, ROWS=128, ADAPT=False), ("sm_scale", "top_p"), dict(num_warps=8, num_stages=3)),
    ("index_topk fp8 x fp8", "indexer._tl_indexer.index_topk_kernel",
     dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=4, HP=4, D=128, DP=128, BS=128, BN=128, TOPK=16, KP=16, INIT=1, LOCAL=2, HAS_SCALE=True,
          BLOCK_SCALE=False, IEEE=False,
          FP8_DOT=True, ROWS=64, ADAPT=False), ("sm_scale", "top_p"), dict(num_warps=4, num_stages=2)),
    ("index_topk fp8 x fp8, Llama-3-8B shapes (8 index heads)", "indexer._tl_indexer.index_topk_kernel",
     dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=8, HP=8, D=128, DP=128, BS=128, BN=128, TOPK=16, KP=16, INIT=0, LOCAL=1, HAS_SCALE=True,
          BLOCK_SCALE=False, IEEE=False, FP8_DOT=True, ROWS=256, ADAPT=False), ("sm_scale", "top_p"),
     dict(num_warps=8, num_stages=3)),
    ("index_topk fp8 x fp8 with one key scale per block, Llama-3-8B shapes, index dim 64",
     "indexer._tl_indexer.index_topk_kernel", dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=8, HP=8, D=64, DP=64, BS=128, BN=128, TOPK=16, KP=16, INIT=0, LOCAL=1, HAS_SCALE=True,
          BLOCK_SCALE=True, IEEE=False, FP8_DOT=True, ROWS=128, ADAPT=False), ("sm_scale", "top_p"),
     dict(num_warps=4, num_stages=2)),
    ("index_topk fp8 widened to fp16, 3 heads, Di 48", "indexer._tl_indexer.index_topk_kernel",
     dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=3, HP=4, D=48, DP=64, BS=64, BN=64, TOPK=8, KP=8, INIT=0, LOCAL=1, HAS_SCALE=True,
          BLOCK_SCALE=False, IEEE=False,
          FP8_DOT=False, ROWS=128, ADAPT=False), ("sm_scale", "top_p"), dict(num_warps=8, num_stages=3)),
    ("index_topk fp8 x fp8, adaptive budget (the candidates' log-sum-exp and the cut on chip)",
     "indexer._tl_indexer.index_topk_kernel", dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=8, HP=8, D=64, DP=64, BS=128, BN=128, TOPK=32, KP=32, INIT=0, LOCAL=1, HAS_SCALE=True,
          BLOCK_SCALE=True, IEEE=False, FP8_DOT=True, ROWS=128, ADAPT=True), ("sm_scale", "top_p"),
     dict(num_warps=4, num_stages=2)),
    ("index_topk past 32 slots (index_topk_kernel_wide's default), fp8 x fp8, adaptive budget",
     "indexer._tl_indexer.index_topk_kernel", dict(q=BF, k=FP8, k_scale=F32, out=I32),
     dict(H=8, HP=8, D=64, DP=64, BS=128, BN=128, TOPK=45, KP=64, INIT=0, LOCAL=1, HAS_SCALE=True,
          BLOCK_SCALE=True, IEEE=False, FP8_DOT=True, ROWS=64, ADAPT=True), ("sm_scale", "top_p"),
     dict(num_warps=4, num_stages=3)),
    ("gather_q_fwd, partials stored by TMA", "sparse_attention._tl_sparse.gather_q_fwd_kernel",
     dict(q=BF, k=BF, v=BF, part_o=BF, part_lse=F32, o_desc="tensordesc<bf16[64,128]>", tile_seg=I32,
          tile_start=I32, seg_off=I32, payload=I32),
     {**SPARSE_FWD, "LSE_ONLY": False, "TMA": True, "ROWS": 64}, ("scale_log2",), dict(num_warps=4, num_stages=2)),
    ("gather_q_fwd, Llama-3-8B groups (G 4), masked stores", "sparse_attention._tl_sparse.gather_q_fwd_kernel",
     dict(q=BF, k=BF, v=BF, part_o=BF, part_lse=F32, o_desc=BF, tile_seg=I32, tile_start=I32, seg_off=I32,
          payload=I32),
     {**SPARSE_FWD, "G": 4, "GP": 4, "CHUNK": 512, "LSE_ONLY": False, "TMA": False, "ROWS": 64}, ("scale_log2",),
     dict(num_warps=4, num_stages=2)),
    ("gather_q_fwd LSE only, tile narrower than the group", "sparse_attention._tl_sparse.gather_q_fwd_kernel",
     dict(q=BF, k=BF, v=BF, part_o=BF, part_lse=F32, o_desc=BF, tile_seg=I32, tile_start=I32, seg_off=I32,
          payload=I32),
     {**SPARSE_FWD, "LSE_ONLY": True, "TMA": False, "ROWS": 8}, ("scale_log2",), dict(num_warps=4, num_stages=2)),
    ("combine", "sparse_attention._tl_sparse.combine_kernel",
     dict(part_o=BF, part_lse=F32, entry=I32, blocks=I32, out=BF, lse_out=F32),
     dict(HKV=4, K=16, G=16, GP=16, D=128, DP=128, STORE_LSE=True, UNROLL=16, TOK=1), (),
     dict(num_warps=4, num_stages=1)),
    ("combine, 45 slots in groups of 16, G 4", "sparse_attention._tl_sparse.combine_kernel",
     dict(part_o=BF, part_lse=F32, entry=I32, blocks=I32, out=BF, lse_out=F32),
     dict(HKV=8, K=45, G=4, GP=4, D=128, DP=128, STORE_LSE=False, UNROLL=16, TOK=1), (),
     dict(num_warps=1, num_stages=1)),
    ("gather_q_bwd", "sparse_attention._tl_sparse.gather_q_bwd_kernel",
     dict(q=BF, k=BF, v=BF, do=BF, lse=F32, delta=F32, dq=F32, dk=F32, dv=F32, tile_seg=I32, tile_start=I32,
          seg_off=I32, payload=I32),
     {**SPARSE, "DQ_PARTS": False, "ROWS": 32}, ("scale", "scale_log2"), dict(num_warps=8, num_stages=2)),
    ("gather_q_bwd, dQ shares per slot", "sparse_attention._tl_sparse.gather_q_bwd_kernel",
     dict(q=BF, k=BF, v=BF, do=BF, lse=F32, delta=F32, dq=BF, dk=F32, dv=F32, tile_seg=I32, tile_start=I32,
          seg_off=I32, payload=I32),
     {**SPARSE, "DQ_PARTS": True, "ROWS": 64}, ("scale", "scale_log2"), dict(num_warps=8, num_stages=2)),
    ("sum_slots", "sparse_attention._tl_sparse.sum_slots_kernel", dict(part=BF, blocks=I32, out=BF),
     dict(K=16, G=16, GP=16, D=128, DP=128), (), dict(num_warps=4, num_stages=1)),
    ("sparse_kl_fwd", "sparse_kl._tl_kl.sparse_kl_fwd_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, tlse=F32, part_lse=F32, part_stat=F32, tile_seg=I32, tile_start=I32,
          seg_off=I32, payload=I32),
     {**KL, "TOK": 32}, ("scale_log2", "iscale_log2"), dict(num_warps=4, num_stages=2)),
    ("sparse_kl_bwd", "sparse_kl._tl_kl.sparse_kl_bwd_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, tlse=F32, lse_s=F32, psum=F32, d_kl=F32, dq=F32, dk=F32, tile_seg=I32,
          tile_start=I32, seg_off=I32, payload=I32),
     {**KL, "SCALAR_GRAD": False, "TOK": 32}, ("scale_log2", "iscale_log2", "iscale", "grad_scale"),
     dict(num_warps=4, num_stages=2)),
    ("sparse_kl_bwd, gradient of the mean", "sparse_kl._tl_kl.sparse_kl_bwd_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, tlse=F32, lse_s=F32, psum=F32, d_kl=F32, dq=F32, dk=F32, tile_seg=I32,
          tile_start=I32, seg_off=I32, payload=I32),
     {**KL, "CHUNK": 64, "SCALAR_GRAD": True, "TOK": 16}, ("scale_log2", "iscale_log2", "iscale", "grad_scale"),
     dict(num_warps=4, num_stages=2)),
    ("sparse_kl_merge", "sparse_kl._tl_kl.sparse_kl_merge_kernel",
     dict(part_lse=F32, part_stat=F32, blocks=I32, kl=F32, lse_s=F32, psum=F32),
     dict(HI=4, K=16, KP=16, ROWS=64, CLEAN=True), (), dict(num_warps=4, num_stages=1)),
    ("sparse_kl_merge, 3 slots", "sparse_kl._tl_kl.sparse_kl_merge_kernel",
     dict(part_lse=F32, part_stat=F32, blocks=I32, kl=F32, lse_s=F32, psum=F32),
     dict(HI=3, K=3, KP=4, ROWS=64, CLEAN=False), (), dict(num_warps=4, num_stages=1)),
    ("causal_lse", "causal_lse._tl_lse.causal_lse_kernel", dict(q=BF, k=BF, rows=I64, sel=F32, out=F32),
     dict(HKV=4, G=16, GP=16, D=128, DP=128, RECALL=False, IEEE=False, ROWS=128, BN=64), ("scale_log2",),
     dict(num_warps=8, num_stages=2)),
    ("causal_lse recall, G 3, head dim 64", "causal_lse._tl_lse.causal_lse_kernel", dict(q=BF, k=BF, rows=I64, sel=F32, out=F32),
     dict(HKV=3, G=3, GP=4, D=64, DP=64, RECALL=True, IEEE=False, ROWS=64, BN=128), ("scale_log2",),
     dict(num_warps=4, num_stages=3)),
    ("norm_rope_fwd, index norm + RoPE", "norm_rope._tl_norm_rope.norm_rope_fwd_kernel",
     dict(x=BF, w_q=F32, w_k=F32, cos=BF, sin=BF, out=BF), dict(D=128, DP=128, W=64, NORM=True, ROWS=16), ("eps",),
     dict(num_warps=4, num_stages=1)),
    ("norm_rope_fwd, RoPE alone, D 80", "norm_rope._tl_norm_rope.norm_rope_fwd_kernel",
     dict(x=BF, w_q=BF, w_k=BF, cos=F32, sin=F32, out=BF), dict(D=80, DP=128, W=80, NORM=False, ROWS=16), ("eps",),
     dict(num_warps=4, num_stages=1)),
    ("norm_rope_bwd", "norm_rope._tl_norm_rope.norm_rope_bwd_kernel",
     dict(g_q=BF, g_k=BF, x=BF, w_q=F32, w_k=F32, cos=BF, sin=BF, dx=BF, dw=F32),
     dict(D=64, DP=64, W=64, NORM=True, ROWS=16), ("eps",), dict(num_warps=4, num_stages=1)),
    ("norm_rope_bwd, RoPE alone", "norm_rope._tl_norm_rope.norm_rope_bwd_kernel",
     dict(g_q=BF, g_k=BF, x=BF, w_q=BF, w_k=BF, cos=BF, sin=BF, dx=BF, dw=F32),
     dict(D=128, DP=128, W=64, NORM=False, ROWS=16), ("eps",), dict(num_warps=4, num_stages=1)),
    ("rms_norm hidden 576", "norm_rope._tl_norm_rope.rms_norm_kernel", dict(x=BF, w=BF, out=BF),
     dict(D=576, DP=1024, GEMMA=False, ROWS=4), ("eps",), dict(num_warps=4, num_stages=1)),
    ("rms_norm gemma, fp32 weight", "norm_rope._tl_norm_rope.rms_norm_kernel", dict(x=BF, w=F32, out=BF),
     dict(D=6144, DP=8192, GEMMA=True, ROWS=1), ("eps",), dict(num_warps=8, num_stages=1)),
    ("add_rms_norm hidden 4096", "norm_rope._tl_norm_rope.add_rms_norm_kernel",
     dict(x=BF, d=BF, s=BF, w=BF, out=BF),
     dict(D=4096, DP=4096, GEMMA=False, ROWS=1), ("eps",), dict(num_warps=4, num_stages=1)),
    ("csr_keys int16", "sparse_attention._tl_sparse.csr_keys_kernel", dict(blocks=I32, key="*i16"), dict(HKV=4, K=16, BLOCK=1024),
     (), dict(num_warps=4, num_stages=1)),
    ("csr_keys int32", "sparse_attention._tl_sparse.csr_keys_kernel", dict(blocks=I32, key=I32), dict(HKV=8, K=16, BLOCK=1024), (),
     dict(num_warps=4, num_stages=1)),
    ("csr_segments", "sparse_attention._tl_sparse.csr_segments_kernel",
     dict(key="*i16", order=I64, payload=I32, entry=I32, seg_off=I32, tiles=I32), dict(BLOCK=1024), (),
     dict(num_warps=4, num_stages=1)),
    ("csr_tiles", "sparse_attention._tl_sparse.csr_tiles_kernel",
     dict(seg_off=I32, tiles=I32, tile_end=I32, tile_seg=I32, tile_start=I32), dict(BLOCK=1024), (),
     dict(num_warps=4, num_stages=1)),
    ("paged_index_scores fp8", "decode._tl_decode.paged_index_scores_fp8_kernel",
     dict(q_idx=BF, idx_cache=FP8, idx_scale=F32, block_table=I32, seq_lens=I32, scores=F32),
     dict(H=4, HP=16, D=128, DP=128, BS=128, BN=128, HAS_SCALE=True, IEEE=False, FP8_DOT=True, NPG=1, PPP=4), (),
     dict(num_warps=4, num_stages=3)),
    ("index_write", "decode._tl_decode.index_write_kernel",
     dict(k_idx=BF, tail=BF, idx_cache=FP8, idx_scale=F32, rows=I64, pos=I64, block_table=I32),
     dict(BS=128, BSP=128, D=128, DP=128), (), dict(num_warps=4, num_stages=1)),
    ("topk_chunk (stage 1 of the decode top-k)", "decode._tl_decode.topk_chunk_kernel",
     dict(scores=F32, seq_lens=I32, cand=I64, out=I32),
     dict(BS=128, CHUNK=256, KC=16, TOPK=16, INIT=0, LOCAL=1, FINAL=False, RANK=False), (),
     dict(num_warps=1, num_stages=1)),
    ("topk_chunk ranked, top-45", "decode._tl_decode.topk_chunk_kernel",
     dict(scores=F32, seq_lens=I32, cand=I64, out=I32),
     dict(BS=128, CHUNK=256, KC=45, TOPK=45, INIT=0, LOCAL=1, FINAL=False, RANK=True), (),
     dict(num_warps=4, num_stages=1)),
    ("topk_chunk as the single pass, topk > chunk, ranked", "decode._tl_decode.topk_chunk_kernel",
     dict(scores=F32, seq_lens=I32, cand=I32, out=I32),
     dict(BS=64, CHUNK=8, KC=32, TOPK=32, INIT=1, LOCAL=2, FINAL=True, RANK=True), (),
     dict(num_warps=4, num_stages=1)),
    ("topk_merge", "decode._tl_decode.topk_merge_kernel", dict(cand=I64, seq_lens=I32, out=I32),
     dict(BS=128, CHUNK=256, KC=45, TOPK=45, MT=1024, TOPKP=64), (), dict(num_warps=4, num_stages=1)),
    ("adaptive_cut (the decode adaptive budget), fp8 query rows, Llama-3-8B at 1M (8192 pages)",
     "decode._tl_decode.adaptive_cut_kernel", dict(q_idx=BF, scores=F32, seq_lens=I32, blocks=I32),
     dict(D=64, DP=64, BS=128, K=32, KP=32, INIT=0, LOCAL=1, FP8=True, CHUNK=1024), ("sm_scale", "top_p"),
     dict(num_warps=4, num_stages=1)),
    ("paged_attention_split", "decode._tl_decode.paged_attention_split_kernel",
     dict(q=BF, k_cache=BF, v_cache=BF, k_scale=F32, v_scale=F32, rot=F32, blocks=I32,
          block_table=I32, seq_lens=I32, part_o=F32, part_lse=F32),
     dict(G=16, GP=16, D=128, DP=128, BS=128, BN=128, IEEE=False, HAS_SCALE=False, ROTATE=0), ("scale_log2",),
     dict(num_warps=4, num_stages=2)),
    ("paged_attention_split, fp8 K/V, Llama-3-8B shapes (G 4)", "decode._tl_decode.paged_attention_split_kernel",
     dict(q=BF, k_cache=FP8, v_cache=FP8, k_scale=F32, v_scale=F32, rot=F32, blocks=I32,
          block_table=I32, seq_lens=I32, part_o=F32, part_lse=F32),
     dict(K=16, G=4, GP=16, D=128, DP=128, BS=128, BN=128, PPS=1, IEEE=False, HAS_SCALE=True, ROTATE=0),
     ("scale_log2",),
     dict(num_warps=4, num_stages=2)),
    ("kv_write fp8, key shift, Llama-3-8B shapes", "decode._tl_decode.kv_write_kernel",
     dict(k=BF, v=BF, k_cache=FP8, v_cache=FP8, k_scale=F32, v_scale=F32, page=I64, off=I64, shift=F32, rot=F32),
     dict(H=8, HP=8, D=128, DP=128, INT8=False, SHIFT=True, ROTATE=0), (), dict(num_warps=4, num_stages=1)),
    ("kv_write int8, key shift and rotation, Qwen2.5-0.5B shapes", "decode._tl_decode.kv_write_kernel",
     dict(k=BF, v=BF, k_cache=I8, v_cache=I8, k_scale=F32, v_scale=F32, page=I64, off=I64, shift=F32, rot=F32),
     dict(H=2, HP=16, D=64, DP=64, INT8=True, SHIFT=True, ROTATE=1), (), dict(num_warps=4, num_stages=1)),
    ("paged_attention_split, int8 K/V, Qwen2.5-0.5B shapes (G 7)", "decode._tl_decode.paged_attention_split_kernel",
     dict(q=BF, k_cache=I8, v_cache=I8, k_scale=F32, v_scale=F32, rot=F32, blocks=I32,
          block_table=I32, seq_lens=I32, part_o=F32, part_lse=F32),
     dict(K=16, G=7, GP=16, D=64, DP=64, BS=128, BN=128, PPS=1, IEEE=False, HAS_SCALE=True, ROTATE=1),
     ("scale_log2",),
     dict(num_warps=4, num_stages=2)),
    ("kv_write int8, key shift and Hadamard rotation, Llama-3-8B shapes", "decode._tl_decode.kv_write_kernel",
     dict(k=BF, v=BF, k_cache=I8, v_cache=I8, k_scale=F32, v_scale=F32, page=I64, off=I64, shift=F32, rot=F32),
     dict(H=8, HP=16, D=128, DP=128, INT8=True, SHIFT=True, ROTATE=2), (), dict(num_warps=4, num_stages=1)),
    ("paged_attention_split, int8 K/V, Hadamard rotation, Llama-3-8B shapes (G 4)",
     "decode._tl_decode.paged_attention_split_kernel",
     dict(q=BF, k_cache=I8, v_cache=I8, k_scale=F32, v_scale=F32, rot=F32, blocks=I32,
          block_table=I32, seq_lens=I32, part_o=F32, part_lse=F32),
     dict(K=16, G=4, GP=16, D=128, DP=128, BS=128, BN=128, PPS=1, IEEE=False, HAS_SCALE=True, ROTATE=2),
     ("scale_log2",), dict(num_warps=4, num_stages=2)),
    ("paged_merge, Hadamard rotation (G 4)", "decode._tl_decode.paged_merge_kernel",
     dict(part_o=F32, part_lse=F32, out=BF, rot=F32), dict(G=4, GP=16, GM=16, SC=1, D=128, DP=128, ROTATE=2), (),
     dict(num_warps=4, num_stages=1)),
    ("paged_merge", "decode._tl_decode.paged_merge_kernel", dict(part_o=F32, part_lse=F32, out=BF, rot=F32),
     dict(G=16, GP=16, GM=16, SC=1, D=128, DP=128, ROTATE=0), (), dict(num_warps=4, num_stages=1)),
    ("paged_merge, Llama-3-8B shapes (G 4)", "decode._tl_decode.paged_merge_kernel",
     dict(part_o=F32, part_lse=F32, out=BF, rot=F32), dict(G=4, GP=16, GM=4, SC=8, D=128, DP=128, ROTATE=0), (),
     dict(num_warps=4, num_stages=1)),
    ("paged_merge, int8 rotation (G 7)", "decode._tl_decode.paged_merge_kernel",
     dict(part_o=F32, part_lse=F32, out=BF, rot=F32), dict(G=7, GP=16, GM=16, SC=4, D=64, DP=64, ROTATE=1), (),
     dict(num_warps=4, num_stages=1)),
    ("block_stats, SmolLM2 (G 3, block 64)", "block_stats._tl_block_stats.block_stats_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, rows=I64, blse=F32, score=F32, arg=I32),
     dict(HKV=3, G=3, GP=4, D=64, DP=64, DI=64, DIP=64, BS=64, BN=64, IEEE=False, IEEE_IDX=False, INDEX=True,
          TOK=16), ("scale_log2", "iscale"), dict(num_warps=4, num_stages=2)),
    ("block_stats, M3 (G 16, block 128)", "block_stats._tl_block_stats.block_stats_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, rows=I64, blse=F32, score=F32, arg=I32),
     dict(HKV=4, G=16, GP=16, D=128, DP=128, DI=128, DIP=128, BS=128, BN=128, IEEE=False, IEEE_IDX=False, INDEX=True,
          TOK=16), ("scale_log2", "iscale"), dict(num_warps=8, num_stages=3)),
    ("block_lse (the oracle's block mass), Qwen2.5-Coder (G 7, block 128)", "block_stats._tl_block_stats.block_stats_kernel",
     dict(q=BF, k=BF, qidx=BF, kidx=BF, rows=I64, blse=F32, score=F32, arg=F32),
     dict(HKV=2, G=7, GP=8, D=64, DP=64, DI=16, DIP=16, BS=128, BN=128, IEEE=False, IEEE_IDX=False, INDEX=False,
          TOK=32), ("scale_log2", "iscale"), dict(num_warps=4, num_stages=2)),
    ("block_stats fp32 ieee, D 48, Di 40, block 48", "block_stats._tl_block_stats.block_stats_kernel",
     dict(q=F32, k=F32, qidx=F32, kidx=F32, rows=I64, blse=F32, score=F32, arg=I32),
     dict(HKV=2, G=4, GP=4, D=48, DP=64, DI=40, DIP=64, BS=48, BN=64, IEEE=True, IEEE_IDX=True, INDEX=True, TOK=64),
     ("scale_log2", "iscale"), dict(num_warps=8, num_stages=1)),
    ("varlen head dim 80 = 64 + 16", "varlen_attention._tl_varlen.varlen_fwd_kernel",
     dict(q=BF, k=BF, v=BF, out=BF, cu_seqlens=I32, tile_seg=I32, tile_start=I32),
     dict(H=16, D=80, DA=64, DB=16, BLOCK_M=128, IEEE=False, BLOCK_N=64), ("scale_log2",),
     dict(num_warps=8, num_stages=3)),
]


def _compile_all() -> dict:
    """{kernel name: "ok" or the compiler's first error line}, compiled in this process (no interpreter)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, path, pointers, constexprs, floats, options in KERNELS:
        mod, attr = path.rsplit(".", 1)
        fn = getattr(importlib.import_module(f"kernels.{mod}"), attr)
        while not isinstance(fn, triton.runtime.jit.JITFunction):  # under @triton.autotune: the JIT function inside
            fn = fn.fn
        try:
            unknown = (set(pointers) | set(constexprs) | set(floats)) - set(fn.arg_names)
            assert not unknown, f"not arguments of the kernel: {sorted(unknown)}"
            signature = {a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a in floats else "i32")
                         for a in fn.arg_names}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            results[name] = "ok" if compiled.asm["cubin"] else "empty cubin"
        except Exception as e:  # noqa: BLE001 - reported per kernel
            results[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return results


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [k[0] for k in KERNELS])
def test_kernel_compiles_for_hopper(compiled, name):
    assert compiled[name] == "ok", compiled[name]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
