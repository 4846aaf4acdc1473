"""What the command line's modules share: exit statuses and the one-line error, the libraries' warnings kept off
the terminal (in the log unless --verbose), the console, the paths a command reads and writes (every output through
the one output guard before the command runs), the parsing of sizes and name lists, the --kv-cache and
selection-budget options, loading a model as the commands do.

Like every module of the command line, it imports the library's torch-bound modules, and rich, inside the functions
that use them (tests/test_architecture.py's LAZY_BY_DESIGN), so that `m3c --help` and a usage error load no torch,
and a command that draws nothing (generate) no rich.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from m3compile.config import KV_CACHE_DTYPES, parse_size, parse_sizes
from m3compile.errors import M3CompileError
from m3compile.outputs import OUTPUT_KINDS, check_output

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "fail", "terminal", "log_path", "libraries_to_log", "stdout_console",
           "InputPath", "OutputPath", "Command", "Group", "guard_outputs", "Size", "parse_layers", "split_names", "stacked",
           "load_model", "budget_options", "kv_cache_option"]

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """End the command with one line `error: <message>` on stderr and exit status `code`."""
    click.echo(f"error: {' '.join(str(message).split())}", file=terminal())
    sys.exit(code)


def log_path() -> Path:
    """Where the libraries' warnings go (libraries_to_log): $M3C_LOG, else ~/.cache/m3compile/m3c.log (under
    $XDG_CACHE_HOME where set)."""
    if os.environ.get("M3C_LOG"):
        return Path(os.environ["M3C_LOG"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "m3compile" / "m3c.log"


class _LibraryStderr(io.TextIOBase):
    """sys.stderr while a command runs: what the libraries write there (Python warnings, the lines of loggers such as
    torch.onnx's) is appended to the log, opened at the first write under a line naming the run; if the log cannot
    be written, the terminal has it as before."""

    def __init__(self, terminal_stream, header: str):
        self.terminal, self.header, self.file = terminal_stream, header, None

    def write(self, text: str) -> int:
        if not text:
            return 0
        if self.file is None:
            try:
                path = log_path()
                path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "a", encoding="utf-8", errors="replace")
                self.file.write(self.header)
            except OSError:
                self.file = self.terminal
        self.file.write(text)
        self.file.flush()
        return len(text)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def fileno(self) -> int:
        return self.terminal.fileno()

    def close_log(self) -> None:
        if self.file is not None and self.file is not self.terminal:
            self.file.close()
        self.file = self.terminal  # a handler a library made keeps this object: later writes reach the terminal


_TERMINAL: list = []  # the stderr m3c's own lines go to while libraries_to_log holds sys.stderr


def terminal():
    """The stream m3c's own lines on stderr go to (the error line, --timings): the terminal, whatever sys.stderr is
    while a command runs."""
    return _TERMINAL[-1] if _TERMINAL else sys.stderr


@contextlib.contextmanager
def libraries_to_log(verbose: bool, argv: list[str]):
    """While the block runs, third-party output on sys.stderr goes to the log (log_path), not to the terminal, unless
    `verbose`; m3c's own lines reach the terminal through terminal(), so an error stays one line."""
    if verbose:
        yield
        return
    stream = _LibraryStderr(sys.stderr, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} m3c {' '.join(argv)}\n")
    _TERMINAL.append(sys.stderr)
    sys.stderr = stream
    try:
        yield
    finally:
        sys.stderr = _TERMINAL.pop()
        stream.close_log()


def stdout_console() -> Console:
    """The console a command prints its tables and lines to (stdout)."""
    from rich.console import Console

    return Console(stderr=False)


class InputPath(click.Path):
    """A path the command reads (a model, data, a prompt file): no output of the command may overlap it."""

    def __init__(self, **kwargs):
        super().__init__(path_type=Path, **kwargs)


class OutputPath(click.Path):
    """A path the command writes, of a kind of m3compile.outputs.OUTPUT_KINDS ("dir" written whole, "file", "folder"
    of files; `suffix` the file's extension): the output guard checks it against every InputPath of the command
    before the command runs (Command.invoke), so no command writes a path the guard has not seen."""

    def __init__(self, kind: str, suffix: str | None = None):
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        super().__init__(path_type=Path)
        self.kind, self.suffix = kind, suffix


def guard_outputs(ctx: click.Context) -> None:
    """Every output of the command being invoked, through the output guard (m3compile.outputs.check_output), against
    every path it reads; one-line errors, nothing written. A directory that exists is left to the command (--force,
    --resume); the lock is taken only by the run's writer (rank 0 under torchrun)."""
    params = [(p, ctx.params.get(p.name)) for p in ctx.command.params if ctx.params.get(p.name) is not None]
    inputs = [value for p, value in params if isinstance(p.type, InputPath)]
    writer = int(os.environ.get("RANK", "0")) == 0
    for p, value in params:
        if isinstance(p.type, OutputPath):
            check_output(value, p.type.kind, inputs, force=True, suffix=p.type.suffix, lock=writer)


class Command(click.Command):
    """A command of m3c: its outputs pass the output guard (guard_outputs) before it runs."""

    def invoke(self, ctx: click.Context):
        guard_outputs(ctx)
        return super().invoke(ctx)


class Group(click.Group):
    """A group of m3c whose commands (and subgroups) are Command (Group)."""

    command_class = Command
    group_class = type  # a subgroup of the same class


class Size(click.ParamType):
    """A size option (m3compile.config.parse_size: 4096, 8K, 1M), checked against its kind's ceiling as the command
    line is parsed, before anything is allocated; `many`: comma-separated sizes ('' for none); `auto`: the word
    "auto" gives None."""

    def __init__(self, kind: str = "length", many: bool = False, auto: bool = False):
        self.kind, self.many, self.auto = kind, many, auto
        self.name = "sizes" if many else "size"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, (int, tuple)) and not isinstance(value, bool):
            return value
        name = param.opts[0] if param is not None and param.opts else "size"
        if self.auto and str(value).strip().lower() == "auto":
            return None
        try:
            return parse_sizes(value, name, self.kind) if self.many else parse_size(value, name, self.kind)
        except M3CompileError as e:
            raise click.UsageError(str(e), ctx) from None


def parse_layers(text: str | None, option: str = "--dense-layers") -> tuple[int, ...]:
    """Comma-separated layer indices ('' or None: none)."""
    if text is None or text.strip() == "":
        return ()
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{option}: expected comma-separated layer indices, got {text!r}") from None


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
