"""m3c: the command line. A thin click + rich layer over the public API: parse, call, render."""
from __future__ import annotations

import time

_STARTED = time.perf_counter()  # `m3c generate --timings`: its "import" phase runs from here

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import click
from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
)
from rich.table import Table
from rich.tree import Tree

from m3compile.config import INDEX_DTYPES
from m3compile.errors import DistillInterrupted, M3CompileError
from m3compile.export.onnx_providers import DTYPES as ONNX_DTYPES, EXTERNAL_DATA, PROVIDERS as ONNX_PROVIDERS
from m3compile.outputs import COMMITTED, atomic_write_text, check_output_file, resolved
from m3compile.evaluation.ruler_tasks import TASKS as RULER_TASKS


def _lazy(module: str, name: str):
    """`module.name`, imported when first called: nothing above imports torch, so `m3c --help` and a usage error
    answer in a fraction of a second, and each command imports only the layers it runs (generate: no tracing,
    passes, ONNX or plotting)."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    return call


DistillConfig = _lazy("m3compile.train.distill", "DistillConfig")
MSAConfig = _lazy("m3compile.config", "MSAConfig")
TrainConfig = _lazy("m3compile.train.distill", "TrainConfig")
convert_checkpoint = _lazy("m3compile.conversion.checkpoint", "convert_checkpoint")
run_distill = _lazy("m3compile.train.distill", "distill")
evaluate = _lazy("m3compile.evaluation.loss", "evaluate")
load = _lazy("m3compile.io.load", "load")
run_train = _lazy("m3compile.train.distill", "train")
run_export = _lazy("m3compile.export.onnx", "export_onnx")
load_tokens = _lazy("m3compile.data", "load_tokens")
compute_attention_map = _lazy("m3compile.tools.attention_map", "attention_map")
draw_attention_map = _lazy("m3compile.tools.attention_map", "draw_attention_map")
BenchConfig = _lazy("m3compile.bench.kernels", "BenchConfig")
VisionBenchConfig = _lazy("m3compile.bench.kernels", "VisionBenchConfig")
run_backward_bench = _lazy("m3compile.bench.kernels", "run_backward_bench")
run_bench = _lazy("m3compile.bench.kernels", "run_bench")
run_vision_bench = _lazy("m3compile.bench.kernels", "run_vision_bench")
speedups = _lazy("m3compile.bench.kernels", "speedups")
write_outputs = _lazy("m3compile.bench.kernels", "write_outputs")
DistillBenchConfig = _lazy("m3compile.bench.distill", "DistillBenchConfig")
run_distill_bench = _lazy("m3compile.bench.distill", "run_distill_bench")
ModelBenchConfig = _lazy("m3compile.bench.model", "ModelBenchConfig")
run_model_bench = _lazy("m3compile.bench.model", "run_model_bench")
write_model_outputs = _lazy("m3compile.bench.model", "write_model_outputs")
TextCodec = _lazy("m3compile.io.tokenizer", "TextCodec")
eos_token_id = _lazy("m3compile.io.tokenizer", "eos_token_id")
run_generate = _lazy("m3compile.runtime.generate", "generate")
run_inspect = _lazy("m3compile.tools.inspect", "inspect")
to_dot = _lazy("m3compile.tools.inspect", "to_dot")
to_mermaid = _lazy("m3compile.tools.inspect", "to_mermaid")
run_retrieval = _lazy("m3compile.evaluation.retrieval", "retrieval")
text_encoder = _lazy("m3compile.evaluation.retrieval", "text_encoder")
holdout_summary = _lazy("m3compile.train.holdout", "summary")
EvalConfig = _lazy("m3compile.config", "EvalConfig")
check_map_output = _lazy("m3compile.tools.attention_map", "check_map_output")
PromptCodec = _lazy("m3compile.io.tokenizer", "PromptCodec")
draw_heatmap = _lazy("m3compile.evaluation.ruler", "draw_heatmap")
read_text = _lazy("m3compile.evaluation.ruler", "read_text")
run_ruler = _lazy("m3compile.evaluation.ruler", "ruler")

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    click.echo(f"error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def _run(fn, *args, **kwargs):
    """Call the API; bad input becomes a one-line error and exit status 2; Ctrl-C or SIGTERM exit status 130."""
    try:
        return fn(*args, **kwargs)
    except M3CompileError as e:
        if _SIGNALLED:  # a library (safetensors) turned the KeyboardInterrupt into an error of its own
            _fail(_interrupted(), EXIT_INTERRUPTED)
        _fail(str(e))
    except DistillInterrupted:
        raise  # the state was saved: the caller says where
    except KeyboardInterrupt:
        _fail(_interrupted(), EXIT_INTERRUPTED)


def _interrupted() -> str:
    """What an interrupted command says: nothing written, or (a signal after the commit) which outputs are whole."""
    if COMMITTED:
        return f"interrupted after {', '.join(map(str, COMMITTED))} was written in full"
    return "interrupted; no output was written"


_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", ())


_SIGNALLED: list[int] = []  # SIGINT/SIGTERM received during this invocation


def _sigterm(signum, frame):
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt  # the atomic writers remove their temporary directories, as for Ctrl-C


class _Group(click.Group):
    """m3c's group: usage errors as one line `error: <message>` (exit 2), SIGTERM handled as Ctrl-C (exit 130)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        previous = {}
        _SIGNALLED.clear()
        COMMITTED.clear()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, _sigterm)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:  # bare `m3c`: the help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except click.Abort:
            _fail(_interrupted(), EXIT_INTERRUPTED)
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        """A Ctrl-C or SIGTERM between the API calls (which `_run` handles) also ends as one line, exit 130, rather
        than as click's Abort, which first prints an empty line."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            if isinstance(e, DistillInterrupted):
                raise
            _fail(_interrupted(), EXIT_INTERRUPTED)


def _console():
    return Console(stderr=False)


def _parse_layers(text: str | None) -> tuple[int, ...]:
    if text is None or text.strip() == "":
        return ()
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer indices, got {text!r}") from None


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    size = None
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            try:
                size = int(float(t[: -len(unit)]) * units[unit])
            except (ValueError, OverflowError):  # nan, inf
                pass
            break
    if size is None:
        try:
            size = int(t)
        except ValueError:
            pass
    if size is None or size < 1:
        raise click.BadParameter(f"expected a positive size such as 5GB or 500MB, got {text!r}")
    return size


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="m3compile")
def main():
    """m3compile: rewrite a dense GQA transformer into MiniMax Sparse Attention (MSA).

    \b
    m3c convert SRC OUT    dense checkpoint -> MSA checkpoint (M3 tensor names)
    m3c eval MODEL --data  dense vs sparse loss and block recall per layer
    m3c distill MODEL ...  train the index branch with KL (resumable, torchrun-ready)
    m3c train MODEL ...    continued training with sparse attention: LM loss + coeff x KL
    m3c attention-map ...  dense attention of one KV group with the selected blocks outlined
    m3c generate MODEL ... text from a prompt, streamed (greedy, or sampled with --temperature)
    m3c inspect [SRC]      what conversion changes and what attention costs (headers only)
    m3c export-onnx M OUT  model.onnx with one m3compile::MSA node per MSA layer
    m3c bench kernels      Triton MSA kernels vs dense SDPA and FlexAttention (GPU)
    m3c bench model M      the whole model: time to first token and decode tokens/s, dense vs MSA (GPU)
    m3c passes             the graph passes and what each does
    """


@main.command()
@click.argument("src", required=False, type=click.Path(path_type=Path))
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--preset", default=None, help="Convert a built-in preset instead of SRC (default when SRC is omitted: m3-tiny).")
@click.option("--out", "out_opt", type=click.Path(path_type=Path), default=None, help="Output directory (same as OUT).")
@click.option("--block-size", default=128, show_default=True, help="Keys per block (also the KV-cache page).")
@click.option("--topk", default=16, show_default=True, help="Blocks each (KV group, query) attends to, own block included.")
@click.option("--dense-layers", default="0", show_default=True, help="Comma-separated layers that keep dense attention ('' for none).")
@click.option("--index-dim", type=int, default=None,
              help="Index head dim [default: the model's head dim]. Below the rotary width (even only) the index "
                   "head keeps the model's lowest RoPE frequencies (config: sparse_index_rope \"low\"): a cheaper "
                   "indexer, its time linear in this. Above the head dim of a fully rotated head every index pair "
                   "turns too (sparse_index_rope \"tile\") and the init fits each RoPE pair with more ranks of the "
                   "shared key: SmolLM2 (heads of 64) at 128 (M3's) inits at +6.7% against +9.0% and distils to "
                   "0.6 points of the oracle against 1.2 (BENCHMARKS.md).")
@click.option("--index-heads", type=int, default=None, help="Index query heads [default: the KV head count, which it must equal].")
@click.option("--init-blocks", default=0, show_default=True, help="Leading blocks every query keeps.")
@click.option("--local-blocks", default=1, show_default=True, help="Most recent blocks every query keeps (its own first).")
@click.option("--vision-window", default=4, show_default=True, help="Multimodal checkpoints: temporal steps per 3D window of ViT attention (1 = per frame).")
@click.option("--index-dtype", type=click.Choice(INDEX_DTYPES), default="auto", show_default=True,
              help="Index scoring: auto (the compute dtype) or fp8 (e4m3 query rows and keys, fp32 accumulation); kept in config.json.")
@click.option("--dtype", default=None, help="Output dtype of floating tensors (float32, bfloat16, float16) [default: each tensor's own].")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output safetensors shard (5GB = 5*10^9 bytes; GiB for 2^30).")
@click.option("--calib", type=click.Path(path_type=Path), default=None,
              help="Calibration data (.bin bytes, .npy ids, .txt/.jsonl via SRC's tokenizer): fits the index branch to "
                   "the hidden states it sees [default: the weight-only init].")
@click.option("--calib-tokens", default=8192, show_default=True, help="Calibration tokens read from the start of --calib.")
@click.option("--calib-seq-len", type=int, default=None,
              help="Tokens per calibration window [default: 2048, or the model's positions if fewer].")
@click.option("--calib-device", default="cpu", show_default=True, help="Where the calibration forward runs (cpu, cuda, cuda:N).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the conversion report as JSON.")
def convert(src, out, preset, out_opt, block_size, topk, dense_layers, index_dim, index_heads, init_blocks,
            local_blocks, vision_window, index_dtype, dtype, max_shard_size, calib, calib_tokens, calib_seq_len,
            calib_device, force, as_json):
    """Convert a dense GQA checkpoint SRC (Hugging Face layout) into an MSA checkpoint OUT.

    With no SRC, converts the m3-tiny preset into ./m3-tiny-msa. OUT gets config.json (with M3's
    sparse_attention_config), safetensors shards with M3 tensor names, graph/module.py (the rewritten graph)
    and conversion_report.json. Nothing is written unless the whole conversion succeeds.

    A checkpoint is converted streaming: the model is traced on the meta device and tensors are read from the
    memory-mapped source shards one layer at a time, so memory stays near one layer whatever the model's size.
    Each tensor keeps its dtype unless --dtype is given.

    The index branch starts from a closed-form fit to the dense attention logits. With --calib it is fitted in the
    coordinates of the data's hidden states (the second moment of each layer's attention input, collected by a
    layer-by-layer dense forward over --calib-tokens tokens): on SmolLM2-135M this lifts layer 3's block recall from
    0.53 to 0.80 (oracle 0.83). The report says which init was used (conversion_report.json: index_init).

    A minimax_m3_vl checkpoint keeps its vision tower and projector (written in M3's release names) and its ViT
    attention is rewritten from per-frame into 3D windows of --vision-window temporal steps
    (vision_config.vit_3d_window in OUT/config.json).
    """

    if src is not None and preset is not None:
        raise click.UsageError("give SRC or --preset, not both")
    given = [f"--{p.replace('_', '-')}" for p in ("calib_tokens", "calib_seq_len", "calib_device")
             if click.get_current_context().get_parameter_source(p) != click.core.ParameterSource.DEFAULT]
    if calib is None and given:
        raise click.UsageError(f"{given[0]} applies only with --calib")
    if out is not None and out_opt is not None and os.path.abspath(out) != os.path.abspath(out_opt):
        raise click.UsageError(f"OUT given twice, as {out} and as --out {out_opt}: give one")
    out = out or out_opt or (Path(f"{preset or 'm3-tiny'}-msa") if src is None else None)
    if out is None:
        raise click.UsageError("missing OUT directory")
    config = _run(MSAConfig, block_size=block_size, topk=topk, index_heads=index_heads, index_dim=index_dim,
                  init_blocks=init_blocks, local_blocks=local_blocks, dense_layers=_parse_layers(dense_layers),
                  vision_window=vision_window, index_dtype=index_dtype)
    ctx = click.get_current_context()
    if src is not None and all(ctx.get_parameter_source(p) == click.core.ParameterSource.DEFAULT
                               for p in ("block_size", "topk", "index_dim", "index_heads", "init_blocks",
                                         "local_blocks", "dense_layers", "vision_window", "index_dtype")):
        config = None  # the defaults (MSAConfig()); an MSA source keeps its own settings

    console = _console()
    columns = (TextColumn("[bold]convert"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task(f"{src or 'preset ' + (preset or 'm3-tiny')}", total=None)
        report = _run(convert_checkpoint, src, out, config, preset=preset, force=force, dtype=dtype,
                      max_shard_size=_parse_size(max_shard_size), calib=calib, calib_tokens=calib_tokens,
                      calib_seq_len=calib_seq_len, calib_device=calib_device,
                      progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return

    table = Table(title=f"{report.model} -> {out}")
    table.add_column("layer", justify="right")
    table.add_column("attention")
    table.add_column("change")
    for row in report.layers:
        table.add_row(str(row["layer"]), row["attention"].upper(), row["change"])
    console.print(table)
    for p in report.passes:
        console.print(f"pass {p.name}: replaced {p.replaced} attention ops, +{p.added} / -{p.removed} graph nodes")
    init = report.index_init
    console.print("index init: weight-only (no --calib)" if init.method == "weight-only" else
                  f"index init: calibrated on {init.tokens:,} tokens of {init.source} ({init.windows} x {init.seq_len})")
    console.print(f"parameters {report.params_before:,} -> {report.params_after:,} (+{report.index_params:,} index branch); "
                  f"{report.seconds:.1f} s")


def _kv_cache(help: str = "K/V cache dtype: auto (the model's), bf16, fp8 (e4m3 with one scale per token and head: "
                          "half of bf16's bytes) or int8 (the same bytes, integer rows after an exact rotation: "
                          "closer to bf16 than fp8 is; BENCHMARKS.md)."):
    """The --kv-cache option (m3compile.runtime.generate.KV_CACHE_DTYPES), with a command's own help text."""
    return click.option("--kv-cache", type=click.Choice(["auto", "bf16", "fp8", "int8"]), default="auto",
                        show_default=True, help=help)


_kv_cache_option = _kv_cache()


@main.command(name="eval")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--data", required=True, type=click.Path(path_type=Path),
              help="Token data: .bin bytes, .npy ids, .txt/.jsonl text (ruler: a UTF-8 text file, e.g. long code).")
