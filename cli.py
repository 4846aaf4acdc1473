"""m3c: the command line. A thin click + rich layer over the library: parse, call, render.

This module holds the group (its one-line errors, exit statuses and signal handling) and the pipeline's commands;
the groups of several subcommands each have a module of m3compile/commands/ (eval, bench; distill and train share
theirs). Every command imports the library modules it runs inside its function, when it runs: the command line is
the one place of the package that imports so (tests/test_architecture.py, LAZY_BY_DESIGN), and its module tops
import only torch-free names and no rich (the commands that draw tables and progress bars import it), so `m3c --help`,
a command's help and a usage error answer without loading torch, and each command loads only the layers it runs
(generate: no rich, tracing, passes, ONNX, evaluation, training or plotting; tests/test_architecture.py runs it).
"""
from __future__ import annotations

import time

_STARTED = time.perf_counter()  # `m3c generate --timings`: its "import" phase runs from here

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import click

from m3compile.config import INDEX_CACHE_DTYPES, INDEX_DTYPES, SIZE_LIMITS
from m3compile.errors import DistillInterrupted, M3CompileError
from m3compile.export.onnx_providers import DTYPES as ONNX_DTYPES, EXTERNAL_DATA, PROVIDERS as ONNX_PROVIDERS
from m3compile.outputs import COMMITTED
from m3compile.commands.bench import bench
from m3compile.commands.common import (
    EXIT_INTERRUPTED, Group, InputPath, OutputPath, Size, fail, kv_cache_option, libraries_to_log, load_model, log_path,
    parse_layers, stdout_console, terminal,
)
from m3compile.commands.compile import compile_after_convert, compile_model, kernel_cache_for
from m3compile.commands.eval import eval_
from m3compile.commands.train import distill, train


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


class _Group(Group):
    """m3c's group: usage errors and the library's errors (M3CompileError) as one line `error: <message>` (exit 2),
    Ctrl-C and SIGTERM as one line and exit 130."""

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
        argv = list(sys.argv[1:] if args is None else args)
        try:
            with libraries_to_log("--verbose" in argv[:argv.index("--")] if "--" in argv else "--verbose" in argv,
                                  argv):
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:  # bare `m3c`: the help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code)
        except click.Abort:
            fail(_interrupted(), EXIT_INTERRUPTED)
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        """Bad input the library refuses ends as one line, exit 2; a Ctrl-C or SIGTERM as one line, exit 130, rather
        than as click's Abort, which first prints an empty line. An interrupted distillation says where it saved."""
        try:
            return super().invoke(ctx)
        except M3CompileError as e:
            if _SIGNALLED:  # a library (safetensors) turned the KeyboardInterrupt into an error of its own
                fail(_interrupted(), EXIT_INTERRUPTED)
            fail(str(e))
        except DistillInterrupted as e:
            click.echo(str(e), file=terminal())
            sys.exit(EXIT_INTERRUPTED)
        except KeyboardInterrupt:
            fail(_interrupted(), EXIT_INTERRUPTED)


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
@click.option("--verbose", is_flag=True,
              help=f"Show the libraries' warnings (torch, ONNX) on the terminal; else they go to the log "
                   f"($M3C_LOG, default {log_path().as_posix().replace(Path.home().as_posix(), '~')}).")
def main(verbose):
    """m3compile: rewrite a dense GQA transformer into MiniMax Sparse Attention (MSA).

    \b
    m3c convert SRC OUT    dense checkpoint -> MSA checkpoint (M3 tensor names)
    m3c eval loss M ...    dense vs sparse loss and block recall per layer (eval retrieval, eval ruler: long context)
    m3c distill MODEL ...  train the index branch with KL (resumable, torchrun-ready)
    m3c train MODEL ...    continued training with sparse attention: LM loss + coeff x KL
    m3c attention-map ...  dense attention of one KV group with the selected blocks outlined
    m3c generate MODEL ... text from a prompt, streamed, or from a batch of prompts (greedy, or sampled)
    m3c compile MODEL      its Triton kernels compiled ahead into MODEL/kernel-cache (GPU; convert runs it there)
    m3c inspect [SRC]      what conversion changes and what attention costs (headers only)
    m3c export-onnx M OUT  model.onnx with one m3compile::MSA node per MSA layer
    m3c bench kernels      Triton MSA kernels vs dense SDPA and FlexAttention (GPU)
    m3c bench model M      the whole model: time to first token and decode tokens/s, dense vs MSA (GPU)
    m3c passes             the graph passes and what each does
    """


