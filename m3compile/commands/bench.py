"""`m3c bench`: the kernels, the whole model, the training steps and kernels, the ViT's windowed attention against
dense attention; one subcommand each (m3compile.bench runs them and renders their tables)."""
from __future__ import annotations

import os

import click

from m3compile.config import INDEX_CACHE_DTYPES, INDEX_DTYPES
from m3compile.commands.common import (
    Group, InputPath, OutputPath, Size, kv_cache_option, parse_layers, stacked, stdout_console,
)

__all__ = ["bench"]


def _device(ctx, param, value: str) -> str:
    """--device: cpu runs the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1 unless set otherwise; read
    when the kernels are first imported, which the bench's own imports do next): without it Triton finds no GPU
    driver to compile for."""
    if str(value).strip().lower() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return value


# Options several bench subcommands take, declared once
_bench_device = click.option("--device", default="cuda", show_default=True, callback=_device,
                             help="cuda; cpu runs a smoke test of the command in Triton's interpreter (timings "
                                  "meaningless).")
_bench_rep_ms = click.option("--rep-ms", default=500, show_default=True,
                             help="Milliseconds of timed repeats per figure (median reported).")
_bench_block = click.option("--block", default=128, show_default=True, help="Keys per block = cache page.")
_bench_topk = click.option("--topk", default=16, show_default=True, help="Blocks each (KV group, query) attends to.")


def _bench_conversion(block: int, topk: int):
    """--block / --topk of a bench of a model: the conversion of a dense one; a converted one runs at its own."""
    return stacked(
        click.option("--block", type=int, default=None,
                     help=f"A dense model's conversion: keys per block = cache page [default: {block}; a converted "
                          f"model's own, which another value cannot change]."),
        click.option("--topk", type=int, default=None,
                     help=f"A dense model's conversion: blocks each (KV group, query) attends to [default: {topk}; a "
                          f"converted model's own]."))
_bench_heads = click.option("--heads", default=64, show_default=True, help="Query heads (M3: 64).")
_bench_kv_heads = click.option("--kv-heads", default=4, show_default=True, help="KV heads = index heads (M3: 4).")
_bench_head_dim = click.option("--head-dim", default=128, show_default=True)
_bench_index_dim = click.option("--index-dim", default=128, show_default=True, help="Index head dim.")
_bench_decode_batch = click.option("--batch", default=8, show_default=True, type=Size("batch"), help="Decode batch.")
_bench_dtype = click.option("--dtype", default="bfloat16", show_default=True, help="The model's weight dtype.")
_bench_model_argument = click.argument("model", metavar="MODEL_DIR|PRESET", type=InputPath())


# --heads --kv-heads --head-dim --index-dim --block --topk: the attention shapes the kernel benches time
_bench_attention_shapes = stacked(_bench_heads, _bench_kv_heads, _bench_head_dim, _bench_index_dim, _bench_block,
                                  _bench_topk)


def _bench_out(writes: str):
    return click.option("--out", "out_dir", default="bench_out", show_default=True, type=OutputPath("folder"),
                        help=f"Writes {writes} here.")


def _bench_dense_max(beyond: str):
    return click.option("--dense-max", default="128K", show_default=True, type=Size(),
                        help=f"Longest length timed densely; {beyond}.")


def _bench_lengths(name: str, default: str | None, bench_default: str | None = None):
    """--prefill-lengths / --decode-lengths; a default of None leaves the lengths to the bench (`bench_default`)."""
    unless = f"; default {bench_default}" if default is None else ""
    return click.option(f"--{name}-lengths", default=default, show_default=default is not None, type=Size(many=True),
                        help=f"{name.capitalize()} context lengths ('' to skip {name}{unless}).")


@click.group(cls=Group)
def bench():
    """Time MSA against dense attention: the kernels, the whole model, its training steps (figures: BENCHMARKS.md)."""


def _log(console):
    return lambda m: console.print(f"[dim]{m}[/dim]")