@click.option("--seq-len", default=4096, show_default=True, help="Tokens per evaluated window (retrieval: the longest probe).")
@click.option("--max-windows", type=int, default=None, help="Evaluate at most this many windows [default: all].")
@click.option("--task", default="loss", show_default=True,
              help="loss: dense / sparse / oracle loss and recall; retrieval: copy a value planted DISTANCE tokens "
                   "back; ruler: the RULER-style suite (needles, variable tracking, common / frequent words).")
@click.option("--no-oracle", is_flag=True, help="Skip the oracle-selection loss and oracle recall (saves a third forward per window).")
@click.option("--batch", type=int, default=None,
              help="Loss: windows per forward (more fill a GPU; memory grows with it) [default: 1]. Ruler: prompts "
                   "per generation batch [default: all samples of a task and length].")
@click.option("--distances", default="1024,2048,4096,8192", show_default=True,
              help="Retrieval: comma-separated distances in tokens (those that do not fit --seq-len are skipped).")
@click.option("--probes", default=16, show_default=True, help="Retrieval: probes per distance.")
@click.option("--seed", default=0, show_default=True, help="Retrieval and ruler: seed of the probes / prompts.")
@click.option("--lengths", default=None,
              help="Ruler: prompt lengths in tokens, generation included (e.g. 4K,8K,16K,32K) [default: those of "
                   "4K,8K,16K,32K within the model's context].")
@click.option("--tasks", "ruler_tasks", default=None,
              help=f"Ruler: comma-separated tasks [default: all: {', '.join(RULER_TASKS)}].")
@click.option("--samples", default=25, show_default=True, help="Ruler: samples per task and length.")
@click.option("--selections", default="dense,index,oracle", show_default=True,
              help="Ruler: how MSA layers pick blocks: dense (every block), index (the index branch), oracle (most "
                   "true attention mass); recent (the newest blocks only) as a baseline.")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Ruler: write a heatmap PNG of the scores (task x length, one panel per selection).")
