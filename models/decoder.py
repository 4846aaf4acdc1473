"""An M3-style decoder-only transformer, read top-down.

It covers what people convert: GQA with any group size, optional q/k/v bias (Qwen2), optional per-head QK RMSNorm
(Qwen3 plain, M3 Gemma-style `1 + w`), full or partial NeoX RoPE, SwiGLU (or M3's clamped SwiGLU-OAI) MLPs, an
optional MoE block (M3's sigmoid router with correction bias and shared experts), tied or untied embeddings, and
MSA layers (index branch + block-sparse attention) natively, so converted and M3 checkpoints run without tracing.
The graph ops it calls (apply_rope, rms_norm, index_branch, msa_select, msa_attention, ...) live in m3compile.ops,
each with its reference and its lowering; which of the two runs is the ops' switch (m3compile.ops.lowering), never a
setting of the model. One forward serves every path: the Decoder's forward(input_ids, positions, cache) walks the
layers once, without a cache over its own tokens, with one (a view of m3compile.runtime's paged caches) over what
the cache holds.

Attention is written in one of three forms (`attn_impl`), all of which the graph matcher recognises:
    "sdpa_gqa"    scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    "sdpa_repeat" scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), is_causal=True)
    "eager"       softmax(q @ repeat_kv(k)^T * scale + causal_mask) @ repeat_kv(v)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3compile.config import INDEX_DTYPES, INDEX_ROPES, SELECTIONS, check_floor_fits, check_msa_ranges, max_positions
from m3compile.errors import M3CompileError
from m3compile.models.fused import Fusable
from m3compile.ops import (add_rms_norm, apply_rope, index_branch, index_norm_rope, msa_attention, msa_attention_lse,
                           msa_oracle_select, msa_recent_select, msa_select, rms_norm, scope)

__all__ = ["ModelArgs", "MSALayerArgs", "Decoder", "Backbone", "DecoderLayer", "Attention", "RMSNorm", "PRESETS"]


@dataclass(frozen=True)
class MSALayerArgs:
    """Settings of the MSA layers of a model (M3's `sparse_attention_config`)."""

    index_heads: int
    index_dim: int
    block_size: int = 128
    topk: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    index_dtype: str = "auto"  # "fp8": e4m3 index scoring (m3compile.config.INDEX_DTYPES)
    index_rope: str = "m3"  # the index RoPE rule (config.INDEX_ROPES; kernels/norm_rope/index_rope.py)
    top_p: float = 1.0  # the adaptive budget (docs/msa.md 2.8): < 1 keeps the fewest blocks of index mass >= top_p
    min_blocks: int = 0  # ... and at least this many (topk is the ceiling)
    answer_budget: str | None = None  # the budget of a prompt's last answer_tokens tokens and of the answer (generate)
    answer_tokens: int = 128
    decode_budget: str | None = None  # the answer's, where it differs from answer_budget

    def check_floor(self, tokens: int, what: str) -> None:
        """An adaptive budget's floor must be reachable in a context of `tokens` (`what` names it in the error): a
        floor above its blocks would hold every query to a budget it never has."""
        blocks = -(-tokens // self.block_size)
        if self.top_p < 1 and self.min_blocks > blocks:
            raise M3CompileError(f"min_blocks {self.min_blocks} is above the {blocks} blocks of {self.block_size} "
                                 f"tokens in {what}: the adaptive budget's floor can never be met there")

    def __post_init__(self):
        if self.index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, got {self.index_dtype!r}")
        if self.index_rope not in INDEX_ROPES:
            raise ValueError(f"index_rope must be one of {', '.join(INDEX_ROPES)}, got {self.index_rope!r}")
        if self.index_rope in ("low", "tile") and self.index_dim % 2:
            raise ValueError(f"index_rope {self.index_rope!r} needs an even index_dim, got {self.index_dim}")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # None: the whole head is rotated
    rope_scaling: dict | None = None  # llama3 / linear frequency scaling
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None, "rms" (Qwen3) or "gemma" (M3: x * (1 + w))
    norm_style: str = "rms"  # "rms" (w * x) or "gemma" (x * (1 + w))
    mlp_act: str = "silu"  # "silu" or "swiglu_oai" (M3)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_embeddings: bool = False
    # MoE: layers whose entry of `mlp_layer_types` is "sparse" get a MoE block.
    mlp_layer_types: tuple[str, ...] | None = None
    n_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    # MSA: layers whose entry of `sparse_layers` is True use the index branch and block-sparse attention.
    sparse_layers: tuple[bool, ...] | None = None
    msa: MSALayerArgs | None = None
    attn_impl: str = "sdpa_gqa"

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.attn_impl not in ("sdpa_gqa", "sdpa_repeat", "eager"):
            raise ValueError(f"unknown attn_impl {self.attn_impl!r}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        for name, n in (("mlp_layer_types", self.mlp_layer_types), ("sparse_layers", self.sparse_layers)):
            if n is not None and len(n) != self.n_layers:
                raise ValueError(f"{name} has {len(n)} entries for {self.n_layers} layers")
        if self.sparse_layers and any(self.sparse_layers) and self.msa is None:
            raise ValueError("sparse layers need MSA settings (msa)")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types is not None and self.mlp_layer_types[layer] == "sparse"

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers and self.sparse_layers[layer])

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D], each KV head repeated for its group."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def causal_mask(length, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [T, T] mask: 0 on and below the diagonal, -inf above."""
    return torch.full((length, length), float("-inf"), dtype=dtype, device=device).triu(1)


# ----------------------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. style "rms": w * x (Llama, Qwen); "gemma": x * (1 + w) (M3).

    norm(x) -> normed x; norm(x, residual=d) -> (x + d, norm(x + d)): a residual add and this norm (one kernel where
    the ops are lowered)."""

    def __init__(self, dim: int, eps: float = 1e-6, style: str = "rms"):
        super().__init__()
        if style not in ("rms", "gemma"):
            raise ValueError(f"unknown norm style {style!r}")
        self.eps, self.style = eps, style
        self.weight = nn.Parameter(torch.ones(dim) if style == "rms" else torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.style)
        return add_rms_norm(x, residual, self.weight, self.eps, self.style)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, style={self.style}"


class FP32Frequencies(nn.Module):
    """Base of the RoPE modules: their `inv_freq` buffer follows the model's device but stays fp32 when the model is
    cast (`load` in a bf16 checkpoint's dtype, `.to(torch.float16)`), as in transformers. Rounded to bf16 the
    frequencies are off by up to 2^-9 of themselves, a RoPE angle error that grows with the position (a
    bf16 checkpoint loaded then cast with .float() differed from its fp32 ONNX export by 0.02 in the logits at 20
    tokens, by 8 at 700)."""

    def _apply(self, fn, recurse=True):
        freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != freq.dtype:
            self.inv_freq = freq.to(self.inv_freq.device)
        return self


class RotaryEmbedding(FP32Frequencies):
    """cos/sin tables [B, T, R] for NeoX RoPE over R = rope_dim channels."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # computed on the CPU, then placed where modules are being built (the meta device under a meta context)
        self.register_buffer("inv_freq", self.frequencies(args).to(torch.empty(0).device), persistent=False)

    @staticmethod
    def frequencies(args: ModelArgs) -> torch.Tensor:
        dim = args.rope_dim  # computed on the CPU even under a meta-device context: it is small and exact
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        return _scale_frequencies(inv_freq, args.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _scale_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: long wavelengths scaled by `factor`, smooth ramp in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class Attention(Fusable):
    """GQA attention; with `msa` it is an MSA layer: index branch (selection only) + block-sparse attention.

    forward(x, cos, sin, cache=None): x [B, T, hidden] -> [B, T, hidden]. Without a cache the layer attends over x's
    own tokens (training, evaluation, tracing); with one (a view of m3compile.runtime's paged caches, which has
    `attend(attention, q, k, v, q_idx, k_idx)`) it stores this forward's keys, values and index keys there and
    attends over everything the cache holds (prefill in chunks, decode). How an MSA layer picks its blocks is
    `selection` (m3compile.config.SELECTIONS); `observer(attention, q, k, blocks, lse)`, when set, sees each sparse
    forward without a cache (evaluation: block recall; lse the attention's per-head log-sum-exp [B, T, Hq], base 2,
    or None where the kernel that ran gives none). Fused (Decoder.fuse_projections): q/k/v (and an MSA layer's index
    q/k) as one matmul where no gradient is needed."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.attn_impl = args.attn_impl
        self.scale = args.head_dim**-0.5
        self.q_proj = nn.Linear(args.hidden_size, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.qk_norm)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.qk_norm)
        self.msa = args.msa if args.is_sparse(layer) else None
        self.selection = "index"
        self.observer = None
        if self.msa is not None:
            m = self.msa
            self.index_q_proj = nn.Linear(args.hidden_size, m.index_heads * m.index_dim, bias=False)
            self.index_k_proj = nn.Linear(args.hidden_size, m.index_dim, bias=False)
            self.index_q_norm = RMSNorm(m.index_dim, args.rms_norm_eps, "gemma")
            self.index_k_norm = RMSNorm(m.index_dim, args.rms_norm_eps, "gemma")

    def projections(self) -> dict[str, nn.Linear]:
        """The Linears reading the layer's input, in their fused order: q, k, v (, index q, index k)."""
        out = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj}
        if self.msa is not None:
            out.update(index_q_proj=self.index_q_proj, index_k_proj=self.index_k_proj)
        return out

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: bool = True):
        """(q [B, Hq, T, D], k/v [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di]): the projections, QK norm
        and RoPE, and for an MSA layer when `index` its index branch (else None, None). The index branch reads the
        input detached (it never trains the backbone): both projections as one matmul, then per head the Gemma norm
        and the index RoPE (ops.index_branch). Fused, one matmul computes q, k, v and the index projections, and
        ops.index_norm_rope the rest."""
        B, T, _ = x.shape
        index = index and self.msa is not None
        f = self.fused(x)
        qn, kn = (self.index_q_norm, self.index_k_norm) if index else (None, None)
        q_idx = k_idx = y_idx = None
        if f is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if index:
                q_idx, k_idx = index_branch(x.detach(), self.index_q_proj.weight, self.index_k_proj.weight, qn.weight,
                                            kn.weight, cos, sin, qn.eps, self.msa.index_rope)
        else:  # [q | k | v (| index q | index k)] from one matmul, each part read in place
            weight, bias = (f.weight, f.bias) if index or self.msa is None else f.rows(3)
            with scope("m3c.proj_mlp"):
                y = F.linear(x, weight, bias)
            q, k, v, *rest = y.split(f.sizes[:3] + ((sum(f.sizes[3:]),) if index else ()), dim=-1)
            y_idx = rest[0] if rest else None
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, Hq, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        if y_idx is not None:
            q_idx, k_idx = index_norm_rope(y_idx, qn.weight, kn.weight, cos, sin, qn.eps, self.msa.index_rope)
        return q, k, v.transpose(1, 2), q_idx, k_idx

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        # a cache keeps every MSA layer's index keys; without one the index branch runs for its own selection only
        q, k, v, q_idx, k_idx = self.project(x, cos, sin, index=cache is not None or self.selection == "index")
        if cache is not None:
            o = cache.attend(self, q, k, v, q_idx, k_idx)
        elif self.msa is not None:
            o = self._msa(q, k, v, q_idx, k_idx)
        elif self.attn_impl == "sdpa_gqa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.attn_impl == "sdpa_repeat":
            n_rep = self.n_heads // self.n_kv_heads
            o = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        else:
            n_rep = self.n_heads // self.n_kv_heads
            s = torch.matmul(q, repeat_kv(k, n_rep).transpose(2, 3)) * self.scale
            s = s + causal_mask(T, s.dtype, s.device)
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, repeat_kv(v, n_rep))
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def select(self, q, k, q_idx, k_idx):
        """The blocks [B, Hkv, T, topk] (-1 = empty) each (KV group, query) attends to, as `selection` says:
        "index" the index branch's top-k, "oracle" the blocks of most dense group-mean attention mass (from this
        layer's own q/k: what a perfect index branch would pick), "recent" the newest blocks (a baseline); the
        forced blocks in every one (docs/msa.md 2.5). With an adaptive budget (docs/msa.md 2.8) the index and the
        oracle keep the fewest blocks of probability (index) or mass (oracle) top_p, "recent" its ceiling."""
        m = self.msa
        if self.selection == "index":
            return msa_select(q_idx, k_idx, m.block_size, m.topk, m.init_blocks, m.local_blocks, m.index_dtype,
                              m.top_p, m.min_blocks)
        if self.selection == "oracle":
            return msa_oracle_select(q, k, m.block_size, m.topk, m.init_blocks, m.local_blocks, self.scale, m.top_p,
                                     m.min_blocks)
        return msa_recent_select(q, k, m.block_size, m.topk, m.init_blocks, m.local_blocks)

    def _msa(self, q, k, v, q_idx, k_idx):
        m = self.msa
        if self.selection == "dense":  # every visible key: no selection to compute
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        blocks = self.select(q, k, q_idx, k_idx)
        adaptive = m.top_p < 1 and self.selection != "recent"
        if self.observer is None:
            return msa_attention(q, k, v, blocks, m.block_size, self.scale, True, adaptive)
        o, lse, _ = msa_attention_lse(q, k, v, blocks, m.block_size, self.scale, True, adaptive)
        self.observer(self, q, k, blocks, lse)
        return o


