"""Whether a sharper (or flatter) index distribution buys an adaptive budget fewer blocks at the same loss.

The adaptive budget (docs/msa.md 2.8) keeps, per (KV group, query), the fewest blocks whose index probability
softmax_b(S / T) reaches top_p. The index branch's scores pass its query RMSNorm's gain (1 + w, "gemma" style) before
the dot product, so scaling that gain by 1 / T divides every score by T: a temperature, with no kernel changed. Where
the index's distribution is flatter than the attention it estimates (it keeps more blocks than the oracle at the same
top_p), T < 1 cuts blocks; the question is whether the loss follows the blocks as it does when top_p moves. This
script evaluates one converted model over a grid of top_p at T = 1 and of T at one top_p, each with its mean blocks
kept per (KV group, query) and the loss over dense (m3compile.evaluation.loss.evaluate), and the oracle's blocks and
loss at each top_p (a perfect selection under the same budget; the temperature does not change it). At equal blocks
the lower loss wins: the T rows against the top_p rows.

    python benchmarks/experiments/index_temperature.py MODEL_DIR DATA --seq-len 2048 --max-windows 2 \
        [--floor 4] [--ceiling 32] [--top-ps 0.8,0.9,0.95,0.98] [--temperatures 0.5,0.7,1.4] [--at-p 0.9]
        [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from m3compile.data import load_tokens
from m3compile.evaluation.loss import evaluate
from m3compile.io.load import load


def set_temperature(model, gains: dict, t: float) -> None:
    """The index query norms' gains (1 + w) divided by t, from the model's own `gains` (saved before any change)."""
    for name, module in model.named_modules():
        if name.endswith("index_q_norm"):
            module.weight.data.copy_((1 + gains[name]) / t - 1)


def row(model, ids, args, top_p: float, t: float, oracle: bool) -> dict:
    model.set_budget(top_p=top_p, min_blocks=args.floor, topk=args.ceiling)
    start = time.perf_counter()
    report = evaluate(model, ids, args.seq_len, args.max_windows, oracle=oracle)
    r = report.to_dict()
    out = {"top_p": top_p, "temperature": t, "blocks": r["mean_blocks"], "loss_increase": r["loss_increase"],
           "recall": r["mean_recall"], "seconds": round(time.perf_counter() - start, 1)}
    if oracle:
        out |= {"oracle_blocks": report.mean_oracle_blocks, "oracle_loss_increase": r["oracle_loss_increase"]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=2)
    ap.add_argument("--floor", type=int, default=4)
    ap.add_argument("--ceiling", type=int, default=32)
    ap.add_argument("--top-ps", default="0.8,0.9,0.95,0.98")
    ap.add_argument("--temperatures", default="0.5,0.7,1.4")
    ap.add_argument("--at-p", type=float, default=0.9, help="the top_p of the temperature rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load(args.model, dtype=torch.float32).eval()
    ids = load_tokens(args.data, model.args.vocab_size, args.model)
    gains = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("index_q_norm")}
    if not gains:
        raise SystemExit(f"error: {args.model} has no index branch (not converted)")
    rows = [row(model, ids, args, float(p), 1.0, oracle=True) for p in args.top_ps.split(",")]
    for t in args.temperatures.split(","):
        set_temperature(model, gains, float(t))
        rows.append(row(model, ids, args, args.at_p, float(t), oracle=False))
    set_temperature(model, gains, 1.0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "seq_len": args.seq_len, "max_windows": args.max_windows,
                       "floor": args.floor, "ceiling": args.ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
