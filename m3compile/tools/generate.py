"""Generation with paged caches: prefill each prompt, then decode all sequences token by token.

Every layer keeps a paged KV cache; every MSA layer also keeps a paged index-key cache (one shared index key per
token, bf16 or fp8 e4m3 with one scale per page, as the prefill's fp8 scoring quantises a key block). Pages hold
`block_size` tokens: the MSA key block is the page, so a selected block id is a logical page of the block table.
Prefill runs the fused indexer and the gather-Q sparse kernel (SDPA for dense layers and for prompts whose blocks
all fit in the top-k); decode runs `kernels.decode`'s paged selection and split-K attention for every layer (a dense
layer selects every page). On CPU the same code runs the torch references. On a GPU the decode step is captured once
as a CUDA graph and replayed per token (`DecodeStep`: static token buffer, the cache's tensors, block tables
preallocated to the longest sequence), so per-token Python and kernel-launch overhead does not set the speed; the
eager step is the same function on the same buffers. On a GPU the backbone runs its fused kernels
(Decoder.set_kernels: RMSNorm, RoPE, the index branch as single kernels instead of the modules' 5-12 elementwise ops
each; a decode layer's dispatches, views included, halve).

    result = m3compile.generate(m3compile.load("out", device="cuda", dtype="bf16"), [[1, 2, 3], [4, 5]], 32)
"""
from __future__ import annotations

import codecs
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.kernels.naive_common import expand_block_scale
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.errors import M3CompileError
from m3compile.models.decoder import Attention, Decoder, MoE
from m3compile.ops import scope

__all__ = ["generate", "GenerationResult", "PagedCache", "DecodeStep", "graph_unavailable", "kernels_default",
           "TextCodec"]


class PagedCache:
    """Paged KV + index-key caches of one batch: pages [P, page, ...] per layer, one block table for all layers."""

    def __init__(self, model: Decoder, batch: int, max_len: int, page: int, device, dtype, index_dtype):
        a = model.args
        key_dtype = next(model.parameters()).dtype  # the index keys' own dtype: the tail holds them exactly
        self.page = page
        per_seq = -(-max_len // page)
        self.block_table = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)  # sequence ids 0..B-1: the decode step's rows
        self.page_ids = torch.arange(per_seq, dtype=torch.int32, device=device)  # logical pages 0..per_seq-1
        P = batch * per_seq
        self.k, self.v, self.idx, self.idx_scale, self.tail = {}, {}, {}, {}, {}
        for i in range(a.n_layers):
            self.k[i] = torch.zeros(P, page, a.n_kv_heads, a.head_dim, dtype=dtype, device=device)
            self.v[i] = torch.zeros_like(self.k[i])
            if a.is_sparse(i):
                self.idx[i] = torch.zeros(P, page, a.msa.index_dim, dtype=index_dtype, device=device)
                fp8 = index_dtype == torch.float8_e4m3fn
                self.idx_scale[i] = torch.ones(P, page, dtype=torch.float32, device=device) if fp8 else None
                if fp8:  # each sequence's keys of its newest page, unquantised (kernels.decode.paged_index_write)
                    self.tail[i] = torch.zeros(batch, page, a.msa.index_dim, dtype=key_dtype, device=device)

    def slots(self, b: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical page, offset in it) of positions `pos` of sequences `b`: the same for every layer."""
        return self.block_table[b, pos // self.page].long(), pos % self.page

    def write(self, layer: int, b: torch.Tensor, pos: torch.Tensor, k, v, k_idx=None, slots=None,
              backend: str = "auto") -> None:
        """Store one new token per sequence: sequences `b` [N] (distinct) at positions `pos`: k/v [N, Hkv, D],
        k_idx [N, Di]. `slots`: what slots(b, pos) gives, computed once for all layers by the caller. An fp8
        index cache requantises each sequence's newest page with the new key (kernels.decode.paged_index_write)."""
        page, off = self.slots(b, pos) if slots is None else slots
        self.k[layer][page, off] = k.to(self.k[layer].dtype)
        self.v[layer][page, off] = v.to(self.v[layer].dtype)
        if k_idx is not None:
            if self.idx_scale[layer] is not None:
                paged.paged_index_write(self.idx[layer], self.idx_scale[layer], self.tail[layer], k_idx, b, pos,
                                        self.block_table, backend=backend)
            else:
                self.idx[layer][page, off] = k_idx.to(self.idx[layer].dtype)

    def write_prompt(self, layer: int, b: int, k, v, k_idx=None) -> None:
        """Store a prompt's T tokens at positions 0..T-1 of sequence b: k/v [T, Hkv, D], k_idx [T, Di]. fp8 index
        keys are quantised with one scale per page, as the prefill's selection quantised them (one per key block);
        the last page's keys, if it is not full, stay unquantised in the tail for the decode steps that fill it."""
        T = k.shape[0]
        pos = torch.arange(T, device=k.device)
        page, off = self.slots(torch.full((T,), b, device=k.device), pos)
        self.k[layer][page, off] = k.to(self.k[layer].dtype)
        self.v[layer][page, off] = v.to(self.v[layer].dtype)
        if k_idx is None:
            return
        if self.idx_scale[layer] is None:
            self.idx[layer][page, off] = k_idx.to(self.idx[layer].dtype)
            return
        q8, scale = quantize_index_keys(k_idx[None], self.page)
        self.idx[layer][page, off] = q8[0]
        self.idx_scale[layer][page, off] = expand_block_scale(scale, self.page, T)[0]
        start = T - T % self.page
        self.tail[layer][b, : T - start] = k_idx[start:].to(self.tail[layer].dtype)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per sequence (prompt excluded)
    prefill_logits: list[torch.Tensor]  # [vocab] logits after each prompt
    step_logits: torch.Tensor  # [steps, B, vocab] logits of each decode step (fp32)


