"""Experiment (issue 15): is the distilled model's gap to the oracle the block-max vs block-mass mismatch?

Evaluates a converted model on windows of DATA four ways, each MSA layer selecting its blocks from its own q/k in
the same forward (as `m3c eval` does):
  dense    every MSA layer dense (the reference)
  max      the index branch with M3's rule: block score = max of the block's token scores (the model itself)
  lse      DIAGNOSTIC only: the index branch's scores pooled by log-sum-exp per block (the mass of the student's own
           token softmax in the block), same forced blocks and top-k; not a product option
  oracle   the blocks of most dense group-mean attention mass (kernels/causal_lse/naive.py: oracle_blocks)
Per selection: loss vs dense, tail share (tokens > 0.5 nats worse than dense), and per layer the mean block recall,
its 10th percentile, and `top1`: the share of (group, query) pairs with a choice to make (t >= topk * block) whose
heaviest non-forced teacher block is selected. Loss deltas are also split by query position (quarters).

    PYTHONPATH=. python benchmarks/experiments/selection_diagnosis.py CKPT DATA SEQ_LEN WINDOWS [OUT.json]
"""
import json
import math
import sys
import time
import types

import torch
import torch.nn.functional as F

import m3compile
from m3compile.io.data import load_tokens, windows
from m3compile.kernels.causal_lse.naive import block_recall
from m3compile.kernels.indexer.naive import select_from_scores  # experiment: the selection's own forced-block rule
from m3compile.kernels.sparse_kl.naive import block_mass
from m3compile.ops import apply_index_rope, msa_attention, split_heads, visible_blocks

TAIL = 0.5


