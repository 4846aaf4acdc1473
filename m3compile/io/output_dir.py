"""Atomic output directories: a command's output appears whole or not at all, one writer at a time.

check_output_dir is the one check before anything is written; atomic_output_dir writes into a temporary sibling
directory, under an exclusive lock, and moves it into place with SIGINT / SIGTERM held, recording each output put in
place in COMMITTED (m3c says so when a signal comes after it).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from m3compile.errors import M3CompileError

__all__ = ["check_output_dir", "output_lock", "COMMITTED", "signals_recorded", "atomic_output_dir"]

def check_output_dir(out: str | os.PathLike, inputs=(), force: bool = False) -> None:
    """The one check before any command writes the directory `out` (one-line errors, nothing written):
    `out` may not equal, contain or lie inside any of `inputs` (with or without force), may not be a file or a
    dangling symlink, must exist only with `force`, and its nearest existing parent must be a writable directory."""
    out = Path(out)
    target = Path(os.path.abspath(out)).resolve()
    for given in inputs:
        if given is None:
            continue
        inp = Path(os.path.abspath(given)).resolve()
        if target == inp:
            raise M3CompileError(f"output {out} is the input {given}; write to another directory")
        if target in inp.parents:
            raise M3CompileError(f"output {out} contains the input {given}; write to another directory")
        if inp in target.parents:
            raise M3CompileError(f"output {out} is inside the input {given}; write to another directory")
    if out.is_symlink() and not out.exists():
        raise M3CompileError(f"output {out} is a dangling symlink")
    if out.exists() and not out.is_dir():
        raise M3CompileError(f"output {out} is a file, not a directory")
    if out.exists() and not force:
        raise M3CompileError(f"{out} already exists (use --force to replace it)")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise M3CompileError(f"output {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise M3CompileError(f"output {out}: cannot write in {parent} (permission denied)")


_HELD_LOCKS: dict[str, list] = {}  # lock file -> [fd, depth]: a process may nest writes of one output


@contextlib.contextmanager
def output_lock(out: str | os.PathLike):
    """Exclusive lock of the output `out` (fcntl.flock on `.NAME.lock` beside it) for as long as the block runs;
    a second writer of the same output, in another process, is refused at once. Reentrant within a process."""
    out = Path(os.path.abspath(out))
    lock = out.parent / f".{out.name}.lock"
    key = str(lock)
    if key in _HELD_LOCKS:
        _HELD_LOCKS[key][1] += 1
        try:
            yield
        finally:
            _HELD_LOCKS[key][1] -= 1
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(lock).st_ino:  # the holder removed it as we opened it: still contended
            raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        raise M3CompileError(f"{out} is being written by another process (lock {lock} is held)") from None
    _HELD_LOCKS[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD_LOCKS[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


COMMITTED: list[Path] = []  # outputs atomic_output_dir has put in place (m3c says so if a signal comes after)


@contextlib.contextmanager
def signals_recorded(got: list[int] | None = None):
    """SIGINT / SIGTERM recorded in `got` (yielded; a new list by default) instead of handled, for the block, in the
    main thread; the previous handlers come back after it. Elsewhere (another thread cannot set handlers) nothing
    changes and the list stays empty. (Python handlers, swapped rather than a thread's signal mask: any thread may
    take a process signal.)"""
    got = [] if got is None else got
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    before = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in (signal.SIGINT,
                                                                                         signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_held():
    """SIGINT / SIGTERM held back for the block (signals_recorded): the handler the first one would have run runs
    when the block ends, so a commit and its record in COMMITTED happen together or not at all."""
    pending: list[int] = []
    try:
        with signals_recorded(pending):
            yield
    finally:
        for signum in pending[:1]:
            handler = signal.getsignal(signum)  # the handler signals_recorded put back
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False, inputs=()):
    """Yield a temporary sibling directory that becomes `out` only if the block completes.

    check_output_dir runs first; the output is locked against a second writer for the duration; stale
    `.NAME.partial-*` directories of a killed earlier run are removed (the lock says none is live)."""
    out = Path(out)
    check_output_dir(out, inputs, force)
    with output_lock(out):
        for stale in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        old = out.parent / f".{out.name}.partial-old-{os.getpid()}"
        tmp = None
        try:
            with _signals_held():  # a signal between the directory's creation and `tmp` would leave it behind
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
            yield tmp
            with _signals_held():
                if out.exists():  # move the old output aside first: a kill at any point leaves one of the two in place
                    out.rename(old)
                    try:
                        tmp.rename(out)
                    except BaseException:
                        old.rename(out)
                        raise
                else:
                    tmp.rename(out)
                COMMITTED.append(out)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:  # the previous output, once the new one is in place (also when a held signal fires after it)
            shutil.rmtree(old, ignore_errors=True)
