"""Evaluation: next-token loss with dense attention, with MSA active and under oracle selection; block recall and
its tail per layer; the share of tokens that sparse attention hurts badly; what each layer costs when it alone is
sparse (layer_costs). With a K/V cache dtype (bf16, fp8) the
losses are those of the paged prefill over a cache of that dtype (runtime.prefill_nll): what the cache costs."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from m3compile.config import EvalConfig, MSAConfig, max_positions
from m3compile.data import load_tokens, windows
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import check_positions
from m3compile.io.load import check_device, from_preset, load
from m3compile.kernels import causal_lse
from m3compile.kernels.causal_lse import naive as reference
from m3compile.models.decoder import Attention, Decoder, MSALayerArgs
from m3compile.ops import lowering
from m3compile.runtime import PagedCache, lowering_default, prefill_nll
from m3compile.runtime.generate import resolve_index_cache, resolve_kv_cache
from m3compile.train.lm_loss import LOGIT_ROWS

__all__ = ["evaluate", "EvalReport", "layer_costs", "costliest_layers", "dense_layers_by_cost", "LayerCostReport",
           "TAIL_NATS", "RECALL_QUANTILE"]

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
    """What `evaluate` measured. `to_dict()` (the JSON of `m3c eval loss --json`) has these keys; losses are nats per token:

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
                               blocks, mean over layers and per MSA layer ({"layer": value}), in the sparse forward
    recall_p10                 per MSA layer, the 10th percentile of recall over (KV group, token) pairs (to 1e-4)
    min_recall_p10             the lowest recall_p10 over layers (the worst layer's tail; null without MSA)
    mean_oracle_recall, oracle_recall  the recall of the oracle's own selection, mean and per layer, measured in the
                               oracle forward (each layer's q/k there; equal to causal_lse.naive.oracle_recall of them);
                               null / {} when oracle_loss is (oracle=False, `--no-oracle`: no oracle pass runs)
    blocks, blocks_p90         the budget used: per MSA layer, the mean and the 90th percentile over (KV group, token)
                               of the blocks kept in the sparse forward (the top-k, or fewer under an adaptive budget,
                               docs/msa.md 2.8; what the attention's time follows); mean_blocks over layers
    oracle_blocks              the same mean for the oracle forward ({} when it does not run)
    kv_cache                   null: the losses come from the model's own forward (no cache); "bf16", "fp8" or
                               "int8": from the paged prefill over a K/V cache of that dtype, each window's queries attending to
                               the keys and values as the cache holds them (runtime.prefill_nll; dense row: every
                               MSA layer attends to every cached key); block recall is then not measured (null / {})
    seconds                    wall time
    """

    seq_len: int
    windows: int
    tokens: int
    dense_loss: float
    sparse_loss: float | None
    recall: dict[int, float] = field(default_factory=dict)  # layer -> mean block recall
    seconds: float = 0.0
    oracle_recall: dict[int, float] = field(default_factory=dict)  # layer -> recall of the oracle run ({}: none)
    oracle_loss: float | None = None
    tail_share: float | None = None
    oracle_tail_share: float | None = None
    recall_p10: dict[int, float] = field(default_factory=dict)  # layer -> 10th percentile of per-token recall
    kv_cache: str | None = None  # None: the model's forward; "bf16" / "fp8" / "int8": the paged prefill over it
    blocks: dict[int, float] = field(default_factory=dict)  # layer -> mean blocks kept per (group, token)
    blocks_p90: dict[int, float] = field(default_factory=dict)  # layer -> their 90th percentile
    oracle_blocks: dict[int, float] = field(default_factory=dict)  # layer -> the oracle forward's mean

    @property
    def mean_blocks(self) -> float | None:
        return sum(self.blocks.values()) / len(self.blocks) if self.blocks else None

    @property
    def mean_oracle_blocks(self) -> float | None:
        return sum(self.oracle_blocks.values()) / len(self.oracle_blocks) if self.oracle_blocks else None

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
            "oracle_recall": per_layer(self.oracle_recall) if self.oracle_recall else None,
            "blocks": per_layer(self.blocks), "blocks_p90": per_layer(self.blocks_p90),
            "mean_blocks": _finite(self.mean_blocks),
            "oracle_blocks": per_layer(self.oracle_blocks) if self.oracle_blocks else None,
            "kv_cache": self.kv_cache, "seconds": round(self.seconds, 2),
        }


class _RecallProbe:
    """The `observer` of the MSA layers during one pass (sparse: the index branch's selection; oracle: the oracle's):
    per layer the sum and count of the block recall of the selection that ran, and, when `hist`, a histogram of its
    per-(group, token) values for the tail quantile. Everything stays on the device: `result` and `quantile` read it
    back once, at the end.

    Recall is the share of the dense group-mean causal attention mass inside the selected blocks
    (causal_lse.naive.block_recall). From the lowered attention's per-head log-sum-exp over the selected keys it is
    causal_lse.dense_recall (mean over the group's heads of exp2(lse_selected - lse_all), the FlashAttention-style
    streamed dense log-sum-exp, never T x T); where every visible block is selected it is 1; otherwise (the
    reference ops ran) causal_lse.naive.block_recall. Also the blocks kept per (group, token): a histogram per
    layer (the budget used)."""

    def __init__(self, hist: bool):
        self.hist = hist
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self.hists: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}  # layer -> [K + 1] how many (group, token) kept 0 .. K blocks

    def __call__(self, layer: int, attn: Attention, q, k, blocks, lse) -> None:
        m = attn.msa
        kept = (blocks >= 0).sum(-1).flatten()
        if layer not in self.kept:
            self.kept[layer] = torch.zeros(blocks.shape[-1] + 1, dtype=torch.long, device=kept.device)
        self.kept[layer].scatter_add_(0, kept, torch.ones_like(kept))
        if lse is not None:
            r = causal_lse.dense_recall(q, k, lse, scale=attn.scale)  # [B, T, Hkv]
        elif -(-q.shape[2] // m.block_size) <= blocks.shape[-1] and m.top_p >= 1:  # every visible block: all the mass
            r = torch.ones(q.shape[0], q.shape[2], k.shape[1], device=q.device)
        else:
            r = reference.block_recall(q, k, blocks.long(), block_size=m.block_size, scale=attn.scale)  # [B, Hkv, T]
        r = r.flatten().float()
        total = r.sum(dtype=torch.float64)
        self.sums[layer] = self.sums[layer] + total if layer in self.sums else total
        self.counts[layer] = self.counts.get(layer, 0) + r.numel()
        if self.hist:
            bins = (r * _RECALL_BINS).long().clamp(0, _RECALL_BINS - 1)
            if layer not in self.hists:
                self.hists[layer] = torch.zeros(_RECALL_BINS, dtype=torch.long, device=r.device)
            self.hists[layer].scatter_add_(0, bins, torch.ones_like(bins))  # (bincount syncs to size its output)

    def result(self) -> dict[int, float]:
        return {layer: float(self.sums[layer]) / self.counts[layer] for layer in sorted(self.sums)}

    def blocks(self, q: float | None = None) -> dict[int, float]:
        """Per layer, the mean blocks kept per (group, token), or (q) the count below which a share q of them falls."""
        out = {}
        for layer in sorted(self.kept):
            h = self.kept[layer].cpu().double()
            if q is None:
                out[layer] = float((h * torch.arange(h.numel())).sum() / h.sum())
            else:
                out[layer] = float(torch.searchsorted(h.cumsum(0), q * h.sum()))
        return out

    def quantile(self, q: float) -> dict[int, float]:
        """Per layer, the recall below which a share q of the (group, token) pairs falls (the bin's upper edge)."""
        out = {}
        for layer in sorted(self.hists):
            cum = self.hists[layer].cpu().cumsum(0)
            i = int(torch.searchsorted(cum, torch.tensor(max(1, math.ceil(q * int(cum[-1]))), dtype=cum.dtype)))
            out[layer] = min(1.0, (i + 1) / _RECALL_BINS)
        return out


def _token_losses(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each next token's cross-entropy (nats), the logits made LOGIT_ROWS tokens at a time (train/lm_loss.py: a 32K
    window's whole logits would hold 20 GB in fp32)."""
    h = model.model(x).flatten(0, 1)
    y = y.flatten()
    return torch.cat([F.cross_entropy(model.lm_head(h[i:i + LOGIT_ROWS]).float(), y[i:i + LOGIT_ROWS],
                                      reduction="none") for i in range(0, h.shape[0], LOGIT_ROWS)])


@contextlib.contextmanager
def _eval_mode(model: Decoder, kernels: bool):
    """The ops' switch as evaluation asks (`kernels`: the lowerings), and the model's selection and observers
    restored afterwards (index selection, none)."""
    try:
        with lowering(kernels):
            yield
    finally:
        for layer in model.model.layers:
            layer.self_attn.observer = None
        model.set_selection("index")


def _attach(model: Decoder, sparse_layers: list[int], probe: _RecallProbe | None) -> None:
    for i in sparse_layers:
        model.model.layers[i].self_attn.observer = None if probe is None else (lambda *a, _i=i: probe(_i, *a))


@torch.no_grad()
def evaluate(model: Decoder, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
             progress: Callable[[int, int], None] | None = None, oracle: bool = True, batch: int = 1,
             kernels: bool | None = None, kv_cache: str = "auto") -> EvalReport:
    """Next-token loss (nats/token) with dense attention everywhere, with MSA active and (`oracle`, one more forward
    per window) under oracle selection; block recall, its 10th percentile and the loss tail; see EvalReport.

    batch: windows per forward. kernels: run the model with the lowered ops (m3compile.ops.lowering: fused RMSNorm,
    RoPE and index branch, Triton selection, gather-Q sparse attention with its log-sum-exp, recall from
    causal_lse.dense_recall); default (None) on CUDA. The losses and
    counts stay on the device until the end (no host synchronisation per window).
    kv_cache: "auto" (default): the model's own forward, which keeps no cache. "bf16", "fp8" or "int8" (a K/V cache
    dtype of m3compile.generate): each window is prefilled in one pass into a PagedCache of that dtype and its losses are
    runtime.prefill_nll's, the queries attending to the keys and values as the cache holds them: dense (selection
    "dense"), MSA (the index branch) and oracle rows, one window at a time (a `batch` other than 1 is refused); no
    recall. progress(done, total): windows done of all, from (0, total) before the first."""
    EvalConfig(seq_len=seq_len, max_windows=max_windows, batch=batch, kv_cache=kv_cache)  # one-line errors
    check_positions(seq_len, getattr(model, "source_config", None), f"--seq-len {seq_len}")
    if model.args.msa is not None:
        model.args.msa.check_floor(seq_len, f"a window of --seq-len {seq_len}")
    start = time.perf_counter()
    device = next(model.parameters()).device
    data = windows(tokens, seq_len, max_windows).to(device)  # one copy, not a (GPU-waiting) one per window
    if progress:
        progress(0, data.shape[0])  # how many windows, before the first (a long one on a CPU)
    sparse_layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    oracle = oracle and bool(sparse_layers)
    kernels = lowering_default(device) if kernels is None else kernels
    if kv_cache != "auto":
        return _cached(model, data, seq_len, kv_cache, sparse_layers, oracle, kernels, progress, start)
    probe, oracle_probe = _RecallProbe(hist=True), _RecallProbe(hist=False)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    dense_sum = sparse_sum = oracle_sum = zero
    tail = oracle_tail = zero.long()
    with _eval_mode(model, kernels):
        for b in range(0, data.shape[0], batch):
            chunk = data[b:b + batch]
            x, y = chunk[:, :-1], chunk[:, 1:]
            model.set_selection("dense")
            dense = _token_losses(model, x, y)
            dense_sum = dense_sum + dense.sum(dtype=torch.float64)
            if sparse_layers:
                model.set_selection("index")
                _attach(model, sparse_layers, probe)
                sparse = _token_losses(model, x, y)
                sparse_sum = sparse_sum + sparse.sum(dtype=torch.float64)
                tail = tail + (sparse - dense > TAIL_NATS).sum()
            if oracle:
                model.set_selection("oracle")
                _attach(model, sparse_layers, oracle_probe)
                best = _token_losses(model, x, y)
                model.set_selection("index")
                oracle_sum = oracle_sum + best.sum(dtype=torch.float64)
                oracle_tail = oracle_tail + (best - dense > TAIL_NATS).sum()
            _attach(model, sparse_layers, None)
            if progress:
                progress(min(b + batch, data.shape[0]), data.shape[0])
    n = data.shape[0] * seq_len
    sums = torch.stack([dense_sum, sparse_sum, oracle_sum, tail.double(), oracle_tail.double()]).tolist()  # one sync
    return EvalReport(
        seq_len, data.shape[0], n, sums[0] / n, sums[1] / n if sparse_layers else None, probe.result(),
        time.perf_counter() - start, oracle_probe.result(), oracle_loss=sums[2] / n if oracle else None,
        tail_share=sums[3] / n if sparse_layers else None, oracle_tail_share=sums[4] / n if oracle else None,
        recall_p10=probe.quantile(RECALL_QUANTILE), blocks=probe.blocks(), blocks_p90=probe.blocks(0.9),
        oracle_blocks=oracle_probe.blocks())


def _cached(model: Decoder, data: torch.Tensor, seq_len: int, kv_cache: str, sparse_layers: list[int], oracle: bool,
            kernels: bool, progress: Callable[[int, int], None] | None, start: float) -> EvalReport:
    """`evaluate` with a K/V cache of dtype `kv_cache`: per window [seq_len + 1] the losses of prefill_nll over one
    reused PagedCache (each prefill overwrites every position it reads), once per row's selection."""
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    kv_dtype = resolve_kv_cache(kv_cache, dtype, device)
    a = model.args
    page = a.msa.block_size if sparse_layers else 128
    index_dtype = resolve_index_cache("auto", a, dtype)
    cache = PagedCache(model, 1, seq_len + 1, page, device, kv_dtype, index_dtype)
    model.fuse_projections()  # the projections as generate runs them: one matmul per group, in place
    rows = ["dense"] + (["index"] if sparse_layers else []) + (["oracle"] if oracle else [])
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = dict.fromkeys(rows, zero)
    tails = dict.fromkeys(rows, zero.long())
    with _eval_mode(model, kernels):
        for w in range(data.shape[0]):
            losses = {r: prefill_nll(model, cache, 0, data[w], selection=r) for r in rows}
            for r in rows:
                sums[r] = sums[r] + losses[r].sum(dtype=torch.float64)
                tails[r] = tails[r] + (losses[r] - losses["dense"] > TAIL_NATS).sum()
            if progress:
                progress(w + 1, data.shape[0])
    n = data.shape[0] * seq_len
    values = torch.stack([sums[r] for r in rows] + [tails[r].double() for r in rows]).tolist()  # one sync
    got = {r: v / n for r, v in zip(rows, values[:len(rows)])}
    shares = {r: v / n for r, v in zip(rows, values[len(rows):])}
    return EvalReport(seq_len, data.shape[0], n, got["dense"], got.get("index"), seconds=time.perf_counter() - start,
                      oracle_loss=got.get("oracle"), tail_share=shares.get("index"),
                      oracle_tail_share=shares.get("oracle"), kv_cache=kv_cache)


@dataclass
class LayerCostReport:
    """What `layer_costs` measured: per MSA layer the cost of making it alone sparse. `to_dict()` has these keys:

    seq_len, windows, tokens, dense_loss   as EvalReport's (the dense model's loss)
    selections     the selections measured (index: the model's own index branch; oracle: a perfect one)
    layers         {"layer": {"loss_increase": {selection: loss / dense_loss - 1}, "recall": {selection: mean
                   block recall}, "blocks": {selection: mean blocks kept per (group, token)}}}: every other layer
                   dense
    costliest      the layers by the first selection's loss increase, costliest first
    seconds        wall time
    """

    seq_len: int
    windows: int
    tokens: int
    dense_loss: float
    selections: list[str]
    layers: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    seconds: float = 0.0

    def costliest(self, n: int | None = None) -> list[int]:
        """The `n` layers (all: None) whose loss rises most when they alone are sparse, under the first selection."""
        sel = self.selections[0]
        order = sorted(self.layers, key=lambda i: -self.layers[i]["loss_increase"][sel])
        return order if n is None else order[:n]

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "windows": self.windows, "tokens": self.tokens,
                "dense_loss": _finite(self.dense_loss), "selections": self.selections,
                "layers": {str(i): {k: {s: _finite(v) for s, v in by_sel.items()} for k, by_sel in figs.items()}
                           for i, figs in self.layers.items()},
                "costliest": self.costliest(), "seconds": round(self.seconds, 2)}


@torch.no_grad()
def layer_costs(model: Decoder, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
                selections: tuple[str, ...] = ("oracle",), kernels: bool | None = None,
                progress: Callable[[int, int], None] | None = None) -> LayerCostReport:
    """What each MSA layer costs when it alone is sparse: per layer and selection the loss increase over the dense
    model (every other layer dense), its block recall and the blocks it keeps, over the windows of `tokens`. The
    oracle's cost is the layer's own (what its attention loses at this budget whatever the index branch), so it
    chooses which layers to keep dense before any distillation (`m3c convert --dense-costliest N`); the index's is
    the converted model's. One forward per window, layer and selection, plus the dense one."""
    EvalConfig(seq_len=seq_len, max_windows=max_windows)
    check_positions(seq_len, getattr(model, "source_config", None), f"--seq-len {seq_len}")
    bad = [s for s in selections if s not in ("index", "oracle")]
    if bad or not selections:
        raise M3CompileError(f"layer costs are measured under the index or the oracle selection, got "
                             f"{bad[0] if bad else '(none)'!r}")
    sparse_layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    if not sparse_layers:
        raise M3CompileError("the model has no MSA layers to measure (convert it first)")
    start = time.perf_counter()
    device = next(model.parameters()).device
    data = windows(tokens, seq_len, max_windows).to(device)
    kernels = lowering_default(device) if kernels is None else kernels
    layers = model.model.layers
    runs = [(i, s) for i in sparse_layers for s in selections]
    sums = {run: torch.zeros((), dtype=torch.float64, device=device) for run in runs}
    dense_sum = torch.zeros((), dtype=torch.float64, device=device)
    probes = {run: _RecallProbe(hist=False) for run in runs}
    done = 0
    with _eval_mode(model, kernels):
        for w in range(data.shape[0]):
            x, y = data[w:w + 1, :-1], data[w:w + 1, 1:]
            model.set_selection("dense")
            dense_sum = dense_sum + _token_losses(model, x, y).sum(dtype=torch.float64)
            for i, sel in runs:
                layers[i].self_attn.selection = sel
                _attach(model, [i], probes[i, sel])
                sums[i, sel] = sums[i, sel] + _token_losses(model, x, y).sum(dtype=torch.float64)
                _attach(model, [i], None)
                layers[i].self_attn.selection = "dense"
                done += 1
                if progress:
                    progress(done, data.shape[0] * len(runs))
    n = data.shape[0] * seq_len
    dense = float(dense_sum) / n
    report = LayerCostReport(seq_len, data.shape[0], n, dense, list(selections))
    for i in sparse_layers:
        report.layers[i] = {"loss_increase": {s: float(sums[i, s]) / n / dense - 1.0 for s in selections},
                            "recall": {s: probes[i, s].result()[i] for s in selections},
                            "blocks": {s: probes[i, s].blocks()[i] for s in selections}}
    report.seconds = time.perf_counter() - start
    return report


def costliest_layers(model: Decoder, config: MSAConfig, ids: torch.Tensor, n: int,
                     seq_len: int | None = None) -> LayerCostReport:
    """What each layer of `model` (dense or converted) costs alone sparse under the oracle at `config`'s budget, on
    the windows of `ids` (`seq_len`: default 2048, at most the model's positions), for keeping the `n` costliest
    dense: the model with every layer MSA (the index branch unused: the oracle picks from the layer's own
    attention), measured by evaluation.loss.layer_costs."""
    a = model.args
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < a.n_layers:
        raise M3CompileError(f"--dense-costliest {n}: the model has {a.n_layers} layers; keep 0 to "
                             f"{a.n_layers - 1} of them dense (all would leave no MSA layer)")
    limit = max_positions(getattr(model, "source_config", None))
    seq_len = seq_len or min(2048, limit or 2048, ids.numel() - 1)
    msa = MSALayerArgs(a.n_kv_heads, config.index_dim or a.head_dim, config.block_size, config.topk,
                       config.init_blocks, config.local_blocks, top_p=config.top_p, min_blocks=config.min_blocks)
    with torch.device("meta"):
        every = Decoder(a.replace(sparse_layers=(True,) * a.n_layers, msa=msa))
    every.load_state_dict(model.state_dict(), strict=False, assign=True)  # the index branch stays unused
    for name, buf in model.named_buffers():  # and the buffers a state dict leaves out (the RoPE frequencies)
        owner, _, leaf = name.rpartition(".")
        every.get_submodule(owner)._buffers[leaf] = buf
    every.source_config = getattr(model, "source_config", None)
    return layer_costs(every.eval(), ids, seq_len, selections=("oracle",))


def dense_layers_by_cost(src: str | None, config: MSAConfig, calib: str, n: int, *, preset: str | None = None,
                         calib_tokens: int = 8192, seq_len: int | None = None, device: str = "cpu") -> LayerCostReport:
    """`costliest_layers` for a checkpoint directory `src` (or a preset) and the first `calib_tokens` tokens of the
    data file `calib` (through src's tokenizer): the whole model is loaded on `device` (fp32 on a CPU)."""
    check_device(device)
    model = from_preset(preset or "m3-tiny") if src is None else load(src, dtype="float32" if device == "cpu" else None,
                                                                      device=device)
    ids = load_tokens(calib, model.args.vocab_size, tokenizer_dir=src)[:calib_tokens]
    if ids.numel() < 2:
        raise M3CompileError(f"{calib}: {ids.numel()} tokens, too few to measure the layers on")
    return costliest_layers(model, config, ids, n, seq_len)
