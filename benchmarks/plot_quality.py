"""Loss vs distillation tokens (PNG) from benchmarks/quality_real.sh results merged into one JSON per model.

    python3 benchmarks/plot_quality.py RESULTS_DIR OUT.png
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curve(merged: dict, tag: str):
    """(tokens, loss increase %) from the calibrated init through each distillation total, and the oracle's %."""
    points = [(0, merged[f"{tag}-c.eval.json"]["loss_increase"])]
    for name, d in sorted(merged.items()):
        if name.startswith(f"{tag}-d") and name.endswith(".distill.json"):
            steps = d["steps"]
            tokens = d["tokens"] * steps / (steps - d["start_step"])  # the run's total, resumed runs included
            points.append((tokens, merged[name.replace(".distill.json", ".eval.json")]["loss_increase"]))
    points.sort()
    oracle = merged[f"{tag}-w.eval.json"]["oracle_loss_increase"]
    weight_only = merged[f"{tag}-w.eval.json"]["loss_increase"]
    return [t for t, _ in points], [100 * v for _, v in points], 100 * oracle, 100 * weight_only


def main(results: Path, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, tag, title) in zip(axes, [("smollm2.json", "smollm2-b64k8", "SmolLM2-135M (real, BPE)"),
                                             ("byte.json", "byte-b64k8", "dense-llama-byte (../shared)")]):
        merged = json.loads((results / name).read_text())
        tokens, loss, oracle, weight_only = curve(merged, tag)
        ax.plot([t / 1e6 for t in tokens], loss, "o-", label="calibrated init, then KL distillation")
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
    main(Path(sys.argv[1]), Path(sys.argv[2]))
