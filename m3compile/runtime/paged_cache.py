"""The paged KV and index-key caches of one batch: pages [P, page, ...] per layer, one block table for all layers."""
from __future__ import annotations

import torch

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import quantize_index_keys
from m3compile.kernels.naive_common import expand_block_scale
from m3compile.models.decoder import Decoder

__all__ = ["PagedCache"]


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
