"""The README's headline picture, drawn from the measured results in benchmarks/results/ (the figures of
BENCHMARKS.md), nothing typed in:

    python3 benchmarks/plot_headline.py                 # writes docs/headline.png
    python3 benchmarks/plot_headline.py --out x.png

Panels: MSA prefill and decode speed over dense attention at M3's attention shapes on one H200 (2026-12-02 runs of
`m3c bench kernels`), and the loss cost of sparse attention at 8K tokens, block 64 / top-8, on the shared
byte-level model and on SmolLM2-135M (`m3c eval` JSON of the 2026-12-01 runs).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
M3 = RESULTS / "2026-12-02-h200-m3-shapes"  # BENCHMARKS.md, "Kernels at M3 shapes"
PREFILL = M3 / "prefill.json"
DECODE = M3 / "decode.json"
Q1, Q2 = RESULTS / "2026-12-01-h200-quality", RESULTS / "2026-12-02-h200-quality"
QUALITY = {  # bar label -> (eval JSON, its entry in a merged results file or None, which loss); what today's
    # `m3c convert --index-dim 128 --calib` (index rope "tile") and `m3c distill --block-loss 1` give (BENCHMARKS.md,
    # "Quality"), beside the oracles
    "byte model\ndistilled\n(dim 128)": (Q2 / "byte_index_rope_tile.json", "t128d.eval.json", "sparse_loss"),
    "byte model\noracle": (Q1 / "byte_block_loss.json", "bc.eval.json", "oracle_loss"),
    "SmolLM2\ncalibrated\ninit (dim 128)": (Q2 / "smollm2_index_rope_tile.json", "t64.eval.json", "sparse_loss"),
    "SmolLM2\ndistilled\n(dim 128)": (Q2 / "smollm2_index_rope_tile.json", "t64d.eval.json", "sparse_loss"),
    "SmolLM2\noracle": (Q1 / "smollm2_block_loss.json", "c.eval.json", "oracle_loss"),
}


def figures() -> dict:
    """The plotted numbers: prefill rows (T, MSA x, attention x, ideal x, dense measured?), decode rows (T, bf16 x,
    fp8 x), quality bars (label, loss increase over the model's own dense attention, %)."""
    prefill = json.loads(PREFILL.read_text())
    rows = {r["T"]: r for r in prefill["prefill"] if r["selection"] == "independent"}
    speed = [s for s in prefill["speedups"]["prefill"] if s["selection"] == "independent"]
    decode = json.loads(DECODE.read_text())["speedups"]["decode"]
    quality = []
    for label, (path, entry, key) in QUALITY.items():
        result = json.loads(path.read_text())
        result = result[entry] if entry else result
        quality.append((label, 100 * (result[key] / result["dense_loss"] - 1)))
    return {
        "gpu": prefill["env"]["gpu"],
        "prefill": [(s["T"], s["msa_x"], s["attention_x"], s["ideal"], rows[s["T"]]["dense"] == "measured")
                    for s in speed],
        "decode": [(d["T"], d["bf16_x"], d["fp8_x"]) for d in decode],
        "quality": quality,
    }


def _length(t: int) -> str:
    return f"{t >> 20}M" if t >= 1 << 20 else f"{t >> 10}K"


def draw(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    f = figures()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.4))
    ts = [r[0] for r in f["prefill"]]
    a.plot(ts, [r[3] for r in f["prefill"]], "k--", lw=1, label="ideal (dense / selected FLOPs)")
    a.plot(ts, [r[2] for r in f["prefill"]], "o-", color="tab:orange", label="sparse attention alone")
    a.plot(ts, [r[1] for r in f["prefill"]], "o-", color="tab:blue", label="MSA: indexer + sparse attention")
    for t, msa, _, _, measured in f["prefill"]:
        if not measured:
            a.plot([t], [msa], "o", color="white", mec="tab:blue", zorder=3)
        a.annotate(f"{msa:.1f}x", (t, msa), textcoords="offset points", xytext=(8, -12), ha="left", fontsize=8)
    a.set(title="Prefill, one sequence (hollow: dense extrapolated as T^2)", xlabel="context", ylabel="x faster than dense SDPA")
    td = [r[0] for r in f["decode"]]
    b.plot(td, [r[1] for r in f["decode"]], "o-", color="tab:blue", label="bf16 index keys")
    b.plot(td, [r[2] for r in f["decode"]], "o-", color="tab:green", label="fp8 index keys")
    for t, bf16, fp8 in f["decode"]:
        b.annotate(f"{bf16:.2f}x", (t, bf16), textcoords="offset points", xytext=(0, -13), ha="center", fontsize=8)
        b.annotate(f"{fp8:.2f}x", (t, fp8), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    b.set(title="Decode step, batch 8", xlabel="context", ylabel="x faster than dense SDPA")
    a.set_yscale("log")
    a.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    b.set_ylim(0, max(r[2] for r in f["decode"]) * 1.15)
    for ax, xs in ((a, ts), (b, td)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_length(t) for t in xs])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    labels, values = zip(*f["quality"])
    colors = ["tab:blue", "tab:gray", "tab:red", "tab:orange", "tab:gray"]
    bars = c.bar(range(len(values)), values, color=colors)
    c.bar_label(bars, [f"+{v:.2f}%" for v in values], fontsize=8)
    c.set_xticks(range(len(labels)), labels, fontsize=7)
    c.set(title="Loss cost at 8K tokens, block 64 / top-8", ylabel="% more loss than the model's dense attention")
    c.set_ylim(0, max(values) * 1.12)
    c.grid(alpha=0.3, axis="y")
    fig.suptitle(f"MSA at M3's attention shapes (64 q / 4 KV heads, d 128, block 128, top-16) on one {f['gpu']}, "
                 "and what sparse attention costs in loss", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "headline.png")
    print(f"wrote {draw(parser.parse_args().out)}")


if __name__ == "__main__":
    main()
