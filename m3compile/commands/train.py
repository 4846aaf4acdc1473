"""`m3c distill` and `m3c train`: the index branch's KL distillation and continued training with sparse attention,
which share their options, progress bar and closing summary."""
from __future__ import annotations

import json
import os
import time

import click

from m3compile.commands.common import Command, InputPath, OutputPath, Size, stacked, stdout_console

__all__ = ["distill", "train"]


def _training_options(*, data: str, out: str, lr: float, lr_help: str, dtype: str, after_lr=(), before_json=()):
    """The arguments and options distill and train share, in their help's order: each command gives its own help
    texts where they differ, and its own options to go after --lr and before --json."""
    options = [
        click.argument("model_dir", type=InputPath()),
        click.option("--data", required=True, type=InputPath(), help=data),
        click.option("--out", "out_dir", required=True, type=OutputPath("dir"), help=out),
        click.option("--steps", required=True, type=int, help="Total optimizer steps (with --resume: the new total)."),
        click.option("--seq-len", default=8192, show_default=True, type=Size(), help="Tokens per training sequence."),
        click.option("--batch", default=1, show_default=True, type=Size("batch"),
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
        click.option("--lr-min", type=float, default=None,
                     help="The cosine's floor, as a fraction of --lr [default: 0.1]."),
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
    return stacked(*options)


@click.command(cls=Command)
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
                          "sequence; 0 = the KL alone (a faster step; what the block loss buys: see BENCHMARKS.md)."),
    ])
def distill(model_dir, data, out_dir, steps, seq_len, batch, lr, lr_schedule, lr_warmup_steps, lr_decay_steps, lr_min,
            warmup_steps, checkpoint_every, device, dtype, seed, holdout_tokens, resume, force, autocast, cuda_graph,
            block_loss, as_json, shard):
    """Distil the index branch of the converted model MODEL_DIR with KL (docs/msa.md section 4).

    Only index parameters learn; the backbone stays bit-identical. The teacher is the dense attention averaged
    over each KV group's heads; the student is the index branch's softmax over the same support (all visible
    keys during --warmup-steps, the selected blocks after). Ctrl-C saves a resumable state in --out. Runs under
    torchrun for data parallelism (gloo on CPU, NCCL on CUDA): a replica per process (DistributedDataParallel), or
    with --shard each process's shard of the model (FSDP2). Sharded or not, --out holds whole tensors, and either
    kind of run resumes it.
    """
    from m3compile.train.distill import DistillConfig, distill

    config = DistillConfig(steps=steps, seq_len=seq_len, batch=batch, lr=lr, warmup_steps=warmup_steps,
                           checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, autocast=autocast,
                           cuda_graph=cuda_graph, block_loss=block_loss, holdout_tokens=holdout_tokens,
                           lr_schedule=lr_schedule, lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps,
                           lr_min=lr_min)
    _training("distil", distill, config, click.get_current_context().params)


def _block(m: dict) -> str:
    return f"  block {m['block']:.4f}" if "block" in m else ""


def _block_change(a: dict, b: dict) -> str:
    return f"   block loss {a['block']:.4f} -> {b['block']:.4f}" if "block" in a else ""


def _train_metrics(lm: str):
    """m3c train's progress row and closing change, the LM figure named `lm`."""
    return (lambda m: f"{lm} {m['lm']:.4f}  KL {m['kl']:.4f}  recall {m['recall']:.3f}",
            lambda a, b: f"{lm} {a['lm']:.4f} -> {b['lm']:.4f}   KL {a['kl']:.4f} -> {b['kl']:.4f}   "
                         f"recall {a['recall']:.3f} -> {b['recall']:.3f}")


# per training verb: a metrics row as the progress bar shows it, and the first -> last row of the closing summary
_METRICS = {
    "distil": (lambda m: f"{m['mode']}  KL {m['kl']:.4f}{_block(m)}  recall {m['recall']:.3f}",
               lambda a, b: f"KL {a['kl']:.4f} -> {b['kl']:.4f}   recall {a['recall']:.3f} -> {b['recall']:.3f}"
                            + _block_change(a, b)),
    "train": _train_metrics("LM"),
}


