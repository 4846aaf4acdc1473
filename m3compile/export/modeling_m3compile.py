"""MiniMax Sparse Attention (MSA) for `transformers`: the modeling file m3compile copies into every converted Llama,
Mistral, Qwen2 or Qwen3 checkpoint, named by config.json's `auto_map` (the Hugging Face remote-code convention).

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    model.generate(input_ids, max_new_tokens=32)                     # kv_cache="fp8" or "int8": an 8-bit KV cache

config.json has model_type "m3compile_msa", the dense model's own type as `source_model_type`, its keys, and M3's
`sparse_attention_config`. Tensors keep the source's names plus `self_attn.index_{q,k}_{proj,norm}.weight` per MSA
layer. This file is plain torch and transformers and imports nothing else; when m3compile is importable and the
tensors are on CUDA, a prompt's forward runs m3compile's Triton kernels (fused indexer, gather-Q sparse attention),
and otherwise the torch code below, which follows m3compile's references (`kernels/*/naive.py`) step by step. With
m3compile installed, generate() first counts the cache and the prompts' forward against the free memory as
`m3c generate` does (m3compile.memory) and stops with the numbers before allocating what would not fit.

MSA layer, for hidden states x (m3compile's docs/msa.md, sections 2-3):
    q_idx = rope(norm_q(x W_qi)) [B, T, Hi, Di], k_idx = rope(norm_k(x W_ki)) [B, T, Di]   (x detached; Hi = Hkv)
    block score S[g, t, b] = max over keys j <= t of block b of q_idx[g, t] . k_idx[j] / sqrt(Di)
    per (group g, token t): the local block(s), the init blocks, then the best other blocks, topk in all (-1 = empty);
      with sparse_top_p < 1 (an adaptive budget, docs/msa.md 2.8) only the fewest best of those whose probability
      softmax(S) over the visible unforced blocks sums to sparse_top_p, at least sparse_min_blocks blocks in all
    the G query heads of group g attend (exact softmax) over the causally visible keys of those blocks
    within generate(), a model converted with an answer budget (sparse_answer_budget, e.g. "k256"; kN or
      pP:FLOOR:CEILING) selects each prompt's last sparse_answer_tokens tokens at that budget and every new token at
      sparse_decode_budget (default: the answer budget; "off": the model's own), as m3compile.generate does

Cache: transformers' own cache holds each layer's keys and values; an MSA layer's index keys ride in its key tensor
as extra heads (Di channels packed into ceil(Di / head_dim) heads of head_dim), so every operation transformers
applies to a cache (beam reordering, cropping, offloading) moves the index keys with the keys. A static cache,
which preallocates Hkv heads, is not supported. Batches may be left-padded (`attention_mask`): every row runs as if
alone, its first real token at position 0, so the blocks are the same as without padding.
"""
from __future__ import annotations

import copy
import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers before 5.0
    from transformers import PretrainedConfig as PreTrainedConfig

try:  # m3compile's Triton kernels, when installed: a prompt's forward on CUDA uses them; and its memory count
    from m3compile.kernels import indexer as m3c_indexer
    from m3compile.kernels import sparse_attention as m3c_sparse
    from m3compile import memory as m3c_memory
    from m3compile.io import kernel_cache as m3c_kernel_cache
except ImportError:
    m3c_indexer = m3c_sparse = m3c_memory = m3c_kernel_cache = None

try:  # transformers' fp8 KV cache layer, where this transformers has it (kv_cache="fp8" and "int8" build on it)
    from transformers.cache_utils import BaseQuantizedLayer, Fp8QuantizedLayer, QuantizedCache
except ImportError:
    BaseQuantizedLayer = Fp8QuantizedLayer = QuantizedCache = None

MODEL_TYPE = "m3compile_msa"
SOURCE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The cache field of transformers' outputs: `cache` from 5.2x, `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_CHUNK_ELEMENTS = 1 << 25  # fp32 scratch elements one query chunk of the torch path may allocate (128 MiB)


class M3CompileConfig(PreTrainedConfig):
    """The source model's config.json keys plus `source_model_type` and M3's `sparse_attention_config`."""

    model_type = MODEL_TYPE

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # Converted models attend causally over the whole prefix (m3compile refuses a real sliding window): a
        # `sliding_window` or `layer_types` kept from the source (Mistral, Qwen2) must not make transformers build
        # windowed cache layers.
        self.sliding_window = None
        n_layers = self.__dict__.get("num_hidden_layers")  # absent in the default instance transformers diffs against
        self.layer_types = None if n_layers is None else ["full_attention"] * n_layers


