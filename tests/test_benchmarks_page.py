"""BENCHMARKS.md and benchmarks/ back each other: every results path the page (or a page of docs/) cites exists,
every results folder is cited by the page (or by docs/: the designs measured and not kept) and every script in
benchmarks/ by the page (or README.md, docs/); and the page stays a reference: at most 400 lines, no diary words."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = (ROOT / "BENCHMARKS.md").read_text()
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
RESULTS_PATH = re.compile(r"`(\d{4}-\d\d-\d\d-[a-z0-9.-]+(?:/[^`\s]*)?)`")  # `2026-12-02-h200-m3-shapes/prefill.json`


def tracked(under: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", under], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_every_results_path_the_page_cites_exists():
    cited = RESULTS_PATH.findall(PAGE)
    assert len(cited) > 20, cited
    cited += RESULTS_PATH.findall(DOCS)
    missing = [c for c in cited if not (RESULTS / c).exists()]
    assert not missing, missing


def test_every_results_folder_is_cited_by_the_page():
    folders = {Path(f).relative_to("benchmarks/results").parts[0] for f in tracked("benchmarks/results")}
    assert folders
    uncited = sorted(f for f in folders if f not in PAGE and f not in DOCS)
    assert not uncited, uncited


def test_every_script_is_cited():
    pages = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    scripts = [f for f in tracked("benchmarks") if f.endswith((".py", ".sh")) and not f.startswith("benchmarks/results/")]
    assert scripts
    uncited = [s for s in scripts if Path(s).name not in PAGE and s not in pages]
    assert not uncited, uncited


def test_the_page_is_a_reference_of_at_most_400_lines():
    lines = PAGE.splitlines()
    assert len(lines) <= 400, len(lines)


# the page gives figures, not the story of how they were reached (missed targets, attempts, next steps: git history)
DIARY_WORDS = ("missed", "next to try", "not yet re-run", "second attempt", "attempt")


def test_the_page_holds_no_diary_words():
    text = PAGE.lower()
    found = [w for w in DIARY_WORDS if w in text]
    assert not found, found
