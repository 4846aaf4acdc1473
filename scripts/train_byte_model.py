#!/usr/bin/env python3
"""Train the small byte-level Llama that the tests and the quickstart use, reproducibly, and write it as a Hugging
Face checkpoint.

    python3 scripts/code_data.py data/code                              # train.bin, calib.bin, eval.bin
    python3 scripts/train_byte_model.py data/code checkpoints/byte-llama --device cuda
    python3 scripts/train_byte_model.py data/code /tmp/byte-smoke --smoke   # 20 CPU steps: a test of the script

The model: m3compile's Decoder with vocab 256 (token id = byte value), hidden 192, 6 layers, 8 query / 2 KV heads
(group 4), head_dim 24, SwiGLU MLP of 384, RMSNorm eps 1e-6, RoPE theta 1e5, untied embeddings: 2.0M parameters,
4 MB in bf16. Training: random windows of --seq-len + 1 bytes of DATA_DIR/train.bin, drawn by a generator seeded
with --seed on the training device (the initial weights are seeded too); next-byte cross-entropy; AdamW (betas 0.9 / 0.95, weight decay 0.1 on
weight matrices only), linear warm-up over --warmup-steps then a cosine decay to 10% of --lr; bf16 autocast on
CUDA, fp32 on a CPU; gradients clipped to norm 1.0. A progress line every --log-every steps on stderr (loss, learning
rate, tokens/s). At the end, the eval loss in nats/byte of the weights as saved (rounded to bf16) on up to 64
consecutive windows of DATA_DIR/eval.bin at --seq-len.

OUT_DIR gets, through a temporary folder beside it renamed when complete (a non-empty OUT_DIR only with --force):

    config.json         a Llama config as transformers writes one (LlamaForCausalLM, bf16, max_position 8192)
    model.safetensors   the weights in bf16, named as transformers names them (model.embed_tokens.weight, ...)
    training.json       the arguments, steps, tokens seen, final train loss, eval loss, seconds, torch, device

`transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` and `m3compile.load(OUT_DIR)` both load it, with the same
logits. --smoke: 20 steps at --seq-len 64, --batch 4 on the CPU (seconds), for tests.

At the defaults a step takes about 28 ms on an H200 (2.3M tokens/s), so 2,000 steps (131M tokens, about 14 passes
over the 10 MB of train.bin) take about a minute. The same recipe reached about 0.85-1.0 nats/byte on eval.bin
after 1,500-3,000 steps, depending more on --seed than on the step count; much longer runs over-fit the small
training set (0.99 after 6,000 steps).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from m3compile.models.decoder import Decoder, ModelArgs

from _script import Parser, ScriptError, check_out_dir, write_dir

__all__ = ["ARGS", "hf_config", "lr_at", "train", "evaluate", "write_checkpoint"]

ARGS = ModelArgs(vocab_size=256, hidden_size=192, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=24,
                 intermediate_size=384, rms_norm_eps=1e-6, rope_theta=1e5)
MAX_POSITIONS = 8192
EVAL_WINDOWS = 64
SMOKE = {"steps": 20, "seq_len": 64, "batch": 4, "device": "cpu", "log_every": 5}


def hf_config(args: ModelArgs = ARGS) -> dict:
    """config.json as transformers writes it for a LlamaForCausalLM of these shapes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": MAX_POSITIONS,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def read_bytes(path: Path, need: int) -> torch.Tensor:
    """A data file as a 1-D uint8 tensor of at least `need` bytes."""
    if not path.is_file():
        raise ScriptError(f"{path}: no such file (make it with scripts/code_data.py)")
    data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    if data.numel() < need:
        raise ScriptError(f"{path} has {data.numel():,} bytes, fewer than the {need:,} of one window")
    return data


