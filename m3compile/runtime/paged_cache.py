"""The paged KV and index-key caches of one batch: pages [P, page, ...] per layer, one block table for all layers."""
from __future__ import annotations

import torch

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import quantize_index_keys
from m3compile.kernels.naive_common import expand_block_scale
from m3compile.memory import DEQUANTIZE_ROWS
from m3compile.models.decoder import Decoder
from m3compile.runtime.key_shift import key_shifts, rotation

__all__ = ["PagedCache"]


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


    def _rows(self, t: torch.Tensor, b: int, length: int) -> torch.Tensor:
        """Sequence b's first `length` rows of a per-layer tensor [P, page, ...] -> [length, ...], a view."""
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
            x = self._rows(cache[layer], b, length)
            if scale[layer] is not None:
                s, x8 = self._rows(scale[layer], b, length), x
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
        keys = self._rows(self.idx[layer], b, length)[None]
        if self.idx_scale[layer] is None:
            return keys, None
        return keys, self._rows(self.idx_scale[layer], b, length)[:: self.page][None]
