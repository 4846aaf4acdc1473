"""The model vLLM runs for architecture M3CompileForCausalLM: m3compile's Decoder (models/decoder.py, the model's
one forward, as `m3compile.load` builds it) over the paged caches vLLM allocates (m3compile.vllm.cache).

vLLM hands a batch's tokens flattened, [N] with their positions; the Decoder runs them as one sequence [1, N], each
token at its own position (RoPE), and every attention layer attends through the batch's view of the caches
(cache.BatchView), which gives each request its own tokens. The weights are read as m3compile reads a checkpoint
(io.tensor_names.internal_names, io.weights.load_state_dict) and fused as `m3c generate` fuses them, so the
projections run the same matmuls. On CUDA the ops run their Triton lowerings (m3compile.ops.lowering), on a CPU
the plain-torch references.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from m3compile.io.tensor_names import internal_names
from m3compile.io.weights import load_state_dict
from m3compile.models.decoder import Decoder
from m3compile.ops import lowering
from m3compile.runtime.forward import lowering_default
from m3compile.vllm.cache import BatchView, IndexKeyPages, KVPages, NoCache
from m3compile.vllm.config import model_args

__all__ = ["M3CompileForCausalLM"]


class M3CompileForCausalLM(nn.Module):
    """vLLM's model interface (forward, compute_logits, embed_input_ids, load_weights) around a Decoder."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.args = args = model_args(model_config.hf_config)
        self.source = model_config.model
        self.dtype = model_config.dtype
        self.page = args.msa.block_size
        self.kernels = lowering_default(vllm_config.device_config.device)
        self.decoder = Decoder(args)
        self.kv = nn.ModuleDict({str(i): KVPages(f"model.layers.{i}.self_attn.attn", vllm_config, args.n_kv_heads,
                                                 args.head_dim, self.dtype) for i in range(args.n_layers)})
        self.index = nn.ModuleDict({str(i): IndexKeyPages(f"model.layers.{i}.self_attn.index_cache", vllm_config,
                                                          args.msa.index_dim, self.dtype)
                                    for i in range(args.n_layers) if args.is_sparse(i)})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Tokens [N] at positions [N] -> final hidden states [N, hidden]."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        with lowering(self.kernels):
            return self.decoder.model.forward_embeds(x[None], positions[None], self._view())[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(hidden_states)

    def _view(self) -> BatchView | NoCache:
        """This forward's view of the caches, from vLLM's forward context (its profiling run has none)."""
        metadata = get_forward_context().attn_metadata
        batch = metadata.get(self.kv["0"].layer_name) if isinstance(metadata, dict) else None
        if batch is None:
            return NoCache()
        kv = {int(i): layer for i, layer in self.kv.items()}
        index = {int(i): layer for i, layer in self.index.items()}
        return BatchView(batch, kv, index, self.page, self.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors under m3compile's names into the Decoder (one-line errors for missing, unexpected
        or mis-shaped tensors), then its projections fused as `m3c generate` fuses them."""
        state, _ = internal_names(dict(weights), self.args)
        if self.args.tie_embeddings:
            state.pop("lm_head.weight", None)
        with torch.no_grad():
            load_state_dict(self.decoder, state, self.source)
        self.decoder.fuse_projections()
        return {name for name, _ in self.named_parameters()}
