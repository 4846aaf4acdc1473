"""Calibration of the index-branch init: the second moment of each layer's attention input on real tokens.

The dense model runs layer by layer over windows of calibration tokens. Before layer i runs, the second moment
C_i = E[x x^T] of its attention input x = input_layernorm(h) is accumulated in float64; models/index_init.py then
fits the index projections in the coordinates that C_i whitens. Layer by layer, so that the streaming converter
can feed one layer's tensors at a time: memory holds the hidden states of the calibration windows (tokens x hidden,
fp32) and one layer in fp32, never the model. MSA layers of a source that already has some run dense here: the
moment describes what the dense teacher sees. In-memory conversion (`pipelines.convert(..., calib=ids)`) and the
streaming converter run the same code on the same fp32 copies, so their index branches are identical.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m3compile.errors import M3CompileError
from m3compile.models.decoder import DecoderLayer, ModelArgs, RotaryEmbedding

__all__ = ["Calibration", "CalibrationInfo", "DEFAULT_CALIB_TOKENS", "DEFAULT_CALIB_SEQ_LEN"]

DEFAULT_CALIB_TOKENS = 8192  # 256 already give SmolLM2 its calibrated recall; the default leaves a wide margin
DEFAULT_CALIB_SEQ_LEN = 2048


@dataclass(frozen=True)
class CalibrationInfo:
    """What the index branch was initialised from (conversion_report.json's `index_init`)."""

    method: str  # "calibrated" or "weight-only"
    tokens: int = 0
    windows: int = 0
    seq_len: int = 0
    source: str | None = None  # the calibration data file, when known

    def to_dict(self) -> dict:
        if self.method == "weight-only":
            return {"method": self.method}
        return {"method": self.method, "tokens": self.tokens, "windows": self.windows, "seq_len": self.seq_len,
                "source": self.source}


class Calibration:
    """Layer-by-layer dense forward over calibration windows; `moment(i, layer)` returns C_i and advances.

    tokens: 1-D token ids, cut into windows of `seq_len` (one shorter window when there are fewer tokens).
    max_positions: the model's positions (max_position_embeddings): a window past them is refused (the hidden states
    there are of positions the model never saw); the default `seq_len` (None: DEFAULT_CALIB_SEQ_LEN) is cut to them.
    Call `embed(weight)` once, then `moment(i, layer)` for i = 0, 1, ... in order (every layer, converted or not:
    `advance(i, layer)` runs a layer whose moment is not needed)."""

    def __init__(self, args: ModelArgs, tokens: torch.Tensor, seq_len: int | None = None,
                 device: str | torch.device = "cpu", source: str | None = None, max_positions: int | None = None):
        tokens = tokens.reshape(-1)
        if seq_len is None:
            seq_len = min(DEFAULT_CALIB_SEQ_LEN, max_positions or DEFAULT_CALIB_SEQ_LEN)
        if seq_len < 1:
            raise M3CompileError(f"calibration sequence length must be positive, got {seq_len}")
        if tokens.numel() < 2:
            raise M3CompileError(f"calibration needs at least 2 tokens, got {tokens.numel()}")
        seq_len = min(seq_len, tokens.numel())
        if max_positions is not None and seq_len > max_positions:
            raise M3CompileError(f"--calib-seq-len: calibration windows of {seq_len:,} tokens are past the model's "
                                 f"{max_positions:,} positions (max_position_embeddings in config.json); use at most "
                                 f"{max_positions:,}")
        n = tokens.numel() // seq_len
        self.windows = tokens[: n * seq_len].view(n, seq_len).to(device)
        self.args, self.device = args, torch.device(device)
        self.info = CalibrationInfo("calibrated", n * seq_len, n, seq_len, source)
        self.hidden: torch.Tensor | None = None
        self.next_layer = 0
        with torch.device(self.device):
            rope = RotaryEmbedding(args)
        positions = torch.arange(seq_len, device=self.device)[None]
        self.cos, self.sin = rope(torch.empty(0, dtype=torch.float32, device=self.device), positions)

    def embed(self, weight: torch.Tensor) -> None:
        """Start: the hidden states are the embeddings of the calibration windows."""
        self.hidden = F.embedding(self.windows, weight.to(device=self.device, dtype=torch.float32))
        self.next_layer = 0

    @torch.no_grad()
    def moment(self, index: int, layer: DecoderLayer) -> torch.Tensor:
        """C = E[x x^T] [hidden, hidden] float64 of layer `index`'s attention input, then run the layer."""
        layer = self._runnable(index, layer)
        x = layer.input_layernorm(self.hidden).reshape(-1, self.args.hidden_size).double()
        moment = (x.T @ x) / x.shape[0]
        self._run(layer)
        return moment

    @torch.no_grad()
    def advance(self, index: int, layer: DecoderLayer) -> None:
        self._run(self._runnable(index, layer))

    def model_moments(self, backbone: torch.nn.Module, layers) -> dict[int, torch.Tensor]:
        """The moments of `layers` (indices) of an in-memory Backbone (`Decoder.model`), from its own weights."""
        layers = set(layers)
        self.embed(backbone.embed_tokens.weight)
        out = {}
        for i, layer in enumerate(backbone.layers):
            if not any(j >= i for j in layers):
                break
            if i in layers:
                out[i] = self.moment(i, layer)
            else:
                self.advance(i, layer)
        return out

    def _runnable(self, index: int, layer: DecoderLayer) -> DecoderLayer:
        if self.hidden is None or index != self.next_layer:
            raise AssertionError(f"calibration got layer {index}, expected layer {self.next_layer} after embed()")
        layer = copy.deepcopy(layer).to(device=self.device, dtype=torch.float32)
        layer.self_attn.selection = "dense"  # an MSA layer of the source runs dense: the teacher's inputs
        return layer

    def _run(self, layer: DecoderLayer) -> None:
        for i in range(self.hidden.shape[0]):  # one window at a time: activations of one sequence at most
            x = self.hidden[i: i + 1]
            self.hidden[i: i + 1] = layer(x, layer.input_layernorm(x), self.cos, self.sin)[0]
        self.next_layer += 1
        if not torch.isfinite(self.hidden).all():
            raise M3CompileError(f"calibration: layer {self.next_layer - 1} produced non-finite hidden states")
