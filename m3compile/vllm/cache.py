"""The paged caches vLLM allocates for a converted model, their attention backend and metadata, and the view of one
vLLM batch that m3compile's model attends through.

Each attention layer registers a `KVPages` layer (its keys and values, vLLM's FullAttentionSpec) and each MSA layer
also an `IndexKeyPages` layer (one index key per token, key-only: MLAAttentionSpec, as vLLM's own MiniMax-M3 index
cache). Both specs have the same block size, the MSA block, so vLLM's KV cache manager puts them in one group with
one block table: a sequence's block b is the same page of every layer's K/V and index keys, and a selected block id
is a page of the block table, as in m3compile.runtime (docs/vllm.md says why).

vLLM allocates each layer's K/V as pages [P, Hkv, BS, 2D] (K in the first D channels) and index keys as [P, 1, BS, Di];
`VllmPagedCache` shows them as m3compile.runtime.paged_cache.PagedCache does its own ([P, BS, Hkv, D] K and V,
[P, BS, Di] index keys, one block table), so the runtime's views run unchanged over them: `BatchView` cuts a
vLLM batch (decodes first, then prefill chunks: vLLM orders it so for this backend) into one decode step of every
decoding sequence (PagedCache.step: kernels.decode's paged selection and attention) and one prompt pass per
prefilling sequence (PagedCache.prompt: the indexer over the cached index keys, then the sparse attention; dense
attention for dense layers and while the keys fit in the top-k). The kernels' backend follows m3compile.ops'
lowering switch: their plain-torch references on a CPU, the Triton kernels on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionImplBase, AttentionMetadata,
                                       AttentionMetadataBuilder, CommonAttentionMetadata, MultipleOf)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SparseCacheRole

from m3compile.models.decoder import Attention
from m3compile.runtime.paged_cache import PagedCache, PromptView, StepView

__all__ = ["PagedMSABackend", "PagedBatch", "PagedBatchBuilder", "KVPages", "IndexKeyPages", "VllmPagedCache",
           "BatchView"]


@dataclass
class PagedBatch(AttentionMetadata):
    """One vLLM batch as the caches' views need it. Rows 0 .. num_decodes - 1 decode one token each; every later row
    is a prompt chunk: (row, first token in the batch, tokens, position of its first token)."""

    num_actual_tokens: int
    num_decodes: int
    block_table: torch.Tensor  # [requests, pages of the longest] int32: vLLM's pages of each request
    seq_lens: torch.Tensor  # [requests] tokens of each request, this batch's included
    prompts: list[tuple[int, int, int, int]]


class PagedBatchBuilder(AttentionMetadataBuilder[PagedBatch]):
    """Builds a PagedBatch from vLLM's common metadata. reorder_batch_threshold 1: vLLM puts the requests that
    decode one token first."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedBatch:
        m = common_attn_metadata
        num_decodes, _, _, _ = split_decodes_and_prefills(m, decode_threshold=1)
        starts = m.query_start_loc_cpu.tolist()
        lens = (m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens.cpu()).tolist()
        prompts = [(b, starts[b], starts[b + 1] - starts[b], lens[b] - (starts[b + 1] - starts[b]))
                   for b in range(num_decodes, m.num_reqs) if starts[b + 1] > starts[b]]
        pages = -(-max(lens[:m.num_reqs], default=1) // self.kv_cache_spec.block_size)  # the longest request's
        return PagedBatch(m.num_actual_tokens, num_decodes, m.block_table_tensor[:m.num_reqs, :pages],
                          m.seq_lens[:m.num_reqs], prompts)


class _NoImpl(AttentionImplBase[PagedBatch]):
    """vLLM asks a backend for an implementation class; the layers here attend through BatchView instead."""


class PagedMSABackend(AttentionBackend):
    """The backend of the converted model's cache layers: its metadata builder and the block sizes it takes (any:
    the references and m3compile's kernels take any page size)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "M3COMPILE_MSA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return _NoImpl

    @staticmethod
    def get_builder_cls() -> type[PagedBatchBuilder]:
        return PagedBatchBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]


class _CacheLayer(nn.Module, AttentionLayerBase):
    """A layer vLLM allocates a paged cache for: registered under `name` in vLLM's static forward context (where its
    KV cache manager finds the layers it sizes and binds caches to)."""

    def __init__(self, name: str, vllm_config: VllmConfig):
        super().__init__()
        self.layer_name = name
        self.kv_cache = torch.tensor([])  # bound by vLLM (bind_kv_cache)
        context = vllm_config.compilation_config.static_forward_context
        if name in context:
            raise ValueError(f"duplicate layer name {name}")
        context[name] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PagedMSABackend


class KVPages(_CacheLayer):
    """One layer's keys and values: pages [P, Hkv, BS, 2 * D] (K, then V, per token and head)."""

    def __init__(self, name: str, vllm_config: VllmConfig, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(name, vllm_config)
        self.num_kv_heads, self.head_size, self.dtype = n_kv_heads, head_dim, dtype

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, head_size_v=self.head_size, dtype=self.dtype)

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as PagedCache holds them: [P, BS, Hkv, D] views of vLLM's pages."""
        D = self.head_size
        return self.kv_cache[..., :D].transpose(1, 2), self.kv_cache[..., D:].transpose(1, 2)