def _dense_blocks(cache: PagedCache, n_kv: int) -> torch.Tensor:
    """Every page of each sequence as the blocks [B, n_kv, pages] of a dense layer (-1 past the sequence's end)."""
    ids = cache.page_ids
    n_pages = (cache.seq_lens + cache.page - 1) // cache.page
    blocks = torch.where(ids[None, :] < n_pages[:, None], ids[None, :], -1)
    return blocks[:, None, :].expand(-1, n_kv, -1).contiguous()


@torch.no_grad()
def _prefill(model: Decoder, cache: PagedCache, b: int, prompt: torch.Tensor, backend: str) -> torch.Tensor:
    """Run one prompt [T] through the model, filling sequence b of the caches; returns the last logits [vocab]."""
    bb = model.model
    T = prompt.shape[0]
    x = bb.embed_tokens(prompt[None])
    cos, sin = bb.rotary_emb(x, torch.arange(T, device=x.device)[None])
    for i, layer in enumerate(bb.layers):
        attn: Attention = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.project(h, cos, sin)
        k_idx = None
        m = attn.msa
        if m is not None and attn.sparse and -(-T // m.block_size) > m.topk:
            q_idx, k_idx = attn.index_branch(h, cos, sin)
            keys, k_scale = quantize_index_keys(k_idx, m.block_size) if m.index_dtype == "fp8" else (k_idx, None)
            blocks = select_blocks(q_idx, keys, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                   local_blocks=m.local_blocks, k_scale=k_scale, backend=backend)
            o = sparse_attention(q, k, v, blocks, block_size=m.block_size, scale=attn.scale, backend=backend)
        else:  # dense layer, or an MSA layer whose prompt fits in the top-k: dense causal is exact
            if m is not None:
                k_idx = attn.index_branch(h, cos, sin)[1]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale, enable_gqa=True)
        cache.write_prompt(i, b, k[0].transpose(0, 1), v[0].transpose(0, 1), None if k_idx is None else k_idx[0])
        x = x + attn.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(bb.norm(x[:, -1])).float()[0]


