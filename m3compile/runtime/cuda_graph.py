"""The decode step of a batch, run eagerly or captured once as a CUDA graph and replayed per token."""
from __future__ import annotations

import torch

from m3compile.errors import M3CompileError
from m3compile.models.decoder import Attention, Decoder, MoE
from m3compile.runtime.forward import decode_step, kernels_default
from m3compile.runtime.paged_cache import PagedCache

__all__ = ["DecodeStep", "graph_unavailable"]


def graph_unavailable(model: Decoder, device, backend: str = "auto") -> str | None:
    """Why the decode step of `model` cannot be captured as a CUDA graph on `device` (None: it can)."""
    if torch.device(device).type != "cuda":
        return "CUDA graphs need a CUDA device"
    if backend == "torch":
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

    kernels: the model's backbone runs its fused kernels for the step (Decoder.using_kernels: RMSNorm, RoPE and
    the index branch as single kernels) during the warm-up, the capture and every eager call; the model's own
    setting is restored after each (a walk over the modules per eager call, unless the caller holds
    `model.using_kernels(...)` around its loop, as generate does). None (default): kernels_default (on for a CUDA
    cache unless backend "torch"). selection: how MSA layers pick their blocks (runtime.selection; captured with
    the step).
    The index branch's concatenated weights (Attention.fused_index_weight) are built by the warm-up, before the
    capture, and kept alive with the graph, which reads them as they were then."""

    def __init__(self, model: Decoder, cache: PagedCache, batch: int, backend: str = "auto", graph: bool = False,
                 warmup: int = 1, kernels: bool | None = None, selection: str = "index"):
        self.model, self.cache, self.backend, self.selection = model, cache, backend, selection
        self.kernels = kernels_default(cache.seq_lens.device, backend) if kernels is None else kernels
        self.graph = None
        if not graph:
            return
        why = graph_unavailable(model, cache.seq_lens.device, backend)
        if why is not None:
            raise M3CompileError(f"cannot capture the decode step as a CUDA graph: {why}")
        device = cache.seq_lens.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        saved = cache.seq_lens.clone()
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with model.using_kernels(self.kernels):
                with torch.cuda.stream(side):
                    for _ in range(max(1, warmup)):  # (it compiles the kernels, builds the kept weights)
                        decode_step(model, cache, self.tokens, backend, selection)
                        cache.seq_lens.copy_(saved)
                torch.cuda.current_stream(device).wait_stream(side)
                # what the graph reads besides the model's parameters and the cache: kept alive with it
                self._kept = [m.fused_index_weight() for m in model.modules() if isinstance(m, Attention)]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.logits = decode_step(model, cache, self.tokens, backend, selection)
            self.graph = graph
        finally:
            cache.seq_lens.copy_(saved)  # capture runs nothing, but a failed warm-up may have counted a step

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one per sequence) -> logits [B, vocab] fp32; every seq_len grows by one."""
        if self.graph is None:
            with self.model.using_kernels(self.kernels):
                return decode_step(self.model, self.cache, tokens, self.backend, self.selection)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