@main.command()
@click.argument("src", required=False, type=InputPath())
@click.argument("out", required=False, type=OutputPath("dir"))
@click.option("--preset", default=None, help="Convert a built-in preset instead of SRC (default when SRC is omitted: m3-tiny).")
@click.option("--out", "out_opt", type=OutputPath("dir"), default=None, help="Output directory (same as OUT).")
@click.option("--block-size", default=128, show_default=True, help="Keys per block (also the KV-cache page).")
@click.option("--topk", default=16, show_default=True, help="Blocks each (KV group, query) attends to, own block included (with --top-p: at most).")
@click.option("--top-p", default=1.0, show_default=True,
              help="Adaptive budget (docs/msa.md 2.8): each (KV group, query) keeps, beside its forced blocks, the "
                   "fewest best blocks whose index-branch probability reaches this, between --min-blocks and --topk "
                   "blocks; 1 = the fixed top-k. A setting of the selection, so it can be changed on an MSA source "
                   "(the weights stay).")
@click.option("--min-blocks", default=0, show_default=True, help="The adaptive budget's floor: blocks kept at least (forced ones included).")
@click.option("--answer-budget", default=None, metavar="kN|pP:FLOOR:CEILING",
              help="Stored in config.json: the budget of each prompt's last --answer-tokens tokens (where a question "
                   "sits) and of the answer when m3c generate, m3compile.generate or the remote code's generate() "
                   "run the model, e.g. k256: the question reads more blocks than the prompt (BENCHMARKS.md, the "
                   "frontier) [default: none, the model's budget throughout]. vLLM serves the model at its own "
                   "budget (and warns).")
@click.option("--answer-tokens", default=128, show_default=True, type=click.IntRange(min=0),
              help="With --answer-budget: the prompt's last tokens read at that budget.")
@click.option("--decode-budget", default=None, metavar="kN|pP:FLOOR:CEILING|off",
              help="Stored in config.json: the answer's budget where it differs from --answer-budget (off: the "
                   "model's budget, whose decode step costs what the model's does) [default: the answer budget].")
@click.option("--dense-layers", default="0", show_default=True, help="Comma-separated layers that keep dense attention ('' for none).")
@click.option("--dense-costliest", type=int, default=None,
              help="Instead of --dense-layers: keep dense the N layers whose loss rises most when each alone is "
                   "sparse under the oracle at this budget, measured on --calib (loads the whole model on "
                   "--calib-device; the figures go into conversion_report.json: layer_costs).")
@click.option("--index-dim", type=int, default=None,
              help="Index head dim [default: the model's head dim]. Below the rotary width (even only) the index "
                   "head keeps the model's lowest RoPE frequencies (config: sparse_index_rope \"low\"): a cheaper "
                   "indexer, its time linear in this. Above the head dim of a fully rotated head every index pair "
                   "turns too (sparse_index_rope \"tile\") and the init fits each RoPE pair with more ranks of the "
                   "shared key (what it buys: see BENCHMARKS.md).")
@click.option("--index-heads", type=int, default=None, help="Index query heads [default: the KV head count, which it must equal].")
@click.option("--init-blocks", default=0, show_default=True, help="Leading blocks every query keeps.")
@click.option("--local-blocks", default=1, show_default=True, help="Most recent blocks every query keeps (its own first).")
@click.option("--vision-window", default=4, show_default=True, help="Multimodal checkpoints: temporal steps per 3D window of ViT attention (1 = per frame).")
@click.option("--index-dtype", type=click.Choice(INDEX_DTYPES), default="auto", show_default=True,
              help="Index scoring: auto (the compute dtype) or fp8 (e4m3 query rows and keys, fp32 accumulation); kept in config.json.")
@click.option("--dtype", default=None, help="Output dtype of floating tensors (float32, bfloat16, float16) [default: each tensor's own].")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output safetensors shard (5GB = 5*10^9 bytes; GiB for 2^30).")
@click.option("--calib", type=InputPath(), default=None,
              help="Calibration data (.bin bytes, .npy ids, .txt/.jsonl via SRC's tokenizer): fits the index branch to "
                   "the hidden states it sees [default: the weight-only init].")
