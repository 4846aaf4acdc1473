"""The repository speaks of the product alone: no tracked file, and no tracked path, points at how or when the work
was done (a numbered work item or sitting, a lettered run of one, a one-off run script). History lives in git.

Patterns, not bare words: `onnxruntime.InferenceSession`, a `session` variable or "an issue with the input" are
fine; "session 12", "(issue 18)", "issues 15, 16", "call B" and `run_s17a.sh` are not."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Matched case-insensitively.
WORDS = [
    r"\bsessions?[ _-]?\d",                 # session 12, sessions 11-12, -session17
    r"\bissues?[ _-]?#?\d",                 # issue 17, issues 15, 16, issue #3
    r"\(\s*issue\b",                        # (issue 18)
    r"\btickets?[ _-]?#?\d",
    r"\bsittings?\b",
    r"\brun_s\d",                           # one-off run scripts, run_s12a.sh
]
# Matched as written: a run's letter is upper case ("call a function" is fine).
CASED = [
    r"\bcalls? [A-H](?:\b|-)",              # call A, calls B, C, calls A-G
]
PATTERNS = [re.compile(p, re.IGNORECASE) for p in WORDS] + [re.compile(p) for p in CASED]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


@pytest.fixture(scope="module")
def files():
    names = tracked_files()
    assert len(names) > 50 and "README.md" in names, names[:5]
    return names


def hits(text: str) -> list[str]:
    return [m.group(0) for p in PATTERNS for m in p.finditer(text)]


def test_the_patterns_catch_development_pointers_and_spare_ordinary_words():
    for text in ("BENCHMARKS.md, session 11", "sessions 11-12", "results/2026-12-02-h200-session17/",
                 "Bad input never hurts (issue 18)", "issues 15, 16", "issue #3", "(call A)", "calls B, C",
                 "calls A-G", "run_s12a.sh", "in this sitting", "ticket 4"):
        assert hits(text), text
    for text in ("session = ort.InferenceSession(path)", "an issue with the input", "call a function",
                 "sess_options", "issue the load two tiles ahead", "the session's pool"):
        assert not hits(text), text


def test_no_tracked_path_names_the_development(files):
    bad = [p for p in files if hits(p)]
    assert not bad, bad


def test_no_tracked_file_speaks_of_the_development(files):
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    bad = []
    for name in files:
        path = ROOT / name
        if name == this or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
        for i, line in enumerate(text.splitlines(), 1):
            found = hits(line)
            if found:
                bad.append(f"{name}:{i}: {found}")
    assert not bad, "\n".join(bad[:50]) + (f"\n... and {len(bad) - 50} more" if len(bad) > 50 else "")


def test_the_repository_stands_alone(files):
    """Nothing tracked reads or cites the folder of shared checkpoints, data and notes beside the repository: a clone
    is whole (its test model is checkpoints/byte-llama, its data the standard library's source, its spec docs/msa.md)."""
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    outside = re.compile(r"\.\./shared\b|\bMSA_SPEC\b|\bPEERS\.md\b")
    bad = []
    for name in files:
        path = ROOT / name
        if name == this or not path.is_file() or name.startswith("benchmarks/results/"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert not bad, bad[:20]
