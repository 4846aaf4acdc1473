"""`m3c eval`: dense / sparse / oracle loss and block recall, retrieval at a distance, the RULER-style suite; one
subcommand each, with only its own options."""
from __future__ import annotations

import json

import click

from m3compile.config import INDEX_DTYPES, RULER_TASKS, SELECTIONS
from m3compile.commands.common import (
    Group, InputPath, OutputPath, Size, budget_options, fail, kv_cache_option, load_model, split_names, stacked,
    stdout_console,
)

__all__ = ["eval_"]


def _task(args: list[str]) -> str | None:
    """The value of a --task among `args` (`--task T` or `--task=T`), or None."""
    for i, a in enumerate(args):
        if a.startswith("--task="):
            return a[len("--task="):]
        if a == "--task" and i + 1 < len(args):
            return args[i + 1]
    return None


class _EvalGroup(Group):
    """`m3c eval`: a first argument that is no subcommand (`m3c eval MODEL [--task T] ...`, the form of the single
    command it replaced) is a usage error that names the subcommand to use."""

    def parse_args(self, ctx, args):
        task = _task(args)
        if args and args[0] not in self.commands and (task is not None or not args[0].startswith("-")):
            if task is None:
                message = "'m3c eval MODEL' is now 'm3c eval loss MODEL ...'"
            elif task in self.commands:
                message = f"'m3c eval --task {task}' is now 'm3c eval {task} MODEL ...'"
            else:
                message = f"unknown --task {task!r}: 'm3c eval' has the subcommands {', '.join(self.commands)}"
            raise click.UsageError(message, ctx)
        return super().parse_args(ctx, args)


@click.group(name="eval", cls=_EvalGroup)
def eval_():
    """Measure a model on data: loss and block recall, retrieval at a distance, the RULER-style suite."""


def _eval_options(data: str, *own):
    """MODEL_DIR and --data, the subcommand's `own` options, then the options every eval subcommand takes."""
    return stacked(
        click.argument("model_dir", type=InputPath()),
        click.option("--data", required=True, type=InputPath(), help=data),
        *own,
        click.option("--dtype", default="float32", show_default=True, help="Compute dtype."),
        click.option("--index-dtype", type=click.Choice(INDEX_DTYPES), default=None,
                     help="Score the index branch in this dtype instead of the checkpoint's own (auto: the compute "
                          "dtype; fp8: e4m3)."),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
        budget_options)


_TOKENS = "Token data: .bin bytes, .npy ids, .txt/.jsonl text."


@eval_.command(name="loss", short_help="Dense, sparse and oracle loss and block recall per layer.")
@_eval_options(
    _TOKENS,
    click.option("--seq-len", default=4096, show_default=True, type=Size(), help="Tokens per evaluated window."),
    click.option("--max-windows", type=int, default=None, help="Evaluate at most this many windows [default: all]."),
    click.option("--batch", default=1, show_default=True, type=Size("batch"),
                 help="Windows per forward (more fill a GPU; memory grows with it)."),
    click.option("--no-oracle", is_flag=True,
                 help="Skip the oracle-selection loss and oracle recall (saves a third forward per window)."),
    kv_cache_option(help="K/V cache dtype: auto scores the model's own forward (no cache); bf16, fp8 or int8 score "
                         "each window through the paged prefill over a cache of that dtype (dense, MSA and oracle "
                         "rows, no recall, one window at a time): `--kv-cache bf16` and `--kv-cache fp8` give the loss "
                         "fp8 costs."))