class MLP(Fusable):
    """SwiGLU: down(act(gate(x)) * up(x)); "swiglu_oai" is M3's clamped variant (up + 1) * g * sigmoid(alpha g).
    Fused (Decoder.fuse_projections): gate and up as one matmul where no gradient is needed."""

    def __init__(self, args: ModelArgs, intermediate_size: int):
        super().__init__()
        self.act, self.alpha, self.limit = args.mlp_act, args.swiglu_alpha, args.swiglu_limit
        self.gate_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, args.hidden_size, bias=False)

    def projections(self) -> dict[str, nn.Linear]:
        return {"gate_proj": self.gate_proj, "up_proj": self.up_proj}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.fused(x)
        if f is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            with scope("m3c.proj_mlp"):
                gate, up = F.linear(x, f.weight).split(f.sizes, dim=-1)
        return self.down_proj(_glu(gate, up, self.act, self.alpha, self.limit))


def _glu(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float, limit: float) -> torch.Tensor:
    if act == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class MoE(nn.Module):
    """M3's MoE block: sigmoid router (+ correction bias for the choice only), top-k renormalised weights scaled by
    `routed_scaling_factor`, plus shared experts. Expert weights are packed: w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I]. Traced as a leaf module: its routing is data-dependent."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, I, H = args.n_experts, args.moe_intermediate_size, args.hidden_size
        self.top_k, self.scaling = args.experts_per_tok, args.routed_scaling_factor
        self.act, self.alpha, self.limit = args.mlp_act, args.swiglu_alpha, args.swiglu_limit
        self.gate = nn.Linear(H, E, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        if not self.w13.is_meta:  # on meta, normal_ would import torch._dynamo (seconds) for nothing
            nn.init.normal_(self.w13, std=0.02)
            nn.init.normal_(self.w2, std=0.02)
        self.shared_experts = MLP(args, args.shared_intermediate_size) if args.shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.sigmoid(self.gate(x.to(self.gate.weight.dtype)).float())
        _, idx = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1)
        weights = probs.gather(1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        if torch.compiler.is_exporting():  # ONNX / torch.export: no data-dependent loop
            out = self._all_experts(x, idx, weights)
        else:
            out = self._routed(x, idx, weights)
        out = out * self.scaling
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _all_experts(self, x, idx, weights):
        """Every expert on every token, combined with the routing weights (0 for unchosen experts): the same sum as
        `_routed`, E times the work, with static shapes."""
        combine = torch.zeros(x.shape[0], self.w13.shape[0], dtype=weights.dtype, device=x.device)
        combine = combine.scatter(1, idx, weights)  # [N, E]
        gate, up = torch.einsum("nh,eih->nei", x, self.w13.to(x.dtype)).chunk(2, dim=-1)
        y = torch.einsum("nei,ehi->neh", _glu(gate, up, self.act, self.alpha, self.limit), self.w2.to(x.dtype))
        return (y * combine[..., None].to(y.dtype)).sum(1).to(x.dtype)

    def _routed(self, x, idx, weights):
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            gate, up = F.linear(x[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(_glu(gate, up, self.act, self.alpha, self.limit), self.w2[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(.)). It takes its input normed already, h =
    input_layernorm(x) (the previous layer computed it with its last residual add), and hands the next norm's output
    on the same way: (x, h) -> (x', next_norm(x'))."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.mlp = MoE(args) if args.is_moe(layer) else MLP(args, args.intermediate_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                next_norm: RMSNorm | None = None, cache=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x', next_norm(x')); without a next norm (a layer run alone) (x', None)."""
        x, h = self.post_attention_layernorm(x, residual=self.self_attn(h, cos, sin, cache))
        if next_norm is None:
            return x + self.mlp(h), None
        return next_norm(x, residual=self.mlp(h))


