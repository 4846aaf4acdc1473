"""The model's forward over the paged caches: a prompt into them (prefill), then one token per sequence from them
(decode_step); kernels_default says whether both run the model's fused backbone kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import quantize_index_keys, select_blocks
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.models.decoder import Attention, Decoder
from m3compile.ops import scope
from m3compile.runtime.paged_cache import PagedCache
from m3compile.runtime.selection import decode_blocks, prefill_blocks

__all__ = ["prefill", "decode_step", "kernels_default"]


def _dense_blocks(cache: PagedCache, n_kv: int) -> torch.Tensor:
    """Every page of each sequence as the blocks [B, n_kv, pages] of a dense layer (-1 past the sequence's end)."""
    ids = cache.page_ids
    n_pages = (cache.seq_lens + cache.page - 1) // cache.page
    blocks = torch.where(ids[None, :] < n_pages[:, None], ids[None, :], -1)
    return blocks[:, None, :].expand(-1, n_kv, -1).contiguous()


@torch.no_grad()
def prefill(model: Decoder, cache: PagedCache, b: int, prompt: torch.Tensor, backend: str,
            selection: str = "index") -> torch.Tensor:
    """Run one prompt [T] through the model, filling sequence b of the caches; returns the last logits [vocab].
    selection: how MSA layers pick their blocks (runtime.selection: "index", "oracle", "dense", "recent")."""
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
        if m is not None and attn.sparse and selection != "dense" and -(-T // m.block_size) > m.topk:
            q_idx, k_idx = attn.index_branch(h, cos, sin)
            if selection == "index":
                keys, k_scale = quantize_index_keys(k_idx, m.block_size) if m.index_dtype == "fp8" else (k_idx, None)
                blocks = select_blocks(q_idx, keys, block_size=m.block_size, topk=m.topk,
                                       init_blocks=m.init_blocks, local_blocks=m.local_blocks, k_scale=k_scale,
                                       backend=backend)
            else:
                blocks = prefill_blocks(selection, q, k, m, attn.scale, backend)
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
def decode_step(model: Decoder, cache: PagedCache, tokens: torch.Tensor, backend: str,
                selection: str = "index") -> torch.Tensor:
    """One token per sequence [B] at position seq_lens[b]; returns logits [B, vocab]. Reads and writes only
    `tokens` and the cache's tensors, on the device, with no host synchronisation: capturable as a CUDA graph.
    What every layer shares is computed once per step: the RoPE tables, the cache slots of the new tokens and
    the dense layers' blocks (every page). The model's modules run as the model is set (Decoder.set_kernels:
    DecodeStep and generate switch the fused kernels on for CUDA). selection: as in `prefill`."""
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
        if m is not None and attn.sparse and selection == "index":
            with scope("m3c.decode_select"):
                blocks = paged.paged_select(q_idx[:, 0], cache.idx[i], cache.block_table, cache.seq_lens,
                                            topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks,
                                            idx_scale=cache.idx_scale[i], backend=backend)
        elif m is not None and attn.sparse and selection != "dense":
            blocks = decode_blocks(selection, q[:, :, 0], cache.k[i], cache.block_table, cache.seq_lens, m, attn.scale)
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
