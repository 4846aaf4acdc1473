"""benchmarks/frontier_32k.sh and benchmarks/plot_frontier.py: the frontier's table from the JSON the commands write
(a real H100 loss eval, a real model bench, RULER-style runs of the suite's shape), and budgets refused before any
work."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import runpy

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def ruler_json(selection: str, scores: dict[str, list[float]], excluded=()) -> dict:
    """An `m3c eval ruler --json` of one selection at 16K and 32K (scores per task: [16K, 32K])."""
    lengths = ["16384", "32768"]
    tasks = {t: {selection: dict(zip(lengths, s))} for t, s in scores.items()}
    kept = [s for t, s in scores.items() if t not in excluded]
    avg = {n: sum(s[i] for s in kept) / len(kept) for i, n in enumerate(lengths)}
    avg["all"] = sum(avg[n] for n in lengths) / 2
    return {"lengths": [16384, 32768], "selections": [selection], "scores": tasks, "excluded": list(excluded),
            "average": {selection: avg}, "stderr": {selection: {"16384": 1.5, "32768": 2.5, "all": 1.4}}}


def test_the_frontier_table_has_dense_then_one_row_per_budget(tmp_path):
    main = runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]  # its functions, not its command
    out = tmp_path / "out"
    (out / "k16").mkdir(parents=True)
    (out / "p0.95-16-64").mkdir()
    qwen = RESULTS / "2026-12-07-h100-adaptive-budget-qwen32k"
    shutil.copy(qwen / "loss32k_k16.json", out / "k16" / "loss.json")
    shutil.copy(qwen / "loss32k_p95.json", out / "p0.95-16-64" / "loss.json")
    shutil.copy(RESULTS / "2026-12-07-h100-one-forward-parity" / "llama3-8b_128k_b4.json", out / "k16" / "speed.json")
    tasks = {"niah_single_1": [100, 100], "niah_multikey_3": [50, 40], "cwe": [10, 5]}
    (out / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", tasks, excluded=["cwe"])))
    (out / "k16" / "ruler.json").write_text(json.dumps(ruler_json("index", {**tasks, "niah_multikey_3": [0, 20]})))
    (out / "p0.95-16-64" / "ruler.json").write_text(json.dumps(ruler_json("index", tasks, excluded=["cwe"])))
    main([str(out)])
    lines = (out / "frontier.md").read_text().splitlines()
    assert lines[0].startswith("| budget |") and "| 16K | 32K |" in lines[0]
    assert lines[2] == "| dense | | | 75.0 ± 1.5 | 70.0 ± 2.5 | 72.5 ± 1.4 | 1x | 1x |"  # cwe left out, as dense does
    # the index run's own average counts cwe: recomputed without it, no standard error; the bench ran top-16
    assert lines[3] == ("| k16 | 15.5 (16), 15.5 | +2.047%, +1.498% | 50.0 | 60.0 | 55.0 | 2.42x (top-16) | "
                        "2.77x (top-16) |")
    # the same tasks as dense: the run's standard errors; no bench yet
    assert lines[4] == "| p0.95-16-64 | 45.1 (64), 38.1 | +0.155%, +0.118% | 75.0 ± 1.5 | 70.0 ± 2.5 | 72.5 ± 1.4 |  |  |"
    assert (out / "frontier.png").stat().st_size > 0


def test_a_budget_is_refused_before_any_work(tmp_path):
    env = {**os.environ, "BUDGETS": "k16 p0.9", "M3C": "false"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_32k.sh"), "m", "d", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "p0.9: give the ceiling" in done.stderr
    assert not (tmp_path / "o").exists()  # nothing written
    env["BUDGETS"] = "top16"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_32k.sh"), "m", "d", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "a budget is kN or pP:FLOOR:CEILING, got top16" in done.stderr
