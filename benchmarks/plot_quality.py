"""Loss vs distillation tokens (PNG) from benchmarks/quality_real.sh results merged into one JSON per model.

    python3 benchmarks/plot_quality.py RESULTS_DIR OUT.png [BLOCK_LOSS_JSON] [--run LABEL:PANEL:FILE:INIT:DISTILLED ...]

BLOCK_LOSS_JSON (optional): a merged JSON of `m3c distill --block-loss 1` runs from the same calibrated SmolLM2 init
(keys d1_<steps>.distill.json / d1_<steps>.eval.json), drawn as a second curve on the SmolLM2 panel.
--run (repeatable): one more recipe from a device call's merged JSON FILE, drawn from its init (INIT.eval.json) to
its distilled model (DISTILLED.distill.json's tokens, DISTILLED.eval.json) on PANEL (smollm2 or byte). A run stopped
by its time limit printed no report: give its tokens as a sixth field (`interrupted after step N` in the call's log,
times batch x sequence length). INIT "-": no init row (its eval did not come back), the distilled point alone.
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def total_tokens(distill: dict) -> float:
    """The run's total distillation tokens, resumed runs included (a report counts its own steps' tokens)."""
    return distill["tokens"] * distill["steps"] / (distill["steps"] - distill["start_step"])


def curve(merged: dict, tag: str):
    """(tokens, loss increase %) from the calibrated init through each distillation total, and the oracle's %."""
    points = [(0, merged[f"{tag}-c.eval.json"]["loss_increase"])]
    for name, d in sorted(merged.items()):
        if name.startswith(f"{tag}-d") and name.endswith(".distill.json"):
            points.append((total_tokens(d), merged[name.replace(".distill.json", ".eval.json")]["loss_increase"]))
    points.sort()
    oracle = merged[f"{tag}-w.eval.json"]["oracle_loss_increase"]
    weight_only = merged[f"{tag}-w.eval.json"]["loss_increase"]
    return [t for t, _ in points], [100 * v for _, v in points], 100 * oracle, 100 * weight_only


def block_curve(merged: dict, start: float):
    """(tokens, loss increase %) of the block-loss runs d1_<steps>, from the shared calibrated init's `start`."""
    points = [(0, start)]
    for name, d in merged.items():
        if name.startswith("d1_") and name.endswith(".distill.json"):
            points.append((total_tokens(d), 100 * merged[name.replace(".distill.json", ".eval.json")]["loss_increase"]))
    points.sort()
    return [t for t, _ in points], [v for _, v in points]


def run_points(spec: str):
    """(panel, label, [tokens], [loss %]) of one --run LABEL:PANEL:FILE:INIT:DISTILLED[:TOKENS]."""
    label, panel, file, init, distilled, *given = spec.split(":")
    merged = json.loads(Path(file).read_text())
    tokens = [0.0, float(given[0]) if given else total_tokens(merged[f"{distilled}.distill.json"])]
    loss = [100 * merged[f"{name}.eval.json"]["loss_increase"] for name in (init, distilled) if name != "-"]
    return panel, label, tokens[-len(loss):], loss


def main(results: Path, out: Path, block: Path | None = None, runs=()) -> None:
    extra = [run_points(r) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, tag, title) in zip(axes, [("smollm2.json", "smollm2-b64k8", "SmolLM2-135M (real, BPE)"),
                                             ("byte.json", "byte-b64k8", "dense-llama-byte (../shared)")]):
        merged = json.loads((results / name).read_text())
        tokens, loss, oracle, weight_only = curve(merged, tag)
        ax.plot([t / 1e6 for t in tokens], loss, "o-", label="calibrated init, then token-KL distillation")
        if block is not None and tag.startswith("smollm2"):
            bt, bl = block_curve(json.loads(block.read_text()), loss[0])
            ax.plot([t / 1e6 for t in bt], bl, "s-", color="C1", label="token KL + block loss (lambda 1)")
            for t, v in zip(bt[1:], bl[1:]):
                ax.annotate(f"{v:+.2f}%", (t / 1e6, v), textcoords="offset points", xytext=(4, -12), fontsize=8,
                            color="C1")
        for i, (panel, label, rt, rl) in enumerate(e for e in extra if tag.startswith(e[0])):
            ax.plot([t / 1e6 for t in rt], rl, "^--", color=f"C{3 + i}", label=label)
            ax.annotate(f"{rl[-1]:+.2f}%", (rt[-1] / 1e6, rl[-1]), textcoords="offset points", xytext=(4, -12 - 9 * i),
                        fontsize=8, color=f"C{3 + i}")
        ax.axhline(oracle, color="g", ls="--", label=f"oracle selection ({oracle:+.2f}%)")
        ax.axhline(weight_only, color="r", ls=":", label=f"weight-only init ({weight_only:+.1f}%)")
        for t, v in zip(tokens, loss):
            ax.annotate(f"{v:+.2f}%", (t / 1e6, v), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.set(title=f"{title}: 8K, block 64 / top-8", xlabel="distillation tokens (millions)",
               ylabel="eval loss vs dense (%)", ylim=(0, max(loss) * 1.25 if weight_only > 3 * max(loss) else None))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("block", type=Path, nargs="?")
    ap.add_argument("--run", action="append", default=[], help="LABEL:PANEL:FILE:INIT:DISTILLED")
    a = ap.parse_args()
    main(a.results, a.out, a.block, a.run)
