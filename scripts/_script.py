"""What every script under scripts/ shares: its one-line refusals, an argument parser that answers in one line, and
files written whole or not at all.

Not a script of its own: the scripts import it from their folder (Python puts a script's folder first on its module
path).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["ScriptError", "Parser", "check_out_dir", "write_atomic", "write_dir"]


class ScriptError(Exception):
    """A refusal with a one-line reason; the command line prints it and exits with `code` (2: fix the command or the
    environment, 1: a step failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors; `doc` is the help's description (a module docstring, shown as written)."""

    def __init__(self, prog: str, doc: str, epilog: str | None = None):
        super().__init__(prog=prog, description=doc, epilog=epilog,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")

    def fail(self, e: ScriptError):
        self.exit(e.code, f"{self.prog}: error: {e}\n")


def check_out_dir(out_dir: Path, force: bool) -> None:
    """OUT_DIR may be missing or an empty folder; a folder with files only with --force (it is replaced)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ScriptError(f"{out_dir} is a file, not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ScriptError(f"{out_dir} exists and is not empty (--force replaces it)")


def write_atomic(path: Path, fill) -> None:
    """Create `path` by calling fill(open binary file) on a temporary file beside it, renamed when complete."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_dir(out_dir: Path, fill, force: bool = False) -> None:
    """Create the folder `out_dir` by calling fill(temporary folder beside it), then move that folder into place with
    the usual permissions (mkdtemp's folder and safetensors' files are private), replacing what check_out_dir allows
    to be there (checked again: it may have changed while fill ran). Nothing is left behind if fill fails."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        fill(tmp)
        mask = os.umask(0o22)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
        for path in tmp.iterdir():
            os.chmod(path, 0o666 & ~mask)
        old = None
        if out_dir.exists():
            check_out_dir(out_dir, force)
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if old is not None:
                os.replace(old, out_dir)
            raise
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
