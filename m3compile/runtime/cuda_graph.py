"""The decode step of a batch, run eagerly or captured once as a CUDA graph and replayed per token."""
from __future__ import annotations

import torch

from m3compile.errors import M3CompileError
from m3compile.models.decoder import Decoder, MoE
from m3compile.ops import lowering
from m3compile.runtime.forward import decode_step, lowering_default
from m3compile.runtime.paged_cache import PagedCache

__all__ = ["DecodeStep", "graph_unavailable"]


def graph_unavailable(model: Decoder, device, kernels: bool = True) -> str | None:
    """Why the decode step of `model` cannot be captured as a CUDA graph on `device` (None: it can)."""
    if torch.device(device).type != "cuda":
        return "CUDA graphs need a CUDA device"
    if not kernels:
        return "the torch reference kernels synchronise with the host"
    if any(isinstance(mod, MoE) for mod in model.modules()):
        return "MoE routing is data-dependent (a host synchronisation per layer)"
    return None


class DecodeStep:
    """The decode step of every sequence of `cache`, eagerly or as a CUDA graph captured once.

    Both run `decode_step` on the same buffers: the captured graph replays it with a static token buffer [B]
    (copied in before each replay) and the cache's own tensors (KV and index-key pages, the block table
    preallocated to the longest sequence, seq_lens), so a replay does what an eager step does, without per-token
    Python or launch overhead. The logits a replay returns are a static buffer, overwritten by the next replay.
    Capture warms the step up first (compiles the Triton kernels, runs their autotuning) on a side stream and
    restores seq_lens after, so capturing changes no visible state (the warm-up writes only at positions past
    each sequence's end, which the next step overwrites).

    kernels: the step runs the ops' lowerings (m3compile.ops.lowering: the Triton kernels) in the warm-up, the
    capture and every eager call. None (default): lowering_default (on for a CUDA cache). selection: how MSA layers
    pick their blocks (config.SELECTIONS; captured with the step)."""

    def __init__(self, model: Decoder, cache: PagedCache, batch: int, graph: bool = False, warmup: int = 1,
                 kernels: bool | None = None, selection: str = "index"):
        self.model, self.cache, self.selection = model, cache, selection
        self.kernels = lowering_default(cache.seq_lens.device) if kernels is None else kernels
        self.graph = None
        if not graph:
            return
        why = graph_unavailable(model, cache.seq_lens.device, self.kernels)
        if why is not None:
            raise M3CompileError(f"cannot capture the decode step as a CUDA graph: {why}")
        device = cache.seq_lens.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        saved = cache.seq_lens.clone()
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with lowering(self.kernels):
                with torch.cuda.stream(side):
                    for _ in range(max(1, warmup)):  # (it compiles the kernels)
                        decode_step(model, cache, self.tokens, selection)
                        cache.seq_lens.copy_(saved)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.logits = decode_step(model, cache, self.tokens, selection)
            self.graph = graph
        finally:
            cache.seq_lens.copy_(saved)  # capture runs nothing, but a failed warm-up may have counted a step

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one per sequence) -> logits [B, vocab] fp32; every seq_len grows by one."""
        if self.graph is None:
            with lowering(self.kernels):
                return decode_step(self.model, self.cache, tokens, self.selection)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
