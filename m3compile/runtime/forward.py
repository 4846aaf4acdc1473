"""The model's forward over the paged caches: a prompt into them (prefill, whole or in chunks), then one token per
sequence from them (decode_step); kernels_default says whether both run the model's fused backbone kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels import decode as paged
from m3compile.kernels.indexer import select_blocks
from m3compile.kernels.sparse_attention import sparse_attention
from m3compile.models.decoder import Attention, Decoder
from m3compile.ops import scope
from m3compile.runtime.paged_cache import PagedCache
from m3compile.runtime.selection import decode_blocks, prefill_blocks

__all__ = ["prefill", "prefill_nll", "decode_step", "kernels_default"]


def _dense_blocks(cache: PagedCache, n_kv: int) -> torch.Tensor:
    """Every page of each sequence as the blocks [B, n_kv, pages] of a dense layer (-1 past the sequence's end)."""
    ids = cache.page_ids
    n_pages = (cache.seq_lens + cache.page - 1) // cache.page
    blocks = torch.where(ids[None, :] < n_pages[:, None], ids[None, :], -1)
    return blocks[:, None, :].expand(-1, n_kv, -1).contiguous()


@torch.no_grad()
def prefill(model: Decoder, cache: PagedCache, b: int, prompt: torch.Tensor, backend: str,
            chunk: int | None = None, selection: str = "index") -> torch.Tensor:
    """Run one prompt [T] through the model, filling sequence b of the caches; returns the last logits [vocab].

    chunk: tokens per pass (None: the whole prompt in one). A pass runs its tokens through every layer: their keys,
    values and index keys go to the cache first, then their queries attend to the keys and values as the cache
    holds them (every earlier pass's and their own; an fp8 cache's dequantised), an MSA layer selecting over the
    cached index keys (fp8: one scale per page, as the decode reads them). So the logits do not depend on the chunk,
    and the activations of one chunk, not of the whole prompt, bound the memory (m3compile.memory.prefill_chunk).
    selection: how MSA layers pick their blocks (runtime.selection: "index", "oracle", "dense", "recent"); the
    oracle and recent selections rank a prompt's own blocks, so they need it in one pass (chunk None or >= T)."""
    T = prompt.shape[0]
    chunk = T if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if selection in ("oracle", "recent") and chunk < T:
        raise ValueError(f"selection {selection!r} ranks the prompt's own blocks: prefill it in one pass "
                         f"(chunk {chunk} < {T} tokens)")
    for t0 in range(0, T, chunk):
        x = _prefill_chunk(model, cache, b, prompt[t0:t0 + chunk], t0, backend, selection)
    return model.lm_head(model.model.norm(x[:, -1])).float()[0]


@torch.no_grad()
def prefill_nll(model: Decoder, cache: PagedCache, b: int, tokens: torch.Tensor, backend: str,
                chunk: int | None = None, rows: int = 4096, selection: str = "index") -> torch.Tensor:
    """The next-token losses [T - 1] (fp32) of a text [T] prefilled as `prefill` does it (the same chunks, each
    attending to the keys as the cache holds them): the loss a cache's dtype (an fp8 KV cache) costs, measured at
    any length. The logits are made `rows` positions at a time (never [T, vocab]). selection: as in `prefill`
    ("dense": every MSA layer attends to every cached key, the dense baseline under the same cache)."""
    T = tokens.shape[0]
    chunk = T if chunk is None else chunk
    if selection in ("oracle", "recent") and chunk < T:
        raise ValueError(f"selection {selection!r} ranks the text's own blocks: prefill it in one pass "
                         f"(chunk {chunk} < {T} tokens)")
    out = torch.empty(T - 1, dtype=torch.float32, device=tokens.device)
    for t0 in range(0, T, chunk):
        x = model.model.norm(_prefill_chunk(model, cache, b, tokens[t0:t0 + chunk], t0, backend, selection)[0])
        for r0 in range(0, min(x.shape[0], T - 1 - t0), rows):
            r1 = min(r0 + rows, x.shape[0], T - 1 - t0)
            out[t0 + r0:t0 + r1] = F.cross_entropy(model.lm_head(x[r0:r1]).float(), tokens[t0 + r0 + 1:t0 + r1 + 1],
                                                   reduction="none")
    return out


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


def _prefill_chunk(model: Decoder, cache: PagedCache, b: int, tokens: torch.Tensor, t0: int,
                   backend: str, selection: str = "index") -> torch.Tensor:
    """Tokens [C] at positions t0 .. t0 + C - 1 of sequence b through every layer -> hidden states [1, C, hidden]."""
    bb = model.model
    C = tokens.shape[0]
    t1 = t0 + C
    x = bb.embed_tokens(tokens[None])
    cos, sin = bb.rotary_emb(x, torch.arange(t0, t1, device=x.device)[None])
    for i, layer in enumerate(bb.layers):
        attn: Attention = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v, q_idx, k_idx = attn.project_with_index(h, cos, sin)  # index [1, C, Hi, Di], [1, C, Di] (MSA)
        m = attn.msa
        cache.write_tokens(i, b, t0, k[0].transpose(0, 1), v[0].transpose(0, 1), None if k_idx is None else k_idx[0],
                           backend=backend)
        k, v = cache.keys_values(i, b, t1)  # [1, Hkv, t1, D]: every key so far, as the cache holds it
        if m is not None and attn.sparse and selection != "dense" and -(-t1 // m.block_size) > m.topk:
            if selection == "index":
                keys, k_scale = cache.index_keys(i, b, t1)
                with scope("m3c.msa_select"):
                    blocks = select_blocks(q_idx, keys, block_size=m.block_size, topk=m.topk,
                                           init_blocks=m.init_blocks, local_blocks=m.local_blocks, k_scale=k_scale,
                                           backend=backend)
            else:
                blocks = prefill_blocks(selection, q, k, m, attn.scale, backend)
            with scope("m3c.msa_attention"):
                o = sparse_attention(q, k, v, blocks, block_size=m.block_size, scale=attn.scale, backend=backend)
        else:  # dense layer, or an MSA layer whose keys fit in the top-k: dense causal is exact
            o = _causal(q, k, v, attn.scale)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(1, C, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


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
    h = bb.layers[0].input_layernorm(x)
    for i, layer in enumerate(bb.layers):
        attn: Attention = layer.self_attn
        q, k, v, q_idx, k_idx = attn.project_with_index(h, cos, sin)  # [B, H, 1, D]; [B, 1, Hi, Di], [B, 1, Di]
        m = attn.msa
        if m is not None:
            cache.write(i, b_ids, pos, k[:, :, 0], v[:, :, 0], k_idx[:, 0], slots=slots, backend=backend)
        else:
            cache.write(i, b_ids, pos, k[:, :, 0], v[:, :, 0], slots=slots, backend=backend)
        if m is not None and attn.sparse and selection == "index":
            with scope("m3c.decode_select"):
                blocks = paged.paged_select(q_idx[:, 0], cache.idx[i], cache.block_table, cache.seq_lens,
                                            topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks,
                                            idx_scale=cache.idx_scale[i], backend=backend)
        elif m is not None and attn.sparse and selection != "dense":
            q_keys = cache.rotate_queries(q[:, :, 0])  # [B, Hq, D] in the cached keys' basis
            blocks = decode_blocks(selection, q_keys, cache.k[i], cache.block_table, cache.seq_lens, m, attn.scale,
                                   cache.k_scale[i])
        else:  # a dense layer, or an MSA layer run densely: every page (no selection to compute)
            if attn.n_kv_heads not in dense:
                dense[attn.n_kv_heads] = _dense_blocks(cache, attn.n_kv_heads)
            blocks = dense[attn.n_kv_heads]
        with scope("m3c.decode_attention"):
            o = paged.paged_attention(q[:, :, 0], cache.k[i], cache.v[i], blocks, cache.block_table,
                                      cache.seq_lens, scale=attn.scale, k_scale=cache.k_scale[i],
                                      v_scale=cache.v_scale[i], rotation=cache.rotation, hadamard=cache.hadamard,
                                      backend=backend)  # [B, Hq, D]
        # each residual add with the norm after it (one kernel each with the model's kernels: RMSNorm.add_forward)
        x, h = layer.post_attention_layernorm.add_forward(x, attn.o_proj(o.reshape(B, 1, -1)))
        after = bb.layers[i + 1].input_layernorm if i + 1 < len(bb.layers) else bb.norm
        x, h = after.add_forward(x, layer.mlp(h))
    return model.lm_head(h[:, 0]).float()


def kernels_default(device, backend: str = "auto") -> bool:
    """Whether generation runs the model's fused kernels (Decoder.set_kernels) by default: on a CUDA device, unless
    backend "torch" asks for the references."""
    return torch.device(device).type == "cuda" and backend != "torch"
