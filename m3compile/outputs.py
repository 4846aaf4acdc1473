"""Atomic outputs: a command's output (a directory, or one file) appears whole or not at all, one writer at a time.

The output guard, one for every command that writes: check_output_dir (a directory written whole), check_output_file
(one file) and check_output_folder (a directory a command writes files into, kept between runs) run before any work
and refuse, as one-line errors with nothing written, an output that is or overlaps an
input (equal to it, inside it or holding it, whatever --force says), a name too long for the temporary and lock
names beside it, a lock that cannot be taken, a symlink loop, a parent that is not a writable directory.
atomic_output_dir / atomic_output_file then write into a temporary sibling, under an exclusive lock, and move it
into place with SIGINT / SIGTERM held, recording each output put in place in COMMITTED (m3c says so when a signal
comes after it). What they put in place has the modes the process's umask gives new files (a temporary directory is
made private; the output is not).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from m3compile.errors import M3CompileError

__all__ = ["check_output_dir", "check_output_file", "check_output_folder", "check_output", "OUTPUT_KINDS", "output_lock", "COMMITTED", "signals_recorded",
           "atomic_output_dir", "atomic_output_file", "atomic_write_text", "atomic_save_figure", "resolved"]

# What the sibling names add to an output's name: `.NAME.partial-XXXXXXXX` (the temporary output), `.NAME.lock`, and
# for a directory replaced with --force `.NAME.partial-old-PID` (the previous output while the new one moves in)
_PARTIAL_EXTRA = len("..partial-") + 8
_LOCK_EXTRA = len("..lock")
_INNER_RESERVE = 64  # bytes of path kept for the files a directory output holds (distill_state/optimizer.safetensors)


def resolved(path: str | os.PathLike) -> Path:
    """`path` absolute with its symlinks followed; a symlink loop is a one-line error, not a traceback."""
    try:
        return Path(os.path.abspath(path)).resolve()
    except (RuntimeError, OSError) as e:  # RuntimeError: Python < 3.13's "Symlink loop"; OSError: ELOOP
        raise M3CompileError(f"{path}: cannot follow its symlinks ({getattr(e, 'strerror', None) or e})") from None


def _existing_parent(target: Path) -> Path:
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):
        return default


def _hard_link(target: Path, inp: Path) -> Path | None:
    """The file of the input `inp` (itself, or one in it for a directory) that the existing file `target` is by
    another name (a hard link), or None. Only a file with more than one link can be one."""
    try:
        st = target.stat()
    except OSError:
        return None
    if not target.is_file() or st.st_nlink < 2:
        return None
    places = [inp] if inp.is_file() else [Path(d) / f for d, _, files in os.walk(inp) for f in files]
    for p in places:
        with contextlib.suppress(OSError):
            other = p.stat()
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return p
    return None


def _check_output(out: Path, inputs, extra: int, directory: bool) -> Path:
    """The checks outputs of both kinds share: overlap with the inputs, name and path length, symlink loops, the
    nearest existing parent a writable directory. Returns the output, resolved."""
    target = resolved(out)
    for given in inputs:
        if given is None:
            continue
        inp = resolved(given)
        if target == inp:
            raise M3CompileError(f"output {out} is the input {given}; write to another "
                                 f"{'directory' if directory else 'file'}")
        if target in inp.parents:
            raise M3CompileError(f"output {out} contains the input {given}; write to another directory")
        if inp in target.parents:
            raise M3CompileError(f"output {out} is inside the input {given}; write to another "
                                 f"{'directory' if directory else 'file'}")
        link = _hard_link(target, inp)
        if link is not None:
            raise M3CompileError(f"output {out} is {link} of the input {given} by another name (a hard link); write "
                                 f"to another file")
    name = Path(os.path.abspath(out)).name
    parent = _existing_parent(target)
    size, name_max = len(os.fsencode(name)), _limit(parent, "PC_NAME_MAX", 255)
    if size + extra > name_max:
        raise M3CompileError(f"output {out}: a name of {size} bytes is too long here: the temporary and lock files "
                             f"beside it add {extra} bytes to it, past the file system's {name_max}; use a name of at "
                             f"most {name_max - extra} bytes")
    path_max = _limit(parent, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(target))) + extra + (_INNER_RESERVE if directory else 0) >= path_max:
        raise M3CompileError(f"output {out}: the path is too long for this file system ({path_max} bytes at most, "
                             f"with the names written inside and beside it)")
    if not parent.is_dir():
        raise M3CompileError(f"output {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise M3CompileError(f"output {out}: cannot write in {parent} (permission denied)")
    return target


def _check_lock(out: Path) -> None:
    """Take and release the output's lock now, before any work: a lock another process holds, or one that cannot be
    created, is refused here rather than after a long conversion. Nothing is left behind."""
    out = Path(os.path.abspath(out))
    if not out.parent.is_dir() or str(out.parent / f".{out.name}.lock") in _HELD_LOCKS:
        return  # a missing parent is created with the output (and its lock) later; a lock this process holds is ours
    with output_lock(out):
        pass


def check_output_dir(out: str | os.PathLike, inputs=(), force: bool = False, lock: bool = True) -> None:
    """The one check before any command writes the directory `out` (one-line errors, nothing written):
    `out` may not equal, contain or lie inside any of `inputs` (with or without force), may not be a file or a
    dangling symlink, must exist only with `force`, its name must leave room for the temporary and lock names beside
    it, its lock must be free (`lock`: checked; False where another process of the same run holds it), and its
    nearest existing parent must be a writable directory."""
    out = Path(out)
    extra = max(_PARTIAL_EXTRA, _LOCK_EXTRA, len("..partial-old-") + len(str(os.getpid())))
    _check_output(out, inputs, extra, directory=True)
    if out.is_symlink() and not out.exists():
        raise M3CompileError(f"output {out} is a dangling symlink")
    if out.exists() and not out.is_dir():
        raise M3CompileError(f"output {out} is a file, not a directory")
    if out.exists() and not force:
        raise M3CompileError(f"{out} already exists (use --force to replace it)")
    if lock:
        _check_lock(out)


def check_output_file(out: str | os.PathLike, inputs=(), suffix: str | None = None, lock: bool = True) -> None:
    """check_output_dir for an output that is one file (inspect --out, attention-map --out, eval ruler --plot): an
    existing file is replaced (as these commands always did), a directory is refused, and so is a name without
    `suffix` (".png") when one is asked; a missing parent directory is created."""
    out = Path(out)
    _check_output(out, inputs, max(_PARTIAL_EXTRA, _LOCK_EXTRA), directory=False)
    if suffix is not None and out.suffix.lower() != suffix:
        raise M3CompileError(f"output {out}: the file is written as {suffix[1:].upper()}; name the file *{suffix}")
    if out.is_dir():
        raise M3CompileError(f"output {out} is a directory; name a file to write")
    if lock:
        _check_lock(out)


def check_output_folder(out: str | os.PathLike, inputs=()) -> None:
    """check_output_dir for a directory a command writes its files into (m3c bench --out): it may exist (its files
    of the same names are replaced, each written whole under its own lock, others are kept), but may not be a file
    or overlap an input."""
    out = Path(out)
    _check_output(out, inputs, max(_PARTIAL_EXTRA, _LOCK_EXTRA), directory=True)
    if out.is_symlink() and not out.exists():
        raise M3CompileError(f"output {out} is a dangling symlink")
    if out.exists() and not out.is_dir():
        raise M3CompileError(f"output {out} is a file, not a directory")


# The kinds of output a command writes, each with its check: "dir" a directory written whole (replaced only with
# --force), "file" one file, "folder" a directory files are written into
OUTPUT_KINDS = ("dir", "file", "folder")


def check_output(out: str | os.PathLike, kind: str, inputs=(), *, force: bool = True, suffix: str | None = None,
                 lock: bool = True) -> None:
    """The output guard for an output of `kind` (OUTPUT_KINDS): check_output_dir, check_output_file or
    check_output_folder."""
    if kind == "dir":
        check_output_dir(out, inputs, force=force, lock=lock)
    elif kind == "file":
        check_output_file(out, inputs, suffix=suffix, lock=lock)
    elif kind == "folder":
        check_output_folder(out, inputs)
    else:
        raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")


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
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise M3CompileError(f"{out}: cannot create the lock file {lock} ({e.strerror})") from None
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


def _umask() -> int:
    """The process's umask, read without changing it where /proc tells it (os.umask sets it to read it)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _umask_modes(path: Path) -> None:
    """Give `path` (a file, or a directory and everything in it) the modes the umask gives what a process creates:
    a temporary directory is made private (0700), and some writers create private files (0600)."""
    mask = _umask()
    for p in [path] + ([Path(d) / n for d, dirs, files in os.walk(path) for n in dirs + files] if path.is_dir() else []):
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        base = 0o777 if p.is_dir() or mode & 0o111 else 0o666
        os.chmod(p, base & ~mask)


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
            _umask_modes(tmp)
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


