"""The paged KV and index-key caches of one batch (pages [P, page, ...] per layer, one block table for all layers),
and the views the model's forward attends through: a prompt's pass (`PagedCache.prompt`) and one decode step of
every sequence (`PagedCache.step`). Each view has `attend(attention, q, k, v, q_idx, k_idx)`, which the model's
attention layers call (models.decoder.Attention): it stores the layer's new keys, values and index keys, picks the
blocks as its selection says (m3compile.config.SELECTIONS) and attends over what the cache holds."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.kernels.naive_common import expand_block_scale
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.memory import DEQUANTIZE_ROWS
from m3compile.models.decoder import Attention, Decoder
from m3compile.ops import lowering_enabled, msa_oracle_select, msa_recent_select, scope
from m3compile.runtime.key_shift import key_shifts, rotation

__all__ = ["PagedCache", "PromptView", "StepView"]


class PagedCache:
    """Paged KV + index-key caches of one batch: pages [P, page, ...] per layer, one block table for all layers.

    dtype: the KV cache's dtype: the model's, another floating dtype, torch.float8_e4m3fn (e4m3) or torch.int8, the
    last two with one fp32 scale per token and head in k_scale / v_scale [P, page, Hkv] (kernels.decode
    .paged_kv_write), each key less its layer's k_shift [Hkv, D] (runtime.key_shift: exact for attention, it keeps a
    K bias's constant out of the rounding); int8 rows are also rotated, keys and values times `rotation` [D, D]
    (runtime.key_shift.rotation), which the decode attention applies to its queries and, transposed, to its outputs
    (kernels.decode.paged_attention's `rotation`; `rotate_queries` for the decode oracle). index_dtype: the
    index-key cache's (fp8: one scale per page, the newest page's keys also kept unquantised in `tail`).
    Each sequence's pages are consecutive (block_table row b = pages b * per_seq ...), so a sequence's keys read
    back as one strided view (`keys_values`, `index_keys`: what a chunked prefill attends to)."""

    # after count_blocks(): [blocks kept, (sequence, KV group) rows] summed over the MSA layers of every decode step,
    # on the device (a CUDA graph captured after count_blocks() adds to it on every replay); None: nothing counted.
    # A class default, so a cache that builds itself otherwise (the vLLM plugin's) counts nothing too
    kept: torch.Tensor | None = None

    def __init__(self, model: Decoder, batch: int, max_len: int, page: int, device, dtype, index_dtype):
        a = model.args
        self.model_dtype = key_dtype = next(model.parameters()).dtype  # what reads return; the tails' dtype
        self.page = page
        per_seq = -(-max_len // page)
        self.block_table = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)  # sequence ids 0..B-1: the decode step's rows
        self.page_ids = torch.arange(per_seq, dtype=torch.int32, device=device)  # logical pages 0..per_seq-1
        P = batch * per_seq
        quantised = dtype in paged.KV_QUANTISED  # one scale per (token, head) row
        self.k, self.v, self.k_scale, self.v_scale = {}, {}, {}, {}
        # quantised caches only: per layer [Hkv, D] fp32 or None (a model constant, not counted by nbytes)
        shifts = key_shifts(model, max_len) if quantised else dict.fromkeys(range(a.n_layers))
        self.k_shift = {i: None if mu is None else mu.to(device) for i, mu in shifts.items()}
        self.rotation = rotation(a.head_dim).to(device) if dtype == torch.int8 else None
        # (a power-of-two head dim's rotation is the Walsh-Hadamard matrix: the kernels make it in registers)
        self.hadamard = self.rotation is not None and a.head_dim & (a.head_dim - 1) == 0
        self.idx, self.idx_scale, self.tail = {}, {}, {}
        for i in range(a.n_layers):
            self.k[i] = torch.zeros(P, page, a.n_kv_heads, a.head_dim, dtype=dtype, device=device)
            self.v[i] = torch.zeros_like(self.k[i])
            self.k_scale[i] = torch.ones(P, page, a.n_kv_heads, device=device) if quantised else None
            self.v_scale[i] = torch.ones(P, page, a.n_kv_heads, device=device) if quantised else None
            if a.is_sparse(i):
                self.idx[i] = torch.zeros(P, page, a.msa.index_dim, dtype=index_dtype, device=device)
                fp8 = index_dtype == torch.float8_e4m3fn
                # (zero: a page's first write quantises it whole, kernels.decode.paged_index_write)
                self.idx_scale[i] = torch.zeros(P, page, dtype=torch.float32, device=device) if fp8 else None
                if fp8:  # each sequence's keys of its newest page, unquantised (kernels.decode.paged_index_write)
                    self.tail[i] = torch.zeros(batch, page, a.msa.index_dim, dtype=key_dtype, device=device)

    def count_blocks(self) -> None:
        """Count the blocks the decode steps' MSA layers keep from now on (`kept`): zeroed in place where a counter
        exists, so a step captured after the first call keeps adding to the one it captured."""
        if self.kept is None:
            self.kept = torch.zeros(2, dtype=torch.int64, device=self.seq_lens.device)
        else:
            self.kept.zero_()

    def nbytes(self) -> int:
        """Bytes of the caches' pages, scales and tails (what m3compile.memory.cache_bytes counts; the block table
        and the lengths, a few bytes per page, aside)."""
        tensors = []
        for d in (self.k, self.v, self.k_scale, self.v_scale, self.idx, self.idx_scale, self.tail):
            tensors += [t for t in d.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def slots(self, b: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical page, offset in it) of positions `pos` of sequences `b`: the same for every layer."""
        return self.block_table[b, pos // self.page].long(), pos % self.page

    def write(self, layer: int, b: torch.Tensor, pos: torch.Tensor, k, v, k_idx=None, slots=None,
              backend: str = "auto") -> None:
        """Store one new token per sequence: sequences `b` [N] (distinct) at positions `pos`: k/v [N, Hkv, D],
        k_idx [N, Di]. `slots`: what slots(b, pos) gives, computed once for all layers by the caller. An fp8 KV
        cache stores each (token, head) row quantised with its own scale (kernels.decode.paged_kv_write); an fp8
        index cache requantises each sequence's newest page with the new key (kernels.decode.paged_index_write)."""
        page, off = self.slots(b, pos) if slots is None else slots
        paged.paged_kv_write(self.k[layer], self.v[layer], k, v, page, off, k_scale=self.k_scale[layer],
                             v_scale=self.v_scale[layer], k_shift=self.k_shift[layer], rotation=self.rotation,
                             hadamard=self.hadamard, backend=backend)
        if k_idx is not None:
            if self.idx_scale[layer] is not None:
                paged.paged_index_write(self.idx[layer], self.idx_scale[layer], self.tail[layer], k_idx, b, pos,
                                        self.block_table, backend=backend)
            else:
                self.idx[layer][page, off] = k_idx.to(self.idx[layer].dtype)

    def write_tokens(self, layer: int, b: int, start: int, k, v, k_idx=None, backend: str = "auto") -> None:
        """Store T consecutive tokens of sequence b at positions start..start+T-1 (a prompt, or one chunk of it):
        k/v [T, Hkv, D], k_idx [T, Di]. fp8 index keys are quantised with one scale per page, as the prefill's
        selection quantises them (one per key block): the page holding `start` is quantised again with the keys it
        held before (the tail's); the last page's keys, if it is not full, stay unquantised in the tail for the
        tokens that fill it."""
        T = k.shape[0]
        dev = k.device
        page, off = self.slots(torch.full((T,), b, device=dev), torch.arange(start, start + T, device=dev))
        paged.paged_kv_write(self.k[layer], self.v[layer], k, v, page, off, k_scale=self.k_scale[layer],
                             v_scale=self.v_scale[layer], k_shift=self.k_shift[layer], rotation=self.rotation,
                             hadamard=self.hadamard, backend=backend)
        if k_idx is None:
            return
        if self.idx_scale[layer] is None:
            self.idx[layer][page, off] = k_idx.to(self.idx[layer].dtype)
            return
        first, end = start - start % self.page, start + T
        keys = torch.cat([self.tail[layer][b, : start - first], k_idx.to(self.tail[layer].dtype)])  # from `first`
        page, off = self.slots(torch.full((end - first,), b, device=dev), torch.arange(first, end, device=dev))
        q8, scale = quantize_index_keys(keys[None], self.page)
        self.idx[layer][page, off] = q8[0]
        self.idx_scale[layer][page, off] = expand_block_scale(scale, self.page, end - first)[0]
        last = end - end % self.page
        self.tail[layer][b, : end - last] = keys[last - first:]

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [..., D] in the basis of this cache's keys: times `rotation` where it has one."""
        return q if self.rotation is None else (q.float() @ self.rotation).to(q.dtype)


    def sequence_rows(self, t: torch.Tensor, b: int, length: int) -> torch.Tensor:
        """Sequence b's first `length` rows of a per-layer tensor [P, page, ...] -> [length, ...], a view (its
        pages are consecutive; a cache whose pages lie anywhere gathers them through its block table)."""
        per_seq = self.block_table.shape[1]
        return t[b * per_seq:(b + 1) * per_seq].flatten(0, 1)[:length]

    def keys_values(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's first `length` keys and values as attention reads them: [1, Hkv, length, D] in the model's
        dtype; views of the pages, or of an fp8 cache the values dequantised into new tensors (in pieces of
        DEQUANTIZE_ROWS tokens, so the fp32 scratch stays bounded at any length), the keys less k_shift: softmax
        attention reads them as it would the keys themselves (every score of a query moves by the same q . shift),
        and so does a selection ranking a query's scores; an int8 cache's rows rotated back (times rotation^T)."""
        out = []
        for cache, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = self.sequence_rows(cache[layer], b, length)
            if scale[layer] is not None:
                s, x8 = self.sequence_rows(scale[layer], b, length), x
                x = torch.empty(x8.shape, dtype=self.model_dtype, device=x8.device)
                for t0 in range(0, length, DEQUANTIZE_ROWS):
                    rows = paged.dequantize_kv(x8[t0:t0 + DEQUANTIZE_ROWS], s[t0:t0 + DEQUANTIZE_ROWS])
                    x[t0:t0 + DEQUANTIZE_ROWS] = rows if self.rotation is None else rows @ self.rotation.T
            elif x.dtype != self.model_dtype:
                x = x.to(self.model_dtype)
            out.append(x.transpose(0, 1)[None])
        return out[0], out[1]

    def index_keys(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequence b's first `length` index keys as the selection reads them: ([1, length, Di] view, the fp8 keys'
        scales [1, ceil(length / page)] (one per page = key block) or None)."""
        keys = self.sequence_rows(self.idx[layer], b, length)[None]
        if self.idx_scale[layer] is None:
            return keys, None
        return keys, self.sequence_rows(self.idx_scale[layer], b, length)[:: self.page][None]

    def prompt(self, b: int, start: int, length: int, selection: str = "index") -> "PromptView":
        """The view a pass of `length` prompt tokens of sequence b at positions start .. start + length - 1 attends
        through (Decoder.forward(tokens, positions, cache=view))."""
        return PromptView(self, b, start, length, selection)

    def step(self, batch: int, selection: str = "index") -> "StepView":
        """The view one decode step of every sequence attends through: one new token each, at position seq_lens[b]
        (read here, then every seq_len grows by one)."""
        return StepView(self, batch, selection)


def _backend() -> str:
    """The paged kernels' backend: Triton where the ops are lowered (m3compile.ops.lowering), else the references."""
    return "auto" if lowering_enabled() else "torch"


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of the last Tq of Tk positions (Tq = Tk: the whole prompt): q [1, Hq, Tq, D], k/v
    [1, Hkv, Tk, D]; SDPA, bottom-right aligned for a chunk over its cached prefix."""
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq == Tk:
        mask = None
    else:  # imported here: torch.nn.attention.bias imports torch._dynamo (1.7 s), which a whole-prompt prefill
        from torch.nn.attention.bias import causal_lower_right  # and the decode never need

        mask = causal_lower_right(Tq, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True)


class PromptView:
    """One pass of a prompt into the caches. Each layer's keys, values and index keys go to the cache first; then
    its queries attend to the keys and values as the cache holds them (every earlier pass's and their own; a
    quantised cache's dequantised), an MSA layer selecting over the cached index keys (fp8: one scale per page, as
    the decode reads them). So the logits do not depend on how a prompt is cut into passes. The oracle and recent
    selections rank a prompt's own blocks, so they take it in one pass (runtime.forward.prefill refuses less)."""

    def __init__(self, cache: PagedCache, b: int, start: int, length: int, selection: str):
        self.cache, self.b, self.start, self.end = cache, b, start, start + length
        self.selection, self.backend = selection, _backend()

    def attend(self, attn: Attention, q, k, v, q_idx, k_idx) -> torch.Tensor:
        """q [1, Hq, C, D], k/v [1, Hkv, C, D], q_idx [1, C, Hi, Di], k_idx [1, C, Di] (MSA) -> [1, Hq, C, D]."""
        cache, i, m, end = self.cache, attn.layer, attn.msa, self.end
        cache.write_tokens(i, self.b, self.start, k[0].transpose(0, 1), v[0].transpose(0, 1),
                           None if k_idx is None else k_idx[0], backend=self.backend)
        k, v = cache.keys_values(i, self.b, end)  # [1, Hkv, end, D]: every key so far, as the cache holds it
        fit = -(-end // m.block_size) <= m.topk and (m.top_p >= 1 or self.selection == "recent") if m else True
        if m is None or self.selection == "dense" or fit:
            return _causal(q, k, v, attn.scale)  # a dense layer, or keys that fit in the top-k: dense is exact
        if self.selection == "index":
            keys, k_scale = cache.index_keys(i, self.b, end)
            with scope("m3c.msa_select"):
                blocks = select_blocks(q_idx, keys, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                       local_blocks=m.local_blocks, k_scale=k_scale, top_p=m.top_p,
                                       min_blocks=m.min_blocks, backend=self.backend)
        elif self.selection == "oracle":
            blocks = msa_oracle_select(q, k, m.block_size, m.topk, m.init_blocks, m.local_blocks, attn.scale, m.top_p,
                                       m.min_blocks)
        else:
            blocks = msa_recent_select(q, k, m.block_size, m.topk, m.init_blocks, m.local_blocks)
        with scope("m3c.msa_attention"):
            return sparse_attention(q, k, v, blocks, block_size=m.block_size, scale=attn.scale, backend=self.backend)


class StepView:
    """One decode step of every sequence: one new token each at position seq_lens[b]. Reads and writes only the
    cache's tensors, on the device, with no host synchronisation: capturable as a CUDA graph. What every layer
    shares is computed once per step: the cache slots of the new tokens and the dense layers' blocks (every page)."""

    def __init__(self, cache: PagedCache, batch: int, selection: str):
        self.cache, self.selection, self.backend = cache, selection, _backend()
        self.positions = cache.seq_lens.long()  # [B] the new tokens' positions
        self.rows = cache.rows if cache.rows.shape[0] == batch else torch.arange(batch, device=cache.rows.device)
        self.slots = cache.slots(self.rows, self.positions)
        cache.seq_lens += 1
        self.dense: dict[int, torch.Tensor] = {}  # n_kv -> every page of each sequence, built by the first layer

    def _dense_blocks(self, n_kv: int) -> torch.Tensor:
        """Every page of each sequence as the blocks [B, n_kv, pages] of a dense layer (-1 past the sequence's end)."""
        if n_kv not in self.dense:
            cache = self.cache
            ids = cache.page_ids
            n_pages = (cache.seq_lens + cache.page - 1) // cache.page
            blocks = torch.where(ids[None, :] < n_pages[:, None], ids[None, :], -1)
            self.dense[n_kv] = blocks[:, None, :].expand(-1, n_kv, -1).contiguous()
        return self.dense[n_kv]

    def attend(self, attn: Attention, q, k, v, q_idx, k_idx) -> torch.Tensor:
        """q [B, Hq, 1, D], k/v [B, Hkv, 1, D], q_idx [B, 1, Hi, Di], k_idx [B, 1, Di] (MSA) -> [B, Hq, 1, D]."""
        cache, i, m = self.cache, attn.layer, attn.msa
        cache.write(i, self.rows, self.positions, k[:, :, 0], v[:, :, 0], None if k_idx is None else k_idx[:, 0],
                    slots=self.slots, backend=self.backend)
        if m is not None and self.selection == "index":
            with scope("m3c.decode_select"):
                blocks = paged.paged_select(q_idx[:, 0], cache.idx[i], cache.block_table, cache.seq_lens,
                                            topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks,
                                            idx_scale=cache.idx_scale[i], top_p=m.top_p, min_blocks=m.min_blocks,
                                            backend=self.backend)
        elif m is not None and self.selection == "oracle":
            q_keys = cache.rotate_queries(q[:, :, 0])  # [B, Hq, D] in the cached keys' basis
            blocks = paged.paged_oracle_select(q_keys, cache.k[i], cache.block_table, cache.seq_lens, topk=m.topk,
                                               init_blocks=m.init_blocks, local_blocks=m.local_blocks,
                                               scale=attn.scale, k_scale=cache.k_scale[i], top_p=m.top_p,
                                               min_blocks=m.min_blocks)
        elif m is not None and self.selection == "recent":
            blocks = paged.paged_recent_select(cache.block_table, cache.seq_lens, attn.n_kv_heads,
                                               block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                               local_blocks=m.local_blocks)
        else:  # a dense layer, or an MSA layer run densely: every page (no selection to compute)
            blocks = self._dense_blocks(attn.n_kv_heads)
        if cache.kept is not None and m is not None and self.selection in ("index", "oracle"):
            cache.kept[0] += (blocks >= 0).sum()  # the budget's -1 slots and those past a sequence's end excluded
            cache.kept[1] += blocks.shape[0] * blocks.shape[1]
        with scope("m3c.decode_attention"):
            o = paged.paged_attention(q[:, :, 0], cache.k[i], cache.v[i], blocks, cache.block_table,
                                      cache.seq_lens, scale=attn.scale, k_scale=cache.k_scale[i],
                                      v_scale=cache.v_scale[i], rotation=cache.rotation, hadamard=cache.hadamard,
                                      backend=self.backend)  # [B, Hq, D]
        return o[:, :, None]