@click.option("--dtype", default="float32", show_default=True, help="Compute dtype.")
@click.option("--index-dtype", type=click.Choice(INDEX_DTYPES), default=None,
              help="Score the index branch in this dtype instead of the checkpoint's own (auto: the compute dtype; fp8: e4m3).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@_kv_cache(help="K/V cache dtype. Loss: auto scores the model's own forward (no cache); bf16, fp8 or int8 score "
                "each window through the paged prefill over a cache of that dtype (dense, MSA and oracle rows, no "
                "recall, one window at a time): `--kv-cache bf16` and `--kv-cache fp8` give the loss fp8 costs. "
                "Ruler: the cache of every prefill and decode (auto: the model's dtype).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_(model_dir, data, seq_len, max_windows, task, no_oracle, batch, distances, probes, seed, lengths, ruler_tasks,
          samples, selections, plot, dtype, index_dtype, device, kv_cache, as_json):
    """Dense loss, sparse (MSA) loss, oracle loss and block recall per layer of MODEL_DIR on --data; or, with
    --task retrieval, dense vs sparse accuracy at copying a value planted --distances tokens earlier; or, with
    --task ruler, the RULER-style suite: greedy answers to long prompts built from --data, scored per task, length
    and selection.

    Recall is the share of the dense attention mass of each query's KV group (mean over its heads) that falls
    in the blocks the index branch selected. The oracle loss runs every MSA layer with the blocks of most dense
    attention mass (same block size and top-k): the best any index branch could do. Loss is in nats per token;
    the tail is the share of tokens whose loss rises by more than 0.5 nats over dense.

    The ruler score of a task is the share of its expected answers found in the generated text (RULER's
    string_match_all), x 100, over --samples prompts; a task the dense model scores below 50 at the shortest
    length is reported and kept out of the averages.

    --kv-cache bf16|fp8|int8 measures what a K/V cache of that dtype costs: the loss rows come from prefilling each
    window into a paged cache of that dtype (the queries read the keys and values as the cache holds them), and
    the ruler suite generates over it. Run it twice, e.g. --kv-cache bf16 --json and --kv-cache fp8 --json, and
    compare the losses (the JSON's kv_cache names the dtype).
    """
    if task not in ("loss", "retrieval", "ruler"):
        _fail(f"unknown --task {task!r} (use loss, retrieval or ruler)")
    if task == "retrieval" and kv_cache != "auto":
        _fail(f"--kv-cache {kv_cache} applies to the loss and ruler tasks (retrieval scores the model's own forward)")
    if task == "ruler":
        _eval_ruler(model_dir, data, batch, seed, lengths, ruler_tasks, samples, selections, plot, dtype,
                    index_dtype, device, as_json, kv_cache)
        return
    batch = 1 if batch is None else batch
    if seq_len < 1:
        raise click.BadParameter("--seq-len must be >= 1")
    if batch < 1:
        raise click.BadParameter("--batch must be >= 1")
    _run(EvalConfig, seq_len=seq_len, max_windows=max_windows, batch=batch, probes=probes)
    if task == "retrieval":
        try:
            dists = tuple(int(d) for d in distances.split(","))
        except ValueError:
            _fail(f"--distances: expected comma-separated token counts, got {distances!r}")
        model = _run(load, model_dir, dtype=dtype, device=device)
        if index_dtype:
            _run(model.set_index_dtype, index_dtype)
        tokens = _run(load_tokens, data, model.args.vocab_size, model_dir)
        encode = _run(text_encoder, model_dir, model.args.vocab_size)
        with Progress(transient=True, disable=as_json) as bar:
            task_id = bar.add_task("retrieval", total=None)
            result = _run(run_retrieval, model, tokens, encode, seq_len=seq_len, distances=dists, probes=probes,
                          seed=seed, progress=lambda i, n: bar.update(task_id, completed=i, total=n))
        if as_json:
            click.echo(json.dumps(result.to_dict(), indent=2, allow_nan=False))
            return
        console = _console()
        console.print(f"{result.probes} probes per distance, seed {result.seed}, {result.seconds:.1f} s")
        table = Table(title="retrieval: exact greedy copy of a planted value")
        for name in ("distance", "tokens", "dense acc", "sparse acc", "dense logprob", "sparse logprob"):
            table.add_column(name, justify="right")
        opt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        for d in result.distances:
            table.add_row(str(d.distance), str(d.length), f"{d.dense_accuracy:.2f}", opt(d.sparse_accuracy, ".2f"),
                          f"{d.dense_logprob:.2f}", opt(d.sparse_logprob, ".2f"))
        console.print(table)
        if result.skipped:
            console.print(f"skipped (do not fit --seq-len {seq_len}): {', '.join(map(str, result.skipped))}")
        return

    model = _run(load, model_dir, dtype=dtype, device=device)
    if index_dtype:
        _run(model.set_index_dtype, index_dtype)
    tokens = _run(load_tokens, data, model.args.vocab_size, model_dir)
    with Progress(transient=True, disable=as_json) as bar:
        task_id = bar.add_task("evaluating", total=None)
        report = _run(evaluate, model, tokens, seq_len, max_windows,
                      progress=lambda i, n: bar.update(task_id, completed=i, total=n), oracle=not no_oracle, batch=batch,
                      kv_cache=kv_cache)
    if not report.finite:
        _fail(f"{model_dir}: the loss is not finite (dense {report.dense_loss}, sparse {report.sparse_loss}): the "
              f"model holds NaN/Inf weights or overflows {dtype}")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, allow_nan=False))
        return

    console = _console()
    console.print(f"{report.windows} windows x {report.seq_len} tokens = {report.tokens:,} tokens, {report.seconds:.1f} s"
                  + ("" if report.kv_cache is None else f"; losses through a {report.kv_cache} K/V cache"))
    console.print(f"dense loss  {report.dense_loss:.4f} nats/token")
    if report.sparse_loss is None:
        console.print("the model has no MSA layers (not converted): no sparse loss or recall")
        return
    console.print(f"sparse loss {report.sparse_loss:.4f} nats/token ({100 * report.loss_increase:+.2f}%), "
                  f"tail {100 * report.tail_share:.2f}% of tokens > +0.5 nats")
    if report.oracle_loss is not None:
        console.print(f"oracle loss {report.oracle_loss:.4f} nats/token ({100 * report.oracle_loss_increase:+.2f}%), "
                      f"tail {100 * report.oracle_tail_share:.2f}% (blocks chosen by dense attention)")
    if not report.recall:
        console.print("block recall: measured in the model's own forward (--kv-cache auto)")
        return
    table = Table(title="block recall per MSA layer")
    table.add_column("layer", justify="right")
    table.add_column("recall", justify="right")
    table.add_column("recall p10", justify="right")
    table.add_column("oracle (teacher's own top-k)", justify="right")
    opt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731 (no oracle pass with --no-oracle)
    for layer, r in report.recall.items():
        table.add_row(str(layer), f"{r:.3f}", f"{report.recall_p10[layer]:.3f}", opt(report.oracle_recall.get(layer)))
    table.add_row("mean", f"{report.mean_recall:.3f}", f"min {report.min_recall_p10:.3f}", opt(report.mean_oracle_recall))
    console.print(table)


def _eval_ruler(model_dir, data, batch, seed, lengths, tasks, samples, selections, plot, dtype, index_dtype, device,
                as_json, kv_cache):
    """m3c eval --task ruler: parse, run the suite, render its table (and JSON, heatmap)."""
    if samples < 1:
        _fail(f"--samples must be >= 1, got {samples}")
    if plot is not None and plot.suffix.lower() != ".png":
        _fail(f"--plot {plot}: the heatmap is written as PNG; name the file *.png")
    names = None if tasks is None else [t.strip() for t in tasks.split(",") if t.strip()]
    chosen = [s.strip() for s in selections.split(",") if s.strip()]
    text = _run(read_text, data)
    model = _run(load, model_dir, dtype=dtype, device=device)
    if index_dtype:
        model.set_index_dtype(index_dtype)
    codec = _run(PromptCodec, model_dir, model.args.vocab_size, model.source_config)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, disable=as_json) as bar:
        task_id = bar.add_task("ruler", total=None)
        report = _run(run_ruler, model, codec, text, tasks=names, samples=samples, seed=seed, selections=chosen,
                      lengths=None if lengths is None else list(_parse_lengths(lengths)), batch=batch,
                      data_name=str(data), kv_cache=kv_cache,
                      progress=lambda i, n, what: bar.update(task_id, completed=i, total=n, description=what))
    if plot is not None:
        _run(draw_heatmap, report, plot)
    if as_json:
        click.echo(json.dumps(report.to_dict() | ({"plot": str(plot)} if plot else {}), indent=2, allow_nan=False))
        return
    console = _console()
    fmt = lambda n: f"{n // 1024}K" if n % 1024 == 0 else str(n)  # noqa: E731
    console.print(f"{report.samples} samples per task and length, seed {report.seed}, "
                  f"{'chat template' if report.chat else 'plain prompts (no chat template)'}, "
                  f"{'the model dtype' if kv_cache == 'auto' else kv_cache} K/V cache, {report.seconds:.1f} s")
    table = Table(title=f"ruler scores ({' / '.join(report.selections)}; share of answers found, %)")
    table.add_column("task")
    for n in report.lengths:
        table.add_column(fmt(n), justify="right")
    cell = lambda values: " / ".join("-" if v is None else f"{v:.0f}" for v in values)  # noqa: E731
    for t in report.tasks:
        table.add_row(t + (" (excluded)" if t in report.excluded else ""),
                      *[cell(report.scores[t][s][n] for s in report.selections) for n in report.lengths])
    kept = len(report.tasks) - len(report.excluded)
    table.add_row(f"average ({kept} tasks)", *[cell(report.average(s, n) for s in report.selections)
                                               for n in report.lengths], style="bold")
    console.print(table)
    if report.excluded:
        console.print(f"excluded from the averages (dense below 50 at {fmt(report.lengths[0])}): "
                      f"{', '.join(report.excluded)}")
    if report.selections == ["dense"]:
        console.print("the model has no MSA layers (not converted): dense only")
    if plot is not None:
        console.print(f"wrote {plot}")


def _stacked(*decorators):
    """One decorator applying `decorators` as if stacked in this order above a command (the first comes first in
    --help)."""
    def apply(command):
        for decorator in reversed(decorators):  # the first listed is applied last
            command = decorator(command)
        return command
    return apply


def _training_options(*, data: str, out: str, lr: float, lr_help: str, dtype: str, after_lr=(), before_json=()):
    """The arguments and options distill and train share, in their help's order: each command gives its own help
    texts where they differ, and its own options to go after --lr and before --json."""
    options = [
        click.argument("model_dir", type=click.Path(path_type=Path)),
        click.option("--data", required=True, type=click.Path(path_type=Path), help=data),
        click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help=out),
        click.option("--steps", required=True, type=int, help="Total optimizer steps (with --resume: the new total)."),
        click.option("--seq-len", default=8192, show_default=True, help="Tokens per training sequence."),
        click.option("--batch", default=1, show_default=True,
                     help="Sequences per process per step (global batch = batch x processes)."),
        click.option("--lr", default=lr, show_default=True, help=lr_help),
        click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant",
                     show_default=True,
                     help="The learning rate after --lr-warmup: constant at --lr, or a cosine from --lr down to "
                          "--lr-min x --lr at step --lr-decay-steps."),
        click.option("--lr-warmup", "lr_warmup_steps", default=0, show_default=True,
                     help="First steps whose learning rate ramps linearly up to --lr."),
        click.option("--lr-decay-steps", type=int, default=None,
                     help="Step at which the cosine reaches its floor [default: --steps]. A run grown by --resume "
                          "keeps its curve only with the same value: set it to the final step count when a run "
                          "goes in stages."),
        click.option("--lr-min", default=0.1, show_default=True,
                     help="The cosine's floor, as a fraction of --lr."),
        *after_lr,
        click.option("--checkpoint-every", default=100, show_default=True,
                     help="Write a resumable checkpoint every this many steps."),
        click.option("--device", default="cpu", show_default=True,
                     help="cpu, cuda or cuda:N (under torchrun: each rank's local GPU)."),
        click.option("--dtype", default="float32", show_default=True, help=dtype),
        click.option("--seed", default=0, show_default=True, help="Seed of the data order."),
        click.option("--holdout-tokens", type=int, default=None,
                     help="Tokens held out from the end of --data (whole sequences of --seq-len): the model's loss on "
                          "them with sparse attention, against dense, is measured at the start and at every "
                          "checkpoint, and --out holds the best state seen, the start included (the resume state "
                          "stays the last step's) [default: 4 sequences, at most a tenth of the data; 0: none, --out "
                          "holds the last state]."),
        click.option("--resume", is_flag=True, help="Continue the run saved in --out, bit for bit."),
        click.option("--force", is_flag=True, help="Replace --out if it exists."),
        click.option("--autocast", type=click.Choice(["auto", "bf16", "none"]), default="auto", show_default=True,
                     help="Compute dtype on CUDA: auto/bf16 = bf16 autocast over fp32 weights, none = the weights' "
                          "dtype."),
        *before_json,
        click.option("--json", "as_json", is_flag=True, help="Print the run report as JSON."),
        click.option("--shard/--no-shard", default=None,
                     help="FSDP2: each process holds its shard of the parameters, gradients and AdamW state, streamed "
                          "from the checkpoint (no process holds the model) [default: under torchrun, when a replica "
                          "would not fit the device]."),
    ]
    return _stacked(*options)


