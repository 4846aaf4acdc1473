#!/usr/bin/env python3
"""Long-context code data: whole, long Python files from this Python's standard library and installed packages.

    python3 scripts/long_code.py OUT_DIR [--min-bytes 60000] [--eval-files 10] [--calib-bytes 16000000]
                                 [--exclude LONG_CODE_EVAL_TXT ...]

writes two text files into OUT_DIR (created if missing):

    long_code_calib.txt   calibration and index-branch distillation at 8K-32K tokens
    long_code_eval.txt    --eval-files other files: evaluation only, never trained or distilled on

A file qualifies when it is a `.py` file of at least --min-bytes bytes under one of the folders of `sys.path`
(the script's own folder and the current directory excepted), readable as UTF-8. Each is kept in one piece, after a
line `# ---- path ----` with its path relative to its `sys.path` folder (a folder that is itself on `sys.path` is
read as its own entry, not as part of its parent); files with the same bytes count once. Files are ranked by the
sha1 of their relative path: the first --eval-files go to eval, the next ones to calib until --calib-bytes would be
passed (0: all of them). --exclude names a file of the same format (an eval file made on another machine): its files,
matched by relative path or by text, go to neither output, so a larger training text made here never holds them.
Each output lists its files sorted by path. Which files exist depends on what is installed, so the split is stable
for a given set of packages, not across machines.

Each file is written under a temporary name and renamed when complete: an interrupted run leaves no partial file.
The outputs are read as text with a checkpoint's tokenizer (`m3c eval --data long_code_eval.txt`).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from _script import Parser, ScriptError, write_atomic

__all__ = ["LongFile", "long_files", "write"]

MIN_BYTES = 60_000
EVAL_FILES = 10
CALIB_BYTES = 16_000_000


@dataclass(frozen=True)
class LongFile:
    relpath: str  # relative to its sys.path folder
    text: str

    @property
    def rank(self) -> tuple[str, str]:
        """The stable order that picks eval files: sha1 of the path, then of the content (same path, two folders)."""
        return (hashlib.sha1(self.relpath.encode("utf-8")).hexdigest(),
                hashlib.sha1(self.text.encode("utf-8")).hexdigest())

    def piece(self) -> str:
        text = self.text if self.text.endswith("\n") else self.text + "\n"
        return f"# ---- {self.relpath} ----\n{text}"


def long_files(folders: list[str], min_bytes: int) -> list[LongFile]:
    """Every qualifying file under `folders` (see the module docstring), deduplicated by content, sorted by path."""
    roots = [Path(f).resolve() for f in folders if f and Path(f).is_dir()]
    roots = list(dict.fromkeys(roots))
    seen: set[bytes] = set()
    found = []
    for root in roots:
        others = {r for r in roots if r != root}
        for folder, dirs, files in os.walk(root):
            here = Path(folder)
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and here / d not in others)
            for name in sorted(files):
                path = here / name
                try:
                    if not name.endswith(".py") or not path.is_file() or path.stat().st_size < min_bytes:
                        continue
                    data = path.read_bytes()
                    text = data.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                digest = hashlib.sha1(data).digest()
                if digest in seen:
                    continue
                seen.add(digest)
                found.append(LongFile(path.relative_to(root).as_posix(), text))
    return sorted(found, key=lambda f: (f.relpath, f.rank))


def write(out_dir: str | os.PathLike, min_bytes: int = MIN_BYTES, eval_files: int = EVAL_FILES,
          calib_bytes: int = CALIB_BYTES, folders: list[str] | None = None, echo: bool = True,
          exclude: list[str | os.PathLike] = ()) -> dict[str, Path]:
    """Write long_code_calib.txt and long_code_eval.txt into `out_dir`; returns {"calib": path, "eval": path}.
    folders: where to look (default: sys.path). echo: print one line per file written. exclude: files of this
    script's format whose pieces (by relative path or text) are left out of both outputs."""
    out_dir = Path(out_dir)
    if min_bytes < 1 or eval_files < 1 or calib_bytes < 0:
        raise ScriptError(f"--min-bytes and --eval-files must be >= 1 and --calib-bytes >= 0, got {min_bytes:,}, "
                          f"{eval_files:,} and {calib_bytes:,}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ScriptError(f"{out_dir} is a file, not a directory")
    files = long_files(sys.path if folders is None else folders, min_bytes)
    paths_out, texts_out = set(), set()
    for path in exclude:
        for relpath, text in pieces(path):
            paths_out.add(relpath)
            texts_out.add(text)
    excluded = len(files)
    files = [f for f in files if f.relpath not in paths_out and f.text not in texts_out]
    excluded -= len(files)
    if len(files) <= eval_files:
        raise ScriptError(f"{len(files)} Python files of >= {min_bytes:,} bytes found: too few for {eval_files} eval "
                          f"files and at least one calibration file (lower --min-bytes or --eval-files)")
    ranked = sorted(files, key=lambda f: f.rank)
    evals, calib, size = ranked[:eval_files], [], 0
    for f in ranked[eval_files:]:
        n = len(f.piece().encode("utf-8"))
        if calib_bytes and calib and size + n > calib_bytes:
            continue  # a smaller file further down may still fit
        calib.append(f)
        size += n
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, chosen in (("calib", calib), ("eval", evals)):
        chosen = sorted(chosen, key=lambda f: (f.relpath, f.rank))
        text = "".join(f.piece() for f in chosen)
        paths[name] = out_dir / f"long_code_{name}.txt"
        write_atomic(paths[name], lambda f: f.write(text.encode("utf-8")))
        if echo:
            print(f"wrote {paths[name]}: {len(text.encode('utf-8')):,} bytes, {len(chosen):,} files "
                  f"(of {len(files):,} of >= {min_bytes:,} bytes"
                  + (f"; {excluded:,} left out by --exclude)" if exclude else ")"))
    return paths


def pieces(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(relative path, text) of each file in a file this script wrote."""
    try:
        data = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ScriptError(f"--exclude {path}: cannot read it as UTF-8 text ({e})") from None
    parts = re.split(r"(?m)^# ---- (.+) ----\n", data)
    if len(parts) < 3 or parts[0]:
        raise ScriptError(f"--exclude {path}: not a file of this script (no '# ---- path ----' line first)")
    # piece() adds a newline to a text without one: the text as read then ends with it
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


def main(argv: list[str] | None = None) -> int:
    ap = Parser("long_code.py", __doc__.split("\n\n")[0],
                epilog="See the module docstring for which files qualify and how eval files are chosen.")
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder for the two .txt files (created if missing)")
    ap.add_argument("--min-bytes", type=int, default=MIN_BYTES, metavar="N",
                    help=f"smallest file taken, in bytes (default {MIN_BYTES:,})")
    ap.add_argument("--eval-files", type=int, default=EVAL_FILES, metavar="N",
                    help=f"files held out for long_code_eval.txt (default {EVAL_FILES})")
    ap.add_argument("--calib-bytes", type=int, default=CALIB_BYTES, metavar="N",
                    help=f"most bytes of long_code_calib.txt, whole files only; 0: every other file "
                         f"(default {CALIB_BYTES:,})")
    ap.add_argument("--exclude", type=Path, action="append", default=[], metavar="FILE",
                    help="a long_code_eval.txt (or _calib.txt) made elsewhere: its files, by path or text, go to "
                         "neither output; repeatable")
    a = ap.parse_args(argv)
    here = Path(__file__).resolve().parent
    folders = [p for p in sys.path if p and Path(p).resolve() != here]
    try:
        write(a.out_dir, a.min_bytes, a.eval_files, a.calib_bytes, folders, exclude=a.exclude)
    except ScriptError as e:
        ap.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