class Backbone(nn.Module):
    """input_ids [B, T] (at `positions`, default 0 .. T-1) -> the final norm's hidden states [B, T, hidden]: the
    model's one walk over its layers, for every path (training, evaluation, tracing, prefill, decode)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        # _weight skips Embedding's own normal_ init, which on the meta device imports torch._dynamo (seconds)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size))
        if not self.embed_tokens.weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.rotary_emb = RotaryEmbedding(args)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(input_ids), positions, cache)  # [B, T, hidden]

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """The layers and final norm from input embeddings [B, T, hidden] (multimodal inputs enter here).

        positions: [B | 1, T] each token's position (default 0 .. T-1: a whole sequence). cache: a view of the
        runtime's paged caches for this forward (Attention.forward); the layers store their keys there and attend
        over what it holds."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rotary_emb(x, positions)  # [B | 1, T, R]
        h = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer(x, h, cos, sin, next_norm, cache)
        return h


class Decoder(nn.Module):
    """Causal LM: input_ids [B, T] -> logits [B, T, vocab], optionally at `positions` over a `cache` (Backbone).
    State-dict names follow Hugging Face (`model.`, `lm_head`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, cache))

    def fuse_projections(self, *twins: "Decoder") -> None:
        """For inference: per layer, one contiguous weight [q; k; v (; index q; index k in an MSA layer)] (and one
        bias where the model has q/k/v biases) and one [gate; up] (MoE layers keep theirs), each Linear's
        parameters re-pointed to their rows (models/fused.py): one matmul instead of three to five, no weight held
        twice, the state dict unchanged; extra memory while converting: one layer's weights. The fused matmuls run
        where no gradient is needed and until a parameter is re-pointed (`.to()`, load_state_dict(assign=True)),
        the separate Linears elsewhere, so training, tracing and export see the model as before.
        twins: models holding the same weight tensors for some layers (m3compile.bench's dense twin of a converted
        model): their Linears that shared a tensor are re-pointed to this model's fused rows and fused in place,
        so the weights stay shared. A no-op for what is already fused."""
        for i, layer in enumerate(self.model.layers):
            for name in ("self_attn", "mlp"):
                module = getattr(layer, name)
                if not isinstance(module, (Attention, MLP)):
                    continue
                before = {n: (lin.weight.data_ptr(), None if lin.bias is None else lin.bias.data_ptr())
                          for n, lin in module.projections().items()}
                module.fuse()
                for twin in twins:
                    other = getattr(twin.model.layers[i], name) if i < len(twin.model.layers) else None
                    if type(other) is not type(module) or other is module:
                        continue
                    mine = module.projections()
                    for n, lin in other.projections().items():
                        src = mine.get(n)
                        if src is None or lin.weight.data_ptr() != before[n][0] \
                                or (lin.weight.shape, lin.weight.dtype) != (src.weight.shape, src.weight.dtype):
                            continue
                        lin.weight.data = src.weight.data
                        if lin.bias is not None and lin.bias.data_ptr() == before[n][1] \
                                and (lin.bias.shape, lin.bias.dtype) == (src.bias.shape, src.bias.dtype):
                            lin.bias.data = src.bias.data
                    other.fuse()

    def set_index_dtype(self, index_dtype: str) -> None:
        """How MSA layers score their index branch from now on: "auto" (the compute dtype) or "fp8" (e4m3 x e4m3,
        per-token key scale). Changes `args.msa` too, so what is saved or traced afterwards scores the same way.
        fp8 on a model without MSA layers is refused: there is no index branch to score with it."""
        if index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, got {index_dtype!r}")
        if self.args.msa is None:
            if index_dtype != "auto":
                raise M3CompileError(f"--index-dtype {index_dtype} applies to MSA layers, and the model has none "
                                     f"(it was never converted): nothing would score with it")
            return
        self._set_msa(index_dtype=index_dtype)

    def set_budget(self, top_p: float | None = None, min_blocks: int | None = None, topk: int | None = None) -> None:
        """The MSA layers' selection budget from now on (docs/msa.md 2.8): top_p < 1 an adaptive one between
        min_blocks and topk blocks, 1 the fixed top-k; None keeps a setting. Changes `args.msa` too, as
        set_index_dtype does. Refused on a model without MSA layers."""
        if self.args.msa is None:
            raise M3CompileError("a selection budget applies to MSA layers, and the model has none (it was never "
                                 "converted)")
        m = self.args.msa
        new = dict(top_p=m.top_p if top_p is None else top_p,
                   min_blocks=m.min_blocks if min_blocks is None else min_blocks, topk=m.topk if topk is None else topk)
        check_msa_ranges(block_size=m.block_size, topk=new["topk"], init_blocks=m.init_blocks,
                         local_blocks=m.local_blocks, top_p=new["top_p"], min_blocks=new["min_blocks"],
                         names={"top_p": "top_p", "min_blocks": "min_blocks"}, min_local=0)
        check_floor_fits(new["min_blocks"], m.block_size, max_positions(getattr(self, "source_config", None)))
        self._set_msa(**new)

    def _set_msa(self, **changes) -> None:
        self.args = self.args.replace(msa=dataclasses.replace(self.args.msa, **changes))
        for module in self.modules():
            if isinstance(module, Attention) and module.msa is not None:
                module.msa = self.args.msa

    def set_selection(self, selection: str) -> None:
        """How the MSA layers pick their blocks from now on (m3compile.config.SELECTIONS): "index" (the index branch,
        the model itself), "oracle" (each layer's dense attention's own top-k blocks, from that layer's q/k in this
        forward), "dense" (every visible key) or "recent" (the newest blocks); the forced blocks in every one."""
        if selection not in SELECTIONS:
            raise ValueError(f"unknown selection {selection!r} (use one of {', '.join(SELECTIONS)})")
        for module in self.modules():
            if isinstance(module, Attention):
                module.selection = selection


def _m3_args(**overrides) -> ModelArgs:
    n_layers = overrides.pop("n_layers", 60)
    dense_first = 3
    base = dict(
        vocab_size=200064, hidden_size=6144, n_layers=n_layers, n_heads=64, n_kv_heads=4, head_dim=128,
        intermediate_size=12288, rms_norm_eps=1e-6, rope_theta=5e6, rotary_dim=64, qk_norm="gemma",
        norm_style="gemma", mlp_act="swiglu_oai", mlp_layer_types=tuple(["dense"] * dense_first + ["sparse"] * (n_layers - dense_first)),
        n_experts=128, experts_per_tok=4, moe_intermediate_size=3072, shared_intermediate_size=3072,
        routed_scaling_factor=2.0,
    )
    base.update(overrides)
    return ModelArgs(**base)


# Named presets. `m3` is M3's real text shapes, dense (the converter adds MSA); build it on the meta device.
# `llama3-8b`, `qwen2.5-7b` and `smollm2-135m` are those models' dense shapes (random weights: for benchmarks; the
# first two are 8B / 7.6B parameters, so build them on a GPU).
PRESETS: dict[str, ModelArgs] = {
    "m3": _m3_args(),
    "m3-tiny": _m3_args(
        vocab_size=256, hidden_size=64, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, intermediate_size=96,
        rotary_dim=8, rope_theta=1e4, n_experts=4, experts_per_tok=2, moe_intermediate_size=32,
        shared_intermediate_size=32, mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    ),
    "llama3-8b": ModelArgs(
        vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    "qwen2.5-7b": ModelArgs(
        vocab_size=152064, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
        intermediate_size=18944, rms_norm_eps=1e-6, rope_theta=1e6, qkv_bias=True,
    ),
    "smollm2-135m": ModelArgs(
        vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_embeddings=True,
    ),
}
