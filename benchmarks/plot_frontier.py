#!/usr/bin/env python3
"""The quality-speed frontier's table and plot, from the JSON that benchmarks/frontier_32k.sh writes.

    python3 benchmarks/plot_frontier.py OUT [OUT2 ...] [--md OUT/frontier.md] [--png OUT/frontier.png]

One row per budget folder of each OUT (a folder holding loss.json; ruler.json, or its lengths split over
ruler-*.json, and speed.json where they exist), tagged with its OUT's name when several are given (e.g. one per
model: distilled, 2 extra dense layers, ...): the blocks each token kept on average (mean over MSA layers; p90: the
largest layer's) with the oracle's, loss over dense at 32K with the oracle's, the RULER-style average of the index
selection at each length with its standard error, and the llama3-8b preset's prefill and decode-step speed-ups at
the top-k nearest those blocks. Dense (OUT/ruler_dense.json) is the first row. A row A+B (A's prompt with the
answer budget B) takes its prefill from row A and its decode from row B; a row A+B+C (the answer itself at budget
C) its decode from row C. The RULER averages leave out the tasks the dense run excludes (a task it scores below 50
at the shortest length). The plot: RULER average over the lengths against the decode speed-up (prefill where no
decode was timed), one point per budget, dense as a line.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_ruler(folder: Path) -> dict | None:
    """A row's RULER-style run: folder/ruler.json, or the runs of the same command split by length across processes
    (folder/ruler-*.json, e.g. ruler-4K-8K.json and ruler-32K.json; the suite seeds each length's samples alone, so
    the parts are the samples one run makes), their scores and variances joined."""
    whole = _read(folder / "ruler.json")
    parts = [_read(p) for p in sorted(folder.glob("ruler-*.json"))]
    if whole is not None or not parts:
        return whole
    joined = {"lengths": sorted({n for p in parts for n in p["lengths"]}), "scores": {}, "variances": {},
              "excluded": sorted({t for p in parts for t in p.get("excluded", [])})}
    for p in parts:
        for key in ("scores", "variances"):
            for task, by_selection in (p.get(key) or {}).items():
                for selection, by_length in by_selection.items():
                    joined[key].setdefault(task, {}).setdefault(selection, {}).update(by_length)
    return joined


def ruler_cells(r: dict | None, selection: str, lengths: list[str], excluded: set[str]) -> dict[str, tuple]:
    """{length | "all": (average, standard error or None)} of one selection over the tasks not excluded."""
    if r is None:
        return {}
    out = {}
    for n in [*lengths, "all"]:
        keep = [n] if n != "all" else lengths
        scores = [r["scores"][task][selection][m] for task in r["scores"] if task not in excluded
                  for m in keep if m in r["scores"][task].get(selection, {})]
        if not scores:
            continue
        out[n] = (statistics.fmean(scores), _stderr(r, selection, keep, excluded))
    return out


def _stderr(r: dict, selection: str, lengths: list[str], excluded: set[str]) -> float | None:
    """The standard error of the mean over the tasks not excluded: from each score's s^2 / n (`variances`), or the
    run's own `stderr` where its exclusions are these (a JSON written before `variances` was kept)."""
    var = r.get("variances")
    if var:
        cells = [var[task][selection][m] for task in var if task not in excluded
                 for m in lengths if m in var[task].get(selection, {})]
        return math.sqrt(sum(cells)) / len(cells) if cells else None
    if set(r.get("excluded", [])) != excluded:
        return None
    return (r.get("stderr") or {}).get(selection, {}).get(lengths[0] if len(lengths) == 1 else "all")


def speedups(speed: dict | None) -> tuple[float | None, float | None, int | None]:
    """(prefill x, decode-step x, the top-k the bench ran) of an `m3c bench model` JSON."""
    if speed is None:
        return None, None, None
    prefill = next((p["speedup"] for p in speed.get("prefill_summary", []) if p.get("speedup")), None)
    decode = next((d["speedup"] for d in speed.get("decode", []) if d.get("speedup")), None)
    return prefill, decode, speed.get("config", {}).get("topk")