def init_weights(model: Decoder, seed: int) -> None:
    """GPT-2's initialisation: normal(0, 0.02) for embeddings and projections, the residual outputs (o_proj,
    down_proj) scaled by 1/sqrt(2 * layers); norms at 1. Seeded, so the same seed gives the same model."""
    gen = torch.Generator().manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * model.args.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim < 2:
                p.zero_()
            else:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `lr` down to 0.1 * lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def _loss(model: Decoder, windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of windows [B, T + 1]."""
    with _autocast(device):
        logits = model(windows[:, :-1])  # [B, T, 256]
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def train(model: Decoder, data: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float, warmup: int,
          seed: int, device: torch.device, log_every: int) -> dict:
    """Train in place; returns {"tokens", "final_train_loss" (mean of the last logged interval), "seconds"}."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device).manual_seed(seed)  # on the data's device: no copy, no wait, each step
    offsets = torch.arange(seq_len + 1, device=device)
    data = data.to(device)
    model.train()
    start = mark = time.perf_counter()
    losses: list[torch.Tensor] = []
    final = float("nan")
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, warmup, lr)
        starts = torch.randint(0, data.numel() - seq_len, (batch, 1), generator=gen, device=device)
        windows = data[starts + offsets].long()  # [B, T + 1]
        loss = _loss(model, windows, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            final = torch.stack(losses).mean().item()  # synchronises: the timing below is real
            now = time.perf_counter()
            rate = len(losses) * batch * seq_len / (now - mark)
            print(f"step {step + 1:>{len(str(steps))}}/{steps}  loss {final:.4f}  "
                  f"lr {lr_at(step, steps, warmup, lr):.2e}  {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
            losses, mark = [], now
    return {"tokens": steps * batch * seq_len, "final_train_loss": final, "seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate(model: Decoder, data: torch.Tensor, seq_len: int, batch: int, device: torch.device) -> tuple[float, int]:
    """(mean next-byte loss in nats, windows): consecutive windows of seq_len predictions from the start of `data`,
    at most EVAL_WINDOWS of them."""
    n = min(EVAL_WINDOWS, (data.numel() - 1) // seq_len)
    model.eval()
    total = 0.0
    for first in range(0, n, batch):
        rows = torch.arange(first, min(n, first + batch))[:, None] * seq_len + torch.arange(seq_len + 1)
        total += _loss(model, data[rows].long().to(device), device).item() * rows.shape[0]
    return total / n, n


def write_checkpoint(model: Decoder, out_dir: Path, record: dict, force: bool) -> None:
    """config.json, model.safetensors (bf16) and training.json as `out_dir`, through a temporary folder beside it."""
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}

    def fill(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(model.args), indent=2) + "\n")
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")

    write_dir(out_dir, fill, force)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"{platform.processor() or platform.machine()} ({threads} thread{'s' * (threads > 1)})"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser("train_byte_model.py", __doc__)
    ap.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="folder with train.bin and eval.bin")
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the checkpoint folder to write")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    ap.add_argument("--seq-len", type=int, default=2048, help="bytes a training window predicts (default 2048)")
    ap.add_argument("--batch", type=int, default=32, help="windows a step (default 32)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                    help="linear warm-up steps (default: 5%% of --steps, at least 1)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the windows (default 0)")
    ap.add_argument("--log-every", type=int, default=100, metavar="N", help="steps between progress lines")
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds files")
    ap.add_argument("--smoke", action="store_true",
                    help="20 steps at --seq-len 64, --batch 4 on the CPU: a quick test of the script")
    a = ap.parse_args(argv)
    if a.smoke:
        for key, value in SMOKE.items():
            setattr(a, key, value)
    for key in ("steps", "seq_len", "batch", "log_every"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
    if a.seq_len > MAX_POSITIONS:
        ap.error(f"--seq-len {a.seq_len} is past the model's {MAX_POSITIONS} positions")
    if not a.lr > 0:
        ap.error(f"--lr must be > 0, got {a.lr}")
    if a.warmup_steps is None:
        a.warmup_steps = max(1, a.steps // 20)
    if not 1 <= a.warmup_steps <= a.steps:
        ap.error(f"--warmup-steps must be in [1, --steps], got {a.warmup_steps}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        run(a)
    except ScriptError as e:
        print(f"train_byte_model.py: error: {e}", file=sys.stderr)
        return e.code
    return 0


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ScriptError(f"--device {name!r} is not a device name (cuda, cuda:N or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScriptError(f"--device {name}: no CUDA GPU here (--device cpu, or --smoke for a quick test)")
    if device.type not in ("cuda", "cpu"):
        raise ScriptError(f"--device {name}: only cuda and cpu are supported")
    return device


def run(a: argparse.Namespace) -> None:
    device = parse_device(a.device)
    check_out_dir(a.out_dir, a.force)
    train_data = read_bytes(a.data_dir / "train.bin", a.seq_len + 1)
    eval_data = read_bytes(a.data_dir / "eval.bin", a.seq_len + 1)
    torch.manual_seed(a.seed)
    model = Decoder(ARGS)
    init_weights(model, a.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; data: {train_data.numel():,} training bytes; {a.steps} steps x "
          f"{a.batch} x {a.seq_len} = {a.steps * a.batch * a.seq_len:,} tokens on {device_name(device)}",
          file=sys.stderr)
    result = train(model, train_data, a.steps, a.seq_len, a.batch, a.lr, a.warmup_steps, a.seed, device,
                   a.log_every)
    with torch.no_grad():  # what is saved is bf16: evaluate those weights
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    eval_loss, windows = evaluate(model, eval_data, a.seq_len, a.batch, device)
    record = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "parameters": n_params,
        "steps": a.steps,
        "tokens_seen": result["tokens"],
        "final_train_loss": round(result["final_train_loss"], 5),
        "eval_loss": round(eval_loss, 5),
        "eval_windows": windows,
        "eval_seq_len": a.seq_len,
        "seconds": round(result["seconds"], 1),
        "torch": torch.__version__,
        "device": device_name(device),
    }
    write_checkpoint(model, a.out_dir, record, a.force)
    print(f"wrote {a.out_dir}: {n_params:,} parameters, {result['tokens']:,} tokens in {result['seconds']:.0f} s; "
          f"train loss {result['final_train_loss']:.4f}, eval loss {eval_loss:.4f} nats/byte "
          f"({windows} windows x {a.seq_len} bytes of eval.bin)")


if __name__ == "__main__":
    sys.exit(main())