@main.command()
@_training_options(
    data="Calibration tokens: .bin bytes, .npy ids, .txt/.jsonl text.",
    out="Output directory: the distilled checkpoint plus its resumable state.",
    lr=1e-3, lr_help="AdamW learning rate of the index parameters.", dtype="Compute and index-weight dtype.",
    after_lr=[click.option("--warmup-steps", default=0, show_default=True,
                           help="First steps with dense support and a dense main branch.")],
    before_json=[
        click.option("--cuda-graph", is_flag=True,
                     help="CUDA, one process: after two eager steps per mode, capture the whole step in a CUDA graph "
                          "and replay it (no host dispatch per kernel); refused where the step cannot be captured."),
        click.option("--block-loss", default=1.0, show_default=True,
                     help="Weight of the block-ranking loss added to the KL: the teacher's block mass against the "
                          "index branch's block-max scores (what the selection ranks by), on up to 1,024 queries per "
                          "sequence; 0 = the KL alone (about 30% faster; SmolLM2 at 14.7M tokens: +3.08% against "
                          "+2.25% with 1)."),
    ])
def distill(model_dir, data, out_dir, steps, seq_len, batch, lr, lr_schedule, lr_warmup_steps, lr_decay_steps, lr_min,
            warmup_steps, checkpoint_every, device, dtype, seed, holdout_tokens, resume, force, autocast, cuda_graph,
            block_loss, as_json, shard):
    """Distil the index branch of the converted model MODEL_DIR with KL (MSA_SPEC section 4).

    Only index parameters learn; the backbone stays bit-identical. The teacher is the dense attention averaged
    over each KV group's heads; the student is the index branch's softmax over the same support (all visible
    keys during --warmup-steps, the selected blocks after). Ctrl-C saves a resumable state in --out. Runs under
    torchrun for data parallelism (gloo on CPU, NCCL on CUDA): a replica per process (DistributedDataParallel), or
    with --shard each process's shard of the model (FSDP2). Sharded or not, --out holds whole tensors, and either
    kind of run resumes it.
    """

    config = _run(DistillConfig, steps=steps, seq_len=seq_len, batch=batch, lr=lr, warmup_steps=warmup_steps,
                  checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, autocast=autocast, cuda_graph=cuda_graph,
                  block_loss=block_loss, holdout_tokens=holdout_tokens, lr_schedule=lr_schedule,
                  lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps, lr_min=lr_min)
    block = lambda m: f"  block {m['block']:.4f}" if "block" in m else ""  # noqa: E731
    _training_cli("distil", run_distill, config, model_dir, data, out_dir, device, resume, force, shard, as_json,
                  lambda m: f"{m['mode']}  KL {m['kl']:.4f}{block(m)}  recall {m['recall']:.3f}",
                  lambda a, b: f"KL {a['kl']:.4f} -> {b['kl']:.4f}   recall {a['recall']:.3f} -> {b['recall']:.3f}"
                               + (f"   block loss {a['block']:.4f} -> {b['block']:.4f}" if "block" in a else ""))