def rows(outs: list[Path]) -> tuple[list[dict], list[str], dict]:
    """The frontier's rows (dense first), the lengths (tokens, as the suite's JSON names them), dense's cells."""
    dense = next((d for d in (_read(o / "ruler_dense.json") for o in outs) if d), None)
    lengths = [str(n) for n in dense["lengths"]] if dense else []
    excluded = set(dense.get("excluded", [])) if dense else set()
    dense_cells = ruler_cells(dense, "dense", lengths, excluded)
    out = []
    for o in outs:
        for loss_path in sorted(o.glob("*/loss.json")):
            b = loss_path.parent
            loss = _read(loss_path)
            oracle = loss.get("oracle_blocks") or {}
            prefill, decode, topk = speedups(_read(b / "speed.json"))
            decode_topk = topk
            if "+" in b.name:  # A+B: A's prompt, B's question and answer: A's row's prefill, B's row's decode;
                prompt_row, answer_row = b.name.split("+", 1)  # A+B+C: the answer at C, C's row's decode
                answer_row = answer_row.split("+")[-1]
                answer_row = prompt_row if answer_row == "off" else answer_row  # off: the answer at A's budget
                prefill, _, topk = speedups(_read(o / prompt_row / "speed.json"))
                _, decode, decode_topk = speedups(_read(o / answer_row / "speed.json"))
            out.append({
                "name": b.name if len(outs) == 1 else f"{o.name} {b.name}",
                "blocks": loss.get("mean_blocks"),
                "blocks_p90": max((loss.get("blocks_p90") or {}).values(), default=None),
                "oracle_blocks": statistics.fmean(oracle.values()) if oracle else None,
                "loss": 100 * loss["loss_increase"],
                "oracle_loss": 100 * loss["oracle_loss_increase"] if loss.get("oracle_loss_increase") is not None
                else None,
                "ruler": ruler_cells(read_ruler(b), "index", lengths, excluded),
                "prefill": prefill, "decode": decode, "bench_topk": topk, "decode_topk": decode_topk,
            })
    return out, lengths, dense_cells


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _cell(c: tuple | None) -> str:
    if not c:
        return ""
    avg, err = c
    return f"{avg:.1f}" + (f" ± {err:.1f}" if err is not None else "")


def table(out: list[dict], lengths: list[str], dense_cells: dict) -> str:
    heads = [f"{int(n) // 1024}K" for n in lengths]
    lines = ["| budget | blocks (p90), oracle | loss vs dense, oracle | " + " | ".join(heads) +
             " | RULER average | prefill 128K | decode 128K, batch 8 |",
             "| --- " * (len(heads) + 6) + "|"]
    lines.append("| dense | | | " + " | ".join(_cell(dense_cells.get(n)) for n in lengths) +
                 f" | {_cell(dense_cells.get('all'))} | 1x | 1x |")
    for r in out:
        blocks = f"{_num(r['blocks'], '.1f')} ({_num(r['blocks_p90'], '.0f')}), {_num(r['oracle_blocks'], '.1f')}"
        loss = f"{r['loss']:+.3f}%, " + (f"{r['oracle_loss']:+.3f}%" if r["oracle_loss"] is not None else "")
        speed = [f"{x:.2f}x (top-{k})" if x is not None else ""
                 for x, k in ((r["prefill"], r["bench_topk"]), (r["decode"], r["decode_topk"]))]
        lines.append(f"| {r['name']} | {blocks} | {loss} | " + " | ".join(_cell(r["ruler"].get(n)) for n in lengths) +
                     f" | {_cell(r['ruler'].get('all'))} | {speed[0]} | {speed[1]} |")
    return "\n".join(lines) + "\n"


def plot(out: list[dict], dense_cells: dict, png: Path) -> bool:
    """RULER average against speed-up; False where no row has both."""
    points = [(r["decode"] or r["prefill"], r["ruler"]["all"][0], r["name"]) for r in out
              if (r["decode"] or r["prefill"]) and r["ruler"].get("all")]
    if not points:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    for x, y, name in points:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if dense_cells.get("all"):
        ax.axhline(dense_cells["all"][0], color="gray", linestyle="--", label="dense")
        ax.legend()
    ax.set_xlabel("speed-up over dense, llama3-8b preset at 128K (decode step, batch 8)")
    ax.set_ylabel("RULER-style average, real 32K model")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", nargs="+", type=Path)
    p.add_argument("--md", type=Path, default=None, help="the table's file [default: OUT/frontier.md]")
    p.add_argument("--png", type=Path, default=None, help="the plot's file [default: OUT/frontier.png]")
    args = p.parse_args(argv)
    missing = [str(o) for o in args.outs if not o.is_dir()]
    if missing:
        raise SystemExit(f"error: not a folder: {', '.join(missing)}")
    found, lengths, dense_cells = rows(args.outs)
    if not found:
        raise SystemExit(f"error: no budget folder with a loss.json in {', '.join(map(str, args.outs))}")
    text = table(found, lengths, dense_cells)
    md = args.md or args.outs[0] / "frontier.md"
    md.write_text(text)
    print(text, end="")
    if plot(found, dense_cells, args.png or args.outs[0] / "frontier.png"):
        print(f"wrote {md} and {args.png or args.outs[0] / 'frontier.png'}")


if __name__ == "__main__":
    main()