@click.option("--calib-tokens", default=8192, show_default=True, type=Size(),
              help="Calibration tokens read from the start of --calib.")
@click.option("--calib-seq-len", type=Size(), default=None,
              help="Tokens per calibration window [default: 2048, or the model's positions if fewer].")
@click.option("--calib-device", default="cpu", show_default=True, help="Where the calibration forward runs (cpu, cuda, cuda:N).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="Compile OUT's Triton kernels ahead into OUT/kernel-cache (m3c compile OUT) [default: on when a "
                   "CUDA GPU is present].")
@click.option("--json", "as_json", is_flag=True, help="Print the conversion report as JSON.")
def convert(src, out, preset, out_opt, block_size, topk, top_p, min_blocks, answer_budget, answer_tokens,
            decode_budget, dense_layers, dense_costliest, index_dim, index_heads, init_blocks, local_blocks,
            vision_window, index_dtype, dtype, max_shard_size, calib, calib_tokens, calib_seq_len, calib_device, force,
            compile_, as_json):
    """Convert a dense GQA checkpoint SRC (Hugging Face layout) into an MSA checkpoint OUT.

    With no SRC, converts the m3-tiny preset into ./m3-tiny-msa. OUT gets config.json (with M3's
    sparse_attention_config), safetensors shards with M3 tensor names, graph/module.py (the rewritten graph)
    and conversion_report.json. Nothing is written unless the whole conversion succeeds.

    A checkpoint is converted streaming: the model is traced on the meta device and tensors are read from the
    memory-mapped source shards one layer at a time, so memory stays near one layer whatever the model's size.
    Each tensor keeps its dtype unless --dtype is given.

    The index branch starts from a closed-form fit to the dense attention logits. With --calib it is fitted in the
    coordinates of the data's hidden states (the second moment of each layer's attention input, collected by a
    layer-by-layer dense forward over --calib-tokens tokens): a start closer to the oracle's selection, for
    distillation or for a model used as converted (see BENCHMARKS.md). The report says which init was used
    (conversion_report.json: index_init).

    A minimax_m3_vl checkpoint keeps its vision tower and projector (written in M3's release names) and its ViT
    attention is rewritten from per-frame into 3D windows of --vision-window temporal steps
    (vision_config.vit_3d_window in OUT/config.json).
    """
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )
    from rich.table import Table

    from m3compile.config import MSAConfig
    from m3compile.conversion.checkpoint import convert_checkpoint
    from m3compile.evaluation.loss import dense_layers_by_cost
    from m3compile.outputs import check_output_dir

    ctx = click.get_current_context()
    if src is not None and preset is not None:
        raise click.UsageError("give SRC or --preset, not both")
    given = [f"--{p.replace('_', '-')}" for p in ("calib_tokens", "calib_seq_len", "calib_device")
             if ctx.get_parameter_source(p) != click.core.ParameterSource.DEFAULT]
    if calib is None and given:
        raise click.UsageError(f"{given[0]} applies only with --calib")
    if dense_costliest is not None and calib is None:
        raise click.UsageError("--dense-costliest measures the layers on calibration data: give --calib")
    if dense_costliest is not None and ctx.get_parameter_source("dense_layers") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --dense-layers or --dense-costliest, not both")
    if out is not None and out_opt is not None and os.path.abspath(out) != os.path.abspath(out_opt):
        raise click.UsageError(f"OUT given twice, as {out} and as --out {out_opt}: give one")
    out = out or out_opt or (Path(f"{preset or 'm3-tiny'}-msa") if src is None else None)
    if out is None:
        raise click.UsageError("missing OUT directory")
    config = MSAConfig(block_size=block_size, topk=topk, index_heads=index_heads, index_dim=index_dim,
                       init_blocks=init_blocks, local_blocks=local_blocks, dense_layers=parse_layers(dense_layers),
                       vision_window=vision_window, index_dtype=index_dtype, top_p=top_p, min_blocks=min_blocks,
                       answer_budget=answer_budget, answer_tokens=answer_tokens, decode_budget=decode_budget)
    if src is not None and all(ctx.get_parameter_source(p) == click.core.ParameterSource.DEFAULT
                               for p in ("block_size", "topk", "index_dim", "index_heads", "init_blocks",
                                         "local_blocks", "dense_layers", "vision_window", "index_dtype", "top_p",
                                         "min_blocks", "answer_budget", "answer_tokens", "decode_budget",
                                         "dense_costliest")):
        config = None  # the defaults (MSAConfig()); an MSA source keeps its own settings
    costs = None
    if dense_costliest is not None:
        check_output_dir(out, (src, calib), force)  # before the measurement: a bad OUT is found at once
        with Progress(transient=True, disable=as_json) as bar:
            bar.add_task("measuring each layer alone sparse (oracle)", total=None)
            costs = dense_layers_by_cost(src, config, calib, dense_costliest, preset=preset, calib_tokens=calib_tokens,
                                         seq_len=calib_seq_len, device=calib_device)
        config = dataclasses.replace(config, dense_layers=tuple(sorted(costs.costliest(dense_costliest))))

    console = stdout_console()
    columns = (TextColumn("[bold]convert"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task(f"{src or 'preset ' + (preset or 'm3-tiny')}", total=None)
        report = convert_checkpoint(
            src, out, config, preset=preset, force=force, dtype=dtype, max_shard_size=_parse_size(max_shard_size),
            calib=calib, calib_tokens=calib_tokens, calib_seq_len=calib_seq_len, calib_device=calib_device,
            layer_costs=None if costs is None else costs.to_dict(),
            progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what))
    kernels = compile_after_convert(out, compile_, as_json)
    if as_json:
        click.echo(json.dumps(report.to_dict() | ({"kernel_cache": kernels} if kernels else {}), indent=2))
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
    c = report.config
    if c.answer_budget or c.decode_budget:
        console.print("stored for generation: " + (f"the prompt's last {c.answer_tokens} tokens at {c.answer_budget}, "
                                                   if c.answer_budget else "") +
                      f"the answer at {c.decode_budget or c.answer_budget} (config.json; --answer-budget off for a run "
                      f"without)")
    if costs is not None:
        rise = lambda i: f"layer {i} {100 * costs.layers[i]['loss_increase']['oracle']:+.2f}%"  # noqa: E731
        kept = costs.costliest(dense_costliest)
        console.print(f"dense by measured cost (loss alone sparse under the oracle, {costs.tokens:,} tokens): "
                      f"{', '.join(map(rise, kept)) or 'none'}; the next: "
                      f"{', '.join(map(rise, costs.costliest()[len(kept):len(kept) + 3])) or 'none'}")
    if kernels:
        console.print(f"kernels compiled ahead: {kernels['kernels']} kernels ({kernels['variants']} variants) in "
                      f"{kernels['seconds']:.1f} s, {kernels['workers']} processes -> {kernels['path']}")


@main.command(name="attention-map")
@click.argument("model_dir", type=InputPath())
@click.option("--data", required=True, type=InputPath(), help="Token data: .bin bytes, .npy ids, .txt/.jsonl text.")
@click.option("--layer", required=True, type=int, help="MSA layer to draw.")
@click.option("--group", default=0, show_default=True, help="KV group (index head) to draw.")
@click.option("--out", "out", required=True, type=OutputPath("file", ".png"), help="PNG file to write.")
@click.option("--seq-len", default=1024, show_default=True, type=Size(),
              help="Tokens in the window (the map is seq-len x seq-len).")
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
    from rich.table import Table

    from m3compile.data import load_tokens
    from m3compile.tools.attention_map import attention_map, check_map_output, draw_attention_map

    check_map_output(out, (model_dir, data))
    model = load_model(model_dir, dtype, device)
    tokens = load_tokens(data, model.args.vocab_size, model_dir)
    amap = attention_map(model, tokens, layer, group, seq_len, offset)
    draw_attention_map(amap, out, (model_dir, data))
    if as_json:
        click.echo(json.dumps(amap.to_dict() | {"out": str(out)}, indent=2))
        return

    table = Table(title=f"block recall on tokens {offset}..{offset + seq_len}")
    table.add_column("MSA layer", justify="right")
    table.add_column("recall", justify="right")
    for i, r in amap.recall.items():
        table.add_row(str(i) + (" (drawn)" if i == layer else ""), f"{r:.3f}")
    console = stdout_console()
    console.print(table)
    console.print(f"layer {layer}, group {group}: recall {amap.group_recall:.3f}; wrote {out}")


_prefill_chunk_option = click.option(
    "--prefill-chunk", default="auto", show_default=True, type=Size(auto=True),
    help="Tokens per prefill pass, e.g. 32K; auto: the whole prompt where its activations fit beside the caches, "
         "else the largest chunk that does.")


_JSON_KINDS = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number",
               type(None): "null"}


