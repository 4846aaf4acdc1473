"""The paged decode runtime: caches, prefill, one decode step, the decode step as a CUDA graph.

Every layer keeps a paged KV cache (the model's dtype, bf16, or fp8 e4m3 with one scale per token and head, the
keys less a constant that softmax ignores: key_shift.py);
every MSA layer also keeps a paged index-key cache (one shared index key per token, bf16 or fp8 e4m3 with one scale
per page, as the prefill's fp8 scoring quantises a key block). Pages hold `block_size` tokens: the MSA key block is
the page, so a selected block id is a logical page of the block table.
Prefill runs a prompt whole or in chunks: each chunk's keys go to the caches, then its queries attend to the keys as
the caches hold them, with the fused indexer over the cached index keys and the gather-Q sparse kernel (SDPA for
dense layers and while the keys fit in the top-k); decode runs `kernels.decode`'s paged selection and split-K
attention for every layer (a dense layer selects every page). What the caches and a prefill chunk need is counted
before anything is allocated (m3compile.memory), against the device's free memory. On CPU the same code runs the torch
references. On a GPU the decode step is captured once as a CUDA graph and replayed per token (`DecodeStep`:
static token buffer, the cache's tensors, block tables preallocated to the longest sequence), so per-token Python
and kernel-launch overhead does not set the speed; the eager step is the same function on the same buffers. On a
GPU the ops run their lowerings (m3compile.ops.lowering: RMSNorm, RoPE and the index branch as single kernels instead
of the modules' 5-12 elementwise ops each; a decode layer's dispatches, views included, halve).

    paged_cache.py  PagedCache: the paged KV and index-key caches of one batch, one block table for all layers;
                    the views the model's forward attends through (a prompt's pass, one decode step)
    key_shift.py    key_shifts: what an fp8 K cache subtracts from each key (the mean rotated K bias) before rounding
    forward.py      prefill (one prompt into the caches, in chunks), prefill_nll (its next-token losses),
                    decode_step (one token per sequence): each one call of the model's forward; lowering_default
    cuda_graph.py   DecodeStep (the decode step, eager or replayed as a CUDA graph), graph_unavailable
    generate.py     generation for a user: sizes the caches, prefills, decodes, samples, stops
    timings.py      where a generation's time goes (phases, Triton compiles, kernel variants)
    compile_ahead.py  `m3c compile`: the model's kernel variants compiled once into MODEL/kernel-cache
                    (io/kernel_cache.py reads and activates it), so a first run loads them instead of compiling

m3compile.runtime.generate drives it (sampling, stopping, text); m3compile.bench.model times it.
"""
from m3compile.runtime.cuda_graph import DecodeStep, graph_unavailable
from m3compile.runtime.forward import decode_step, lowering_default, prefill, prefill_nll
from m3compile.runtime.paged_cache import PagedCache

__all__ = ["PagedCache", "prefill", "prefill_nll", "decode_step", "lowering_default", "DecodeStep",
           "graph_unavailable"]
