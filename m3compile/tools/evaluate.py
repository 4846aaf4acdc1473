"""Evaluation: next-token loss with dense attention, with MSA active and under oracle selection; block recall and
its tail per layer; the share of tokens that sparse attention hurts badly."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from m3compile.io.data import windows
from m3compile.kernels import reference
from m3compile.models.decoder import Attention, Decoder

__all__ = ["evaluate", "EvalReport", "TAIL_NATS", "RECALL_QUANTILE"]

# A token is in the loss tail when sparse attention raises its loss by more than this (nats) over dense attention.
TAIL_NATS = 0.5
# The recall tail: this quantile of the per-(KV group, token) block recall.
RECALL_QUANTILE = 0.1
# Recall quantiles are read off a histogram of this many bins over [0, 1] (bounded memory at any data size).
_RECALL_BINS = 10_000


def _finite(x: float | None) -> float | None:
    """JSON has no NaN or infinity: those become null."""
    return None if x is None or not math.isfinite(x) else x


@dataclass
class EvalReport:
    """What `evaluate` measured. `to_dict()` (the JSON of `m3c eval --json`) has these keys; losses are nats per token:

    seq_len, windows, tokens   window length, windows evaluated, tokens scored (windows x seq_len)
    dense_loss                 loss with every MSA layer run as dense causal attention
    sparse_loss                loss with MSA active, the index branch selecting (null: the model has no MSA layer)
    loss_increase              sparse_loss / dense_loss - 1 (null without MSA)
    oracle_loss                loss with MSA active under oracle selection: each MSA layer, inside this forward,
                               keeps per (KV group, query) its forced blocks plus the earlier blocks of most dense
                               group-mean attention mass from its own q/k, same block size and top-k (null without MSA
                               or with oracle=False); the best loss any index branch could reach at this block/top-k
    oracle_loss_increase       oracle_loss / dense_loss - 1 (null when oracle_loss is)
    tail_share                 share of tokens whose sparse per-token loss exceeds their dense one by > 0.5 nats
    oracle_tail_share          the same for the oracle run (null when oracle_loss is)
    mean_recall, recall        block recall: share of the dense group-mean attention mass inside the selected
                               blocks, mean over layers and per MSA layer ({"layer": value})
    recall_p10                 per MSA layer, the 10th percentile of recall over (KV group, token) pairs (to 1e-4)
    min_recall_p10             the lowest recall_p10 over layers (the worst layer's tail; null without MSA)
    mean_oracle_recall, oracle_recall  the recall of the oracle's own selection, mean and per layer
    seconds                    wall time
    """

    seq_len: int
    windows: int
    tokens: int
    dense_loss: float
    sparse_loss: float | None
    recall: dict[int, float] = field(default_factory=dict)  # layer -> mean block recall
    seconds: float = 0.0
    oracle_recall: dict[int, float] = field(default_factory=dict)  # layer -> recall of the teacher's own top-k
    oracle_loss: float | None = None
    tail_share: float | None = None
    oracle_tail_share: float | None = None
    recall_p10: dict[int, float] = field(default_factory=dict)  # layer -> 10th percentile of per-token recall

    @property
    def mean_oracle_recall(self) -> float | None:
        return sum(self.oracle_recall.values()) / len(self.oracle_recall) if self.oracle_recall else None

    @property
    def mean_recall(self) -> float | None:
        return sum(self.recall.values()) / len(self.recall) if self.recall else None

    @property
    def min_recall_p10(self) -> float | None:
        return min(self.recall_p10.values()) if self.recall_p10 else None

    @property
    def loss_increase(self) -> float | None:
        return None if self.sparse_loss is None or not self.dense_loss else self.sparse_loss / self.dense_loss - 1.0

    @property
    def oracle_loss_increase(self) -> float | None:
        return None if self.oracle_loss is None or not self.dense_loss else self.oracle_loss / self.dense_loss - 1.0

    @property
    def finite(self) -> bool:
        """Whether every loss is a number (a model with NaN/Inf weights, or one overflowing its dtype, is not)."""
        return all(math.isfinite(x) for x in (self.dense_loss, self.sparse_loss) if x is not None)

    def to_dict(self) -> dict:
        per_layer = lambda d: {str(k): _finite(v) for k, v in d.items()}  # noqa: E731
        return {
            "seq_len": self.seq_len, "windows": self.windows, "tokens": self.tokens,
            "dense_loss": _finite(self.dense_loss), "sparse_loss": _finite(self.sparse_loss),
            "loss_increase": _finite(self.loss_increase), "oracle_loss": _finite(self.oracle_loss),
            "oracle_loss_increase": _finite(self.oracle_loss_increase), "tail_share": _finite(self.tail_share),
            "oracle_tail_share": _finite(self.oracle_tail_share), "mean_recall": _finite(self.mean_recall),
            "recall": per_layer(self.recall), "recall_p10": per_layer(self.recall_p10),
            "min_recall_p10": _finite(self.min_recall_p10), "mean_oracle_recall": _finite(self.mean_oracle_recall),
            "oracle_recall": per_layer(self.oracle_recall), "seconds": round(self.seconds, 2),
        }


class _RecallProbe:
    """Attached to MSA layers during the sparse (index-selected) forward: accumulates per-layer block recall, a
    histogram of its per-(group, token) values for the tail quantile, and oracle recall."""

    def __init__(self):
        self.sums: dict[int, float] = {}
        self.oracle_sums: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.hists: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, attn: Attention, q, k, blocks) -> None:
        m = attn.msa
        r = reference.block_recall(q, k, blocks, block_size=m.block_size, scale=attn.scale)
        best = reference.oracle_recall(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                       local_blocks=m.local_blocks, scale=attn.scale)
        self.sums[layer] = self.sums.get(layer, 0.0) + float(r.sum())
        self.oracle_sums[layer] = self.oracle_sums.get(layer, 0.0) + float(best.sum())
        self.counts[layer] = self.counts.get(layer, 0) + r.numel()
        bins = (r.flatten().float() * _RECALL_BINS).long().clamp(0, _RECALL_BINS - 1)
        hist = torch.bincount(bins, minlength=_RECALL_BINS).cpu()
        self.hists[layer] = self.hists[layer] + hist if layer in self.hists else hist

    def result(self, oracle: bool = False) -> dict[int, float]:
        sums = self.oracle_sums if oracle else self.sums
        return {layer: sums[layer] / self.counts[layer] for layer in sorted(sums)}

    def quantile(self, q: float) -> dict[int, float]:
        """Per layer, the recall below which a share q of the (group, token) pairs falls (the bin's upper edge)."""
        out = {}
        for layer in sorted(self.hists):
            cum = self.hists[layer].cumsum(0)
            i = int(torch.searchsorted(cum, torch.tensor(max(1, math.ceil(q * int(cum[-1]))), dtype=cum.dtype)))
            out[layer] = min(1.0, (i + 1) / _RECALL_BINS)
        return out


def _token_losses(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="none")


@torch.no_grad()
def evaluate(model: Decoder, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
             progress: Callable[[int, int], None] | None = None, oracle: bool = True) -> EvalReport:
    """Next-token loss (nats/token) with dense attention everywhere, with MSA active and (`oracle`, one more forward
    per window) under oracle selection; block recall, its 10th percentile and the loss tail; see EvalReport."""
    start = time.perf_counter()
    data = windows(tokens, seq_len, max_windows)
    device = next(model.parameters()).device
    sparse_layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    oracle = oracle and bool(sparse_layers)
    probe = _RecallProbe()

    def attach(on: bool) -> None:
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.probe = (lambda *a, _i=i: probe(_i, *a)) if on and i in sparse_layers else None

    dense_sum = sparse_sum = oracle_sum = 0.0
    tail = oracle_tail = 0
    try:
        for w, window in enumerate(data):
            x, y = window[None, :-1].to(device), window[None, 1:].to(device)
            model.set_sparse(False)
            dense = _token_losses(model, x, y)
            dense_sum += float(dense.sum())
            if sparse_layers:
                model.set_sparse(True)
                attach(True)
                sparse = _token_losses(model, x, y)
                attach(False)
                sparse_sum += float(sparse.sum())
                tail += int((sparse - dense > TAIL_NATS).sum())
            if oracle:
                model.set_selection("oracle")
                best = _token_losses(model, x, y)
                model.set_selection("index")
                oracle_sum += float(best.sum())
                oracle_tail += int((best - dense > TAIL_NATS).sum())
            if progress:
                progress(w + 1, len(data))
    finally:
        model.set_sparse(True)
        model.set_selection("index")
        attach(False)
    n = data.shape[0] * seq_len
    return EvalReport(
        seq_len, data.shape[0], n, dense_sum / n, sparse_sum / n if sparse_layers else None, probe.result(),
        time.perf_counter() - start, probe.result(oracle=True), oracle_loss=oracle_sum / n if oracle else None,
        tail_share=tail / n if sparse_layers else None, oracle_tail_share=oracle_tail / n if oracle else None,
        recall_p10=probe.quantile(RECALL_QUANTILE))