def _read_text(path: Path, what: str) -> str:
    """A file of `what` (the prompt, the prompts) as UTF-8 text; a file that cannot be read or is not UTF-8 ends the
    command with one line naming it."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        fail(f"{path}: cannot read {what} ({e.strerror})")
    except UnicodeDecodeError as e:
        fail(f"{path}: not UTF-8 text (invalid byte at offset {e.start})")


def _jsonl_prompts(path: Path) -> list[tuple[str, str]]:
    """(source "FILE:LINE", text) for each line of a JSON-lines file of prompts: every line one JSON string (the
    newline that ends the last line is not a line of its own). A blank line, a line that is not JSON or whose value is
    not a string, and a file with no line are one-line errors naming the file and the line."""
    text = _read_text(path, "the prompts")
    lines = text.split("\n")  # not splitlines(): U+2028 and the like may stand unescaped inside a JSON string
    if lines[-1] == "":
        lines.pop()
    if not lines:
        fail(f"{path}: no prompts (the file is empty; expected one JSON string per line)")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            fail(f"{path} line {n}: a blank line (expected one JSON string per line, a prompt)")
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{path} line {n}: not valid JSON ({e.msg}: column {e.colno}); expected one JSON string per line")
        if not isinstance(value, str):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            fail(f"{path} line {n}: expected a JSON string (a prompt), got {_JSON_KINDS[type(value)]} ({shown})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can escape a lone surrogate ("\\ud800"), which is no text
            fail(f"{path} line {n}: the string holds a lone surrogate (\\u{ord(value[e.start]):04x}), which is not "
                 f"text")
        out.append((f"{path}:{n}", value))
    return out


def _prompts(prompt: str | None, prompt_files: tuple[Path, ...], prompts_jsonl: tuple[Path, ...]) \
        -> list[tuple[str, str]]:
    """(source, text) of every prompt of `m3c generate`, from its one source: --prompt, --prompt-file (one or
    more) or --prompts-jsonl; read and checked whole before the model loads."""
    given = [name for name, value in (("--prompt", prompt is not None), ("--prompt-file", prompt_files),
                                      ("--prompts-jsonl", prompts_jsonl)) if value]
    if len(given) != 1:
        raise click.UsageError("give exactly one source of prompts: --prompt, --prompt-file (one or more) or "
                               "--prompts-jsonl" + (f", not {' and '.join(given)}" if given else ""))
    if len(prompts_jsonl) > 1:
        raise click.UsageError("give --prompts-jsonl once (one file of prompts, one per line)")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
            fail(f"--prompt is not UTF-8 text (invalid byte at offset "
                 f"{len(prompt[:e.start].encode('utf-8', 'replace'))})")
        return [("--prompt", prompt)]
    if prompt_files:
        prompts = [(str(path), _read_text(path, "the prompt")) for path in prompt_files]
    else:
        prompts = _jsonl_prompts(prompts_jsonl[0])
    limit, n = SIZE_LIMITS["batch"], len(prompts)
    if n > limit:
        fail(f"{f'{prompts_jsonl[0]}: {n:,} prompts' if prompts_jsonl else f'{n:,} --prompt-file prompts'}, past the "
             f"ceiling of {limit:,} sequences in one batch")
    return prompts


@main.command()
@click.argument("model_dir", type=InputPath())
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", "prompt_files", type=InputPath(), multiple=True,
              help="Read a prompt from this UTF-8 file; repeat for a batch (one prompt per file).")
@click.option("--prompts-jsonl", type=InputPath(), multiple=True,
              help="A batch of prompts: a JSON-lines file, each line one JSON string (a prompt); no blank lines.")
@click.option("--max-new-tokens", default=64, show_default=True, type=Size(), help="Tokens to generate at most, per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy; > 0 samples from softmax(logits / T).")
@click.option("--top-p", default=1.0, show_default=True, help="With --temperature: sample from the smallest set of tokens holding this probability.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling (reproducible output).")
@click.option("--dtype", default="auto", show_default=True,
              help="Compute dtype: float32, bfloat16 or float16; auto: the checkpoint's own on a GPU (config.json "
                   "torch_dtype, else its tensors'), float32 on a CPU (its bf16 matmuls are slow).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--eager", is_flag=True,
              help="Decode step by step (on a GPU the step is otherwise replayed as a CUDA graph).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON line per prompt, after generation: prompt_index (from 1), source, prompt_tokens, "
                   "tokens (the new token ids), text and finish (eos or length).")
@click.option("--timings", is_flag=True,
              help="After the text, print one JSON object on stderr: seconds of import (from the command's start), "
                   "load, tokenize, setup (checks and the memory plan), cache, prefill, graph_capture, decode and "
                   "decode_per_token, release (the caches and CUDA graph freed) and output, each without the "
                   "Triton compiles inside it, which are counted apart (compile, compiles, kernel_variants, and "
                   "compiled_anew: the kernels compiled rather than loaded from Triton's cache); timed (the phases "
                   "and compiles) and untimed (total less timed); CUDA is synchronised between phases; and batch, "
                   "new_tokens and new_tokens_per_s (every prompt's new tokens over the decode seconds, to compare a "
                   "batch with one prompt).")
@kv_cache_option()
@click.option("--index-cache", type=click.Choice(INDEX_CACHE_DTYPES), default="auto", show_default=True,
              help="Index-key cache dtype of MSA layers (auto: the model's; fp8 when it scores in fp8).")
@_prefill_chunk_option
@click.option("--answer-budget", default=None, metavar="kN|pP:FLOOR:CEILING|off",
              help="The MSA layers' selection budget for each prompt's last --answer-tokens tokens (where a question "
                   "sits) and for every new token: kN the fixed top-N blocks, pP:FLOOR:CEILING top-p P of "
                   "FLOOR-CEILING blocks (e.g. k256), off the model's budget throughout [default: the one the model "
                   "was converted with (m3c convert --answer-budget), else off].")
@click.option("--answer-tokens", default=None, type=click.IntRange(min=0),
              help="The prompt's last tokens selected at the answer budget [default: the model's, else 128].")
@click.option("--decode-budget", default=None, metavar="kN|pP:FLOOR:CEILING|off",
              help="The MSA layers' selection budget for every new token, where it differs from --answer-budget "
                   "(e.g. off: the question read at k256, the answer written at the model's budget, whose decode "
                   "step costs what the model's does) [default: the model's, else the answer budget].")
def generate(model_dir, prompt, prompt_files, prompts_jsonl, max_new_tokens, temperature, top_p, seed, dtype, device,
             eager, as_json, timings, kv_cache, index_cache, prefill_chunk, answer_budget, answer_tokens,
             decode_budget):
    """Continue one prompt or a batch of prompts with MODEL_DIR (dense or converted).

    Give the prompts one way: --prompt TEXT, --prompt-file FILE (repeat it for several), or --prompts-jsonl FILE
    (one JSON string per line). One prompt is streamed: its text is printed as it is generated. Several are
    prefilled one by one and decoded together, one batched step per new token, and printed when all are done, in
    order, each after a line with its number and its source (the file, or FILE:LINE of the JSON-lines file):

    \b
    --- prompt 1 (prompts.jsonl:1) ---
    <its continuation>
    --- prompt 2 (prompts.jsonl:2) ---
    ...

    --json prints instead one JSON line per prompt (prompt_index, source, prompt_tokens, tokens, text, finish): the
    form for scripts, as a continuation may hold a line like a header. Greedy continuations are the same in a batch
    as alone; a sampled batch (--temperature) draws for all its prompts at once, so --seed repeats a batch, not each
    prompt alone. Each prompt stops at --max-new-tokens or at the end-of-sequence token of generation_config.json /
    config.json.

    Text goes through the checkpoint's tokenizer.json, or as raw UTF-8 bytes for a byte-level (vocab 256) model
    without one. Generation uses m3compile.generate: paged KV caches, MSA layers select blocks as in the spec. The
    caches hold every prompt at the longest one's length plus --max-new-tokens; what does not fit in memory stops
    before anything is allocated, saying what would (how many of these prompts at once, how many positions).

    On a GPU the Triton kernels run the tiles recorded from the H200's tuning (M3C_AUTOTUNE=0 unless set: a
    search would compile every candidate tile on a first run); compiled kernels are kept in Triton's cache
    (TRITON_CACHE_DIR, default ~/.triton/cache), so later runs load them instead of compiling. Kernels compiled
    ahead for this model and GPU (m3c compile: MODEL_DIR/kernel-cache, which m3c convert writes on a GPU) are loaded
    from there on a first run too; a kernel cache built for another model or GPU is rebuilt first, and a
    kernel-cache m3compile did not write (no manifest.json) is left as it is, unused.
    """
    prompts = _prompts(prompt, prompt_files, prompts_jsonl)
    os.environ.setdefault("M3C_AUTOTUNE", "0")  # read when the kernels are first imported, next
    from m3compile.io.tokenizer import TextCodec, eos_token_id
    from m3compile.runtime.generate import generate
    from m3compile.runtime.timings import Timings

    clock = Timings(device) if timings else None
    if timings:
        clock.add("import", round(time.perf_counter() - _STARTED, 4))
    kernels = kernel_cache_for(model_dir, device, dtype, kv_cache)
    if timings:
        for name, value in kernels.to_dict().items():
            clock.add(name, value)
        clock.mark("load")
    model = load_model(model_dir, dtype, device)
    if timings:
        clock.mark("tokenize")
    codec = TextCodec(model_dir, model.args.vocab_size)
    ids = [codec.encode(text) for _, text in prompts]
    for i, ((source, _), p) in enumerate(zip(prompts, ids), 1):
        if not p:
            fail("the prompt is empty (no tokens)" if len(prompts) == 1 else
                 f"prompt {i} ({source}) is empty (no tokens)")
    streamed = len(prompts) == 1 and not as_json
    stream = codec.stream()
    if timings:
        clock.stop()

    def show(b, token):
        text = stream(token)
        if text:
            click.echo(text, nl=False)
            sys.stdout.flush()

    eos = eos_token_id(model.source_config, model_dir)
    result = generate(model, ids, max_new_tokens, eos_token_id=eos, temperature=temperature, top_p=top_p, seed=seed,
                      on_token=show if streamed else None, cuda_graph=False if eager else None, timings=timings,
                      kv_cache_dtype=kv_cache, index_cache_dtype=index_cache, prefill_chunk=prefill_chunk,
                      answer_budget=answer_budget, answer_tokens=answer_tokens, decode_budget=decode_budget)
    if timings:
        clock.mark("output")
    if streamed:
        click.echo()
    else:
        for i, ((source, _), p, new) in enumerate(zip(prompts, ids, result.tokens), 1):
            decode = codec.stream()
            text = "".join(decode(t) for t in new)  # the text streaming shows
            if as_json:
                finish = "eos" if eos is not None and new and new[-1] == eos else "length"
                click.echo(json.dumps({"prompt_index": i, "source": source, "prompt_tokens": len(p), "tokens": new,
                                       "text": text, "finish": finish}))
            else:
                click.echo(f"--- prompt {i} ({source}) ---")
                click.echo(text)
    if timings:
        clock.stop()
        total = time.perf_counter() - _STARTED
        phases = {k: round(v, 4) for k, v in clock.seconds.items()} | result.timings
        timed = clock.timed + result.timings["timed"] + sum(clock.extra.get(k, 0) for k in ("import", "kernel_cache_s"))
        click.echo(json.dumps(clock.extra | phases | {"timed": round(timed, 4), "untimed": round(total - timed, 4),
                                                      "total": round(total, 4)}), file=terminal())


@main.command()
@click.argument("src", required=False, type=InputPath())
@click.option("--preset", default=None, help="Inspect a built-in preset instead of SRC (default when SRC is omitted: m3).")
@click.option("--context", default=None, type=Size(),
              help="Context length for the cost figures [default: 131072, or the model's positions if fewer].")
@click.option("--format", "fmt", type=click.Choice(["rich", "json", "dot", "svg", "mermaid"]), default="rich",
              show_default=True, help="rich tables, JSON, or one layer's graph as Graphviz DOT, SVG or Mermaid.")
@click.option("--layer", type=int, default=None, help="Layer drawn by dot/svg/mermaid [default: the first MSA layer].")
@click.option("--out", "out", type=OutputPath("file"), default=None, help="Write to this file instead of stdout.")
@click.option("--block-size", default=128, show_default=True, help="For an unconverted model: MSA block size to apply.")
@click.option("--topk", default=16, show_default=True, help="For an unconverted model: top-k blocks to apply.")
@click.option("--dense-layers", default=None, help="For an unconverted model: layers kept dense [default: 0; m3: 0,1,2].")
@click.option("--blocks", type=float, default=None,
              help="Blocks each (KV group, query) keeps, for the cost: an adaptive budget's measured mean (m3c eval "
                   "loss: mean_blocks) [default: the top-k, the budget's ceiling].")
def inspect(src, preset, context, fmt, layer, out, block_size, topk, dense_layers, blocks):
    """Show what conversion changes in SRC (a checkpoint directory) or a preset, without loading weights.

    Works from config.json and the safetensors headers on the meta device, so any size takes seconds: every
    tensor's name and shape is checked against config.json, the graph is traced before and after the passes,
    and the report gives per-layer attention (dense or MSA, with settings), what each pass changed, an op
    histogram before and after, and attention cost per token at --context (FLOPs against dense, KV-cache and
    index-K-cache bytes, index-branch parameters). An already converted model is shown as it is.
    """
    from m3compile.config import MSAConfig
    from m3compile.outputs import atomic_write_text, check_output_file
    from m3compile.tools.inspect import inspect, render, to_dot, to_mermaid, to_svg

    if src is not None and preset is not None:
        raise click.UsageError("give SRC or --preset, not both")
    if out is not None and fmt == "rich":
        raise click.UsageError("--out writes --format json, dot, svg or mermaid; the rich tables go to the terminal")
    if out is not None:
        check_output_file(out, (src,))
    config = None
    if dense_layers is not None or block_size != 128 or topk != 16:
        default_dense = "0,1,2" if src is None and (preset or "m3") == "m3" else "0"
        config = MSAConfig(block_size=block_size, topk=topk,
                           dense_layers=parse_layers(dense_layers if dense_layers is not None else default_dense))
    report = inspect(src, preset=preset, config=config, context=context, blocks=blocks)
    if fmt == "rich":
        console = stdout_console()
        for part in render(report):
            console.print(part)
        return
    text = {"json": lambda r, _: json.dumps(r.to_dict(), indent=2) + "\n", "dot": to_dot, "mermaid": to_mermaid,
            "svg": to_svg}[fmt](report, layer)
    if out is None:
        click.echo(text, nl=False)
    else:
        atomic_write_text(out, text, (src,))


@main.command(name="export-onnx")
@click.argument("model_dir", type=InputPath())
@click.argument("out_dir", type=OutputPath("dir"))
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
        fail("export-onnx needs onnx and onnxscript: pip install onnx onnxscript onnxruntime")
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    from m3compile.export.onnx import export_onnx

    columns = (TextColumn("[bold]export-onnx"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=stdout_console(), transient=True) as bar:
        task = bar.add_task(str(model_dir), total=None)
        path = export_onnx(model_dir, out_dir, force=force, dtype=dtype, external_data=external_data, provider=provider,
                           progress=lambda done, total, what: bar.update(task, completed=done, total=total,
                                                                         description=what))
    written = sorted(p.name for p in path.parent.iterdir())
    stdout_console().print(f"wrote {path.parent}: {', '.join(written)}")


@main.command()
def passes():
    """List the graph passes with their stage and what each does, and the pipelines that run them."""
    from rich.table import Table

    from m3compile.graph.pass_manager import PASSES
    from m3compile.pipelines import PIPELINES  # imports (so registers) every pass

    table = Table(title="m3compile passes")
    for column in ("name", "stage", "what it does"):
        table.add_column(column)
    for name, cls in PASSES.items():
        table.add_row(name, cls.stage, cls.summary())
    console = stdout_console()
    console.print(table)
    pipelines = Table(title="pipelines (m3compile.pipelines)")
    pipelines.add_column("pipeline")
    pipelines.add_column("passes, in order")
    for name, make in PIPELINES.items():
        passes_ = make()
        pipelines.add_row(name, " -> ".join(p.name for p in passes_))
    console.print(pipelines)


main.add_command(eval_)  # the commands of m3compile/commands/
main.add_command(distill)
main.add_command(train)
main.add_command(bench)
main.add_command(compile_model)

if __name__ == "__main__":
    main()
