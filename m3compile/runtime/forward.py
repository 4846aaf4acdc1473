"""Prompts into the paged caches and tokens out of them, through the model's own forward: a prompt in one pass or
in chunks (prefill), its next-token losses (prefill_nll), one token per sequence (decode_step). Each is a call of
Decoder.forward with the tokens' positions and a view of the caches (runtime.paged_cache); the ops' switch
(m3compile.ops.lowering) says whether they run the Triton kernels, and `lowering_default` when generation turns it
on."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.models.decoder import Decoder
from m3compile.runtime.paged_cache import PagedCache

__all__ = ["prefill", "prefill_nll", "decode_step", "lowering_default"]

# selections that rank a prompt's own blocks: they need the whole prompt in one pass
_WHOLE_PROMPT = ("oracle", "recent")


def _chunk(T: int, chunk: int | None, selection: str) -> int:
    chunk = T if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if selection in _WHOLE_PROMPT and chunk < T:
        raise ValueError(f"selection {selection!r} ranks the prompt's own blocks: prefill it in one pass "
                         f"(chunk {chunk} < {T} tokens)")
    return chunk


def _pass(model: Decoder, cache: PagedCache, b: int, tokens: torch.Tensor, start: int,
          selection: str) -> torch.Tensor:
    """Tokens [C] at positions start .. start + C - 1 of sequence b through the model -> hidden states [1, C, hidden]
    (after the final norm)."""
    positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)[None]
    return model.model(tokens[None], positions, cache.prompt(b, start, tokens.shape[0], selection))


@torch.no_grad()
def prefill(model: Decoder, cache: PagedCache, b: int, prompt: torch.Tensor, chunk: int | None = None,
            selection: str = "index", start: int = 0) -> torch.Tensor:
    """Run one prompt [T] through the model, filling sequence b of the caches; returns the last logits [vocab].
    start: the prompt's first position (the caches already hold the tokens before it: a prompt in two parts).

    chunk: tokens per pass (None: the whole prompt in one). A pass runs its tokens through every layer, which store
    their keys first and then attend to the keys as the cache holds them (PagedCache.prompt), so the logits do not
    depend on the chunk, and the activations of one chunk, not of the whole prompt, bound the memory
    (m3compile.memory.prefill_chunk). selection: how MSA layers pick their blocks (config.SELECTIONS); the oracle
    and recent selections rank a prompt's own blocks, so they need it in one pass (chunk None or >= T)."""
    T = prompt.shape[0]
    chunk = _chunk(T, chunk, selection)
    for t0 in range(0, T, chunk):
        h = _pass(model, cache, b, prompt[t0:t0 + chunk], start + t0, selection)
    return model.lm_head(h[:, -1]).float()[0]


@torch.no_grad()
def prefill_nll(model: Decoder, cache: PagedCache, b: int, tokens: torch.Tensor, chunk: int | None = None,
                rows: int = 4096, selection: str = "index") -> torch.Tensor:
    """The next-token losses [T - 1] (fp32) of a text [T] prefilled as `prefill` does it (the same chunks, each
    attending to the keys as the cache holds them): the loss a cache's dtype (an fp8 KV cache) costs, measured at
    any length. The logits are made `rows` positions at a time (never [T, vocab]). selection: as in `prefill`
    ("dense": every MSA layer attends to every cached key, the dense baseline under the same cache)."""
    T = tokens.shape[0]
    chunk = _chunk(T, chunk, selection)
    out = torch.empty(T - 1, dtype=torch.float32, device=tokens.device)
    for t0 in range(0, T, chunk):
        x = _pass(model, cache, b, tokens[t0:t0 + chunk], t0, selection)[0]
        for r0 in range(0, min(x.shape[0], T - 1 - t0), rows):
            r1 = min(r0 + rows, x.shape[0], T - 1 - t0)
            out[t0 + r0:t0 + r1] = F.cross_entropy(model.lm_head(x[r0:r1]).float(), tokens[t0 + r0 + 1:t0 + r1 + 1],
                                                   reduction="none")
    return out


@torch.no_grad()
def decode_step(model: Decoder, cache: PagedCache, tokens: torch.Tensor, selection: str = "index") -> torch.Tensor:
    """One token per sequence [B] at position seq_lens[b]; returns logits [B, vocab] (fp32). Reads and writes only
    `tokens` and the cache's tensors, on the device, with no host synchronisation: capturable as a CUDA graph
    (runtime.cuda_graph.DecodeStep). selection: as in `prefill`."""
    step = cache.step(tokens.shape[0], selection)
    h = model.model(tokens[:, None], step.positions[:, None], step)
    return model.lm_head(h[:, 0]).float()


def lowering_default(device) -> bool:
    """Whether generation runs the ops' lowerings (the Triton kernels) by default: on a CUDA device."""
    return torch.device(device).type == "cuda"
