"""What the command line's modules share: exit statuses and the one-line error, the console, the parsing of lengths
and name lists, the --kv-cache and selection-budget options, loading a model as the commands do.

Like every module of the command line, it imports the library's torch-bound modules inside the functions that use
them (tests/test_architecture.py's LAZY_BY_DESIGN), so that `m3c --help` and a usage error load no torch.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import click
from rich.console import Console

from m3compile.config import KV_CACHE_DTYPES

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "fail", "stdout_console", "parse_lengths", "parse_chunk",
           "split_names", "stacked", "load_model", "budget_options", "kv_cache_option"]

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """End the command with one line `error: <message>` on stderr and exit status `code`."""
    click.echo(f"error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def stdout_console() -> Console:
    """The console a command prints its tables and lines to (stdout)."""
    return Console(stderr=False)


def parse_lengths(text: str) -> tuple[int, ...]:
    """Comma-separated token counts, K = 1024 and M = 1024 x 1024 (8K,32K,1M)."""
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


def parse_chunk(text: str) -> int | None:
    """--prefill-chunk: None for auto, else one length (8K, 65536)."""
    if text.strip().lower() == "auto":
        return None
    try:
        lengths = parse_lengths(text)
    except click.BadParameter:
        lengths = ()
    if len(lengths) != 1:
        raise click.BadParameter(f"--prefill-chunk takes one length >= 1 (such as 32K) or auto, got {text!r}")
    return lengths[0]


def split_names(text: str | None) -> list[str] | None:
    """A comma-separated list of names (None stays None)."""
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def stacked(*decorators):
    """One decorator applying `decorators` as if stacked in this order above a command (the first comes first in
    --help)."""
    def apply(command):
        for decorator in reversed(decorators):  # the first listed is applied last
            command = decorator(command)
        return command
    return apply


def load_model(model_dir: Path, dtype: str, device: str, index_dtype: str | None = None, budget: dict | None = None):
    """m3compile.load, scoring the index branch in `index_dtype` when one is given, with the selection budget
    `budget` ({"topk", "top_p", "min_blocks"}: those given replace the checkpoint's; Decoder.set_budget)."""
    from m3compile.io.load import load

    model = load(model_dir, dtype=dtype, device=device)
    if index_dtype:
        model.set_index_dtype(index_dtype)
    if budget:
        model.set_budget(**budget)
    return model


def budget_options(f):
    """--topk, --top-p and --min-blocks (the MSA layers' selection budget for this run, instead of the
    checkpoint's: docs/msa.md 2.8), folded into the command's one `budget` argument (a dict of those given)."""
    @functools.wraps(f)
    def command(*args, topk, top_p, min_blocks, **kwargs):
        given = dict(topk=topk, top_p=top_p, min_blocks=min_blocks)
        return f(*args, budget={k: v for k, v in given.items() if v is not None}, **kwargs)

    return stacked(
        click.option("--topk", type=int, default=None,
                     help="Blocks each (KV group, query) keeps at most [default: the checkpoint's]."),
        click.option("--top-p", type=float, default=None,
                     help="Adaptive budget: keep the fewest blocks whose index-branch probability reaches this "
                          "(0 < p <= 1; 1 = the fixed top-k) [default: the checkpoint's]."),
        click.option("--min-blocks", type=int, default=None,
                     help="The adaptive budget's floor in blocks [default: the checkpoint's]."),
    )(command)


def kv_cache_option(help: str = "K/V cache dtype: auto (the model's), bf16, fp8 (e4m3 with one scale per token and "
                                "head: half of bf16's bytes) or int8 (the same bytes, integer rows after an exact "
                                "rotation: closer to bf16 than fp8 is; see BENCHMARKS.md)."):
    """The --kv-cache option (m3compile.config.KV_CACHE_DTYPES), with a command's own help text."""
    return click.option("--kv-cache", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True, help=help)