def _training_cli(verb, fn, config, model_dir, data, out_dir, device, resume, force, shard, as_json, info, summary):
    """Progress bar, Ctrl-C (exit 130) and the closing summary shared by distill and train (rank 0 prints)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    columns = (TextColumn(f"[bold]{verb}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    with Progress(*columns, disable=as_json or not rank0) as bar:
        task = bar.add_task(verb, total=config.steps, info="loading")

        def show(step, total, m):
            bar.update(task, completed=step, info=f"{info(m)}  {m['tokens_per_s']:,.0f} tok/s")

        try:
            report = _run(fn, model_dir, data, out_dir, config, device=device, resume=resume, force=force,
                          shard=shard, progress=show)
        except DistillInterrupted as e:
            click.echo(str(e), err=True)
            sys.exit(EXIT_INTERRUPTED)
    if not rank0:
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    first, last = report.history[0], report.history[-1]
    console = _console()
    console.print(f"steps {report.start_step} -> {report.steps} on {report.world_size} process(es)"
                  f"{' (sharded)' if report.sharded else ''}, {report.tokens:,} tokens in {report.seconds:.1f} s "
                  f"({report.tokens_per_s:,.0f} tok/s); parameters per process "
                  f"{max(report.param_bytes_per_rank) / 2**20:,.1f} MiB")
    console.print(f"{summary(first, last)}   (step {first['step']} -> {last['step']})")
    console.print(holdout_summary(report.holdout))
    console.print(f"wrote {out_dir} (evaluate with: m3c eval {out_dir} --data FILE)")


@main.command()
@_training_options(
    data="Training tokens: .bin bytes, .npy ids, .txt/.jsonl text.",
    out="Output directory: the trained checkpoint plus its resumable state.",
    lr=1e-5, lr_help="AdamW learning rate of every parameter.", dtype="Compute and weight dtype.",
    after_lr=[click.option("--loss-coeff", default=1.0, show_default=True,
                           help="Weight of the index KL added to the LM loss.")])
def train(model_dir, data, out_dir, steps, seq_len, batch, lr, lr_schedule, lr_warmup_steps, lr_decay_steps, lr_min,
          loss_coeff, checkpoint_every, device, dtype, seed, holdout_tokens, resume, force, autocast, as_json, shard):
    """Continue training the converted model MODEL_DIR with sparse attention active (MSA_SPEC section 4).

    Every parameter learns from the next-token loss through the sparse attention; --loss-coeff x the index KL
    (teacher: the group-mean attention over the selected blocks) keeps the index branch aligned and reaches only
    the index branch (its input is detached; top-k passes no gradient). On CUDA the MSA ops run as the Triton
    kernels, forward and backward. Checkpoints, Ctrl-C, --resume, torchrun and --shard work as in m3c distill; the
    state is in OUT/train_state/.
    """

    config = _run(TrainConfig, steps=steps, seq_len=seq_len, batch=batch, lr=lr, loss_coeff=loss_coeff,
                  checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, autocast=autocast,
                  holdout_tokens=holdout_tokens, lr_schedule=lr_schedule, lr_warmup_steps=lr_warmup_steps,
                  lr_decay_steps=lr_decay_steps, lr_min=lr_min)
    _training_cli("train", run_train, config, model_dir, data, out_dir, device, resume, force, shard, as_json,
                  lambda m: f"LM {m['lm']:.4f}  KL {m['kl']:.4f}  recall {m['recall']:.3f}",
                  lambda a, b: f"LM {a['lm']:.4f} -> {b['lm']:.4f}   KL {a['kl']:.4f} -> {b['kl']:.4f}   "
                               f"recall {a['recall']:.3f} -> {b['recall']:.3f}")


@main.command(name="attention-map")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--data", required=True, type=click.Path(path_type=Path), help="Token data: .bin bytes, .npy ids, .txt/.jsonl text.")
@click.option("--layer", required=True, type=int, help="MSA layer to draw.")
@click.option("--group", default=0, show_default=True, help="KV group (index head) to draw.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="PNG file to write.")
@click.option("--seq-len", default=1024, show_default=True, help="Tokens in the window (the map is seq-len x seq-len).")
@click.option("--offset", default=0, show_default=True, help="First token of the window in --data.")
@click.option("--dtype", default="float32", show_default=True, help="Compute dtype.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Print the recall figures as JSON.")
def attention_map(model_dir, data, layer, group, out, seq_len, offset, dtype, device, as_json):
    """Draw the dense attention of one KV group of MODEL_DIR with its selected blocks outlined, plus per-layer recall.

    The left panel is the mean over the group's query heads of the dense causal softmax (log colour scale); the
    outlines enclose, for every query row, the key blocks the index branch selected. Mass outside the outlines is
    what MSA drops. The right panel is the block recall of every MSA layer on the same window.
    """

    _run(check_map_output, out, (model_dir, data))
    model = _run(load, model_dir, dtype=dtype, device=device)
    tokens = _run(load_tokens, data, model.args.vocab_size, model_dir)
    amap = _run(compute_attention_map, model, tokens, layer, group, seq_len, offset)
    _run(draw_attention_map, amap, out, (model_dir, data))
    if as_json:
        click.echo(json.dumps(amap.to_dict() | {"out": str(out)}, indent=2))
        return

    table = Table(title=f"block recall on tokens {offset}..{offset + seq_len}")
    table.add_column("MSA layer", justify="right")
    table.add_column("recall", justify="right")
    for i, r in amap.recall.items():
        table.add_row(str(i) + (" (drawn)" if i == layer else ""), f"{r:.3f}")
    console = _console()
    console.print(table)
    console.print(f"layer {layer}, group {group}: recall {amap.group_recall:.3f}; wrote {out}")


_prefill_chunk_option = click.option(
    "--prefill-chunk", default="auto", show_default=True,
    help="Tokens per prefill pass, e.g. 32K; auto: the whole prompt where its activations fit beside the caches, "
         "else the largest chunk that does.")


def _parse_chunk(text: str) -> int | None:
    """--prefill-chunk: None for auto, else one length (8K, 65536)."""
    if text.strip().lower() == "auto":
        return None
    try:
        lengths = _parse_lengths(text)
    except click.BadParameter:
        lengths = ()
    if len(lengths) != 1:
        raise click.BadParameter(f"--prefill-chunk takes one length >= 1 (such as 32K) or auto, got {text!r}")
    return lengths[0]


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="Read the prompt from this UTF-8 file.")
@click.option("--max-new-tokens", default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy; > 0 samples from softmax(logits / T).")
@click.option("--top-p", default=1.0, show_default=True, help="With --temperature: sample from the smallest set of tokens holding this probability.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling (reproducible output).")
@click.option("--dtype", default="auto", show_default=True,
              help="Compute dtype: float32, bfloat16 or float16; auto: the checkpoint's own on a GPU (config.json "
                   "torch_dtype, else its tensors'), float32 on a CPU (its bf16 matmuls are slow).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--eager", is_flag=True,
              help="Decode step by step (on a GPU the step is otherwise replayed as a CUDA graph).")
@click.option("--timings", is_flag=True,
              help="After the text, print one JSON object of seconds on stderr: import (from the command's start), "
                   "load, tokenize, cache, prefill, graph_capture, decode and decode_per_token, each without the "
                   "Triton compiles inside it, which are counted apart (compile, compiles, kernel_variants); CUDA "
                   "is synchronised between phases.")
@_kv_cache_option
@click.option("--index-cache", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="Index-key cache dtype of MSA layers (auto: the model's; fp8 when it scores in fp8).")
@_prefill_chunk_option
def generate(model_dir, prompt, prompt_file, max_new_tokens, temperature, top_p, seed, dtype, device, eager, timings,
             kv_cache, index_cache, prefill_chunk):
    """Continue a prompt with MODEL_DIR (dense or converted), streaming the text as it is generated.

    Text goes through the checkpoint's tokenizer.json, or as raw UTF-8 bytes for a byte-level (vocab 256) model
    without one. Generation uses m3compile.generate: paged KV caches, MSA layers select blocks as in the spec.
    Stops at --max-new-tokens or the end-of-sequence token of generation_config.json / config.json. A context
    whose caches do not fit in memory stops before anything is allocated, saying what would fit.

    On a GPU the Triton kernels run the tiles recorded from the H200's tuning (M3C_AUTOTUNE=0 unless set: a
    search would compile every candidate tile on a first run); compiled kernels are kept in Triton's cache
    (TRITON_CACHE_DIR, default ~/.triton/cache), so later runs load them instead of compiling.
    """
    chunk = _parse_chunk(prefill_chunk)
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_bytes().decode("utf-8")
        except OSError as e:
            _fail(f"{prompt_file}: cannot read the prompt ({e.strerror})")
        except UnicodeDecodeError as e:
            _fail(f"{prompt_file}: not UTF-8 text (invalid byte at offset {e.start})")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
        _fail(f"--prompt is not UTF-8 text (invalid byte at offset {len(prompt[:e.start].encode('utf-8', 'replace'))})")
    if max_new_tokens < 1:
        raise click.BadParameter("--max-new-tokens must be >= 1")
    os.environ.setdefault("M3C_AUTOTUNE", "0")  # read when the kernels are first imported, below
    clock = importlib.import_module("m3compile.runtime.timings").Timings(device) if timings else None
    if timings:
        importlib.import_module("m3compile.runtime.generate")  # what generation runs, so that "import" counts it
        clock.add("import", round(time.perf_counter() - _STARTED, 4))
        clock.mark("load")
    model = _run(load, model_dir, dtype=dtype, device=device)
    if timings:
        clock.mark("tokenize")
    codec = _run(TextCodec, model_dir, model.args.vocab_size)
    ids = codec.encode(prompt)
    if not ids:
        _fail("the prompt is empty (no tokens)")
    stream = codec.stream()
    if timings:
        clock.stop()

    def show(b, token):
        text = stream(token)
        if text:
            click.echo(text, nl=False)
            sys.stdout.flush()

    result = _run(run_generate, model, [ids], max_new_tokens,
                  eos_token_id=_run(eos_token_id, model.source_config, model_dir), temperature=temperature,
                  top_p=top_p, seed=seed, on_token=show, cuda_graph=False if eager else None, timings=timings,
                  kv_cache_dtype=kv_cache, index_cache_dtype=index_cache, prefill_chunk=chunk)
    click.echo()
    if timings:
        total = {"total": round(time.perf_counter() - _STARTED, 4)}
        click.echo(json.dumps(clock.extra | {k: round(v, 4) for k, v in clock.seconds.items()} | result.timings
                              | total), err=True)


@main.command()
@click.argument("src", required=False, type=click.Path(path_type=Path))
@click.option("--preset", default=None, help="Inspect a built-in preset instead of SRC (default when SRC is omitted: m3).")
@click.option("--context", default=131072, show_default=True, help="Context length for the cost figures.")
@click.option("--format", "fmt", type=click.Choice(["rich", "json", "dot", "svg", "mermaid"]), default="rich",
              show_default=True, help="rich tables, JSON, or one layer's graph as Graphviz DOT, SVG or Mermaid.")
@click.option("--layer", type=int, default=None, help="Layer drawn by dot/svg/mermaid [default: the first MSA layer].")
@click.option("--out", "out", type=click.Path(path_type=Path), default=None, help="Write to this file instead of stdout.")
@click.option("--block-size", default=128, show_default=True, help="For an unconverted model: MSA block size to apply.")
@click.option("--topk", default=16, show_default=True, help="For an unconverted model: top-k blocks to apply.")
@click.option("--dense-layers", default=None, help="For an unconverted model: layers kept dense [default: 0; m3: 0,1,2].")
def inspect(src, preset, context, fmt, layer, out, block_size, topk, dense_layers):
    """Show what conversion changes in SRC (a checkpoint directory) or a preset, without loading weights.

    Works from config.json and the safetensors headers on the meta device, so any size takes seconds: every
    tensor's name and shape is checked against config.json, the graph is traced before and after the passes,
    and the report gives per-layer attention (dense or MSA, with settings), what each pass changed, an op
    histogram before and after, and attention cost per token at --context (FLOPs against dense, KV-cache and
    index-K-cache bytes, index-branch parameters). An already converted model is shown as it is.
    """

    if src is not None and preset is not None:
        raise click.UsageError("give SRC or --preset, not both")
    if out is not None and fmt == "rich":
        raise click.UsageError("--out writes --format json, dot, svg or mermaid; the rich tables go to the terminal")
    if out is not None:
        _run(check_output_file, out, (src,))
    config = None
    if dense_layers is not None or block_size != 128 or topk != 16:
        default_dense = "0,1,2" if src is None and (preset or "m3") == "m3" else "0"
        config = _run(MSAConfig, block_size=block_size, topk=topk,
                      dense_layers=_parse_layers(dense_layers if dense_layers is not None else default_dense))
    report = _run(run_inspect, src, preset=preset, config=config, context=context)
    text = None
    if fmt == "json":
        text = json.dumps(report.to_dict(), indent=2) + "\n"
    elif fmt == "dot":
        text = _run(to_dot, report, layer)
    elif fmt == "mermaid":
        text = _run(to_mermaid, report, layer)
    elif fmt == "svg":
        dot = shutil.which("dot")
        if dot is None:
            _fail("--format svg needs Graphviz's dot program, which is not installed (apt-get install graphviz, "
                  "brew install graphviz or conda install graphviz); --format dot writes the source")
        text = subprocess.run([dot, "-Tsvg"], input=_run(to_dot, report, layer), capture_output=True, text=True,
                              check=True).stdout
    if text is not None:
        if out is None:
            click.echo(text, nl=False)
        else:
            _run(atomic_write_text, out, text, (src,))
        return
    _print_inspect(report)


def _print_inspect(report) -> None:
    console = _console()
    c = report.cost
    tree = Tree(f"[bold]{report.source}[/] ({report.model_type}), {report.params:,} parameters")
    checked = f"{report.tensors_checked} tensors checked against config.json" if report.tensors_checked else "preset (no tensors)"
    tree.add(f"{checked}; graph {report.nodes_before} -> {report.nodes_after} nodes; {report.seconds:.1f} s")
    passes = tree.add("passes")
    for p in report.passes:
        passes.add(f"{p['name']}: replaced {p['replaced']}, +{p['added']} / -{p['removed']} nodes")
    if not report.passes:
        passes.add("none run: the model already has MSA layers")
    if report.vision:
        v = report.vision
        steps = lambda w: "per frame (2D)" if w == 1 else f"3D windows of <= {w} temporal steps"  # noqa: E731
        tree.add(f"vision tower: {v['layers']} layers, {v['heads']} heads x {v['head_dim']}, {v['params']:,} "
                 f"parameters (with projector); {v['attention_ops']} attention ops: {steps(v['window_before'])} -> "
                 f"{steps(v['window_after'])}")
    console.print(tree)
    layers = Table(title="layers")
    for col in ("layer", "attention", "this run", "nodes", "depth", "index", "block", "top-k", "local"):
        layers.add_column(col, justify="right")
    for r in report.layers:
        msa = r["attention"] == "msa"
        index = f"{r['index_heads']}x{r['index_dim']}" if msa else ""
        if msa and r.get("index_rope", "m3") != "m3":  # a narrow index head's own RoPE rule
            index += f" {r['index_rope']}"
        layers.add_row(str(r["layer"]), r["attention"].upper(), "converted" if r["converted_now"] else "",
                       str(r["nodes"]), str(r.get("attention_depth", "")), index,
                       str(r["block_size"]) if msa else "",
                       str(r["topk"]) if msa else "", str(r["local_blocks"]) if msa else "")
    console.print(layers)
    ops = Table(title="ops before -> after (most frequent)")
    ops.add_column("op")
    ops.add_column("before", justify="right")
    ops.add_column("after", justify="right")
    names = sorted(set(report.ops_before) | set(report.ops_after),
                   key=lambda k: (-report.ops_after.get(k, 0), k))
    for name in names[:16]:
        ops.add_row(name, str(report.ops_before.get(name, 0)), str(report.ops_after.get(name, 0)))
    console.print(ops)
    cost = Table(title=f"attention cost per token at context {c['context']:,} ({c['msa_layers']} MSA of {c['layers']} layers)")
    cost.add_column("figure")
    cost.add_column("dense", justify="right")
    cost.add_column("MSA", justify="right")
    cost.add_column("dense / MSA", justify="right")
    cost.add_row("prefill FLOPs per token (mean over the context)", f"{c['dense_prefill_flops_per_token']:.3e}",
                 f"{c['msa_prefill_flops_per_token']:.3e}", f"{c['prefill_ratio']:.1f}x")
    if c["prefill_ratio_per_msa_layer"]:
        cost.add_row("  one MSA layer", "", "", f"{c['prefill_ratio_per_msa_layer']:.1f}x")
    cost.add_row("decode FLOPs for one token at the context", f"{c['dense_decode_flops']:.3e}",
                 f"{c['msa_decode_flops']:.3e}", f"{c['decode_ratio']:.1f}x")
    cost.add_row("KV cache bytes per token (bf16)", f"{c['kv_cache_bytes_per_token']:,}",
                 f"{c['kv_cache_bytes_per_token'] + c['index_k_cache_bytes_per_token']:,}", "")
    cost.add_row("index-branch parameters", "", f"{c['index_params']:,}", "")
    console.print(cost)


@main.command(name="export-onnx")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(ONNX_DTYPES), default="float32", show_default=True,
              help="The exported weights' and the graph's dtype (the MSA function computes in fp32).")
@click.option("--external-data", type=click.Choice(EXTERNAL_DATA), default="auto", show_default=True,
              help="Weights in OUT_DIR/model.onnx.data beside model.onnx: auto once they pass 1.75 GiB (one protobuf "
                   "file holds less than 2 GiB), always, or never (refused for a larger model).")
@click.option("--provider", type=click.Choice(ONNX_PROVIDERS), default="cpu", show_default=True,
              help="The onnxruntime execution provider the file is for; a dtype it cannot run is refused before the "
                   "work (cpu: float32, float16; cuda: float32, float16, bfloat16).")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
def export_onnx(model_dir, out_dir, dtype, external_data, provider, force):
    """Export the converted model in MODEL_DIR to OUT_DIR/model.onnx (input_ids -> logits).

    Batch and sequence length are dynamic. Each MSA layer is one node of the custom domain m3compile (op MSA,
    version 1) whose ONNX function body uses only standard operators, so onnxruntime runs the file as is and a
    runtime with a native MSA kernel can replace the node; a model without MSA layers uses no custom domain.
    The file passes onnx.checker's full check before it is written. Needs onnx, onnxscript and onnxruntime.

    Weights past protobuf's 2 GiB limit go to OUT_DIR/model.onnx.data (ONNX external data; keep the two files
    together). The destination needs room for the weights (checked first); nothing is written on failure.

    A multimodal (minimax_m3_vl) checkpoint also gets OUT_DIR/vision.onnx: pixel_values [N, C*2*14*14],
    positions [N, 3] and segment_ids [N] (models.vision.onnx_vision_inputs builds both from grid_thw) -> visual
    tokens [N/4, text hidden], the ViT with its 3D-window attention and the projector, dynamic patch count;
    model.onnx is then the language model (MoE layers exported as every expert with the routing weights).
    """
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        _fail("export-onnx needs onnx and onnxscript: pip install onnx onnxscript onnxruntime")

    columns = (TextColumn("[bold]export-onnx"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=_console(), transient=True) as bar:
        task = bar.add_task(str(model_dir), total=None)
        path = _run(run_export, model_dir, out_dir, force=force, dtype=dtype, external_data=external_data,
                    provider=provider,
                    progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what))
    written = sorted(p.name for p in path.parent.iterdir())
    _console().print(f"wrote {path.parent}: {', '.join(written)}")


def _parse_lengths(text: str) -> tuple[int, ...]:
    out = []
    for t in text.split(","):
        t = t.strip().upper()
        if not t:
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1], 1)
        try:
            out.append(int(float(t[:-1] if mult > 1 else t) * mult))
        except ValueError:
            raise click.BadParameter(f"expected lengths such as 8K,32K,1M, got {text!r}") from None
    if any(n < 1 for n in out):
        raise click.BadParameter(f"lengths must be >= 1, got {text!r}")
    return tuple(out)


# `m3c bench`'s mode flags before it had subcommands, and the subcommands that replaced them
_BENCH_MODES = {"--model": "model MODEL", "--distill": "distill MODEL", "--backward": "backward", "--vision": "vision"}
_BENCH_PREFIXES = tuple(f"{mode}-" for mode in _BENCH_MODES if mode != "--model")  # renamed without the prefix


class _BenchGroup(click.Group):
    """`m3c bench`'s group: the options it took before it had subcommands name the subcommand that now takes them."""

    def parse_args(self, ctx, args):
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            moved = self.moved(args)
            if moved:
                raise click.UsageError(moved, ctx)
        return super().parse_args(ctx, args)

    def moved(self, args: list[str]) -> str | None:
        """`'m3c bench --X' is now 'm3c bench SUB --Y'` for an option of the old single command, else None."""
        options = [a.split("=")[0] for a in args if a.startswith("--")]
        mode = next((m for m in _BENCH_MODES if m in options), None)  # as they chose the mode: --model first
        if mode:
            return f"'m3c bench {mode}' is now 'm3c bench {_BENCH_MODES[mode]}'"
        for option in options:
            for prefix in _BENCH_PREFIXES:  # --distill-seq-len -> distill MODEL --seq-len, ...
                if option.startswith(prefix):
                    new = f"{_BENCH_MODES[prefix[:-1]]} --{option[len(prefix):]}"
                    return f"'m3c bench {option}' is now 'm3c bench {new}'"
            for name, command in self.commands.items():  # kernels first: without a mode flag, they ran
                if any(option in p.opts for p in command.params if isinstance(p, click.Option)):
                    model = " MODEL" if any(isinstance(p, click.Argument) for p in command.params) else ""
                    return f"'m3c bench {option}' is now 'm3c bench {name}{model} {option}'"
        return None


