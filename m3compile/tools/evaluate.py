"""Evaluation: next-token loss with dense attention everywhere and with MSA active, block recall per layer."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from m3compile.io.data import windows
from m3compile.kernels import reference
from m3compile.models.decoder import Attention, Decoder

__all__ = ["evaluate", "EvalReport"]


@dataclass
class EvalReport:
    seq_len: int
    windows: int
    tokens: int
    dense_loss: float
    sparse_loss: float | None
    recall: dict[int, float] = field(default_factory=dict)  # layer -> mean block recall
    seconds: float = 0.0
    oracle_recall: dict[int, float] = field(default_factory=dict)  # layer -> recall of the teacher's own top-k

    @property
    def mean_oracle_recall(self) -> float | None:
        return sum(self.oracle_recall.values()) / len(self.oracle_recall) if self.oracle_recall else None

    @property
    def mean_recall(self) -> float | None:
        return sum(self.recall.values()) / len(self.recall) if self.recall else None

    @property
    def loss_increase(self) -> float | None:
        return None if self.sparse_loss is None else self.sparse_loss / self.dense_loss - 1.0

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len, "windows": self.windows, "tokens": self.tokens, "dense_loss": self.dense_loss,
            "sparse_loss": self.sparse_loss, "loss_increase": self.loss_increase, "mean_recall": self.mean_recall,
            "recall": {str(k): v for k, v in self.recall.items()}, "mean_oracle_recall": self.mean_oracle_recall,
            "oracle_recall": {str(k): v for k, v in self.oracle_recall.items()}, "seconds": round(self.seconds, 2),
        }


class _RecallProbe:
    """Attached to MSA layers during evaluation: accumulates per-layer block recall and oracle recall."""

    def __init__(self):
        self.sums: dict[int, float] = {}
        self.oracle_sums: dict[int, float] = {}
        self.counts: dict[int, int] = {}

    def __call__(self, layer: int, attn: Attention, q, k, blocks) -> None:
        m = attn.msa
        r = reference.block_recall(q, k, blocks, block_size=m.block_size, scale=attn.scale)
        best = reference.oracle_recall(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                 local_blocks=m.local_blocks, scale=attn.scale)
        self.sums[layer] = self.sums.get(layer, 0.0) + float(r.sum())
        self.oracle_sums[layer] = self.oracle_sums.get(layer, 0.0) + float(best.sum())
        self.counts[layer] = self.counts.get(layer, 0) + r.numel()

    def result(self, oracle: bool = False) -> dict[int, float]:
        sums = self.oracle_sums if oracle else self.sums
        return {layer: sums[layer] / self.counts[layer] for layer in sorted(sums)}


@torch.no_grad()
def evaluate(model: Decoder, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> EvalReport:
    """Next-token loss (nats/token) with dense attention everywhere and with MSA active, plus block recall per layer."""
    start = time.perf_counter()
    data = windows(tokens, seq_len, max_windows)
    device = next(model.parameters()).device
    sparse_layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    probe = _RecallProbe()
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.probe = (lambda *a, _i=i: probe(_i, *a)) if i in sparse_layers else None
    dense_sum = sparse_sum = 0.0
    try:
        for w, window in enumerate(data):
            x, y = window[None, :-1].to(device), window[None, 1:].to(device)
            model.set_sparse(False)
            dense_sum += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            if sparse_layers:
                model.set_sparse(True)
                sparse_sum += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            if progress:
                progress(w + 1, len(data))
    finally:
        model.set_sparse(True)
        for layer in model.model.layers:
            layer.self_attn.probe = None
    n = data.shape[0] * seq_len
    return EvalReport(seq_len, data.shape[0], n, dense_sum / n, sparse_sum / n if sparse_layers else None,
                      probe.result(), time.perf_counter() - start, probe.result(oracle=True))
