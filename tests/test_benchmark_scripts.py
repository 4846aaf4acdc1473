"""benchmarks/frontier_32k.sh and benchmarks/plot_frontier.py: the frontier's table from the JSON the commands write
(a real H100 loss eval, a real model bench, RULER-style runs of the suite's shape), and budgets refused before any
work."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import runpy

from tests.conftest import EVAL_DATA

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


def test_a_row_with_other_exclusions_gets_its_standard_error_from_the_variances(tmp_path):
    main = runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]
    out = tmp_path / "out"
    (out / "k16").mkdir(parents=True)
    shutil.copy(RESULTS / "2026-12-07-h100-adaptive-budget-qwen32k" / "loss32k_k16.json", out / "k16" / "loss.json")
    tasks = {"niah_single_1": [100, 100], "niah_multikey_3": [50, 40], "cwe": [10, 5]}
    (out / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", tasks, excluded=["cwe"])))
    index = ruler_json("index", {**tasks, "niah_multikey_3": [0, 20]})  # no exclusions of its own
    index["variances"] = {"niah_single_1": {"index": {"16384": 0.0, "32768": 9.0}},
                          "niah_multikey_3": {"index": {"16384": 16.0, "32768": 16.0}},
                          "cwe": {"index": {"16384": 400.0, "32768": 400.0}}}
    (out / "k16" / "ruler.json").write_text(json.dumps(index))
    main([str(out)])
    row = (out / "frontier.md").read_text().splitlines()[3]
    # cwe left out of the averages and of their errors: 16K sqrt(0 + 16) / 2, 32K sqrt(9 + 16) / 2, all sqrt(41) / 4
    assert row.startswith("| k16 | 15.5 (16), 15.5 | +2.047%, +1.498% | 50.0 ± 2.0 | 60.0 ± 2.5 | 55.0 ± 1.6 |"), row


def test_a_budget_is_refused_before_any_work(tmp_path):
    env = {**os.environ, "BUDGETS": "k16 p0.9", "M3C": "false"}
    done = _script(env, tmp_path / "o", timeout=60)
    assert done.returncode != 0 and "p0.9: give the ceiling" in done.stderr
    assert not (tmp_path / "o").exists()  # nothing written
    env["BUDGETS"] = "top16"
    done = _script(env, tmp_path / "o", timeout=60)
    assert done.returncode == 2 and "a budget is kN or pP:FLOOR:CEILING, got top16" in done.stderr


def _fake_m3c(tmp_path, fail_on: str = "") -> Path:
    """An m3c that answers `eval ruler` and `eval loss` with recorded JSON after half a second, logging when each
    run starts and ends; it fails for a command line holding `fail_on`."""
    tasks = {"niah_single_1": [100, 100], "niah_multikey_3": [50, 40]}
    (tmp_path / "dense.json").write_text(json.dumps(ruler_json("dense", tasks)))
    (tmp_path / "index.json").write_text(json.dumps(ruler_json("index", tasks)))
    shutil.copy(RESULTS / "2026-12-07-h100-adaptive-budget-qwen32k" / "loss32k_p95.json", tmp_path / "loss.json")
    fake = tmp_path / "m3c"
    fake.write_text(f"""#!/usr/bin/env python3
import sys, time
args = " ".join(sys.argv[1:])
log = open({str(tmp_path / "runs.log")!r}, "a")
log.write(f"{{time.time():.3f}} start {{args}}\\n"); log.flush()
time.sleep(0.5)
if {fail_on!r} and {fail_on!r} in args:
    sys.exit("error: failed as asked")
if sys.argv[1] == "bench":  # a recorded bench JSON where --out says
    import os, shutil
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    shutil.copy({str(RESULTS / "2026-12-07-h100-frontier-and-first-run" / "k16" / "speed.json")!r},
                out + "/llama3-8b.json")
    sys.exit(0)