@contextlib.contextmanager
def atomic_output_file(out: str | os.PathLike, inputs=()):
    """Yield a temporary sibling path (not yet created) that becomes the file `out` only if the block completes.

    check_output_file runs first; the output is locked against a second writer; stale `.NAME.partial-*` files of a
    killed earlier run are removed."""
    out = Path(out)
    check_output_file(out, inputs)
    with output_lock(out):
        for stale in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
            with contextlib.suppress(OSError):
                stale.unlink()
        tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
        try:
            yield tmp
            if tmp.exists():
                _umask_modes(tmp)
            with _signals_held():
                os.replace(tmp, out)
                COMMITTED.append(out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def atomic_write_text(out: str | os.PathLike, text: str, inputs=()) -> Path:
    """Write `text` to the file `out` through atomic_output_file (the guard first; whole or not at all)."""
    with atomic_output_file(out, inputs) as tmp:
        tmp.write_text(text)
    return Path(out)


def atomic_save_figure(fig, out: str | os.PathLike, inputs=(), **savefig) -> Path:
    """Save the matplotlib figure `fig` as the PNG file `out` through atomic_output_file (the guard first; whole or
    not at all); `savefig`: Figure.savefig's options (dpi, bbox_inches)."""
    with atomic_output_file(out, inputs) as tmp:
        fig.savefig(tmp, format="png", **savefig)
    return Path(out)
