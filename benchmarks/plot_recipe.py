#!/usr/bin/env python3
"""The 32K distillation recipe's curves and table, from the JSON that benchmarks/distill_recipe_32k.sh writes.

    python3 benchmarks/plot_recipe.py OUT [--png OUT/recipe.png] [--reference RULER_JSON] [--exclude TASK,...]

For every budget found in OUT (OUT/b{block}k{topk}/, or OUT/b{block}k{topk}-{TAG}/ from a run with TAG): loss over
dense (%) against distillation tokens with the oracle selection's as a dashed line, and the RULER-style average
(MSA selection) against tokens, one line per prompt length; then a markdown table for BENCHMARKS.md: tokens, loss %,
oracle %, the RULER average at each length and over all, the distillation's tokens/s and peak GPU memory (over the
calls that reached the stage).

The RULER average leaves out the tasks the dense model fails: those `excluded` in --reference (an `m3c eval ruler
--json` run with the dense row, e.g. benchmarks/ruler_real.sh's ruler.json; its dense averages become the
reference lines), or those named by --exclude; with neither, every task counts (the table says which).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


BUDGET = re.compile(r"b(\d+)k(\d+)(?:-([\w.]+))?")  # a budget's folder: b128k16, or b128k16-TAG


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _runs(budget: Path) -> list[dict]:
    path = budget / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def ruler_average(r: dict, excluded: set[str], length: str | None = None) -> float | None:
    """Mean score of the index selection over the tasks not excluded, at one length (None: over every length). The
    suite's JSON names it "index"; the results of its runs before that, "msa"."""
    lengths = [str(n) for n in r["lengths"]] if length is None else [length]
    sel = "index" if "index" in r["selections"] else "msa"
    values = [r["scores"][t][sel][n] for t in r["tasks"] if t not in excluded for n in lengths
              if r["scores"][t][sel].get(n) is not None]
    return sum(values) / len(values) if values else None


def collect(out: Path, excluded: set[str]) -> dict[str, list[dict]]:
    """{budget: [stage rows in token order]}: tokens, loss and oracle % over dense, RULER averages, speed."""
    budgets = {}
    for budget in sorted(out.glob("b*k*"), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)]):
        if not BUDGET.fullmatch(budget.name):
            continue
        runs = _runs(budget)
        rows = []
        for stage in sorted(budget.glob("steps-*")):
            steps = int(stage.name.split("-")[1])
            loss, ruler, run = (_read(stage / f) for f in ("loss.json", "ruler.json", "distill.json"))
            if loss is None and ruler is None:
                continue
            seq_len = (loss or {}).get("seq_len") or (runs[0]["seq_len"] if runs else 32768)
            batch = runs[0]["batch"] if runs else 1
            reached = [r for r in runs if r["end_step"] <= steps and r["tokens"]]
            tokens, seconds = sum(r["tokens"] for r in reached), sum(r["seconds"] for r in reached)
            peaks = [r["peak_gb"] for r in reached if r.get("peak_gb") is not None]
            row = {"budget": budget.name, "steps": steps, "tokens": steps * seq_len * batch,
                   "loss_pct": None if loss is None else 100 * loss["loss_increase"],
                   "oracle_pct": None if loss is None or loss.get("oracle_loss_increase") is None
                   else 100 * loss["oracle_loss_increase"],
                   "recall": None if loss is None else loss.get("mean_recall"),
                   "tokens_per_s": tokens / seconds if seconds else None, "peak_gb": max(peaks) if peaks else None,
                   "kept_step": ((run or {}).get("holdout") or {}).get("kept", {}).get("step") if run else None,
                   "ruler": None}
            if ruler is not None:
                row["ruler"] = {str(n): ruler_average(ruler, excluded, str(n)) for n in ruler["lengths"]}
                row["ruler"]["all"] = ruler_average(ruler, excluded)
            rows.append(row)
        if rows:
            budgets[budget.name] = rows
    return budgets