def lse_blocks(q_idx, k_idx, m, chunk=256):
    """Selection by the student's block log-sum-exp. q_idx [B, T, Hi, Di], k_idx [B, T, Di] -> [B, Hi, T, K]."""
    q = q_idx.transpose(1, 2).float()
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, m.topk, dtype=torch.long)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        nb = -(-e // m.block_size)
        z = torch.einsum("bhtd,bjd->bhtj", q[:, :, s:e], k_idx[:, :e].float()) / math.sqrt(D)
        t = torch.arange(s, e)
        z = z.masked_fill(torch.arange(e)[None, :] > t[:, None], float("-inf"))
        z = F.pad(z, (0, nb * m.block_size - e), value=float("-inf")).unflatten(-1, (nb, m.block_size))
        out[:, :, s:e] = select_from_scores(torch.logsumexp(z, -1), t, m.block_size, m.topk, m.init_blocks,
                                            m.local_blocks)
    return out


def _msa_lse(self, x, q, k, v, cos, sin):
    """Attention._msa with the diagnostic block-LSE selection."""
    m = self.msa
    xd = x.detach()
    q_idx = self.index_q_norm(split_heads(self.index_q_proj(xd), m.index_heads, m.index_dim))
    k_idx = self.index_k_norm(split_heads(self.index_k_proj(xd), 1, m.index_dim))
    q_idx, k_idx = apply_index_rope(q_idx, cos, sin), apply_index_rope(k_idx, cos, sin)[:, :, 0]
    blocks = lse_blocks(q_idx, k_idx, m)
    if self.probe is not None:
        self.probe(self, q, k, blocks)
    return msa_attention(q, k, v, blocks, block_size=m.block_size, scale=self.scale, sparse=True)


class Probe:
    def __init__(self):
        self.recall, self.top1 = {}, {}

    def __call__(self, layer, attn, q, k, blocks):
        m = attn.msa
        B, H, T, _ = blocks.shape
        r = block_recall(q, k, blocks, block_size=m.block_size, scale=attn.scale)
        self.recall.setdefault(layer, []).append(r.flatten())
        rows = torch.arange(T) >= m.topk * m.block_size
        if rows.any():
            mass = block_mass(q, k, visible_blocks(B, H, T, m.block_size), block_size=m.block_size,
                              scale=attn.scale)  # [B, H, T, nb]: slot j is block j
            nb = mass.shape[-1]
            own = torch.arange(T) // m.block_size
            forced = (torch.arange(nb)[None, :] > own[:, None] - m.local_blocks) | (torch.arange(nb) < m.init_blocks)
            best = mass.masked_fill(forced, -1.0).argmax(-1)  # [B, H, T]
            hit = (blocks == best[..., None]).any(-1)
            self.top1.setdefault(layer, []).append(hit[:, :, rows].flatten().float())

    def summary(self):
        out = {}
        for layer in sorted(self.recall):
            r = torch.cat(self.recall[layer])
            out[layer] = {"recall": float(r.mean()), "p10": float(r.quantile(0.1)),
                          "top1": float(torch.cat(self.top1[layer]).mean()) if layer in self.top1 else None}
        return out


def main():
    ckpt, data, seq_len, n_win = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out_path = sys.argv[5] if len(sys.argv) > 5 else None
    t0 = time.time()
    model = m3compile.load(ckpt)
    model.eval()
    tokens = load_tokens(data, model.args.vocab_size, ckpt)
    wins = windows(tokens, seq_len, n_win)
    attns = [(i, l.self_attn) for i, l in enumerate(model.model.layers) if l.self_attn.msa is not None]
    probes = {name: Probe() for name in ("max", "lse", "oracle")}
    losses = {name: [] for name in ("dense", "max", "lse", "oracle")}

    def run(name, x, y):
        for i, a in attns:
            a.probe = (lambda *args, _i=i: probes[name](_i, *args)) if name in probes else None
            a.selection = "oracle" if name == "oracle" else "index"
            if name == "lse":
                a._msa = types.MethodType(_msa_lse, a)
            elif "_msa" in a.__dict__:
                del a._msa
        model.set_sparse(name != "dense")
        with torch.no_grad():
            logits = model(x)
        losses[name].append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none"))

    for w, win in enumerate(wins):
        x, y = win[None, :-1], win[None, 1:]
        for name in losses:
            run(name, x, y)
        print(f"window {w + 1}/{len(wins)}  {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    dense = torch.cat(losses["dense"])
    res = {"ckpt": ckpt, "seq_len": seq_len, "windows": len(wins), "dense_loss": float(dense.mean())}
    q = seq_len // 4
    for name in ("max", "lse", "oracle"):
        s = torch.cat(losses[name])
        d = (s - dense).view(len(wins), seq_len)
        layers = probes[name].summary()
        res[name] = {
            "loss": float(s.mean()), "increase": float(s.mean() / dense.mean() - 1), "tail": float((d > TAIL).float().mean()),
            "delta_by_quarter": [float(d[:, i * q:(i + 1) * q].mean()) for i in range(4)],
            "mean_recall": sum(v["recall"] for v in layers.values()) / len(layers),
            "min_p10": min(v["p10"] for v in layers.values()),
            "mean_top1": sum(v["top1"] for v in layers.values()) / len(layers),
            "layers": layers,
        }
    res["seconds"] = round(time.time() - t0, 1)
    print(f"dense {res['dense_loss']:.4f}")
    for name in ("max", "lse", "oracle"):
        r = res[name]
        worst = sorted(r["layers"].items(), key=lambda kv: kv[1]["p10"])[:3]
        print(f"{name:7s} loss {r['loss']:.4f} ({100 * r['increase']:+.2f}%)  tail {100 * r['tail']:.2f}%  "
              f"recall {r['mean_recall']:.3f}  min p10 {r['min_p10']:.3f}  top1 {r['mean_top1']:.3f}  "
              f"delta by quarter {' '.join(f'{v:.4f}' for v in r['delta_by_quarter'])}  worst p10 layers "
              + ", ".join(f"{l}:{v['p10']:.3f}/{v['top1']:.3f}" for l, v in worst))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