name = "loss" if sys.argv[2] == "loss" else ("dense" if "--selections dense" in args else "index")
print(open({str(tmp_path)!r} + "/" + name + ".json").read())
log.write(f"{{time.time():.3f}} end {{args}}\\n")
""")
    fake.chmod(0o755)
    return fake


def _script(env: dict, out: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """benchmarks/frontier_32k.sh m d OUT with `env` (the fake m3c's model and data names)."""
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_32k.sh"), "m", "d", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def _started(tmp_path) -> list[str]:
    """The fake m3c's command lines, in the order they started."""
    return [line.split(" ", 2)[2] for line in (tmp_path / "runs.log").read_text().splitlines() if " start " in line]


def _frontier(tmp_path, fake, parallel: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "M3C": str(fake), "BUDGETS": "k16 p0.95:16:64", "SPEED": "0", "PARALLEL": str(parallel)}
    return _script(env, tmp_path / "o")


def test_the_frontier_runs_its_quality_rows_side_by_side_and_continues(tmp_path):
    """PARALLEL=3: dense's RULER and the first two runs of the budgets start together, each budget's RULER after its
    loss; everything is written, the table too; called again, nothing runs again."""
    fake = _fake_m3c(tmp_path)
    done = _frontier(tmp_path, fake, 3)
    assert done.returncode == 0, done.stderr
    runs = [line.split(" ", 2) for line in (tmp_path / "runs.log").read_text().splitlines()]
    starts = sorted(float(t) for t, what, _ in runs if what == "start")
    first_end = min(float(t) for t, what, _ in runs if what == "end")
    assert len(starts) == 5 and sum(s < first_end for s in starts) == 3  # dense RULER, two losses at once
    out = tmp_path / "o"
    for f in ("ruler_dense.json", "k16/loss.json", "k16/ruler.json", "p0.95-16-64/loss.json", "p0.95-16-64/ruler.json",
              "frontier.md", "dense_row.log", "k16.log"):  # (no plot: no speed was asked for)
        assert (out / f).is_file(), f
    assert _frontier(tmp_path, fake, 3).returncode == 0
    assert len((tmp_path / "runs.log").read_text().splitlines()) == 10  # no run again


def test_a_failed_quality_row_fails_the_frontier_and_leaves_no_half_file(tmp_path):
    fake = _fake_m3c(tmp_path, fail_on="--top-p 0.95")
    done = _frontier(tmp_path, fake, 2)
    assert done.returncode == 1 and "a quality run failed" in done.stderr
    out = tmp_path / "o"
    assert (out / "k16" / "ruler.json").is_file() and (out / "ruler_dense.json").is_file()
    assert not (out / "p0.95-16-64" / "loss.json").exists() and "failed as asked" in (out / "p0.95-16-64.log").read_text()


def test_a_row_with_an_answer_budget_runs_the_suite_with_it_and_no_bench(tmp_path):
    """k16+p0.95:16:40: the loss at top-16, the suite at top-16 with --answer-budget p0.95:16:40, no speed bench
    (its speed is k16's prefill and the answer budget's decode); a bad answer budget is refused first."""
    fake = _fake_m3c(tmp_path)
    env = {**os.environ, "M3C": str(fake), "BUDGETS": "k16+p0.95:16:40", "SPEED": "1", "DENSE": "0"}
    done = _script(env, tmp_path / "o")
    assert done.returncode == 0, done.stderr
    runs = _started(tmp_path)
    assert len(runs) == 2 and runs[0].startswith("eval loss") and "--topk 16 --top-p 1" in runs[0]
    assert "--answer-budget" not in runs[0]
    assert runs[1].startswith("eval ruler") and runs[1].endswith("--topk 16 --top-p 1 --answer-budget p0.95:16:40")
    row = tmp_path / "o" / "k16+p0.95-16-40"
    assert (row / "loss.json").is_file() and (row / "ruler.json").is_file() and not (row / "speed.json").exists()
    measured = RESULTS / "2026-12-07-h100-frontier-and-first-run"
    for row, speed in (("k16", "k16"), ("p0.95-16-40", "p0.95-16-64")):  # A and B benched apart (B: a stand-in)
        (tmp_path / "o" / row).mkdir()
        shutil.copy(measured / speed / "speed.json", tmp_path / "o" / row / "speed.json")
    (tmp_path / "o" / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", {"niah_single_1": [100, 100]})))
    main = runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]
    main([str(tmp_path / "o")])
    table = (tmp_path / "o" / "frontier.md").read_text()
    # A+B: A's prefill (this k16 bench timed decode alone: none) and B's decode
    assert [line for line in table.splitlines() if line.startswith("| k16+")][0].endswith("|  | 3.91x (top-45) |")
    env["BUDGETS"] = "k16+p0.95:16"
    done = _script(env, tmp_path / "o2", timeout=60)
    assert done.returncode != 0 and "p0.95:16: give the ceiling" in done.stderr and not (tmp_path / "o2").exists()


def test_a_row_with_a_decode_budget_runs_the_suite_with_both_and_takes_its_decode_from_that_row(tmp_path):
    """k16+k256+k16: the question at k256, the answer at k16 (--decode-budget); its speed is k16's prefill and
    k16's decode."""
    fake = _fake_m3c(tmp_path)
    env = {**os.environ, "M3C": str(fake), "BUDGETS": "k16+k256+k16", "SPEED": "1", "DENSE": "0", "DENSE_LAYERS": "0"}
    done = _script(env, tmp_path / "o")
    assert done.returncode == 0, done.stderr
    runs = _started(tmp_path)
    assert len(runs) == 3 and runs[1].endswith("--topk 16 --top-p 1 --answer-budget k256 --decode-budget k16")
    assert runs[2].startswith("bench model llama3-8b") and "--topk 16 " in runs[2]  # the answer's top-16, benched
    assert "--dense-layers 0 " in runs[2]  # as many dense layers as the model m ("DENSE_LAYERS" below)
    assert (tmp_path / "o" / "k16" / "speed.json").is_file() and not (tmp_path / "o" / "k16" / "loss.json").exists()
    (tmp_path / "o" / "k256").mkdir()  # the question's row (a stand-in), unused
    shutil.copy(RESULTS / "2026-12-07-h100-frontier-and-first-run" / "p0.95-16-64" / "speed.json",
                tmp_path / "o" / "k256" / "speed.json")
    (tmp_path / "o" / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", {"niah_single_1": [100, 100]})))
    runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]([str(tmp_path / "o")])
    row = [line for line in (tmp_path / "o" / "frontier.md").read_text().splitlines() if line.startswith("| k16+")]
    assert row[0].endswith("|  | 4.70x (top-16) |")  # k16's decode, not k256's stand-in (3.91x)
    env["BUDGETS"] = "k16+k256+off"  # the answer at the prompt's budget: k16's decode again
    done = _script(env, tmp_path / "o")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs.log").read_text().splitlines()[-1].endswith("--answer-budget k256 --decode-budget off")
    runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]([str(tmp_path / "o")])
    row = [line for line in (tmp_path / "o" / "frontier.md").read_text().splitlines() if "+off" in line]
    assert row[0].endswith("|  | 4.70x (top-16) |")
    env["BUDGETS"] = "k16+k256+x3"
    done = _script(env, tmp_path / "o2", timeout=60)
    assert done.returncode != 0 and "got x3" in done.stderr and not (tmp_path / "o2").exists()