# Options several bench subcommands take, declared once
_bench_device = click.option("--device", default="cuda", show_default=True,
                             help="cuda; cpu runs a smoke test of the command (timings meaningless).")
_bench_rep_ms = click.option("--rep-ms", default=500, show_default=True,
                             help="Milliseconds of timed repeats per figure (median reported).")
_bench_block = click.option("--block", default=128, show_default=True, help="Keys per block = cache page.")
_bench_topk = click.option("--topk", default=16, show_default=True, help="Blocks each (KV group, query) attends to.")
_bench_heads = click.option("--heads", default=64, show_default=True, help="Query heads (M3: 64).")
_bench_kv_heads = click.option("--kv-heads", default=4, show_default=True, help="KV heads = index heads (M3: 4).")
_bench_head_dim = click.option("--head-dim", default=128, show_default=True)
_bench_index_dim = click.option("--index-dim", default=128, show_default=True, help="Index head dim.")
_bench_decode_batch = click.option("--batch", default=8, show_default=True, help="Decode batch.")
_bench_dtype = click.option("--dtype", default="bfloat16", show_default=True, help="The model's weight dtype.")
_bench_model_argument = click.argument("model", metavar="MODEL_DIR|PRESET")


# --heads --kv-heads --head-dim --index-dim --block --topk: the attention shapes the kernel benches time
_bench_attention_shapes = _stacked(_bench_heads, _bench_kv_heads, _bench_head_dim, _bench_index_dim, _bench_block,
                                   _bench_topk)


def _bench_out(writes: str):
    return click.option("--out", "out_dir", default="bench_out", show_default=True, type=click.Path(path_type=Path),
                        help=f"Writes {writes} here.")


def _bench_dense_max(beyond: str):
    return click.option("--dense-max", default="128K", show_default=True,
                        help=f"Longest length timed densely; {beyond}.")


def _bench_lengths(name: str, default: str | None, bench_default: str | None = None):
    """--prefill-lengths / --decode-lengths; a default of None leaves the lengths to the bench (`bench_default`)."""
    unless = f"; default {bench_default}" if default is None else ""
    return click.option(f"--{name}-lengths", default=default, show_default=default is not None,
                        help=f"{name.capitalize()} context lengths ('' to skip {name}{unless}).")


@main.group(cls=_BenchGroup)
def bench():
    """Time MSA against dense attention: the kernels, the whole model, its training steps (figures: BENCHMARKS.md)."""


@bench.command(name="kernels", short_help="Triton MSA kernels vs dense SDPA and FlexAttention (GPU).")
@_bench_lengths("prefill", "8K,32K,128K,512K,1M")
@_bench_lengths("decode", "32K,128K,512K,1M")
@_bench_decode_batch
@_bench_attention_shapes
@click.option("--selection", "selections", multiple=True, default=("independent", "shared"), show_default=True,
              help="Selection regimes for prefill: independent (indexer on random inputs) and/or shared (one "
                   "selection per 128-query block).")
