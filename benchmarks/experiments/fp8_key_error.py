"""What an fp8 (e4m3) key cache costs a dense model, by how the keys are prepared before the rounding.

Each variant rounds every key row (token, KV head) to e4m3 with one scale per row, as the fp8 K/V cache does, and
scores the model's own dense forward with those keys (values, queries and everything else exact):
  none       no rounding (the reference loss)
  raw        the key itself
  shift      the key less its layer's key shift (runtime.key_shift: the position-mean of the rotated K bias)
  exact      the key less its own rotated K bias R_t b (the bound for any bias-side treatment: exact, since
             q . R_t b can be added back, but it needs position-dependent work in the attention kernel)
  shift+had  the shifted key times the int8 cache's orthonormal matrix H (runtime.key_shift.rotation: Hadamard for
             a power-of-two head dim; q . k = (q H) . (k H)), rounded, then H^T
  exact+had  both
  int8-X     variant X with 8-bit integer rows (one scale per row) instead of e4m3
Scores how much each variant costs (loss over `none`, in %) and the rms score error q . (k_hat - k) / sqrt(D) of
each layer's keys against a sample of its queries.

  python benchmarks/experiments/fp8_key_error.py MODEL_DIR --data long_code_eval.txt --seq-len 4096
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from m3compile.data import load_tokens, windows
from m3compile.io.load import load
from m3compile.kernels.decode.naive import dequantize_kv, quantize_kv
from m3compile.models.decoder import Attention
from m3compile.ops import apply_rope
from m3compile.runtime.key_shift import key_shifts, rotation

VARIANTS = ("none", "raw", "shift", "exact", "shift+had", "exact+had")


def rounded(k: torch.Tensor, int8: bool = False) -> torch.Tensor:
    """k [B, Hkv, T, D] rounded as the fp8 cache (or, int8, the int8 cache) holds each (token, head) row."""
    x8, s = quantize_kv(k.transpose(1, 2).float(), torch.int8 if int8 else torch.float8_e4m3fn)
    return dequantize_kv(x8, s).transpose(1, 2).to(k.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--values", default="none", choices=["none", "fp8", "int8", "int8+had"],
                    help="how every variant but `none` also rounds the values")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load(args.model, dtype="float32")
    model.set_selection("dense")
    model.eval()
    ids = windows(load_tokens(args.data, model.args.vocab_size, args.model), args.seq_len, 1)
    T = ids.shape[1]
    shifts = key_shifts(model, T)
    attn_layers = [layer.self_attn for layer in model.model.layers]
    D = attn_layers[0].head_dim
    H = rotation(D)  # the int8 cache's (Walsh-Hadamard for a power-of-two head dim)
    state = {"variant": "none", "err": {}, "values": args.values}
    original = Attention._project

    def project(self, x, cos, sin, index):
        q, k, v, y_idx = original(self, x, cos, sin, index)
        variant, int8 = state["variant"], state["variant"].startswith("int8-")
        variant = variant.removeprefix("int8-")
        if variant == "none":
            return q, k, v, y_idx
        i = attn_layers.index(self)
        mu = torch.zeros(self.n_kv_heads, D) if shifts[i] is None else shifts[i]
        base = mu[None, :, None, :].expand_as(k)
        if variant.startswith("exact") and self.k_proj.bias is not None:
            b = self.k_proj.bias.detach().float().view(1, 1, self.n_kv_heads, D).expand(1, T, -1, -1)
            base = apply_rope(b.contiguous(), cos, sin).transpose(1, 2)  # R_t b [1, Hkv, T, D]
        if variant == "raw":
            base = torch.zeros_like(k)
        r = k - base
        if variant.endswith("+had"):
            k_hat = rounded(r @ H, int8) @ H.T + base
        else:
            k_hat = rounded(r, int8) + base
        if state["values"] == "fp8":
            v = rounded(v)
        elif state["values"] == "int8":
            v = rounded(v, True)
        elif state["values"] == "int8+had":
            v = rounded(v @ H, True) @ H.T
        g = self.n_heads // self.n_kv_heads
        qs = q[:, ::max(1, g)][:, : self.n_kv_heads, ::64]  # a query sample of each KV group
        err = (qs @ (k_hat - k).transpose(-1, -2)) / math.sqrt(D)
        causal = torch.arange(T)[None, :] <= torch.arange(0, T, 64)[:, None]
        state["err"][i] = float(err[..., causal].pow(2).mean().sqrt())
        return q, k_hat, v, y_idx

    Attention._project = project
    results = {}
    try:
        for variant in args.variants.split(","):
            state["variant"], state["err"] = variant, {}
            with torch.no_grad():
                logits = model(ids)
            loss = float(torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]))
            errs = [state["err"][i] for i in sorted(state["err"])]
            results[variant] = {"loss": loss, "score_rms_err_mean": sum(errs) / len(errs) if errs else 0.0,
                                "score_rms_err_max": max(errs) if errs else 0.0}
            base = results.get("none", {}).get("loss")
            extra = "" if base is None else f" ({100 * (loss / base - 1):+.3f}%)"
            print(json.dumps({"variant": variant, **results[variant]}) + extra, flush=True)
    finally:
        Attention._project = original
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq_len": T, "values": args.values, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