def eval_loss(model_dir, data, seq_len, max_windows, batch, no_oracle, kv_cache, dtype, index_dtype, device, as_json,
              budget):
    """Dense loss, sparse (MSA) loss, oracle loss and block recall per layer of MODEL_DIR on --data.

    Recall is the share of the dense attention mass of each query's KV group (mean over its heads) that falls
    in the blocks the index branch selected. The oracle loss runs every MSA layer with the blocks of most dense
    attention mass (same block size and top-k): the best any index branch could do. Loss is in nats per token;
    the tail is the share of tokens whose loss rises by more than 0.5 nats over dense.

    --kv-cache bf16|fp8|int8 measures what a K/V cache of that dtype costs: the loss rows come from prefilling each
    window into a paged cache of that dtype (the queries read the keys and values as the cache holds them). Run it
    twice, e.g. --kv-cache bf16 --json and --kv-cache fp8 --json, and compare the losses (the JSON's kv_cache names
    the dtype).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from m3compile.config import EvalConfig
    from m3compile.data import load_tokens
    from m3compile.evaluation.loss import evaluate

    EvalConfig(seq_len=seq_len, max_windows=max_windows, batch=batch, kv_cache=kv_cache)
    model = load_model(model_dir, dtype, device, index_dtype, budget)
    tokens = load_tokens(data, model.args.vocab_size, model_dir)
    with Progress(TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(), TextColumn("windows, {task.fields[left]}"),
                  TimeRemainingColumn(), console=stdout_console(), transient=True, disable=as_json) as bar:
        task_id = bar.add_task("evaluating", total=None, left="")
        report = evaluate(model, tokens, seq_len, max_windows, oracle=not no_oracle, batch=batch, kv_cache=kv_cache,
                          progress=lambda i, n: bar.update(task_id, completed=i, total=n, left=f"{n - i} left"))
    if not report.finite:
        fail(f"{model_dir}: the loss is not finite (dense {report.dense_loss}, sparse {report.sparse_loss}): the "
              f"model holds NaN/Inf weights or overflows {dtype}")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, allow_nan=False))
        return

    console = stdout_console()
    cache = "" if report.kv_cache is None else f"; losses through a {report.kv_cache} K/V cache"
    console.print(f"{report.windows} windows x {report.seq_len} tokens = {report.tokens:,} tokens, "
                  f"{report.seconds:.1f} s{cache}")
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
    table = Table(title="block recall and blocks kept per MSA layer")
    for name in ("layer", "recall", "recall p10", "oracle (teacher's own top-k)", "blocks", "blocks p90",
                 "oracle blocks"):
        table.add_column(name, justify="right")
    opt = lambda v, f=".3f": "-" if v is None else format(v, f)  # noqa: E731 (no oracle pass with --no-oracle)
    for layer, r in report.recall.items():
        table.add_row(str(layer), f"{r:.3f}", f"{report.recall_p10[layer]:.3f}", opt(report.oracle_recall.get(layer)),
                      f"{report.blocks[layer]:.2f}", f"{report.blocks_p90[layer]:.0f}",
                      opt(report.oracle_blocks.get(layer), ".2f"))
    table.add_row("mean", f"{report.mean_recall:.3f}", f"min {report.min_recall_p10:.3f}",
                  opt(report.mean_oracle_recall), f"{report.mean_blocks:.2f}", "", opt(report.mean_oracle_blocks, ".2f"))
    console.print(table)


@eval_.command(name="layers", short_help="What each MSA layer costs when it alone is sparse.")
@_eval_options(
    _TOKENS,
    click.option("--seq-len", default=2048, show_default=True, help="Tokens per evaluated window."),
    click.option("--max-windows", type=int, default=4, show_default=True, help="Evaluate at most this many windows."),
    click.option("--selections", default="oracle,index", show_default=True,
                 help="Comma-separated, of index and oracle; the first orders the layers."))
def eval_layers(model_dir, data, seq_len, max_windows, selections, dtype, index_dtype, device, as_json, budget):
    """Per MSA layer of MODEL_DIR, the loss increase over dense when that layer alone is sparse (every other layer
    dense), its block recall and the blocks it keeps, under each of --selections.

    The oracle's figures are the layer's own cost at this budget (what no index branch can win back); the index's
    are the converted model's. The costliest layers are the ones to keep dense (m3c convert --dense-costliest N
    measures the oracle's on calibration data before converting). One forward per window, layer and selection.
    """
    from rich.progress import Progress
    from rich.table import Table

    from m3compile.data import load_tokens
    from m3compile.evaluation.loss import layer_costs

    model = load_model(model_dir, dtype, device, index_dtype, budget)
    tokens = load_tokens(data, model.args.vocab_size, model_dir)
    with Progress(transient=True, disable=as_json) as bar:
        task_id = bar.add_task("layers", total=None)
        report = layer_costs(model, tokens, seq_len, max_windows, selections=tuple(split_names(selections)),
                             progress=lambda i, n: bar.update(task_id, completed=i, total=n))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, allow_nan=False))
        return
    console = stdout_console()
    console.print(f"{report.windows} windows x {report.seq_len} tokens, dense loss {report.dense_loss:.4f} "
                  f"nats/token, {report.seconds:.1f} s")
    table = Table(title="each MSA layer alone sparse, costliest first")
    table.add_column("layer", justify="right")
    for sel in report.selections:
        for name in ("loss", "recall", "blocks"):
            table.add_column(f"{sel} {name}", justify="right")
    for i in report.costliest():
        figs = report.layers[i]
        table.add_row(str(i), *[cell for sel in report.selections for cell in (
            f"{100 * figs['loss_increase'][sel]:+.2f}%", f"{figs['recall'][sel]:.3f}", f"{figs['blocks'][sel]:.2f}")])
    console.print(table)


@eval_.command(name="retrieval", short_help="Dense vs sparse accuracy at copying a value planted tokens earlier.")
@_eval_options(
    _TOKENS,
    click.option("--seq-len", default=4096, show_default=True, type=Size(), help="Tokens of the longest probe."),
    click.option("--distances", default="1024,2048,4096,8192", show_default=True, type=Size(many=True),
                 help="Comma-separated distances in tokens (those that do not fit --seq-len are skipped)."),
    click.option("--probes", default=16, show_default=True, type=Size("samples"), help="Probes per distance."),
    click.option("--seed", default=0, show_default=True, help="Seed of the probes."))
def eval_retrieval(model_dir, data, seq_len, distances, probes, seed, dtype, index_dtype, device, as_json, budget):
    """Dense vs sparse accuracy of MODEL_DIR at copying a value planted --distances tokens earlier in --data.

    Each probe plants a key and its value in text of --data and asks for the value again each of --distances
    tokens later; it scores the greedy copy (exact) and its log-probability, with dense attention and with the MSA
    selection, in the model's own forward (no K/V cache).
    """
    from rich.progress import Progress
    from rich.table import Table

    from m3compile.config import EvalConfig
    from m3compile.data import load_tokens
    from m3compile.evaluation.retrieval import retrieval, text_encoder

    EvalConfig(seq_len=seq_len, probes=probes)
    model = load_model(model_dir, dtype, device, index_dtype, budget)
    tokens = load_tokens(data, model.args.vocab_size, model_dir)
    encode = text_encoder(model_dir, model.args.vocab_size)
    with Progress(transient=True, disable=as_json) as bar:
        task_id = bar.add_task("retrieval", total=None)
        result = retrieval(model, tokens, encode, seq_len=seq_len, distances=distances, probes=probes, seed=seed,
                           progress=lambda i, n: bar.update(task_id, completed=i, total=n))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, allow_nan=False))
        return
    console = stdout_console()
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


@eval_.command(name="ruler", short_help="The RULER-style long-context suite, per task, length and selection.")
@_eval_options(
    "A UTF-8 text file (e.g. long code): the haystacks and the words of the prompts.",
    click.option("--lengths", default=None, type=Size(many=True),
                 help="Prompt lengths in tokens, generation included (e.g. 4K,8K,16K,32K) [default: those of "
                      "4K,8K,16K,32K within the model's context]."),
    click.option("--tasks", default=None, help=f"Comma-separated tasks [default: all: {', '.join(RULER_TASKS)}]."),
    click.option("--samples", default=25, show_default=True, type=Size("samples"), help="Samples per task and length."),
    click.option("--seed", default=0, show_default=True, help="Seed of the prompts."),
    click.option("--batch", type=Size("batch"), default=None,
                 help="Prompts per generation batch [default: all samples of a task and length]."),
    click.option("--selections", default="dense,index,oracle", show_default=True,
                 help=f"Comma-separated, of {', '.join(SELECTIONS)}: how MSA layers pick blocks: index (the index "
                      "branch), oracle (most true attention mass), dense (every block); recent (the newest blocks "
                      "only) as a baseline."),
    click.option("--plot", type=OutputPath("file", ".png"), default=None,
                 help="Write a heatmap PNG of the scores (task x length, one panel per selection)."),
    kv_cache_option(help="K/V cache dtype of every prefill and decode: auto (the model's), bf16, fp8 or int8."),
    click.option("--answer-budget", default=None, metavar="kN|pP:FLOOR:CEILING|off",
                 help="The index selection's budget for each prompt's last --answer-tokens tokens (the question) "
                      "and for the answer: kN the fixed top-N blocks, pP:FLOOR:CEILING top-p P of FLOOR-CEILING "
                      "blocks (e.g. k16 for the prompt with --topk 16, and k256 here), off the prompt's budget "
                      "throughout [default: the model's (m3c convert --answer-budget), else off]."),
    click.option("--answer-tokens", default=None, type=click.IntRange(min=0),
                 help="The prompt's last tokens selected at the answer budget [default: the model's, else 128]."),
    click.option("--decode-budget", default=None, metavar="kN|pP:FLOOR:CEILING|off",
                 help="The index selection's budget for the answer, where it differs from --answer-budget (e.g. "
                      "the question read at k256 and the answer written at the prompt's budget: off) [default: the "
                      "model's, else the answer budget]."))
def eval_ruler(model_dir, data, lengths, tasks, samples, seed, batch, selections, plot, kv_cache, answer_budget,
               answer_tokens, decode_budget, dtype, index_dtype, device, as_json, budget):
    """The RULER-style suite on MODEL_DIR: greedy answers to long prompts built from --data, scored per task, length
    and selection.

    The score of a task is the share of its expected answers found in the generated text (RULER's
    string_match_all), x 100, over --samples prompts; a task the dense model scores below 50 at the shortest
    length is reported and kept out of the averages. --kv-cache bf16|fp8|int8 generates over a K/V cache of that
    dtype. --answer-budget gives the question and the answer their own budget (the index selection's; dense and
    oracle rows run without it): the prompt is prefilled at the model's (or --topk / --top-p) budget up to its last
    --answer-tokens tokens, those and every new token at the answer budget (the new tokens at --decode-budget where
    given).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from m3compile.evaluation.ruler import draw_heatmap, read_text, ruler
    from m3compile.io.tokenizer import PromptCodec

    text = read_text(data)
    model = load_model(model_dir, dtype, device, index_dtype, budget)
    codec = PromptCodec(model_dir, model.args.vocab_size, model.source_config)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, disable=as_json) as bar:
        task_id = bar.add_task("ruler", total=None)
        report = ruler(model, codec, text, tasks=split_names(tasks), samples=samples, seed=seed,
                       selections=split_names(selections), batch=batch,
                       lengths=None if lengths is None else list(lengths), data_name=str(data),
                       kv_cache=kv_cache, answer_budget=answer_budget, answer_tokens=answer_tokens,
                       decode_budget=decode_budget,
                       progress=lambda i, n, what: bar.update(task_id, completed=i, total=n, description=what))
    if plot is not None:
        draw_heatmap(report, plot, (model_dir, data))
    if as_json:
        click.echo(json.dumps(report.to_dict() | ({"plot": str(plot)} if plot else {}), indent=2, allow_nan=False))
        return
    console = stdout_console()
    fmt = lambda n: f"{n // 1024}K" if n % 1024 == 0 else str(n)  # noqa: E731
    console.print(f"{report.samples} samples per task and length, seed {report.seed}, "
                  f"{'chat template' if report.chat else 'plain prompts (no chat template)'}, "
                  f"{'the model dtype' if kv_cache == 'auto' else kv_cache} K/V cache, {report.seconds:.1f} s")
    if report.answer_budget or report.decode_budget:  # given, or stored in the model
        console.print("index rows: " + (f"the last {report.answer_tokens} prompt tokens at {report.answer_budget}, "
                                          if report.answer_budget else "") +
                      f"the answer at {report.decode_budget or report.answer_budget}")
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
    table.add_row("standard error", *[" / ".join("-" if v is None else f"{v:.1f}" for v in
                                                 (report.stderr(s, n) for s in report.selections))
                                      for n in report.lengths])
    console.print(table)
    if report.excluded:
        console.print(f"excluded from the averages (dense below 50 at {fmt(report.lengths[0])}): "
                      f"{', '.join(report.excluded)}")
    if report.selections == ["dense"]:
        console.print("the model has no MSA layers (not converted): dense only")
    if plot is not None:
        console.print(f"wrote {plot}")
