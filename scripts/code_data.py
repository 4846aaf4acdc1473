#!/usr/bin/env python3
"""Code data for byte-level models: the Python standard library's own source, as raw UTF-8 bytes.

    python3 scripts/code_data.py OUT_DIR [--calib-bytes 4000000] [--eval-bytes 300000]

writes three files into OUT_DIR (created if missing):

    train.bin   every training file
    calib.bin   the first --calib-bytes bytes of train.bin: calibration and index-branch distillation
    eval.bin    the first --eval-bytes bytes of the held-out files: evaluation, never trained or distilled on

The source is the running Python's standard library (`sysconfig.get_paths()["stdlib"]`): every `.py` file outside
`site-packages`, `test` / `tests` folders (lib2to3's test data among them) and `idlelib`, and readable as UTF-8.
Each file is kept whole, after a line `# ---- relpath ----`, in sorted order of its path relative to the library.
A file is held out when the first byte of sha1(relpath) is a multiple of 10 (about a tenth of the files), so the
split depends on the path alone: the same Python version gives the same bytes on every machine. A byte-level
model reads them as token ids (token id = byte value; `m3c eval --data eval.bin`, `m3c distill --data calib.bin`).

Each file is written under a temporary name and renamed when complete: an interrupted run leaves no partial file.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from _script import Parser, ScriptError, write_atomic

__all__ = ["SKIP_DIRS", "sources", "held_out", "write"]

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
CALIB_BYTES = 4_000_000
EVAL_BYTES = 300_000


def held_out(relpath: str) -> bool:
    """Whether a file goes to evaluation: the first byte of sha1 of its relative path is a multiple of 10."""
    return hashlib.sha1(relpath.encode("utf-8")).digest()[0] % 10 == 0


def sources(root: str | os.PathLike | None = None) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every usable `.py` file under `root` (default: the standard library), sorted by
    path. Folders in SKIP_DIRS are not entered, links to folders are not followed, files that are not UTF-8 are
    left out."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ScriptError(f"{root}: no such directory (the standard library's source is not installed)")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            try:
                data = path.read_bytes()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            found.append((path.relative_to(root).as_posix(), data))
    return sorted(found)


def _piece(relpath: str, data: bytes) -> bytes:
    """One file as it appears in the output: its header line, then the file, ending in a newline."""
    if data and not data.endswith(b"\n"):
        data += b"\n"
    return f"# ---- {relpath} ----\n".encode("utf-8") + data


def write(out_dir: str | os.PathLike, calib_bytes: int = CALIB_BYTES, eval_bytes: int = EVAL_BYTES,
          root: str | os.PathLike | None = None, echo: bool = True) -> dict[str, Path]:
    """Write train.bin, calib.bin and eval.bin into `out_dir`; returns {"train": path, "calib": ..., "eval": ...}.
    root: the source folder (default: the standard library). echo: print one line per file written."""
    out_dir = Path(out_dir)
    if calib_bytes < 0 or eval_bytes < 0:
        raise ScriptError(f"byte counts must be >= 0, got calib {calib_bytes:,} and eval {eval_bytes:,}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ScriptError(f"{out_dir} is a file, not a directory")
    files = sources(root)
    train = [f for f in files if not held_out(f[0])]
    evals = [f for f in files if held_out(f[0])]
    if not train or not evals:
        raise ScriptError(f"{len(files)} usable .py files: too few to split into training and held-out files")
    train_data = b"".join(_piece(*f) for f in train)
    eval_data = b"".join(_piece(*f) for f in evals)
    outputs = {  # name -> (bytes, files they come from, of how many)
        "train": (train_data, len(train), len(train)),
        "calib": (train_data[:calib_bytes], _files_in(train, calib_bytes), len(train)),
        "eval": (eval_data[:eval_bytes], _files_in(evals, eval_bytes), len(evals)),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (data, used, total) in outputs.items():
        paths[name] = out_dir / f"{name}.bin"
        write_atomic(paths[name], lambda f: f.write(data))
        if echo:
            print(f"wrote {paths[name]}: {len(data):,} bytes, {used:,} of {total:,} files")
    return paths


def _files_in(files: list[tuple[str, bytes]], limit: int) -> int:
    """How many files the first `limit` bytes of their concatenation touch (the last one possibly cut)."""
    count, size = 0, 0
    for relpath, data in files:
        if size >= limit:
            break
        size += len(_piece(relpath, data))
        count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    ap = Parser("code_data.py", __doc__.split("\n\n")[0],
                epilog="Writes train.bin, calib.bin and eval.bin; see the module docstring for the split.")
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder for the .bin files (created if missing)")
    ap.add_argument("--calib-bytes", type=int, default=CALIB_BYTES, metavar="N",
                    help=f"size of calib.bin, the start of train.bin (default {CALIB_BYTES:,})")
    ap.add_argument("--eval-bytes", type=int, default=EVAL_BYTES, metavar="N",
                    help=f"size of eval.bin, the start of the held-out files (default {EVAL_BYTES:,})")
    a = ap.parse_args(argv)
    try:
        write(a.out_dir, a.calib_bytes, a.eval_bytes)
    except ScriptError as e:
        ap.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