def test_the_bench_keeps_as_many_layers_dense_as_the_model(tmp_path):
    """A model with 3 dense layers of 7 (`m3c convert --dense-costliest 2`): its speed is benched with layers 0-2
    dense."""
    fake = _fake_m3c(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"sparse_attention_config": {
        "sparse_attention_freq": [0, 1, 1, 0, 1, 0, 1]}}))
    env = {**os.environ, "M3C": str(fake), "BUDGETS": "k16+k256+k16", "SPEED": "1", "DENSE": "0"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_32k.sh"), str(model), "d", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _started(tmp_path)[-1].startswith("bench model llama3-8b") and "--dense-layers 0,1,2 " in _started(tmp_path)[-1]


def test_a_rows_suite_split_by_length_over_processes_is_joined(tmp_path):
    """ruler-*.json (the same command at some of the lengths each) read as one run: every length's scores and
    errors, the same row as one ruler.json of them all."""
    main = runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]
    tasks = {"niah_single_1": [100, 90], "niah_multikey_3": [50, 40]}
    whole = ruler_json("index", tasks)
    whole["variances"] = {t: {"index": {"16384": 4.0, "32768": 9.0}} for t in tasks}
    rows = {}
    for name, files in (("one", {"ruler.json": whole}),
                        ("split", {f"ruler-{n}.json": {"lengths": [int(n)], "excluded": [],
                                                        "scores": {t: {"index": {n: by["index"][n]}}
                                                                   for t, by in whole["scores"].items()},
                                                        "variances": {t: {"index": {n: by["index"][n]}}
                                                                      for t, by in whole["variances"].items()}}
                                   for n in ("16384", "32768")})):
        out = tmp_path / name
        (out / "k16").mkdir(parents=True)
        shutil.copy(RESULTS / "2026-12-07-h100-adaptive-budget-qwen32k" / "loss32k_k16.json", out / "k16" / "loss.json")
        (out / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", tasks)))
        for f, body in files.items():
            (out / "k16" / f).write_text(json.dumps(body))
        main([str(out)])
        rows[name] = (out / "frontier.md").read_text().splitlines()[3]
    assert rows["split"] == rows["one"]
    assert rows["one"].startswith("| k16 | 15.5 (16), 15.5 | +2.047%, +1.498% | 75.0 ± 1.4 | 65.0 ± 2.1 | 70.0 ± 1.3 |")


def test_generate_batch_compares_a_batch_with_one_prompt(byte_msa, tmp_path):
    """benchmarks/generate_batch.sh on the byte-level model: 3 prompts of 300 bytes against the first alone, a
    first run of each and one timed; the summary is the batch's new tokens/s over one prompt's."""
    text = tmp_path / "code.txt"
    text.write_text(Path(os.__file__).read_text()[:2000])
    env = {**os.environ, "N": "3", "CHARS": "300", "NEW_TOKENS": "4", "DEVICE": "cpu", "REPEATS": "1",
           "OUT": str(tmp_path / "o")}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "generate_batch.sh"), str(byte_msa), str(text)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert [(r["prompts"], r["run"]) for r in d["runs"]] == [("one", 0), ("batch", 0), ("one", 1), ("batch", 1)]
    assert [r["timings"]["batch"] for r in d["runs"]] == [1, 3, 1, 3]
    s = d["summary"]
    assert s["batch"] == 3 and s["batch_over_one"] == round(s["new_tokens_per_s"]["batch"] / s["new_tokens_per_s"]["one"], 3)
    lines = (tmp_path / "o" / "batch-1.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt_index"] for x in lines] == [1, 2, 3]
    env["CHARS"] = "1000"  # 3 x 1,000 > 2,000 characters: refused before any run
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "generate_batch.sh"), str(byte_msa), str(text)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "holds 2,000 characters; 3 prompts of 1,000 need 3,000" in done.stderr