def _setting(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


class Settings:
    """What the layers need, read from the config as m3compile's loader reads config.json (io/hf_config.py)."""

    def __init__(self, config):
        source = _setting(config, "source_model_type")
        if source not in SOURCE_TYPES:
            raise ValueError(f"config.json source_model_type must be one of {', '.join(SOURCE_TYPES)}, got {source!r}")
        self.hidden, self.n_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = _setting(config, "head_dim", self.hidden // self.n_heads)
        self.n_kv_heads = _setting(config, "num_key_value_heads", self.n_heads)
        self.n_layers, self.vocab = config.num_hidden_layers, config.vocab_size
        self.intermediate = config.intermediate_size
        self.eps = _setting(config, "rms_norm_eps", 1e-6)
        bias = _setting(config, "attention_bias", source == "qwen2")
        self.qkv_bias, self.o_bias = bool(bias), bool(bias) and source != "qwen2"
        self.qk_norm = source == "qwen3"
        params = _setting(config, "rope_parameters", {}) or {}
        self.rope_theta = float(params.get("rope_theta", _setting(config, "rope_theta", 10000.0)))
        partial = float(params.get("partial_rotary_factor", _setting(config, "partial_rotary_factor", 1.0)))
        self.rope_dim = int(self.head_dim * partial)
        kind = params.get("rope_type", params.get("type", "default"))
        self.rope_scaling = params if kind != "default" else (_setting(config, "rope_scaling") or None)
        sparse = _setting(config, "sparse_attention_config", {}) or {}
        freq = sparse.get("sparse_attention_freq") or [0] * self.n_layers
        if not sparse.get("use_sparse_attention", True):
            freq = [0] * self.n_layers
        if len(freq) != self.n_layers:
            raise ValueError(f"sparse_attention_freq has {len(freq)} entries for {self.n_layers} layers")
        if sparse.get("sparse_score_type", "max") != "max":
            raise ValueError(f"sparse_score_type {sparse['sparse_score_type']!r} is not supported (max only)")
        self.sparse = [bool(f) for f in freq]
        self.index_heads = sparse.get("sparse_num_index_heads", self.n_kv_heads)
        self.index_dim = sparse.get("sparse_index_dim", self.head_dim)
        self.block_size = sparse.get("sparse_block_size", 128)
        self.topk = sparse.get("sparse_topk_blocks", 16)
        self.init_blocks = sparse.get("sparse_init_block", 0)
        self.local_blocks = sparse.get("sparse_local_block", 1)
        self.top_p = sparse.get("sparse_top_p", 1.0)
        self.min_blocks = sparse.get("sparse_min_blocks", 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sparse_top_p must be in (0, 1], got {self.top_p!r}")
        self.answer_tokens = sparse.get("sparse_answer_tokens", 128)
        if not isinstance(self.answer_tokens, int) or self.answer_tokens < 0:
            raise ValueError(f"sparse_answer_tokens must be a whole number >= 0, got {self.answer_tokens!r}")
        self.answer = self.at_budget(sparse.get("sparse_answer_budget"), "sparse_answer_budget")
        decode = sparse.get("sparse_decode_budget")
        self.decode = self if decode == "off" else self.at_budget(decode, "sparse_decode_budget") or self.answer
        self.index_rope = sparse.get("sparse_index_rope", "m3")
        if self.index_rope not in ("m3", "low", "tile"):
            raise ValueError(f"sparse_index_rope must be 'm3', 'low' or 'tile', got {self.index_rope!r}")
        if any(self.sparse) and self.index_heads != self.n_kv_heads:
            raise ValueError(f"MSA needs one index head per KV head: {self.index_heads} index heads, "
                             f"{self.n_kv_heads} KV heads")

    def at_budget(self, spec, key: str):
        """These settings at another selection budget (kN: the fixed top-N blocks; pP:FLOOR:CEILING: top-p P of
        FLOOR-CEILING blocks), or None for no spec."""
        if spec is None:
            return None
        try:
            if spec[:1] == "k":
                topk, top_p, floor = int(spec[1:]), 1.0, 0
            else:
                p, floor, topk = spec[1:].split(":") if spec[:1] == "p" else (None, None, None)
                topk, top_p, floor = int(topk), float(p), int(floor)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be kN or pP:FLOOR:CEILING, got {spec!r}") from None
        if topk < 1 or not 0 < top_p <= 1 or not 0 <= floor <= topk:
            raise ValueError(f"{key} {spec!r} is out of range (top-N >= 1, 0 < P <= 1, 0 <= FLOOR <= CEILING)")
        out = copy.copy(self)
        out.topk, out.top_p, out.min_blocks = topk, top_p, floor
        return out


# ----------------------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: "rms" is w * x (Llama, Qwen), "gemma" x * (1 + w) (the index branch's norms)."""

    def __init__(self, dim: int, eps: float, style: str = "rms"):
        super().__init__()
        self.eps, self.style = eps, style
        self.weight = nn.Parameter(torch.ones(dim) if style == "rms" else torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(s: Settings) -> torch.Tensor:
    """inv_freq [R / 2], fp32, computed on the CPU (as m3compile does: the same values on every device)."""
    dim = s.rope_dim
    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    scaling = s.rope_scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: long wavelengths scaled by `factor`, a smooth ramp in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first cos.shape[-1] channels. x [B, T, H, D], cos/sin [B, T, R] -> [B, T, H, D]."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def apply_index_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: str = "m3") -> torch.Tensor:
    """The index branch's RoPE. "m3": the main table cut to min(R, Di) channels (transformers' M3 indexer rule);
    "low" (sparse_index_rope, an index head narrower than R): its Di/2 pairs turn at the table's Di/2 lowest
    frequencies; "tile" (an index head wider than R): all Di channels turn, pair c (channels c, c + Di/2) at the
    frequency of the table's pair (c + h - (Di/2 mod h)) mod h, h = R/2 (every frequency once, then the lowest
    ones again)."""
    R, Di = cos.shape[-1], x.shape[-1]
    if rope == "tile" and Di > R:
        h, n = R // 2, Di // 2
        pairs = (torch.arange(n, device=cos.device) + (h - n % h) % h) % h
        cos, sin = cos[..., :h].index_select(-1, pairs), sin[..., :h].index_select(-1, pairs)
        return apply_rope(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    if rope == "low" and Di < R:
        h, n = R // 2, Di // 2
        cos = torch.cat((cos[..., h - n:h], cos[..., R - n:]), -1)
        sin = torch.cat((sin[..., h - n:h], sin[..., R - n:]), -1)
        return apply_rope(x, cos, sin)
    w = min(R, Di)
    return apply_rope(x, cos[..., :w], sin[..., :w])


# ----------------------------------------------------------------------------------------------------------------
# MSA in torch: queries at positions q_start .. q_start + Tq - 1 of one sequence whose keys are 0 .. Tk - 1


def select_blocks(q_idx: torch.Tensor, k_idx: torch.Tensor, q_start: int, s: Settings) -> torch.Tensor:
    """q_idx [B, Hi, Tq, Di], k_idx [B, Tk, Di] -> [B, Hi, Tq, topk] block ids (-1 = empty slot)."""
    B, Hi, Tq, Di = q_idx.shape
    Tk, bs = k_idx.shape[1], s.block_size
    out = torch.empty(B, Hi, Tq, s.topk, dtype=torch.long, device=q_idx.device)
    chunk = max(1, min(Tq, _CHUNK_ELEMENTS // max(1, B * Hi * Tk)))
    for start in range(0, Tq, chunk):
        end = min(Tq, start + chunk)
        last = q_start + end  # keys past the chunk's last query are invisible to all of it
        n_blocks = -(-last // bs)
        q, k = q_idx[:, :, start:end].float(), k_idx[:, :last].float()
        scores = torch.einsum("bhtd,bjd->bhtj", q, k) / math.sqrt(Di)
        t_pos = torch.arange(q_start + start, q_start + end, device=q.device)
        j_pos = torch.arange(last, device=q.device)
        scores = scores.masked_fill(j_pos[None, :] > t_pos[:, None], float("-inf"))
        scores = F.pad(scores, (0, n_blocks * bs - last), value=float("-inf"))
        scores = scores.view(*scores.shape[:3], n_blocks, bs).amax(-1)  # [B, Hi, C, n_blocks]
        b_pos = torch.arange(n_blocks, device=q.device)
        q_block = (t_pos // bs)[:, None]
        visible = b_pos[None, :] <= q_block
        local = visible & (b_pos[None, :] > q_block - s.local_blocks)
        init = visible & (b_pos[None, :] < s.init_blocks)
        lse = torch.logsumexp(scores.masked_fill(~visible | local | init, float("-inf")), -1)  # the candidates'
        # forced blocks win; when they outnumber the slots, local blocks win over init blocks
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(init, torch.finfo(torch.float32).max)
        scores = scores.masked_fill(local, float("inf"))
        kk = min(s.topk, n_blocks)
        top_scores, top_idx = scores.topk(kk, dim=-1)
        top_idx = top_idx.masked_fill(top_scores == float("-inf"), -1)
        if s.top_p < 1:
            top_idx = adaptive_keep(top_idx, top_scores, lse, s.top_p, s.min_blocks)
        out[:, :, start:end] = F.pad(top_idx, (0, s.topk - kk), value=-1)
    return out


def adaptive_keep(blocks: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, top_p: float,
                  min_blocks: int) -> torch.Tensor:
    """The adaptive budget over a fixed selection: blocks [..., K] with their logits (forced: the largest float or
    more, always kept) and lse [...] over every candidate; the candidates best first until their probability
    exp(logit - lse) sums to top_p, and more while fewer than min_blocks blocks are kept; the rest -1."""
    forced = logits >= torch.finfo(torch.float32).max
    cand = (blocks >= 0) & ~forced
    z = logits.float().masked_fill(~cand, float("-inf"))
    order = z.argsort(dim=-1, descending=True, stable=True)
    z = z.gather(-1, order)
    prob = torch.exp(z - lse[..., None]).masked_fill(z == float("-inf"), 0.0)
    before = torch.cumsum(prob, -1) - prob
    rank = torch.arange(blocks.shape[-1], device=blocks.device)
    keep = (z > float("-inf")) & ((before < top_p) | (forced.sum(-1, keepdim=True) + rank < min_blocks))
    keep = torch.zeros_like(keep).scatter(-1, order, keep)
    return blocks.masked_fill(~(keep | forced), -1)


def sparse_attention(q, k, v, blocks, q_start: int, block_size: int, scale: float) -> torch.Tensor:
    """Exact softmax of each query head over the causally visible keys of its group's selected blocks.

    q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], blocks [B, Hkv, Tq, K] -> [B, Hq, Tq, D] in q's dtype (computed in fp32).
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk, K = k.shape[1], k.shape[2], blocks.shape[-1]
    G = Hq // Hkv
    out = torch.empty(B, Hkv, G, Tq, D, dtype=torch.float32, device=q.device)
    qg = q.view(B, Hkv, G, Tq, D)
    n_blocks = -(-Tk // block_size)
    pad = (0, 0, 0, n_blocks * block_size - Tk)
    kb = F.pad(k.float(), pad).view(B, Hkv, n_blocks, block_size, D)
    vb = F.pad(v.float(), pad).view(B, Hkv, n_blocks, block_size, D)
    i_b = torch.arange(B, device=q.device)[:, None, None, None]
    i_h = torch.arange(Hkv, device=q.device)[None, :, None, None]
    offs = torch.arange(block_size, device=q.device)
    chunk = max(1, min(Tq, _CHUNK_ELEMENTS // max(1, B * Hkv * (G + 2 * D) * K * block_size)))
    for start in range(0, Tq, chunk):
        end = min(Tq, start + chunk)
        idx = blocks[:, :, start:end]
        safe = idx.clamp(min=0)  # -1 slots read block 0, then are masked out
        pos = (safe[..., None] * block_size + offs).flatten(-2)  # [B, Hkv, C, K * bs] key positions
        t_pos = torch.arange(q_start + start, q_start + end, device=q.device)[:, None]
        valid = (idx >= 0).repeat_interleave(block_size, dim=-1) & (pos <= t_pos)
        C = end - start
        kg = kb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)
        vg = vb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)
        scores = torch.einsum("bhgcd,bhcsd->bhgcs", qg[:, :, :, start:end].float(), kg) * scale
        p = torch.softmax(scores.masked_fill(~valid[:, :, None], float("-inf")), dim=-1)
        out[:, :, :, start:end] = torch.einsum("bhgcs,bhcsd->bhgcd", p, vg)
    return out.view(B, Hq, Tq, D).to(q.dtype)


def use_kernels(*tensors: torch.Tensor, backend: str) -> bool:
    """m3compile's Triton kernels for this call: backend "auto" on CUDA tensors when m3compile is importable,
    "m3compile" always (m3compile must be importable; on CPU only under TRITON_INTERPRET=1), "torch" never."""
    if backend not in ("auto", "torch", "m3compile"):
        raise ValueError(f"msa_backend must be 'auto', 'torch' or 'm3compile', got {backend!r}")
    if backend == "m3compile" and m3c_sparse is None:
        raise ImportError("msa_backend 'm3compile' needs m3compile installed (pip install m3compile[triton])")
    return backend == "m3compile" or (backend == "auto" and m3c_sparse is not None and all(t.is_cuda for t in tensors))


if Fp8QuantizedLayer is not None:
    class Fp8RowLayer(Fp8QuantizedLayer):
        """transformers' fp8 cache layer with one scale per (sequence, head, position) row instead of one per tensor
        (fixed by the prompt): e4m3, each row's largest magnitude mapped to 448, as m3compile's paged fp8 cache holds
        K and V; an MSA layer's index key, riding in the keys as extra heads, keeps its own scales too."""

        def _quantize(self, tensor, scale=None):
            scale = (tensor.abs().amax(-1, keepdim=True).float() / self.fp8_max).clamp(min=1e-12)
            return (tensor.float() / scale).to(self.fp8_dtype), scale

        def _quantize_rows(self, states, name):
            """New states of the keys or the values (`name`: the attribute that holds them) as stored."""
            return self._quantize(states)

        def _dequantize_rows(self, name):
            return self._dequantize(getattr(self, name))

        def update(self, key_states, value_states, *args, **kwargs):
            self.cumulative_length += key_states.shape[-2]
            if not self.is_initialized:  # the prompt attends to its own states; they are stored quantised
                self.lazy_initialization(key_states, value_states)
                return key_states, value_states
            for name, states in (("_quantized_keys", key_states), ("_quantized_values", value_states)):
                (q, scale), (q_new, scale_new) = getattr(self, name), self._quantize_rows(states, name)
                setattr(self, name, (torch.cat([q, q_new], dim=-2), torch.cat([scale, scale_new], dim=-2)))
            return self._dequantize_rows("_quantized_keys"), self._dequantize_rows("_quantized_values")

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.is_initialized:
                for name in ("_quantized_keys", "_quantized_values"):
                    q, scale = getattr(self, name)
                    idx = beam_idx.to(q.device)
                    setattr(self, name, (q.index_select(0, idx), scale.index_select(0, idx)))

    class Int8RowLayer(Fp8RowLayer):
        """The int8 cache layer: each (sequence, head, position) row less its sequence's mean row over the prompt
        (keys and values apart), times an orthonormal matrix, as 8-bit integers with one scale per row (largest
        magnitude -> 127); read back exactly but for the rounding (times the transpose, plus the mean). The
        rotation spreads a row's few large channels over all of them, so 8-bit steps lose little (m3compile's paged
        int8 cache does the same: m3compile.runtime.key_shift.rotation, BENCHMARKS.md)."""

        def lazy_initialization(self, key_states, value_states):
            BaseQuantizedLayer.lazy_initialization(self, key_states, value_states)
            self._rot = _rotation(key_states.shape[-1]).to(key_states.device)
            self._mean = {name: states.float().mean(-2, keepdim=True)
                          for name, states in (("_quantized_keys", key_states), ("_quantized_values", value_states))}
            self._quantized_keys = self._quantize_rows(key_states, "_quantized_keys")
            self._quantized_values = self._quantize_rows(value_states, "_quantized_values")

        def _quantize_rows(self, states, name):
            x = (states.float() - self._mean[name]) @ self._rot
            scale = (x.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-12)
            return (x / scale).round().clamp(-127, 127).to(torch.int8), scale

        def _dequantize_rows(self, name):
            q, scale = getattr(self, name)
            return ((q.float() * scale) @ self._rot.T + self._mean[name]).to(self.keys.dtype)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            super().reorder_cache(beam_idx)
            if self.is_initialized:
                self._mean = {k: m.index_select(0, beam_idx.to(m.device)) for k, m in self._mean.items()}
else:
    Fp8RowLayer = Int8RowLayer = None


def _rotation(dim: int) -> torch.Tensor:
    """An orthonormal [dim, dim] fp32 matrix: Walsh-Hadamard for a power of two, else the Q of a seeded Gaussian's QR
    (m3compile.runtime.key_shift.rotation's matrices; this file stands alone, so it builds its own)."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return (h / dim ** 0.5).float()
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


# ----------------------------------------------------------------------------------------------------------------
# Modules (names as in the checkpoint: model.layers.{i}.self_attn.q_proj, ..., index_q_proj, lm_head)


class M3CompileAttention(nn.Module):
    def __init__(self, s: Settings, layer: int):
        super().__init__()
        self.s, self.layer = s, layer
        self.n_heads, self.n_kv, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
        self.scale = s.head_dim**-0.5
        self.q_proj = nn.Linear(s.hidden, s.n_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.n_heads * s.head_dim, s.hidden, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.eps)
            self.k_norm = RMSNorm(s.head_dim, s.eps)
        self.msa = s.sparse[layer]
        if self.msa:
            self.index_q_proj = nn.Linear(s.hidden, s.index_heads * s.index_dim, bias=False)
            self.index_k_proj = nn.Linear(s.hidden, s.index_dim, bias=False)
            self.index_q_norm = RMSNorm(s.index_dim, s.eps, "gemma")
            self.index_k_norm = RMSNorm(s.index_dim, s.eps, "gemma")
            self.extra_heads = -(-s.index_dim // s.head_dim)  # cache heads that carry the index keys

    def forward(self, x, cos, sin, cache, past: int, starts: list[int], backend: str, question=None) -> torch.Tensor:
        """x [B, T, hidden] at cache positions past .. past + T - 1; row b's first real token at cache position
        starts[b] (left padding). cos/sin [B, T, R] of each token's own position. question: (n, settings): the last
        n tokens select at those settings' budget (generate's answer and decode budgets), or None."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        q_idx = k_idx = None
        if self.msa:
            s, xd = self.s, x.detach()  # the index branch never trains the backbone
            q_idx = apply_index_rope(self.index_q_norm(self.index_q_proj(xd).view(B, T, s.index_heads, s.index_dim)),
                                     cos, sin, s.index_rope)  # [B, T, Hi, Di]
            k_idx = apply_index_rope(self.index_k_norm(self.index_k_proj(xd).view(B, T, 1, s.index_dim)),
                                     cos, sin, s.index_rope)[:, :, 0]  # [B, T, Di]
        if cache is not None:
            stored = k if k_idx is None else torch.cat([k, self._pack(k_idx.to(k.dtype))], dim=1)
            stored, v = cache.update(stored, v, self.layer)
            k = stored[:, : self.n_kv]
            if k_idx is not None:
                k_idx = self._unpack(stored[:, self.n_kv:])  # [B, Tk, Di]: the whole prefix
        if not any(starts):
            o = self._attend(q, k, v, q_idx, k_idx, past, backend, question)
        else:  # left-padded rows: each runs alone from its first real token; its padding queries give zeros
            o = q.new_zeros(q.shape)
            for b, first in enumerate(starts):
                i = max(first - past, 0)  # first real query of this chunk
                if i < T:
                    o[b:b + 1, :, i:] = self._attend(
                        q[b:b + 1, :, i:], k[b:b + 1, :, first:], v[b:b + 1, :, first:],
                        None if q_idx is None else q_idx[b:b + 1, i:], None if k_idx is None else k_idx[b:b + 1, first:],
                        past + i - first, backend, question)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _pack(self, k_idx: torch.Tensor) -> torch.Tensor:
        """[B, T, Di] -> [B, E, T, D]: the index key as E extra key heads (zero-padded to E * D channels)."""
        B, T, Di = k_idx.shape
        flat = F.pad(k_idx, (0, self.extra_heads * self.head_dim - Di))
        return flat.view(B, T, self.extra_heads, self.head_dim).transpose(1, 2)

    def _unpack(self, heads: torch.Tensor) -> torch.Tensor:
        B, E, T, D = heads.shape
        return heads.transpose(1, 2).reshape(B, T, E * D)[..., : self.s.index_dim]

    def _attend(self, q, k, v, q_idx, k_idx, q_start: int, backend: str, question=None) -> torch.Tensor:
        """One sequence's attention: queries q [B, Hq, Tq, D] at positions q_start.., keys k/v [B, Hkv, Tk, D] at
        0 .. Tk - 1 (Tk = q_start + Tq) -> [B, Hq, Tq, D]; with a question (n, settings), the last n queries at
        those settings' budget, the others at the model's."""
        if question is None or not self.msa:
            return self._attend_at(q, k, v, q_idx, k_idx, q_start, backend, self.s)
        n = q.shape[2] - min(question[0], q.shape[2])  # the queries before the question's
        tail = self._attend_at(q[:, :, n:], k, v, q_idx[:, n:], k_idx, q_start + n, backend, question[1])
        if not n:
            return tail
        end = q_start + n
        body = self._attend_at(q[:, :, :n], k[:, :, :end], v[:, :, :end], q_idx[:, :n], k_idx[:, :end], q_start,
                               backend, self.s)
        return torch.cat([body, tail], dim=2)

    def _attend_at(self, q, k, v, q_idx, k_idx, q_start: int, backend: str, s: Settings) -> torch.Tensor:
        """_attend at the budget of settings s."""
        Tq, Tk = q.shape[2], k.shape[2]
        everything = -(-Tk // s.block_size) <= s.topk and s.top_p >= 1  # every visible block: dense attention
        kernels = self.msa and use_kernels(q, k, v, backend=backend)
        if self.msa and not (kernels and everything):  # (there m3compile's lowered model runs SDPA too)
            if kernels and q_start == 0:  # a prompt: fused indexer, gather-Q sparse attention
                blocks = m3c_indexer.select_blocks(q_idx.contiguous(), k_idx.contiguous(), block_size=s.block_size,
                                                   topk=s.topk, init_blocks=s.init_blocks, local_blocks=s.local_blocks,
                                                   top_p=s.top_p, min_blocks=s.min_blocks)
                return m3c_sparse.sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), blocks,
                                                   block_size=s.block_size, scale=self.scale)
            blocks = select_blocks(q_idx.transpose(1, 2), k_idx, q_start, s)  # decode steps; no kernels
            return sparse_attention(q, k, v, blocks, q_start, s.block_size, self.scale)
        if q_start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        mask = torch.arange(Tk, device=q.device)[None, :] <= torch.arange(q_start, Tk, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)


class M3CompileMLP(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class M3CompileDecoderLayer(nn.Module):
    def __init__(self, s: Settings, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = M3CompileAttention(s, layer)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = M3CompileMLP(s)

    def forward(self, x, cos, sin, cache, past, starts, backend, question=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, past, starts, backend, question)
        return x + self.mlp(self.post_attention_layernorm(x))


class M3CompilePreTrainedModel(PreTrainedModel):
    config_class = M3CompileConfig
    base_model_prefix = "model"
    _no_split_modules = ["M3CompileDecoderLayer"]

    def _init_weights(self, module):  # only for tensors a checkpoint lacks
        std = _setting(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0 if module.style == "rms" else 0.0)


class M3CompileModel(M3CompilePreTrainedModel):
    """Embeddings, decoder layers, final norm: input_ids [B, T] -> hidden states [B, T, hidden]."""

    def __init__(self, config: M3CompileConfig):
        super().__init__(config)
        self.settings = s = Settings(config)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(M3CompileDecoderLayer(s, i) for i in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.inv_freq = rope_frequencies(s)  # a plain attribute, not a buffer: never cast, never left on meta
        self.msa_backend = "auto"  # "auto" (m3compile's kernels on CUDA when importable), "torch" or "m3compile"
        self.generating = False  # inside generate(): the answer and decode budgets apply
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        past = cache.get_seq_length() if cache is not None else 0
        starts = [0] * B
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask must be [batch, past + new tokens] = [{B}, {past + T}], "
                                 f"got {list(attention_mask.shape)}")
            starts = self._row_starts(attention_mask.bool())
        if position_ids is None:
            first = torch.tensor(starts, device=x.device)[:, None]
            position_ids = (torch.arange(past, past + T, device=x.device)[None, :] - first).clamp(min=0)
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, R]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        s, question = self.settings, None
        if self.generating and past == 0 and s.answer is not None:  # the prompt: its last tokens at the answer's
            question = (s.answer_tokens, s.answer)
        elif self.generating and past > 0 and s.decode is not None:  # a new token
            question = (T, s.decode)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, past, starts, self.msa_backend, question)
        return self.norm(x)

    @staticmethod
    def _row_starts(mask: torch.Tensor) -> list[int]:
        """Per row, the index of its first real token; padding may only lead (or trail: causal attention never
        lets a real token see it), never sit between real tokens."""
        real = mask.sum(1)
        first = mask.int().argmax(1)
        last = mask.shape[1] - mask.flip(1).int().argmax(1)
        if bool(((last - first) != real).any() | (real == 0).any()):
            raise ValueError("attention_mask: every row needs real tokens in one run (left or right padding only)")
        return first.tolist()


class M3CompileForCausalLM(M3CompilePreTrainedModel, GenerationMixin):
    """Causal LM with MSA layers: input_ids [B, T] -> logits [B, T, vocab]; `generate()` with a DynamicCache, or
    with kv_cache="fp8" / "int8" an 8-bit one."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: M3CompileConfig):
        super().__init__(config)
        self.model = M3CompileModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def generate(self, *args, kv_cache: str = "auto", **kwargs):
        """transformers' generate(), after m3compile's memory check where m3compile is installed: the cache of every
        sequence at its prompt + new tokens and the prompts' forward, counted as `m3c generate` counts them
        (m3compile.memory, the contiguous layout), against the device's free memory, before anything is
        allocated; an error says how much it needs and what would fit. kv_cache: "auto" (transformers' default
        cache, the model's dtype), "fp8" (transformers' QuantizedCache(backend="fp8") with `Fp8RowLayer`s: e4m3
        keys, index keys and values with one scale per position and head) or "int8" (the same cache with
        `Int8RowLayer`s: integer rows after a rotation, closer to the model's dtype at the same bytes); both where
        this transformers has QuantizedCache(backend="fp8"). Where the model's folder holds kernels compiled ahead
        for this GPU (`m3c compile`: kernel-cache), the prompt's Triton kernels load from there."""
        layers = {"fp8": Fp8RowLayer, "int8": Int8RowLayer}
        if kv_cache not in ("auto", *layers):
            raise ValueError(f"kv_cache must be 'auto', 'fp8' or 'int8', got {kv_cache!r}")
        if kv_cache != "auto":
            if layers[kv_cache] is None:
                raise ValueError(f"kv_cache={kv_cache!r} needs a transformers with QuantizedCache(backend='fp8')")
            cache = QuantizedCache(backend="fp8", config=self.config)
            cache.layers = [layers[kv_cache]() for _ in cache.layers]
            kwargs[CACHE_FIELD] = cache
        folder = getattr(self.config, "_name_or_path", None)
        if m3c_kernel_cache is not None and self.device.type == "cuda" and folder and os.path.isdir(folder):
            m3c_kernel_cache.activate(folder, warn=warnings.warn)  # kernels compiled ahead
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if m3c_memory is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            kv_dtype = {"auto": self.dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache]
            self._check_memory(ids, kwargs, kv_dtype)
        self.model.generating = True  # the stored answer and decode budgets, where the config has them
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.model.generating = False

    def _check_memory(self, ids: torch.Tensor, kwargs: dict, kv_dtype: torch.dtype) -> None:
        config = kwargs.get("generation_config") or self.generation_config
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        total = ids.shape[1] + new if new is not None else max(ids.shape[1] + 1,
                                                                kwargs.get("max_length", config.max_length or 0))
        batch = ids.shape[0] * kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1) \
            * kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1) or 1)
        s = self.model.settings
        shape = m3c_memory.ModelShape(s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.intermediate,
                                      s.vocab, sum(s.sparse), s.index_heads, s.index_dim, s.topk, s.block_size)
        plan = m3c_memory.plan_memory(shape, batch, total, kv_dtype=kv_dtype, index_dtype=kv_dtype,
                                      model_dtype=self.dtype, chunk=ids.shape[1], layout="contiguous",
                                      weights=m3c_memory.weight_bytes(self))
        m3c_memory.check_memory(plan, m3c_memory.available_bytes(self.device), str(self.device))

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None, **kwargs):
        """`cache` (transformers 5.2x) or `past_key_values` (earlier): a transformers Cache, created when
        use_cache is on and none is given; returned under the name this transformers uses."""
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = _setting(self.config, "use_cache", True)
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden = self.model(input_ids, attention_mask, position_ids, cache if use_cache else None, inputs_embeds)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