@bench.command(name="kernels", short_help="Triton MSA kernels vs dense SDPA and FlexAttention (GPU).")
@_bench_lengths("prefill", "8K,32K,128K,512K,1M")
@_bench_lengths("decode", "32K,128K,512K,1M")
@_bench_decode_batch
@_bench_attention_shapes
@click.option("--selection", "selections", multiple=True, default=("independent", "shared"), show_default=True,
              help="Selection regimes for prefill: independent (indexer on random inputs) and/or shared (one "
                   "selection per 128-query block).")
@_bench_dense_max("longer ones are extrapolated as T^2 and marked")
@click.option("--flex-max", default="128K", show_default=True, type=Size(),
              help="Longest prefill timed with FlexAttention.")
@click.option("--no-flex", is_flag=True, help="Skip FlexAttention.")
@click.option("--query-chunk-sweep", default="", type=Size(many=True),
              help="Also time the sparse attention with these query chunks, e.g. 4K,16K (tuning aid).")
@_bench_rep_ms
@_bench_device
@_bench_out("bench.json and bench.png")
def bench_kernels(prefill_lengths, decode_lengths, batch, heads, kv_heads, head_dim, index_dim, block, topk,
                  selections, dense_max, flex_max, no_flex, query_chunk_sweep, rep_ms, device, out_dir):
    """Time MSA prefill and decode against dense SDPA and FlexAttention at M3 shapes.

    \b
    Prefill (one sequence, bf16): dense SDPA causal (enable_gqa); FlexAttention with a BlockMask built from the
    same selection; the gather-Q sparse attention alone; the fused indexer (scores + block max + top-k), in bf16
    and with fp8 scoring (e4m3 keys and query rows, fp32 accumulation; with the share of the bf16 selection's blocks
    it also selects); and both together (the whole MSA prefill, index projections excluded). "ideal" = dense causal
    FLOPs / FLOPs on the keys the selection makes visible.
    Decode (batch of equal lengths): dense SDPA over a contiguous cache vs paged selection + split-K attention with
    bf16 and fp8 index keys, timed as CUDA-graph replays; "byte limit" = dense bytes / bytes MSA must read.
    Each figure is the median of repeated runs after warm-up (CUDA events). Prints a table, writes
    OUT/bench.json and OUT/bench.png.
    """
    from m3compile.bench.kernels import BenchConfig, render, run_bench, write_outputs

    cfg = BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim, block=block, topk=topk,
                      prefill_lengths=prefill_lengths, decode_lengths=decode_lengths, batch=batch,
                      dense_max=dense_max, flex_max=flex_max, selections=tuple(selections), flex=not no_flex,
                      device=device, rep_ms=rep_ms, query_chunk_sweep=query_chunk_sweep,
                      warmup_ms=max(25, rep_ms // 5))
    console = stdout_console()
    result = run_bench(cfg, prefill=bool(cfg.prefill_lengths), decode=bool(cfg.decode_lengths), log=_log(console))
    write_outputs(result, out_dir)
    for part in render(result, cfg, out_dir):
        console.print(part)


@bench.command(name="model", short_help="The whole model: time to first token and decode tokens/s, dense vs MSA (GPU).")
@_bench_model_argument
@_bench_lengths("prefill", None, "8K,32K,128K,512K")
@_bench_lengths("decode", None, "32K,128K")
@_bench_decode_batch
@_bench_conversion(128, 16)
@click.option("--index-dim", type=int, default=None,
              help="The conversion's index head dim (default: the model's head dim; below its rotary width the index "
                   "head keeps the lowest RoPE frequencies).")
@click.option("--top-p", type=float, default=None,
              help="A dense model's conversion: the adaptive budget (as m3c convert --top-p; --topk is its ceiling) "
                   "[default: none; a converted model's own]. A preset's random index branch gives near-uniform "
                   "probabilities, so a small --top-p with --min-blocks N keeps about N blocks a query in --topk "
                   "slots: the adaptive path's cost at a measured mean (e.g. --topk 64 --top-p 0.01 --min-blocks 45).")
@click.option("--min-blocks", type=int, default=None,
              help="A dense model's conversion: the adaptive budget's floor (as m3c convert --min-blocks).")
@click.option("--dense-layers", default=None,
              help="A dense model's conversion: comma-separated layers that keep dense attention [default: 0; a "
                   "converted model's own]. Their count is what speed depends on: a converted model with N dense "
                   "layers is timed on a preset as --dense-layers 0,...,N-1.")
@_bench_dense_max("longer ones are extrapolated per stage and marked")
@click.option("--msa-max", default="128K", show_default=True, type=Size(),
              help="Longest prefill timed on the MSA model; longer ones are extrapolated per stage and marked.")
@_bench_dtype
@click.option("--index-cache", type=click.Choice(INDEX_CACHE_DTYPES), default="auto", show_default=True,
              help="Decode index-key cache dtype (auto: the model's).")
@click.option("--index-dtype", type=click.Choice(INDEX_DTYPES), default="auto", show_default=True,
              help="The converted model's index scoring (fp8: e4m3 scores in prefill and an fp8 decode index cache).")
@kv_cache_option()
@click.option("--prefill-chunk", default=None, type=Size(),
              help="Time to first token through m3c generate's prefill in chunks of this many tokens (e.g. 64K), into "
                   "a paged cache [default: the whole prompt through the lowered backbone where its activations fit, "
                   "else chunks of the largest size that fits].")
@click.option("--bandwidth", type=float, default=None,
              help="The GPU's memory bandwidth in TB/s for the decode byte floor [default: by its name, e.g. H200 "
                   "4.8].")
@click.option("--sparse-kernel", type=click.Choice(["gather", "tile"]), default="gather", show_default=True,
              help="The MSA prefill's sparse attention: gather-Q, or the query-tile union kernel "
                   "(kernels/sparse_attention/tile.py; opt-in, to compare the two: see BENCHMARKS.md; "
                   "M3C_SPARSE_KERNEL=tile turns it on elsewhere).")
@click.option("--profile-max", default=None, type=Size(),
              help="Longest prefill also run once under the profiler for its per-stage breakdown; longer ones are "
                   "timed only (a long prefill's profiled run costs as much as a timed one) [default: every length].")
@click.option("--steps", default=5, show_default=True, help="Timed prefill runs per figure, at most.")
@click.option("--decode-steps", default=32, show_default=True, type=Size("decode steps"),
              help="Decode steps per timing.")
@click.option("--figure-seconds", default=10.0, show_default=True,
              help="Fewer than --steps timed prefill runs where one run is long (at least one).")
@click.option("--separate-projections", is_flag=True,
              help="Run q/k/v (and index q/k), gate and up as separate matmuls [default: fused per layer, as m3c "
                   "generate runs them].")
@_bench_device
@_bench_out("<model>.json and model_speedup.png (every model bench in OUT)")
def bench_model(model, prefill_lengths, decode_lengths, batch, block, topk, index_dim, top_p, min_blocks, dense_layers,
                dense_max, msa_max, dtype,
                index_cache, index_dtype, kv_cache, prefill_chunk, bandwidth, sparse_kernel, profile_max, steps,
                decode_steps, figure_seconds, separate_projections, device, out_dir):
    """Time the whole model, dense against converted and lowered: time to first token and decode tokens/s.

    MODEL_DIR|PRESET is a checkpoint directory, or a preset with random weights built on the device (llama3-8b,
    qwen2.5-7b, ...); a dense model is converted in memory with --block/--topk (layer 0 dense). Time to first token
    at --prefill-lengths (dense timed up to --dense-max, MSA up to --msa-max, longer ones extrapolated per stage and
    marked) and decode tokens/s at --decode-lengths x --batch, eager and as a CUDA graph, each with a per-stage
    breakdown, and each step's byte floor (weights, the K/V it reads, the index keys) with the share of it reached
    at the GPU's bandwidth. A batch whose caches do not fit runs lowered, and then as asked on the first layers at
    two depths, extrapolated to the whole depth and marked; a prompt whose activations do not fit is prefilled in
    chunks, and one whose caches do not fit either is marked with the bytes it needs. Writes OUT/<model>.json and
    OUT/model_speedup.png (the plot: every model bench in OUT).
    """
    from m3compile.bench.model import ModelBenchConfig, render, run_model_bench, write_model_outputs

    lengths = {name: value for name, value in (("prefill_lengths", prefill_lengths),
                                               ("decode_lengths", decode_lengths)) if value is not None}
    cfg = ModelBenchConfig(model=str(model), batch=batch, block=block, topk=topk, top_p=top_p, min_blocks=min_blocks,
                           dense_layers=None if dense_layers is None else parse_layers(dense_layers),
                           dense_max=dense_max,
                           msa_max=msa_max, dtype=dtype, profile_max=profile_max,
                           index_cache=index_cache, index_dtype=index_dtype, index_dim=index_dim,
                           sparse_kernel=sparse_kernel, steps=steps, decode_steps=decode_steps,
                           figure_seconds=figure_seconds, device=device, kv_cache=kv_cache,
                           prefill_chunk=prefill_chunk,
                           bandwidth_tbs=bandwidth, fuse_projections=not separate_projections, **lengths)
    console = stdout_console()
    result = run_model_bench(cfg, log=_log(console))
    for part in render(result, *write_model_outputs(result, out_dir)):
        console.print(part)


@bench.command(name="distill", short_help="Distillation and training steps vs the frozen dense forward.")
@_bench_model_argument
@click.option("--seq-len", default="8K", show_default=True, type=Size(), help="Tokens per sequence.")
@click.option("--batch", default=2, show_default=True, type=Size("batch"), help="Sequences per step.")
@_bench_dtype
@click.option("--autocast", type=click.Choice(["auto", "bf16", "none"]), default="auto", show_default=True,
              help="As m3c distill --autocast.")
@click.option("--block-loss", type=float, default=1.0, show_default=True,
              help="The distillation rows with m3c distill --block-loss L (m3c distill's default, 1; 0: the KL-only "
                   "step; the training rows keep the KL).")
@click.option("--no-train", is_flag=True, help="Skip the two training steps (dense and MSA).")
@click.option("--no-eval", is_flag=True,
              help="Skip the eval rows (the converted model's dense, MSA and oracle forwards, and m3c eval with and "
                   "without the oracle pass).")
@click.option("--shard", is_flag=True,
              help="The distillation and MSA training steps sharded with FSDP2 as m3c distill --shard (under "
                   "torchrun, or in a process group of one).")
@click.option("--layers", type=int, default=None,
              help="With a preset: only its first N layers (op counts are extrapolated to its full depth).")
@click.option("--count-ops", "count_only", is_flag=True,
              help="Only count one step's host dispatches (aten ops, Triton launches) per mode, on the lowered graph, "
                   "no timing; on CPU set TRITON_INTERPRET=1 so the Triton kernels' host path runs.")
@click.option("--cuda-graph", is_flag=True,
              help="Also each distillation mode's step captured in a CUDA graph: checked against the eager step from "
                   "the same state (KL, recall, gradients, updated weights), then timed.")
@click.option("--steps", default=5, show_default=True, help="Timed steps (median reported) after 2 untimed.")
@_bench_conversion(64, 8)
@_bench_device
@_bench_out("distill.json")
def bench_distill(model, seq_len, batch, dtype, autocast, block_loss, no_train, no_eval, shard, layers, count_only,
                  cuda_graph, steps, block, topk, device, out_dir):
    """Time distillation and training steps against the frozen dense forward, and m3c eval on the same batch.

    MODEL_DIR|PRESET is a checkpoint directory or a preset (llama3-8b, qwen2.5-7b, smollm2-135m, m3-tiny); a dense
    model is converted with --block/--topk. Rows: the dense forward, a distillation step in warm-up and in sparse
    mode, m3c eval's forwards and evaluate() itself (ratio: its forwards' ms over its ms), a dense and an MSA
    training step; each with its peak memory, a per-stage breakdown of one profiled step and, for distillation,
    the step's host dispatches (aten ops and Triton launches by stage and layer). Writes OUT/distill.json.
    """
    from m3compile.bench.distill import DistillBenchConfig, render, run_distill_bench
    from m3compile.bench.kernels import write_json

    cfg = DistillBenchConfig(model=str(model), seq_len=seq_len, batch=batch, block=block, topk=topk,
                             dtype=dtype, autocast=autocast, train=not no_train, shard=shard, steps=steps,
                             device=device, layers=layers, count_only=count_only, cuda_graph=cuda_graph,
                             block_loss=block_loss, eval=not no_eval)
    console = stdout_console()
    result = run_distill_bench(cfg, log=_log(console))
    for part in render(result, cfg, write_json(result, out_dir / "distill.json")):
        console.print(part)


@bench.command(name="backward", short_help="Sparse attention and fused KL, forward + backward, vs dense SDPA.")
@_bench_attention_shapes
@click.option("--lengths", default="32K,128K", show_default=True, type=Size(many=True), help="Context lengths.")
@_bench_dense_max("longer ones have no dense time")
@_bench_rep_ms
@_bench_device
@_bench_out("backward.json")
def bench_backward(heads, kv_heads, head_dim, index_dim, block, topk, lengths, dense_max, rep_ms, device, out_dir):
    """Time the training kernels: forward + backward of the sparse attention against dense SDPA, and the fused KL.

    At each of --lengths: the sparse attention's forward + backward against dense SDPA's, and the fused KL's time
    (with its own teacher LSE pass, and with the LSE given, as a lowered training graph passes it from the
    attention) and peak memory. Writes OUT/backward.json.
    """
    from m3compile.bench.kernels import BenchConfig, render_backward, run_backward_bench, write_json

    cfg = BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim, block=block, topk=topk,
                      dense_max=dense_max, device=device, rep_ms=rep_ms,
                      warmup_ms=max(25, rep_ms // 5))
    console = stdout_console()
    result = run_backward_bench(cfg, lengths, log=_log(console))
    for part in render_backward(result, cfg, write_json(result, out_dir / "backward.json")):
        console.print(part)


@bench.command(name="vision", short_help="The ViT's 3D windowed attention: fused varlen kernel vs SDPA.")
@click.option("--steps", default="8,13,21,34,64", show_default=True, help="Temporal steps of each video in the batch.")
@click.option("--grid", default=32, show_default=True, help="Patches per side of each frame.")
@click.option("--window", default=4, show_default=True, help="Temporal steps per 3D window.")
@click.option("--heads", default=16, show_default=True, help="ViT heads (M3: 16).")
@click.option("--head-dim", default=80, show_default=True, help="ViT head dim (M3: 80).")
@_bench_rep_ms
@_bench_device
@_bench_out("vision.json")
def bench_vision(steps, grid, window, heads, head_dim, rep_ms, device, out_dir):
    """Time the ViT's 3D windowed attention: the fused varlen kernel against SDPA per window and padded SDPA.

    One launch of the fused kernel over every window, against a Python loop of SDPA per window and SDPA over the
    windows padded to the longest, with each one's error against the loop. Writes OUT/vision.json.
    """
    from m3compile.bench.kernels import VisionBenchConfig, render_vision, run_vision_bench, write_json

    try:
        steps = tuple(int(t) for t in steps.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated step counts, got {steps!r}") from None
    cfg = VisionBenchConfig(steps=steps, grid=grid, window=window, heads=heads, head_dim=head_dim, device=device,
                            rep_ms=rep_ms, warmup_ms=max(25, rep_ms // 5))
    console = stdout_console()
    result = run_vision_bench(cfg, log=_log(console))
    for part in render_vision(result, cfg, write_json(result, out_dir / "vision.json")):
        console.print(part)