class IndexKeyPages(_CacheLayer):
    """One MSA layer's index keys: pages [P, BS, Di] (vLLM allocates [P, 1, BS, Di]: key-only, one head)."""

    def __init__(self, name: str, vllm_config: VllmConfig, index_dim: int, dtype: torch.dtype):
        super().__init__(name, vllm_config)
        self.head_size, self.dtype = index_dim, dtype

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                                head_size=self.head_size, dtype=self.dtype, cache_role=SparseCacheRole.INDEXER)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache.squeeze(1)


class VllmPagedCache(PagedCache):
    """vLLM's pages of a batch as a PagedCache: per layer K, V [P, BS, Hkv, D] and index keys [P, BS, Di] (views of
    vLLM's tensors), vLLM's block table rows, and each sequence's cached tokens (`seq_lens`). The K/V cache is in
    the model's dtype (no scales, shifts or rotation); a sequence's pages lie wherever vLLM put them, so its rows
    are gathered through the block table."""

    def __init__(self, kv: dict[int, KVPages], index: dict[int, IndexKeyPages], block_table: torch.Tensor,
                 seq_lens: torch.Tensor | None, page: int, model_dtype: torch.dtype):
        self.model_dtype, self.page = model_dtype, page
        self.block_table, self.seq_lens = block_table, seq_lens
        device = block_table.device
        self.rows = torch.arange(block_table.shape[0], device=device)
        self.page_ids = torch.arange(block_table.shape[1], dtype=torch.int32, device=device)
        self.k, self.v = {}, {}
        for i, layer in kv.items():
            self.k[i], self.v[i] = layer.pages()
        self.idx = {i: layer.kv_cache for i, layer in index.items()}
        self.k_scale = self.v_scale = self.k_shift = dict.fromkeys(kv)
        self.idx_scale = dict.fromkeys(index)
        self.tail = {}
        self.rotation, self.hadamard = None, False

    def sequence_rows(self, t: torch.Tensor, b: int, length: int) -> torch.Tensor:
        pages = self.block_table[b, : -(-length // self.page)].long()
        return t[pages].flatten(0, 1)[:length]


class BatchView:
    """What one forward of the model attends through (Attention.forward's `cache`): a vLLM batch cut into one decode
    step of its decoding rows (StepView) and a prompt pass per prompt chunk (PromptView), both over vLLM's pages.
    The model's forward runs all the batch's tokens as one sequence [1, N]; `attend` hands each view its tokens."""

    def __init__(self, batch: PagedBatch, kv: dict[int, KVPages], index: dict[int, IndexKeyPages], page: int,
                 model_dtype: torch.dtype):
        self.n = batch.num_actual_tokens
        self.decodes = batch.num_decodes
        self.step: StepView | None = None
        if self.decodes:  # the step's cache: the decoding rows, each with its tokens before this one
            rows = VllmPagedCache(kv, index, batch.block_table[:self.decodes], batch.seq_lens[:self.decodes] - 1,
                                  page, model_dtype)
            self.step = rows.step(self.decodes)
        whole = VllmPagedCache(kv, index, batch.block_table, None, page, model_dtype)
        self.prompts: list[tuple[PromptView, int, int]] = [
            (whole.prompt(row, start, length), first, first + length) for row, first, length, start in batch.prompts]

    def attend(self, attn: Attention, q, k, v, q_idx, k_idx) -> torch.Tensor:
        """q [1, Hq, N, D], k/v [1, Hkv, N, D], q_idx [1, N, Hi, Di], k_idx [1, N, Di] (MSA) -> [1, Hq, N, D]; rows
        past the batch's tokens (vLLM's padding) give zeros."""
        out = torch.zeros_like(q)
        d = self.decodes
        if d:
            one = lambda x: x[0, :, :d].transpose(0, 1)[:, :, None]  # noqa: E731  [1, H, d, D] -> [d, H, 1, D]
            o = self.step.attend(attn, one(q), one(k), one(v), None if q_idx is None else q_idx[0, :d, None],
                                 None if k_idx is None else k_idx[0, :d, None])
            out[0, :, :d] = o[:, :, 0].transpose(0, 1)
        for view, s, e in self.prompts:
            out[:, :, s:e] = view.attend(attn, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                         None if q_idx is None else q_idx[:, s:e],
                                         None if k_idx is None else k_idx[:, s:e])
        return out


class NoCache:
    """The view of vLLM's profiling forward, which runs before any cache is allocated: attention gives zeros (only
    the memory of the rest of the model is measured)."""

    @staticmethod
    def attend(attn: Attention, q, k, v, q_idx, k_idx) -> torch.Tensor:
        return torch.zeros_like(q)