def test_guided_answer_block_mass_is_the_question_s_causal_attention_per_block():
    """benchmarks/experiments/guided_answer.py's block mass: the softmax of each question token and head over the keys
    up to it, summed per key block and KV group (each group's mass totals its tokens x heads; no key past the last
    token weighs)."""
    import torch

    block_mass = runpy.run_path(str(ROOT / "benchmarks" / "experiments" / "guided_answer.py"))["block_mass"]
    Hq, Hkv, C, T, D, bs = 6, 2, 5, 37, 8, 8
    q, k = torch.randn(1, Hq, C, D), torch.randn(1, Hkv, T, D)
    mass = block_mass(q, k, 0.3, bs)
    assert mass.shape == (Hkv, 5)
    torch.testing.assert_close(mass.sum(-1), torch.full((Hkv,), C * Hq / Hkv))
    want = torch.zeros(Hkv, 5)
    for h in range(Hq):
        for c in range(C):
            p = torch.softmax(q[0, h, c] @ k[0, h // 3, : T - C + c + 1].T * 0.3, -1)
            want[h // 3].index_add_(0, torch.arange(p.shape[0]) // bs, p)
    torch.testing.assert_close(mass, want)


def test_recipe_budget_copies_a_model_at_another_stored_budget(byte_msa, tmp_path):
    """benchmarks/recipe_distill.py budget: the copy loads with the budget given and the source's weights; a budget
    m3compile would refuse, an existing output or an unconverted model is one error and leaves no output."""
    import sys

    import torch

    from m3compile import load

    def budget(out, *options, model=byte_msa):
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recipe_distill.py"), "budget", str(model),
                               str(out), *options], capture_output=True, text=True, timeout=120)

    done = budget(tmp_path / "p", "--topk", "6", "--top-p", "0.9", "--min-blocks", "2")
    assert done.returncode == 0, done.stderr
    msa = load(tmp_path / "p", dtype="float32").args.msa
    assert (msa.topk, msa.top_p, msa.min_blocks) == (6, 0.9, 2)
    a, b = load(byte_msa, dtype="float32").state_dict(), load(tmp_path / "p", dtype="float32").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = json.loads((byte_msa / "config.json").read_text())
    for out, options, model, needle in [
            (tmp_path / "bad", ["--topk", "2", "--min-blocks", "3"], byte_msa, "exceeds"),
            (tmp_path / "p", ["--topk", "3"], byte_msa, "exists"),
            (tmp_path / "dense", ["--topk", "3"], ROOT / "checkpoints" / "byte-llama", "not a model m3compile converted")]:
        existed = out.exists()
        done = budget(out, *options, model=model)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert out.exists() == existed and not list(tmp_path.glob("*.part"))
    assert json.loads((byte_msa / "config.json").read_text()) == before  # the source untouched


def test_a_loss_below_dense_is_written_with_its_own_sign(tmp_path):
    """A trained model's sparse loss below its own dense (the sparse-training run's row) reads -0.026%, not +-0.026%."""
    main = runpy.run_path(str(ROOT / "benchmarks" / "plot_frontier.py"))["main"]
    out = tmp_path / "out"
    (out / "p0.95-16-64").mkdir(parents=True)
    shutil.copy(RESULTS / "2026-12-07-h100-sparse-training-32k" / "p0.95-16-64+k256+off" / "loss.json",
                out / "p0.95-16-64" / "loss.json")
    tasks = {"niah_single_1": [100, 100], "niah_multikey_3": [50, 40]}
    (out / "ruler_dense.json").write_text(json.dumps(ruler_json("dense", tasks)))
    (out / "p0.95-16-64" / "ruler.json").write_text(json.dumps(ruler_json("index", tasks)))
    main([str(out)])
    row = (out / "frontier.md").read_text().splitlines()[3]
    assert row.startswith("| p0.95-16-64 | ") and "| -0.026%, -0.029% |" in row, row


def test_answer_attention_spread_counts_the_blocks_of_the_last_rows_mass():
    """benchmarks/experiments/answer_attention_spread.py: its attention function returns SDPA's output, and keeps for
    the last rows each KV group's head-mean causal attention per key block; blocks_for counts the fewest blocks that
    hold a share p of a row's mass, never more than the row can see."""
    import torch
    import torch.nn.functional as F

    script = runpy.run_path(str(ROOT / "benchmarks" / "experiments" / "answer_attention_spread.py"))
    attend, rows, state, blocks_for = (script[k] for k in ("_spread_attention", "ROWS", "STATE", "blocks_for"))
    Hq, Hkv, T, D, bs, R = 6, 2, 37, 8, 8, 5
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    state.update(rows=R, block=bs)
    layer = type("Layer", (), {"layer_idx": 3})()
    out, _ = attend(layer, q, k, v, None, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                                          scale=0.3)
    torch.testing.assert_close(out, want.transpose(1, 2))
    mass = rows[3]
    assert mass.shape == (Hkv, R, 5)
    torch.testing.assert_close(mass.sum(-1), torch.ones(Hkv, R))
    for g in range(Hkv):
        for r in range(R):
            t = T - R + r
            p = sum(torch.softmax(q[0, h, t] @ k[0, g, : t + 1].T * 0.3, -1) for h in range(3 * g, 3 * g + 3)) / 3
            torch.testing.assert_close(mass[g, r], torch.zeros(5).index_add_(0, torch.arange(t + 1) // bs, p))
    m = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    assert blocks_for(m, 0.8, torch.tensor([4, 4, 4])).tolist() == [2, 4, 1]
    assert blocks_for(m, 0.95, torch.tensor([4, 4, 4])).tolist() == [3, 4, 1]
    assert blocks_for(m, 0.95, torch.tensor([2, 2, 2])).tolist() == [2, 2, 1]


def test_index_temperature_divides_the_index_scores_and_sharper_keeps_fewer_blocks(byte_msa, tmp_path):
    """benchmarks/experiments/index_temperature.py: dividing the index query norm's gain by T divides every index
    score by T, so at one top_p a lower T keeps no more blocks (the top blocks' softmax share only grows as T falls),
    and the model's own gains come back after the grid."""
    import torch

    from m3compile import load

    script = runpy.run_path(str(ROOT / "benchmarks" / "experiments" / "index_temperature.py"))
    model = load(byte_msa, dtype="float32")
    norm = next(m for n, m in model.named_modules() if n.endswith("index_q_norm"))
    x = torch.randn(3, norm.weight.numel())
    before = norm(x)
    gains = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("index_q_norm")}
    script["set_temperature"](model, gains, 0.5)
    torch.testing.assert_close(norm(x), 2 * before)
    out = tmp_path / "t.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "experiments" / "index_temperature.py"),
                           str(byte_msa), str(EVAL_DATA), "--seq-len", "256", "--max-windows", "1", "--floor", "1",
                           "--ceiling", "16", "--top-ps", "0.5,0.9", "--temperatures", "0.25,1,4", "--at-p", "0.5",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    at_p = {r["temperature"]: r for r in rows if r["top_p"] == 0.5 and "oracle_blocks" not in r}
    assert at_p[0.25]["blocks"] <= at_p[1.0]["blocks"] <= at_p[4.0]["blocks"]
    assert at_p[0.25]["blocks"] < at_p[4.0]["blocks"]
    first = next(r for r in rows if r["top_p"] == 0.5 and "oracle_blocks" in r)
    assert at_p[1.0]["blocks"] == first["blocks"] and at_p[1.0]["loss_increase"] == first["loss_increase"]