@_bench_dense_max("longer ones are extrapolated as T^2 and marked")
@click.option("--flex-max", default="128K", show_default=True, help="Longest prefill timed with FlexAttention.")
@click.option("--no-flex", is_flag=True, help="Skip FlexAttention.")
@click.option("--query-chunk-sweep", default="",
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
    cfg = _run(BenchConfig, heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim, block=block,
               topk=topk, prefill_lengths=_parse_lengths(prefill_lengths), decode_lengths=_parse_lengths(decode_lengths),
               batch=batch, dense_max=_parse_lengths(dense_max)[0], flex_max=_parse_lengths(flex_max)[0],
               selections=tuple(selections), flex=not no_flex, device=device, rep_ms=rep_ms,
               query_chunk_sweep=_parse_lengths(query_chunk_sweep),
               warmup_ms=max(25, rep_ms // 5))
    console = _console()
    result = _run(run_bench, cfg, prefill=bool(cfg.prefill_lengths), decode=bool(cfg.decode_lengths),
                  log=lambda m: console.print(f"[dim]{m}[/dim]"))
    write_outputs(result, out_dir)
    pre, dec = speedups(result)

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    if result.prefill:
        t = Table(title=f"prefill ({heads} q heads, {kv_heads} kv heads, d {head_dim}, block {block}, top-{topk})")
        for c in ("T", "selection", "dense ms", "flex ms", "attention ms", "indexer ms", "indexer fp8 ms",
                  "fp8 same blocks", "msa ms", "attention x", "ideal x", "share of ideal", "flex x", "msa x",
                  "msa fp8 x"):
            t.add_column(c, justify="right")
        for r, s in zip(result.prefill, pre):
            dense = ms(r["dense_ms"]) + ("*" if r["dense"] == "extrapolated" else "")
            t.add_row(f"{r['T']:,}", r["selection"], dense, ms(r["flex_ms"]), ms(r["attention_ms"]),
                      ms(r["indexer_ms"]), ms(r["indexer_fp8_ms"]), f"{100 * r['fp8_same_blocks']:.1f}%",
                      ms(r["msa_ms"]), f"{s['attention_x']:.1f}", f"{s['ideal']:.1f}",
                      f"{s['share_of_ideal']:.2f}", "-" if s["flex_x"] is None else f"{s['flex_x']:.1f}",
                      f"{s['msa_x']:.1f}", f"{s['msa_fp8_x']:.1f}")
        console.print(t)
        console.print("indexer fp8: keys quantised per key block, then fp8 x fp8 scores (query rows quantised in the "
                      "kernel); fp8 same blocks: share of the bf16 selection's blocks fp8 scoring also selects")
        if any(r["dense"] == "extrapolated" for r in result.prefill):
            console.print("* dense time extrapolated from the longest measured length as causal FLOPs (T^2)")
    if result.decode:
        t = Table(title=f"decode (batch {batch})")
        for c in ("T", "dense ms", "msa bf16 ms", "msa fp8 ms", "bf16 x", "fp8 x", "byte limit bf16", "byte limit fp8"):
            t.add_column(c, justify="right")
        for r, s in zip(result.decode, dec):
            t.add_row(f"{r['T']:,}", ms(r["dense_ms"]), f"{r['msa_bf16_ms']:.4f}", f"{r['msa_fp8_ms']:.4f}",
                      f"{s['bf16_x']:.2f}", f"{s['fp8_x']:.2f}", f"{s['ideal_bf16']:.2f}", f"{s['ideal_fp8']:.2f}")
        console.print(t)
    console.print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")


@bench.command(name="model", short_help="The whole model: time to first token and decode tokens/s, dense vs MSA (GPU).")
@_bench_model_argument
@_bench_lengths("prefill", None, "8K,32K,128K,512K")
@_bench_lengths("decode", None, "32K,128K")
@_bench_decode_batch
@_bench_block
@_bench_topk
@click.option("--index-dim", type=int, default=None,
              help="The conversion's index head dim (default: the model's head dim; below its rotary width the index "
                   "head keeps the lowest RoPE frequencies).")
@_bench_dense_max("longer ones are extrapolated per stage and marked")
@click.option("--msa-max", default="128K", show_default=True,
              help="Longest prefill timed on the MSA model; longer ones are extrapolated per stage and marked.")
@_bench_dtype
@click.option("--index-cache", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="Decode index-key cache dtype (auto: the model's).")
@click.option("--index-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="The converted model's index scoring (fp8: e4m3 scores in prefill and an fp8 decode index cache).")
@_kv_cache_option
@click.option("--prefill-chunk", default=None,
              help="Time to first token through m3c generate's prefill in chunks of this many tokens (e.g. 64K), into "
                   "a paged cache [default: the whole prompt through the lowered backbone where its activations fit, "
                   "else chunks of the largest size that fits].")
@click.option("--bandwidth", type=float, default=None,
              help="The GPU's memory bandwidth in TB/s for the decode byte floor [default: by its name, e.g. H200 "
                   "4.8].")
@click.option("--sparse-kernel", type=click.Choice(["gather", "tile"]), default="gather", show_default=True,
              help="The MSA prefill's sparse attention: gather-Q, or the query-tile union kernel "
                   "(kernels/sparse_attention/tile.py; opt-in: on the H200 it ties gather-Q at best, BENCHMARKS.md; "
                   "M3C_SPARSE_KERNEL=tile turns it on elsewhere).")
@click.option("--profile-max", default=None,
              help="Longest prefill also run once under the profiler for its per-stage breakdown; longer ones are "
                   "timed only (a long prefill's profiled run costs as much as a timed one) [default: every length].")
@click.option("--steps", default=5, show_default=True, help="Timed prefill runs per figure, at most.")
@click.option("--decode-steps", default=32, show_default=True, help="Decode steps per timing.")
@click.option("--figure-seconds", default=10.0, show_default=True,
              help="Fewer than --steps timed prefill runs where one run is long (at least one).")
@click.option("--separate-projections", is_flag=True,
              help="Run q/k/v (and index q/k), gate and up as separate matmuls [default: fused per layer, as m3c "
                   "generate runs them].")
@_bench_device
@_bench_out("<model>.json and model_speedup.png (every model bench in OUT)")
def bench_model(model, prefill_lengths, decode_lengths, batch, block, topk, index_dim, dense_max, msa_max, dtype,
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
    lengths = {}
    if prefill_lengths is not None:
        lengths["prefill_lengths"] = _parse_lengths(prefill_lengths)
    if decode_lengths is not None:
        lengths["decode_lengths"] = _parse_lengths(decode_lengths)
    if Path(model).is_dir():
        where, model_dir = _run(resolved, out_dir), _run(resolved, model)  # (a symlink loop: one line)
        if where == model_dir or model_dir in where.parents:
            _fail(f"--out {out_dir} is inside the model directory {model}: choose another output directory")
    cfg = _run(ModelBenchConfig, model=model, batch=batch, block=block, topk=topk,
               dense_max=_parse_lengths(dense_max)[0], msa_max=_parse_lengths(msa_max)[0], dtype=dtype,
               profile_max=None if profile_max is None else _parse_lengths(profile_max)[0],
               index_cache=index_cache, index_dtype=index_dtype, index_dim=index_dim, sparse_kernel=sparse_kernel,
               steps=steps, decode_steps=decode_steps, figure_seconds=figure_seconds, device=device,
               kv_cache=kv_cache, prefill_chunk=None if prefill_chunk is None else _parse_chunk(prefill_chunk),
               bandwidth_tbs=bandwidth, fuse_projections=not separate_projections, **lengths)
    console = _console()
    result = _run(run_model_bench, cfg, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    path, png = write_model_outputs(result, out_dir)
    shapes = result["shapes"]
    title = (f"{result['model']}: {result['layers']} layers ({result['msa_layers']} MSA), {shapes['heads']} q / "
             f"{shapes['kv_heads']} kv heads, block {result['msa']['block_size']}, top-{result['msa']['topk']}")

    def f(x, p=1):
        return "-" if x is None else f"{x:,.{p}f}"

    if result["prefill"]:
        t = Table(title=f"time to first token, ms: {title}")
        for c in ("T", "model", "ms", "attention", "indexer", "proj + MLP", "rest", "host", "runs"):
            t.add_column(c, justify="right")
        for r in result["prefill"]:
            b = r["breakdown"] or {}
            mark = {"timed": "", "extrapolated": "*"}.get(r["measured"], " (not run)")
            mark += f" (chunks of {r['chunk']:,})" if r.get("chunk") else ""
            t.add_row(f"{r['T']:,}", r["model"], f(r["ms"]) + mark, f(b.get("attention")), f(b.get("indexer")),
                      f(b.get("projections_mlp")), f(b.get("rest")), f(b.get("host")), str(r.get("runs", "-")))
        console.print(t)
        t = Table(title="prefill speedup (dense / MSA)")
        for c in ("T", "dense ms", "MSA ms", "speedup", "ceiling", "dense attention share"):
            t.add_column(c, justify="right")
        for s in result["prefill_summary"]:
            star = lambda k: "*" if s[k] == "extrapolated" else ""  # noqa: E731
            t.add_row(f"{s['T']:,}", f(s["dense_ms"]) + star("dense"), f(s["msa_ms"]) + star("msa"),
                      f"{s['speedup']:.2f}x", "-" if s["ceiling"] is None else f"{s['ceiling']:.2f}x",
                      "-" if s["dense_attention_share"] is None else f"{s['dense_attention_share']:.0%}")
        console.print(t)
        console.print("* extrapolated per stage from the longest timed length (attention and selection as T^2, "
                      "sparse attention as the keys top-k reaches, the rest as T); ceiling: dense / dense outside "
                      "attention")
        for r in result["prefill"]:
            if r.get("note") or r.get("fits") is False:
                console.print(f"prefill {r['T']:,} {r['model']}: " + (r.get("note") or "does not fit: "
                              f"{r['memory']['caches_gb'] + r['memory']['activations_gb']:.1f} GB of caches and "
                              f"activations"))
    if result["decode"]:
        t = Table(title="decode, ms per step (all sequences) and tokens/s")
        for c in ("T", "batch", "dense eager", "dense graph", "MSA eager", "MSA graph", "dense tok/s", "MSA tok/s",
                  "speedup", "graph = eager"):
            t.add_column(c, justify="right")
        for r in result["decode"]:
            d, m = r.get("dense") or {}, r.get("msa") or {}
            checks = [x.get("graph_check") for x in (d, m) if x.get("graph_check")]
            same = "-" if not checks else ("equal" if all(c["equal"] for c in checks) else
                                          "close" if all(c["close"] for c in checks) else "DIFFERENT")
            tok = lambda x: x.get("graph_tokens_per_s") or x.get("eager_tokens_per_s")  # noqa: E731
            speed = r.get("speedup") or r.get("speedup_eager")
            t.add_row(f"{r['T']:,}", f"{r['batch']}/{r['batch_requested']}" + ("*" if r.get("extrapolated") else ""),
                      f(d.get("eager_ms"), 2),
                      f(d.get("graph_ms"), 2), f(m.get("eager_ms"), 2), f(m.get("graph_ms"), 2), f(tok(d), 0),
                      f(tok(m), 0), "-" if speed is None else f"{speed:.2f}x", same)
        console.print(t)
        for r in result["decode"]:
            if r["note"]:
                console.print(("* " if r.get("extrapolated") else "") + f"decode {r['T']:,}: {r['note']}")
        tbs = result.get("bandwidth_tbs")
        t = Table(title="decode byte floor: what a step must read, and the share of its time at "
                        + (f"{tbs} TB/s" if tbs else "an unknown bandwidth (--bandwidth)"))
        for c in ("T", "batch", "model", "weights GB", "KV GB", "index GB", "total GB", "floor ms", "step ms",
                  "share"):
            t.add_column(c, justify="right")
        for r in result["decode"]:
            for name in ("dense", "msa"):
                x = r.get(name) or {}
                if not x.get("floor"):
                    continue
                fb = x["floor"]["bytes"]
                gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
                share = x["floor"]["share"]
                t.add_row(f"{r['T']:,}", str(r["batch"]) + ("*" if r.get("extrapolated") else ""), name,
                          gb(fb["weights"]), gb(fb["kv"]), gb(fb["index"]), gb(fb["total"]), f(x["floor"]["ms"], 3),
                          f(x.get("graph_ms") or x.get("eager_ms"), 3), "-" if share is None else f"{share:.0%}")
        console.print(t)
        why = next((x.get("graph_unavailable") for r in result["decode"] for x in (r.get("dense"), r.get("msa"))
                    if x and x.get("graph_unavailable")), None)
        if why:
            console.print(f"no CUDA graph: {why}")
    check = result["conversion_check"]
    if check is not None:
        console.print(f"conversion kept device {check['device']} and dtype {check['dtype']}: "
                      + ("yes" if check["ok"] else f"NO ({', '.join(check['mismatched'][:4])})"))
    console.print(f"wrote {path} and {png}")


@bench.command(name="distill", short_help="Distillation and training steps vs the frozen dense forward.")
@_bench_model_argument
@click.option("--seq-len", default="8K", show_default=True, help="Tokens per sequence.")
@click.option("--batch", default=2, show_default=True, help="Sequences per step.")
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
@_bench_block
@_bench_topk
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
    seq_len = _parse_lengths(seq_len)[0]
    cfg = _run(DistillBenchConfig, model=model, seq_len=seq_len, batch=batch, block=block, topk=topk, dtype=dtype,
               autocast=autocast, train=not no_train, shard=shard, steps=steps, device=device, layers=layers,
               count_only=count_only, cuda_graph=cuda_graph, block_loss=block_loss, eval=not no_eval)
    console = _console()
    result = _run(run_distill_bench, cfg, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "distill.json").write_text(json.dumps(result, indent=2) + "\n")
    counted = [r for r in result["rows"] if "ops" in r]
    if counted:
        t = Table(title=f"host dispatches per step ({result['layers']} layers"
                        + (f", extrapolated to {counted[0]['ops']['full_depth_layers']}" if layers else "") + ")")
        for c in ("stage", "total", "aten", "triton", "per MSA layer", "casts", "syncs", "at full depth"):
            t.add_column(c, justify="right")
        for r in counted:
            o = r["ops"]
            t.add_row(r["stage"], f"{o['total']:,}", f"{o['aten']:,}", f"{o['triton']:,}", str(o["per_msa_layer"]),
                      str(o["casts"]), str(o["syncs"]), f"{o['ops_at_full_depth']:,}")
        console.print(t)
        for r in counted:
            stages = sorted(r["ops"]["stages"].items(), key=lambda kv: -sum(kv[1].values()))[:6]
            console.print(f"{r['stage']}, largest stages: " + ", ".join(f"{k} {sum(v.values())}" for k, v in stages))
    if count_only:
        console.print(f"wrote {out_dir / 'distill.json'}")
        return
    t = Table(title=f"{result['model']}: {result['layers']} layers, {batch} x {seq_len:,} tokens, block "
                    f"{result['msa']['block_size']}, top-{result['msa']['topk']}, autocast {result['autocast']}"
                    f"{', sharded over ' + str(result['world_size']) + ' process(es)' if shard else ''}")
    for c in ("stage", "ms", "tokens/s", "ratio", "vs", "peak GB", "select", "attention", "KL fwd", "KL bwd",
              "block loss", "rest fwd", "rest bwd", "optimizer", "host wait"):
        t.add_column(c, justify="right")
    for r in result["rows"]:
        b = r.get("breakdown") or {}
        cell = (lambda k: f"{b[k]:.1f}" if k in b else "-")
        attention = f"{b['attention_fwd_ms'] + b['attention_bwd_ms']:.1f}" if b else "-"
        block = f"{b['block_loss_fwd_ms'] + b['block_loss_bwd_ms']:.1f}" if b else "-"
        t.add_row(r["stage"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.2f}", r["ratio_to"],
                  f"{r['peak_gb']:.1f}", cell("select_ms"), attention, cell("kl_fwd_ms"), cell("kl_bwd_ms"),
                  block, cell("rest_of_forward_ms"), cell("rest_of_backward_ms"), cell("optimizer_ms"),
                  cell("host_wait_ms"))
    console.print(t)
    for r in result["rows"]:
        if "check" in r:
            c = r["check"]
            console.print(f"{r['stage']}: {'same' if c['ok'] else 'DIFFERENT'} as the eager step (relative: KL "
                          f"{c['kl_rel']:.1e}, recall {c['recall_rel']:.1e}, gradients {c['grad_rel_max']:.1e}, "
                          f"weights {c['param_rel_max']:.1e})")
    for name, error in result.get("cuda_graph_errors", {}).items():
        console.print(f"{name}, CUDA graph: {error}")
    for r in result["rows"]:
        if "passes" in r:
            console.print(f"{r['stage']}: its {r['passes']} forwards {r['forwards_ms']:.1f} ms / its {r['ms']:.1f} ms "
                          f"= {r['ratio']:.2f} (1: at the forwards' speed; {r['dtype']}, no autocast, "
                          f"{'lowered' if r['kernels'] else 'reference'} ops)")
    console.print(f"stage columns: GPU ms of one profiled step; wrote {out_dir / 'distill.json'}")


@bench.command(name="backward", short_help="Sparse attention and fused KL, forward + backward, vs dense SDPA.")
@_bench_attention_shapes
@click.option("--lengths", default="32K,128K", show_default=True, help="Context lengths.")
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
    cfg = _run(BenchConfig, heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim, block=block,
               topk=topk, dense_max=_parse_lengths(dense_max)[0], device=device, rep_ms=rep_ms,
               warmup_ms=max(25, rep_ms // 5))
    console = _console()
    result = _run(run_backward_bench, cfg, _parse_lengths(lengths), log=lambda m: console.print(f"[dim]{m}[/dim]"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".backward.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out_dir / "backward.json")

    t = Table(title=f"forward + backward ({heads} q heads, {kv_heads} kv heads, d {head_dim}, block {block}, top-{topk})")
    for c in ("T", "dense fwd+bwd ms", "sparse fwd+bwd ms", "sparse fwd ms", "speedup", "ideal", "share of ideal",
              "KL fwd+bwd ms", "KL, LSE given ms", "KL peak MB"):
        t.add_column(c, justify="right")
    for r in result["rows"]:
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        t.add_row(f"{r['T']:,}", f(r["dense_fwd_bwd_ms"], 3), f(r["sparse_fwd_bwd_ms"], 3), f(r["sparse_fwd_ms"], 3),
                  f(r["speedup"]),
                  f(r["ideal"]), f(r["share_of_ideal"]), f(r["kl_fwd_bwd_ms"], 3), f(r["kl_given_lse_fwd_bwd_ms"], 3),
                  "-" if r["kl_peak_bytes"] is None else f"{r['kl_peak_bytes'] / 2**20:.1f}")
    console.print(t)
    console.print(f"wrote {out_dir / 'backward.json'}")


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
    try:
        steps = tuple(int(t) for t in steps.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated step counts, got {steps!r}") from None
    cfg = _run(VisionBenchConfig, steps=steps, grid=grid, window=window, heads=heads, head_dim=head_dim, device=device,
               rep_ms=rep_ms, warmup_ms=max(25, rep_ms // 5))
    console = _console()
    result = _run(run_vision_bench, cfg, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".vision.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out_dir / "vision.json")

    t = Table(title=f"3D windowed attention: {result['windows']} windows of <= {window} steps, {result['tokens']:,} "
                    f"tokens, {heads} heads x {head_dim}")
    for c in ("method", "ms", "TFLOP/s", "rel. error vs loop"):
        t.add_column(c, justify="right")
    for name, label in (("loop", "Python loop of SDPA per window"), ("padded", "SDPA over windows padded to the longest"),
                        ("fused", f"fused varlen kernel (one launch, BLOCK_M {result['best_block_m']})")):
        ms = result["ms"][name]
        t.add_row(label, f"{ms:.3f}", f"{result['flops'] / ms / 1e9:.0f}",
                  "-" if name == "loop" else f"{result['rel_err_vs_loop'][name]:.1e}")
    console.print(t)
    console.print(f"fused vs the faster baseline: {result['speedup_vs_best_baseline']:.2f}x; wrote {out_dir / 'vision.json'}")


@main.command()
def passes():
    """List the graph passes with their stage and what each does, and the pipelines that run them."""
    pipelines_ = importlib.import_module("m3compile.pipelines")  # imports (so registers) every pass
    table = Table(title="m3compile passes")
    table.add_column("name")
    table.add_column("stage")
    table.add_column("what it does")
    for name, cls in importlib.import_module("m3compile.graph.pass_manager").PASSES.items():
        table.add_row(name, cls.stage, cls.summary())
    console = _console()
    console.print(table)
    pipelines = Table(title="pipelines (m3compile.pipelines)")
    pipelines.add_column("pipeline")
    pipelines.add_column("passes, in order")
    for name, make in pipelines_.PIPELINES.items():
        passes_ = make(lowered=True) if name == "distill" else make()  # distill: as on CUDA
        pipelines.add_row(name, " -> ".join(p.name for p in passes_))
    console.print(pipelines)


if __name__ == "__main__":
    main()