@torch.no_grad()
def _decode_step(model: Decoder, cache: PagedCache, tokens: torch.Tensor, backend: str) -> torch.Tensor:
    """One token per sequence [B] at position seq_lens[b]; returns logits [B, vocab]. Reads and writes only
    `tokens` and the cache's tensors, on the device, with no host synchronisation: capturable as a CUDA graph.
    What every layer shares is computed once per step: the RoPE tables, the cache slots of the new tokens and
    the dense layers' blocks (every page). The model's modules run as the model is set (Decoder.set_kernels:
    DecodeStep and generate switch the fused kernels on for CUDA)."""
    bb = model.model
    B = tokens.shape[0]
    pos = cache.seq_lens.long()
    x = bb.embed_tokens(tokens[:, None])  # [B, 1, hidden]
    cos, sin = bb.rotary_emb(x, pos[:, None])
    b_ids = cache.rows if cache.rows.shape[0] == B else torch.arange(B, device=x.device)
    slots = cache.slots(b_ids, pos)
    cache.seq_lens += 1
    dense: dict[int, torch.Tensor] = {}  # n_kv -> every page of each sequence, built by the first layer needing it
    for i, layer in enumerate(bb.layers):
        attn: Attention = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.project(h, cos, sin)  # [B, H, 1, D]
        m = attn.msa
        if m is not None:
            q_idx, k_idx = attn.index_branch(h, cos, sin)  # [B, 1, Hi, Di], [B, 1, Di]
            cache.write(i, b_ids, pos, k[:, :, 0], v[:, :, 0], k_idx[:, 0], slots=slots, backend=backend)
        else:
            cache.write(i, b_ids, pos, k[:, :, 0], v[:, :, 0], slots=slots)
        if m is not None and attn.sparse:
            with scope("m3c.decode_select"):
                blocks = paged.paged_select(q_idx[:, 0], cache.idx[i], cache.block_table, cache.seq_lens,
                                            topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks,
                                            idx_scale=cache.idx_scale[i], backend=backend)
        else:  # a dense layer, or an MSA layer run densely: every page (no selection to compute)
            if attn.n_kv_heads not in dense:
                dense[attn.n_kv_heads] = _dense_blocks(cache, attn.n_kv_heads)
            blocks = dense[attn.n_kv_heads]
        with scope("m3c.decode_attention"):
            o = paged.paged_attention(q[:, :, 0], cache.k[i], cache.v[i], blocks, cache.block_table,
                                      cache.seq_lens, scale=attn.scale, backend=backend)  # [B, Hq, D]
        x = x + attn.o_proj(o.reshape(B, 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(bb.norm(x[:, 0])).float()


def kernels_default(device, backend: str = "auto") -> bool:
    """Whether generation runs the model's fused kernels (Decoder.set_kernels) by default: on a CUDA device, unless
    backend "torch" asks for the references."""
    return torch.device(device).type == "cuda" and backend != "torch"


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

    Both run `_decode_step` on the same buffers: the captured graph replays it with a static token buffer [B]
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
    cache unless backend "torch").
    The index branch's concatenated weights (Attention.fused_index_weight) are built by the warm-up, before the
    capture, and kept alive with the graph, which reads them as they were then."""

    def __init__(self, model: Decoder, cache: PagedCache, batch: int, backend: str = "auto", graph: bool = False,
                 warmup: int = 2, kernels: bool | None = None):
        self.model, self.cache, self.backend = model, cache, backend
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
                    for _ in range(max(1, warmup)):  # (at least one: it builds the kept weights before capture)
                        _decode_step(model, cache, self.tokens, backend)
                        cache.seq_lens.copy_(saved)
                torch.cuda.current_stream(device).wait_stream(side)
                # what the graph reads besides the model's parameters and the cache: kept alive with it
                self._kept = [m.fused_index_weight() for m in model.modules() if isinstance(m, Attention)]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.logits = _decode_step(model, cache, self.tokens, backend)
            self.graph = graph
        finally:
            cache.seq_lens.copy_(saved)  # capture runs nothing, but a failed warm-up may have counted a step

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one per sequence) -> logits [B, vocab] fp32; every seq_len grows by one."""
        if self.graph is None:
            with self.model.using_kernels(self.kernels):
                return _decode_step(self.model, self.cache, tokens, self.backend)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] from logits [B, vocab]: argmax at temperature 0, else a sample from the top-p nucleus of
    softmax(logits / temperature) (drawn on the CPU, so a seed gives the same tokens on any device)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the most likely token always stays
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


