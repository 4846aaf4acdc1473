"""`m3c compile` (a model's Triton kernels compiled ahead into MODEL/kernel-cache: m3compile.runtime.compile_ahead),
convert's --compile, and the kernel cache a GPU run of m3c generate points Triton at."""
from __future__ import annotations

import contextlib
import json

import click

from m3compile.commands.common import Command, InputPath, split_names, terminal
from m3compile.errors import M3CompileError

__all__ = ["compile_model", "compile_after_convert", "kernel_cache_for"]


def compile_after_convert(out, compile_: bool | None, quiet: bool) -> dict | None:
    """convert's --compile: the kernel cache of the converted model (m3c compile), or None. Asked for explicitly, a
    failure is the command's error; by default (a GPU present) a warning, the conversion standing."""
    import torch

    if compile_ is False or (compile_ is None and not torch.cuda.is_available()):
        return None
    from m3compile.runtime.compile_ahead import build

    try:
        with _compile_progress(quiet) as progress:
            return build(out, progress=progress).to_dict()
    except M3CompileError as e:
        if compile_:
            raise M3CompileError(f"{out} converted, but {e}") from None
        click.echo(f"warning: {out} converted; its kernels were not compiled ahead ({e}); `m3c compile {out}` "
                   f"retries", file=terminal())
        return None


@contextlib.contextmanager
def _compile_progress(quiet: bool):
    """A progress bar of the compiling worker processes (none with quiet), yielding build's progress callback."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]compile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("worker processes done"), transient=True, disable=quiet) as bar:
        task = bar.add_task("compile", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@click.command(name="compile", cls=Command)
@click.argument("model_dir", type=InputPath())
@click.option("--dtype", "dtypes", default="auto", show_default=True,
              help="Compute dtypes to compile for, comma-separated, as m3c generate --dtype names them.")
@click.option("--kv-cache", "kv_caches", default="auto", show_default=True,
              help="K/V cache dtypes to compile for, comma-separated (m3c generate --kv-cache).")
@click.option("--batch-sizes", default="1,2", show_default=True,
              help="Batch sizes of the synthetic runs, comma-separated (a batch of 1 and one of several cover every "
                   "batch m3c generate runs, but 16 or a multiple of it, which Triton specialises apart).")
@click.option("--workers", type=int, default=None,
              help="Compiling processes side by side [default: one per run, at most the CPUs, 8 and what fits the "
                   "GPU's free memory].")
@click.option("--device", default="cuda", show_default=True, help="The GPU to compile for (cuda or cuda:N).")
@click.option("--json", "as_json", is_flag=True, help="Print what was built as JSON.")
def compile_model(model_dir, dtypes, kv_caches, batch_sizes, workers, device, as_json):
    """Compile MODEL_DIR's Triton kernels ahead, into MODEL_DIR/kernel-cache, for this GPU.

    Runs the model's own generation on synthetic prompts (lengths of 1, under 16, past the top-k's blocks and not a
    multiple of 16, and a multiple of 16; one sequence and a batch; a whole and a chunked prefill; the CUDA-graph and
    the eager decode step) in worker processes side by side, each compiling into the cache. m3c generate and the
    remote code's generate() then load the kernels instead of compiling on a first run; --timings says kernel_cache
    "used". A cache built for another model, GPU, Triton or torch is never used: m3c generate rebuilds it. m3c
    convert runs this on a GPU unless --no-compile. Nothing is replaced unless the whole build succeeds, and a
    kernel-cache m3compile did not write (no manifest.json) is never replaced: the command stops, naming it.
    """
    from m3compile.config import KV_CACHE_DTYPES
    from m3compile.runtime.compile_ahead import build

    kvs = split_names(kv_caches)
    bad = [x for x in kvs if x not in KV_CACHE_DTYPES]
    if bad or not kvs:
        raise click.BadParameter(f"{bad[0] if bad else kv_caches!r} is not one of {', '.join(KV_CACHE_DTYPES)}",
                                 param_hint="--kv-cache")
    try:
        batches = [int(x) for x in split_names(batch_sizes)]
    except ValueError:
        raise click.BadParameter(f"{batch_sizes!r} is not a list of whole numbers",
                                 param_hint="--batch-sizes") from None
    if workers is not None and workers < 1:
        raise click.BadParameter(f"{workers} is below 1", param_hint="--workers")
    with _compile_progress(as_json) as progress:
        report = build(model_dir, dtypes=split_names(dtypes) or ["auto"],
                       kv_caches=kvs, batches=batches or [1], device=device, workers=workers, progress=progress)
    d = report.to_dict()
    click.echo(json.dumps(d, indent=2) if as_json else
               f"{d['kernels']} kernels ({d['variants']} variants) compiled in {d['seconds']:.1f} s by "
               f"{d['workers']} processes -> {d['path']}")


def kernel_cache_for(model_dir, device: str, dtype: str, kv_cache: str):
    """MODEL/kernel-cache for a GPU run (m3compile.runtime.compile_ahead.activate): used when built for this model
    and GPU, rebuilt (one line on stderr) when not."""
    import torch

    from m3compile.io.kernel_cache import Activation
    from m3compile.kernels._common import interpreting
    from m3compile.runtime.compile_ahead import activate

    gpu = str(device).startswith("cuda") and torch.cuda.is_available()
    if not gpu and not interpreting():
        return Activation("none")
    return activate(model_dir, dtype=dtype, kv_cache=kv_cache, device=device,
                    warn=lambda line: click.echo(line, file=terminal()))
