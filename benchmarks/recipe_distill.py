#!/usr/bin/env python3
"""The Python steps of benchmarks/distill_recipe_32k.sh and benchmarks/train_recipe_32k.sh: the token files, and
one stage of distillation or of continued training that records its speed and peak memory.

    python3 benchmarks/recipe_distill.py prepare TOKENIZER_DIR CALIB_TXT EVAL_TXT OUT_DIR [--calib-chars N]
        [--train-chars N]
        OUT_DIR/calib_ids.npy  the conversion's calibration ids: the first --calib-chars characters of CALIB_TXT
                               (4,000,000, as benchmarks/ruler_real.sh)
        OUT_DIR/train_ids.npy  the distillation data: CALIB_TXT (its first --train-chars characters when given)
        OUT_DIR/eval_ids.npy   the loss eval's data: EVAL_TXT
        Whole files go through m3compile's own reader (the ids `m3c distill` / `m3c eval` would take from the text).

    python3 benchmarks/recipe_distill.py distill MODEL_DIR DATA OUT_DIR --steps N --record RUNS.jsonl [options]
        m3compile.distill up to N steps in total: a new run, or the run saved in OUT_DIR resumed (bit for bit). Each
        call appends one line to RUNS.jsonl: the steps it went through, tokens, seconds (held-out evaluations
        excluded, as the run report counts them), tokens/s, peak GPU memory, and the held-out figures. SIGINT or
        SIGTERM (`timeout -s INT`) stops it after the step in flight with the state saved: exit 3, call again to
        continue. A stage that is reached prints the run report's summary (no per-step history) as JSON.

    python3 benchmarks/recipe_distill.py train MODEL_DIR DATA OUT_DIR --steps N --record RUNS.jsonl [options]
        The same with m3compile.train (every parameter through the sparse attention, plus --loss-coeff x the index
        KL; lr 1e-5 and no block loss unless given); its state is OUT_DIR/train_state.

    python3 benchmarks/recipe_distill.py budget MODEL_DIR OUT_DIR [--topk N] [--top-p P] [--min-blocks N]
        A copy of the converted MODEL_DIR (its files hard-linked where the file system allows) whose stored
        selection budget is the one given (sparse_attention_config: topk the ceiling, top-p and its floor), so that
        a later distillation or training runs at it; checked as m3compile reads a config. OUT_DIR must not exist.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from m3compile import DistillConfig, DistillInterrupted, M3CompileError, TrainConfig, distill, train
from m3compile.data import load_tokens

EXIT_STOPPED = 3


def prepare(a) -> None:
    from tokenizers import Tokenizer

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(a.tokenizer_dir) / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    with open(a.calib_txt, encoding="utf-8") as f:
        head = f.read(a.calib_chars)
    _save(out / "calib_ids.npy", np.array(tok.encode(head).ids, dtype=np.int32))
    if a.train_chars:
        with open(a.calib_txt, encoding="utf-8") as f:
            train = np.array(tok.encode(f.read(a.train_chars)).ids, dtype=np.int32)
    else:
        train = load_tokens(a.calib_txt, vocab, a.tokenizer_dir).numpy().astype(np.int32)
    _save(out / "train_ids.npy", train)
    _save(out / "eval_ids.npy", load_tokens(a.eval_txt, vocab, a.tokenizer_dir).numpy().astype(np.int32))


def budget(a) -> int:
    import os
    import shutil

    from m3compile.io.hf_config import args_from_config, read_config

    src, out = Path(a.model_dir), Path(a.out_dir)
    if out.exists():
        print(f"error: {out} exists", file=sys.stderr)
        return 2
    config = json.loads((src / "config.json").read_text())
    sparse = config.get("sparse_attention_config")
    if not isinstance(sparse, dict) or "sparse_topk_blocks" not in sparse:
        print(f"error: {src} is not a model m3compile converted (no sparse_attention_config)", file=sys.stderr)
        return 2
    for key, value in (("sparse_topk_blocks", a.topk), ("sparse_top_p", a.top_p), ("sparse_min_blocks", a.min_blocks)):
        if value is not None:
            sparse[key] = value
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    try:
        args_from_config(read_config(tmp))
    except M3CompileError as e:
        shutil.rmtree(tmp)
        print(f"error: {e}", file=sys.stderr)
        return 2
    tmp.rename(out)
    print(f"wrote {out}: topk {sparse['sparse_topk_blocks']}, top-p {sparse.get('sparse_top_p', 1.0)}, "
          f"floor {sparse.get('sparse_min_blocks', 0)}", file=sys.stderr)
    return 0


def _save(path: Path, ids: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, ids)
    tmp.replace(path)
    print(f"wrote {path}: {ids.size:,} tokens", file=sys.stderr)


def run_stage(a) -> int:
    out = Path(a.out_dir)
    training = a.cmd == "train"
    resume = (out / ("train_state" if training else "distill_state") / "state.json").is_file()
    common = dict(steps=a.steps, seq_len=a.seq_len, batch=a.batch, lr=a.lr, warmup_steps=a.warmup_steps,
                  checkpoint_every=a.checkpoint_every, dtype=a.dtype, block_loss=a.block_loss,
                  holdout_tokens=a.holdout_tokens, cuda_graph=a.cuda_graph, lr_schedule=a.lr_schedule,
                  lr_warmup_steps=a.lr_warmup, lr_decay_steps=a.lr_decay_steps, lr_min=a.lr_min)
    config = (TrainConfig(**common, loss_coeff=a.loss_coeff, lm_target=a.lm_target, recompute_mlp=a.recompute_mlp)
              if training else DistillConfig(**common))
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    last = [time.perf_counter()]

    def progress(step: int, total: int, m: dict) -> None:
        if step % a.log_every == 0 or step == total or time.perf_counter() - last[0] > 60:
            last[0] = time.perf_counter()
            lm = f"  LM {m['lm']:.4f}" if "lm" in m else ""
            print(f"  step {step}/{total}{lm}  KL {m['kl']:.4f}  recall {m['recall']:.3f}  "
                  f"{m['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)

    stopped = False
    try:
        (train if training else distill)(a.model_dir, a.data, out, config, device=a.device, resume=resume,
                                         progress=progress)
    except DistillInterrupted:
        stopped = True
    except M3CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = json.loads((out / ("train_report.json" if training else "distill_report.json")).read_text())
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 1e9 if cuda else None
    end = report["history"][-1]["step"] if report["history"] else report["start_step"]
    record = {"start_step": report["start_step"], "end_step": end, "target_steps": a.steps,
        "seq_len": a.seq_len, "batch": a.batch, "tokens": report["tokens"], "seconds": round(report["seconds"], 3),
        "tokens_per_s": report["tokens_per_s"], "peak_gb": None if peak is None else round(peak, 2),
        "peak_reserved_gb": None if reserved is None else round(reserved, 2), "stopped": stopped,
        "cuda_graph": a.cuda_graph, "holdout": report.get("holdout")}
    with open(a.record, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"steps {record['start_step']} -> {record['end_step']} of {a.steps}: {record['tokens']:,} tokens in "
          f"{record['seconds']:.1f} s ({record['tokens_per_s']:,.0f} tok/s), peak {record['peak_gb']} GB"
          + ("; stopped, state saved" if stopped else ""), file=sys.stderr)
    if stopped:
        return EXIT_STOPPED
    summary = {k: v for k, v in report.items() if k != "history"}
    last_step = report["history"][-1] if report["history"] else {}
    summary["final"] = {k: last_step.get(k) for k in ("step", "mode", "lm", "kl", "recall", "block")}
    summary["peak_gb"], summary["peak_reserved_gb"] = record["peak_gb"], record["peak_reserved_gb"]
    print(json.dumps(summary, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="the token files")
    p.add_argument("tokenizer_dir")
    p.add_argument("calib_txt")
    p.add_argument("eval_txt")
    p.add_argument("out_dir")
    p.add_argument("--calib-chars", type=int, default=4_000_000)
    p.add_argument("--train-chars", type=int, default=0, help="0: the whole file")
    for name, what in (("distill", "one stage of distillation"), ("train", "one stage of continued training")):
        _stage_options(sub.add_parser(name, help=what), training=name == "train")
    b = sub.add_parser("budget", help="a copy of a converted model with another stored selection budget")
    b.add_argument("model_dir")
    b.add_argument("out_dir")
    b.add_argument("--topk", type=int, help="the ceiling (the fixed top-k when --top-p is 1)")
    b.add_argument("--top-p", type=float)
    b.add_argument("--min-blocks", type=int, help="the adaptive budget's floor")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a)
        return 0
    if a.cmd == "budget":
        return budget(a)
    return run_stage(a)


def _stage_options(d: argparse.ArgumentParser, training: bool) -> None:
    d.add_argument("model_dir")
    d.add_argument("data")
    d.add_argument("out_dir")
    d.add_argument("--steps", type=int, required=True)
    d.add_argument("--record", required=True)
    d.add_argument("--seq-len", type=int, default=32768)
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--lr", type=float, default=1e-5 if training else 1e-3)
    d.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    d.add_argument("--lr-warmup", type=int, default=0)
    d.add_argument("--lr-decay-steps", type=int, default=None)
    d.add_argument("--lr-min", type=float, default=None)
    d.add_argument("--warmup-steps", type=int, default=0)
    d.add_argument("--checkpoint-every", type=int, default=250)
    d.add_argument("--holdout-tokens", type=int, default=None)
    d.add_argument("--block-loss", type=float, default=0.0 if training else 1.0)
    if training:
        d.add_argument("--loss-coeff", type=float, default=1.0, help="weight of the index KL beside the LM loss")
        d.add_argument("--lm-target", choices=("data", "dense"), default="data",
                       help="the LM loss: the next token of DATA, or the model's own dense output (m3c train)")
        d.add_argument("--recompute-mlp", action="store_true", help="m3c train --recompute-mlp")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--device", default="cuda")
    d.add_argument("--cuda-graph", action="store_true")
    d.add_argument("--log-every", type=int, default=50)


if __name__ == "__main__":
    sys.exit(main())