def _training(verb: str, run, config, params: dict) -> None:
    """`run` (m3compile.distill or .train) with `config` and the command's `params` (MODEL_DIR, --data, --out,
    --device, --resume, --force, --shard, --json): the progress bar and the closing summary (rank 0 prints)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from m3compile.train.holdout import summary

    rank0 = int(os.environ.get("RANK", "0")) == 0
    row, change = _METRICS[verb]
    if getattr(config, "lm_target", "data") == "dense":
        row, change = _train_metrics("LM (KL to the dense copy)")
    columns = (TextColumn(f"[bold]{verb}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    with Progress(*columns, disable=params["as_json"] or not rank0) as bar:
        task = bar.add_task(verb, total=config.steps, info="loading")
        # not a terminal (a log file, a pipe): the bar draws once, at the end; a plain line every tenth of the run
        # (at most one a minute, and the last step) says how far it is meanwhile
        lines = not bar.disable and not bar.console.is_terminal
        last = {"at": time.monotonic()}

        def show(step, total, m):
            info = f"{row(m)}  {m['tokens_per_s']:,.0f} tok/s"
            bar.update(task, completed=step, info=info)
            if lines and (step == total or step % max(1, total // 10) == 0 or time.monotonic() - last["at"] >= 60):
                last["at"] = time.monotonic()
                bar.console.print(f"{verb} step {step}/{total}  {info}", highlight=False)

        report = run(params["model_dir"], params["data"], params["out_dir"], config, device=params["device"],
                     resume=params["resume"], force=params["force"], shard=params["shard"], progress=show)
    if not rank0:
        return
    if params["as_json"]:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    first, last = report.history[0], report.history[-1]
    console = stdout_console()
    console.print(f"steps {report.start_step} -> {report.steps} on {report.world_size} process(es)"
                  f"{' (sharded)' if report.sharded else ''}, {report.tokens:,} tokens in {report.seconds:.1f} s "
                  f"({report.tokens_per_s:,.0f} tok/s); parameters per process "
                  f"{max(report.param_bytes_per_rank) / 2**20:,.1f} MiB")
    console.print(f"{change(first, last)}   (step {first['step']} -> {last['step']})")
    console.print(summary(report.holdout))
    console.print(f"wrote {params['out_dir']} (evaluate with: m3c eval loss {params['out_dir']} --data FILE)")


@click.command(cls=Command)
@_training_options(
    data="Training tokens: .bin bytes, .npy ids, .txt/.jsonl text.",
    out="Output directory: the trained checkpoint plus its resumable state.",
    lr=1e-5, lr_help="AdamW learning rate of every parameter.", dtype="Compute and weight dtype.",
    after_lr=[click.option("--loss-coeff", default=1.0, show_default=True,
                           help="Weight of the index KL added to the LM loss."),
              click.option("--lm-target", type=click.Choice(["data", "dense"]), default="data", show_default=True,
                           help="What the LM loss fits: the next token of --data (cross-entropy), or the model's own "
                                "next-token distribution with dense attention (KL from a frozen copy of MODEL_DIR, "
                                "computed on the same text): the sparse model learns to match the dense one rather "
                                "than the text (raw text moves an instruct model's answers: docs/training.md). It "
                                "costs a dense forward a step and a second copy of the weights; not with --shard."),
              click.option("--recompute-mlp", is_flag=True,
                           help="Run each dense MLP's forward again in the backward instead of keeping its "
                                "[tokens, intermediate] tensors (torch.utils.checkpoint): the same step with less "
                                "memory, for about a third more MLP FLOPs. Not with --shard.")])
def train(model_dir, data, out_dir, steps, seq_len, batch, lr, lr_schedule, lr_warmup_steps, lr_decay_steps, lr_min,
          loss_coeff, lm_target, recompute_mlp, checkpoint_every, device, dtype, seed, holdout_tokens, resume, force,
          autocast, as_json, shard):
    """Continue training the converted model MODEL_DIR with sparse attention active (docs/msa.md section 4).

    Every parameter learns from the next-token loss through the sparse attention; --loss-coeff x the index KL
    (teacher: the group-mean attention over the selected blocks) keeps the index branch aligned and reaches only
    the index branch (its input is detached; top-k passes no gradient). On CUDA the MSA ops run as the Triton
    kernels, forward and backward. Checkpoints, Ctrl-C, --resume, torchrun and --shard work as in m3c distill; the
    state is in OUT/train_state/.
    """
    from m3compile.train.distill import TrainConfig, train

    config = TrainConfig(steps=steps, seq_len=seq_len, batch=batch, lr=lr, loss_coeff=loss_coeff, lm_target=lm_target,
                         recompute_mlp=recompute_mlp,
                         checkpoint_every=checkpoint_every, seed=seed, dtype=dtype, autocast=autocast,
                         holdout_tokens=holdout_tokens, lr_schedule=lr_schedule, lr_warmup_steps=lr_warmup_steps,
                         lr_decay_steps=lr_decay_steps, lr_min=lr_min)
    _training("train", train, config, click.get_current_context().params)