def generate(model: Decoder, prompts: list[list[int]] | torch.Tensor, max_new_tokens: int, *,
             index_cache_dtype: str = "auto", page_size: int | None = None, backend: str = "auto",
             eos_token_id: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, on_token: Callable[[int, int], None] | None = None,
             cuda_graph: bool | None = None, kernels: bool | None = None) -> GenerationResult:
    """Generation with paged caches: prompts of any lengths, one batched decode per new token.

    Greedy by default; temperature > 0 samples from the top-p nucleus (seed: a reproducible draw).
    index_cache_dtype: "auto" (the model's dtype; fp8 when the model scores its index in fp8, index_dtype "fp8") or
    "fp8" (e4m3 index keys, per-token fp32 scale).
    page_size: tokens per cache page; MSA models use their block size (required to be equal).
    on_token(sequence, token) is called for every generated token as it is chosen (streaming).
    cuda_graph: replay the decode step as a CUDA graph (DecodeStep). None (default): on a CUDA device when the
    step is capturable (`graph_unavailable`) and at least 8 decode steps follow; eager on a CPU. True: required.
    kernels: prefill and decode run the model's fused backbone kernels (Decoder.set_kernels: RMSNorm, RoPE, the
    index branch), the model's setting restored after. None (default): on a CUDA device unless backend "torch"
    (kernels_default); True on a CPU runs them under TRITON_INTERPRET=1 and the references otherwise.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise M3CompileError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise M3CompileError(f"top_p must be in (0, 1], got {top_p!r}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if not isinstance(model, Decoder):
        raise M3CompileError("generate needs a Decoder (m3compile.load or m3compile.from_preset)")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise M3CompileError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise M3CompileError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    a = model.args
    vocab = a.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise M3CompileError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    block = a.msa.block_size if a.msa is not None and any(a.is_sparse(i) for i in range(a.n_layers)) else None
    if block is not None and page_size not in (None, block):
        raise M3CompileError(f"page_size ({page_size}) must equal the MSA block size ({block}): a page is a block")
    page = block or page_size or 128
    if index_cache_dtype not in ("auto", "fp8"):
        raise M3CompileError(f"index_cache_dtype must be 'auto' or 'fp8', got {index_cache_dtype!r}")
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    fp8_model = a.msa is not None and a.msa.index_dtype == "fp8"
    index_dtype = torch.float8_e4m3fn if index_cache_dtype == "fp8" or fp8_model else dtype
    B = len(prompts)
    cache = PagedCache(model, B, max(len(p) for p in prompts) + max_new_tokens, page, device, dtype, index_dtype)
    kernels = kernels_default(device, backend) if kernels is None else kernels
    with model.using_kernels(kernels):  # prefill and decode on the fused backbone kernels (CUDA by default)
        prefill_logits = []
        for b, p in enumerate(prompts):
            prefill_logits.append(_prefill(model, cache, b, torch.tensor(p, device=device), backend))
            cache.seq_lens[b] = len(p)
        auto = cuda_graph is None
        if auto:
            cuda_graph = max_new_tokens > 8 and graph_unavailable(model, device, backend) is None
        try:
            step_fn = DecodeStep(model, cache, B, backend, graph=bool(cuda_graph) and max_new_tokens > 1,
                                 kernels=kernels)
        except RuntimeError as e:  # a capture CUDA refused: what was not asked for explicitly falls back to eager
            if not auto:
                raise
            warnings.warn(f"decode step not captured as a CUDA graph ({str(e).splitlines()[0][:120]}); running eagerly")
            step_fn = DecodeStep(model, cache, B, backend, kernels=kernels)
        out = [[] for _ in range(B)]
        done = [False] * B
        step_logits = []
        next_tok = _pick(torch.stack(prefill_logits), temperature, top_p, generator)
        for step in range(max_new_tokens):
            chosen = next_tok.tolist()  # one host synchronisation per step
            for b in range(B):
                if not done[b]:
                    out[b].append(chosen[b])
                    if on_token is not None:
                        on_token(b, chosen[b])
                    done[b] = chosen[b] == eos_token_id
            if eos_token_id is not None and all(done):
                break
            if step == max_new_tokens - 1:
                break
            logits = step_fn(next_tok)
            step_logits.append(logits.clone() if step_fn.graph is not None else logits)
            next_tok = _pick(logits, temperature, top_p, generator)
    steps = torch.stack(step_logits) if step_logits else torch.empty(0, B, vocab)
    return GenerationResult(out, prefill_logits, steps)


class TextCodec:
    """Text <-> token ids of a checkpoint: its tokenizer.json, or raw UTF-8 bytes for a byte-level (vocab 256)
    model without one. `stream()` gives a decoder that turns ids, one at a time, into the new text they complete."""

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int):
        self.tokenizer = None
        tok_file = Path(model_dir) / "tokenizer.json"
        if tok_file.is_file():
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(str(tok_file))
            except Exception as e:  # tokenizers raises its own exception type for malformed files
                raise M3CompileError(f"{tok_file}: cannot read tokenizer ({str(e).splitlines()[0]})") from None
        elif vocab_size != 256:
            raise M3CompileError(f"{model_dir}: no tokenizer.json, and the model is not byte-level (vocab "
                                 f"{vocab_size}, not 256): cannot turn text into tokens")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def stream(self) -> Callable[[int], str]:
        if self.tokenizer is None:
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return lambda t: utf8.decode(bytes([t]))
        ids: list[int] = []
        shown = [""]

        def push(t: int) -> str:  # decode everything so far, emit what is new (tokens may merge across ids)
            ids.append(t)
            text = self.tokenizer.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
                return ""
            new, shown[0] = text[len(shown[0]):] if text.startswith(shown[0]) else text, text
            return new
        return push


def eos_token_id(config: dict, model_dir: str | os.PathLike | None = None) -> int | None:
    """The end-of-sequence id of generation_config.json or config.json (the first, when a list), or None."""
    sources = []
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        try:
            sources.append(json.loads((Path(model_dir) / "generation_config.json").read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise M3CompileError(f"{model_dir}/generation_config.json: not valid JSON") from None
    sources.append(config)
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