def _label(name: str) -> str:
    """b128k16-cos -> "128 / 16 (cos)"."""
    block, topk, tag = BUDGET.fullmatch(name).groups()
    return f"{block} / {topk}" + (f" ({tag})" if tag else "")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _tokens(n: int) -> str:
    if not n:
        return "0 (init)"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def table(budgets: dict[str, list[dict]], excluded: set[str]) -> str:
    lengths = sorted({k for rows in budgets.values() for r in rows if r["ruler"] for k in r["ruler"] if k != "all"},
                     key=int)
    head = (["budget", "tokens", "loss vs dense", "oracle", "recall"]
            + [f"RULER {int(n) // 1024}K" for n in lengths] + ["RULER avg", "tokens/s", "peak GB"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, rows in budgets.items():
        for r in rows:
            ruler = r["ruler"] or {}
            cells = [_label(name), _tokens(r["tokens"]), _fmt(r["loss_pct"], "+.2f") + "%",
                     _fmt(r["oracle_pct"], "+.2f") + "%", _fmt(r["recall"], ".3f")]
            cells += [_fmt(ruler.get(n), ".1f") for n in lengths] + [_fmt(ruler.get("all"), ".1f")]
            cells += [_fmt(r["tokens_per_s"], ",.0f"), _fmt(r["peak_gb"], ".1f")]
            lines.append("| " + " | ".join(cells) + " |")
    note = (f"RULER averages leave out {', '.join(sorted(excluded))} (the dense model fails them)" if excluded
            else "RULER averages over every task (no dense reference given)")
    return "\n".join(lines) + f"\n\n{note}; loss and oracle in % over dense at the eval's sequence length."


def plot(budgets: dict[str, list[dict]], png: Path, reference: dict | None, excluded: set[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ruler) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rows) in enumerate(budgets.items()):
        c = colors[i % len(colors)]
        label = _label(name)
        pts = [(r["tokens"] / 1e6, r["loss_pct"]) for r in rows if r["loss_pct"] is not None]
        if pts:
            ax_loss.plot(*zip(*pts), "o-", color=c, label=f"{label} distilled")
        oracle = [r["oracle_pct"] for r in rows if r["oracle_pct"] is not None]
        if oracle:
            ax_loss.axhline(sum(oracle) / len(oracle), color=c, ls="--", lw=1, label=f"{label} oracle")
        styles = ["o-", "s--", "^:", "d-."]
        lengths = sorted({k for r in rows if r["ruler"] for k in r["ruler"] if k != "all"}, key=int)
        for j, n in enumerate(lengths):
            pts = [(r["tokens"] / 1e6, r["ruler"][n]) for r in rows if r["ruler"] and r["ruler"].get(n) is not None]
            if pts:
                ax_ruler.plot(*zip(*pts), styles[j % len(styles)], color=c, label=f"{label}, {int(n) // 1024}K")
    if reference is not None and "dense" in reference.get("average", {}):
        for n, v in reference["average"]["dense"].items():
            if n != "all" and v is not None:
                ax_ruler.axhline(v, color="gray", lw=0.8, ls=":")
                ax_ruler.annotate(f"dense {int(n) // 1024}K", (0, v), fontsize=7, color="gray", va="bottom")
    ax_loss.set(xlabel="distillation tokens (M)", ylabel="loss over dense (%)", title="32K loss, held-out long code")
    ax_ruler.set(xlabel="distillation tokens (M)", ylabel="RULER-style average (MSA)",
                 title="RULER-style average" + (f" (without {', '.join(sorted(excluded))})" if excluded else ""))
    for ax in (ax_loss, ax_ruler):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the OUT_DIR of benchmarks/distill_recipe_32k.sh")
    ap.add_argument("--png", type=Path, help="the plot [default: OUT/recipe.png]")
    ap.add_argument("--reference", type=Path, help="a RULER run with the dense row (its exclusions, its averages)")
    ap.add_argument("--exclude", default="", help="comma-separated tasks left out of the RULER averages")
    ap.add_argument("--json", type=Path, help="also write the collected rows to this file")
    a = ap.parse_args()
    reference = _read(a.reference) if a.reference else None
    excluded = set(reference.get("excluded", [])) if reference else set()
    excluded |= {t for t in a.exclude.split(",") if t}
    budgets = collect(a.out, excluded)
    if not budgets:
        raise SystemExit(f"error: no budget with an evaluated stage under {a.out} (b<block>k<topk>/steps-*/)")
    png = a.png or a.out / "recipe.png"
    plot(budgets, png, reference, excluded)
    if a.json:
        a.json.write_text(json.dumps(budgets, indent=2) + "\n")
    print(table(budgets, excluded))
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
