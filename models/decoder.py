"""An M3-style decoder-only transformer, read top-down.

It covers what people convert: GQA with any group size, optional q/k/v bias (Qwen2), optional per-head QK RMSNorm
(Qwen3 plain, M3 Gemma-style `1 + w`), full or partial NeoX RoPE, SwiGLU (or M3's clamped SwiGLU-OAI) MLPs, an
optional MoE block (M3's sigmoid router with correction bias and shared experts), tied or untied embeddings, and
MSA layers (index branch + block-sparse attention) natively, so converted and M3 checkpoints run without tracing.
The graph ops it calls (apply_rope, msa_select, msa_attention, ...) live in m3compile.ops.

Attention is written in one of three forms (`attn_impl`), all of which the graph matcher recognises:
    "sdpa_gqa"    scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    "sdpa_repeat" scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), is_causal=True)
    "eager"       softmax(q @ repeat_kv(k)^T * scale + causal_mask) @ repeat_kv(v)
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3compile.config import INDEX_DTYPES, INDEX_ROPES
from m3compile.errors import M3CompileError
from m3compile.kernels._common import use_triton
from m3compile.kernels.norm_rope import add_rms_norm
from m3compile.kernels.causal_lse import oracle_blocks
from m3compile.models.fused import Fusable
from m3compile.ops import (apply_index_rope, apply_rope, apply_rope_triton, index_branch_triton,
                           index_norm_rope_triton, msa_attention, msa_attention_lse_triton, msa_attention_triton,
                           msa_select, msa_select_triton, rms_norm_triton, scope, split_heads)

__all__ = ["ModelArgs", "MSALayerArgs", "Decoder", "PRESETS", "Selection", "SELECTIONS"]

# How a sparse MSA layer picks its blocks: "index" (the index branch, the model itself) or "oracle" (the blocks of
# most dense, group-mean attention mass from the layer's own q/k: what a perfect index branch would pick; evaluation)
Selection = Literal["index", "oracle"]
SELECTIONS: tuple[Selection, ...] = ("index", "oracle")


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
    index_rope: str = "m3"  # the index RoPE table (m3compile.config.INDEX_ROPES; ops.index_rope_tables)

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
    """RMSNorm over the last dim. style "rms": w * x (Llama, Qwen); "gemma": x * (1 + w) (M3)."""

    def __init__(self, dim: int, eps: float = 1e-6, style: str = "rms"):
        super().__init__()
        if style not in ("rms", "gemma"):
            raise ValueError(f"unknown norm style {style!r}")
        self.eps, self.style = eps, style
        self.weight = nn.Parameter(torch.ones(dim) if style == "rms" else torch.zeros(dim))
        # True: rms_norm_triton, one kernel where no gradient is needed (this formula elsewhere; Decoder.set_kernels)
        self.kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return rms_norm_triton(x, self.weight, self.eps, self.style)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, self(x + d)): a residual add and this norm, one kernel where `kernels` is set (add_rms_norm)."""
        if self.kernels:
            return add_rms_norm(x, d, self.weight, eps=self.eps, style=self.style)
        s = x + d
        return s, self(s)

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
    Fused (Decoder.fuse_projections): q/k/v (and an MSA layer's index q/k) as one matmul where no gradient is
    needed."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
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
        self.sparse = True  # False runs an MSA layer densely (the "dense loss" of `m3c eval`)
        self.selection: Selection = "index"  # "oracle": the dense attention's own top-k blocks (`m3c eval`)
        self.probe = None  # evaluation hook: probe(attn, q, k, blocks) sees each sparse forward
        # evaluation hook: lse_probe(attn, q, k, blocks, lse) sees each sparse forward after its attention, with the
        # attention's per-head log-sum-exp over the selected keys (lse [B, T, Hq] fp32 base 2; None where the
        # lowered kernel did not run or every visible block was selected)
        self.lse_probe = None
        # True: the lowered ops (Triton on CUDA / under the interpreter, the references elsewhere): fused RoPE, the
        # fused index branch, the MSA selection and attention kernels (Decoder.set_kernels: `m3c eval`, decode)
        self.kernels = False
        self._index_weight = None  # (q weight, k weight, their versions and storages, [W_qi; W_ki]) while kernels
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

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, Hq, T, D], k/v [B, Hkv, T, D]: projections, QK norm and RoPE (also used by the decode path)."""
        return self._project(x, cos, sin, False)[:3]

    def project_with_index(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v, q_idx, k_idx): `project` and, for an MSA layer, `index_branch` of the same input (else None,
        None); fused, one matmul computes q, k, v and the index projections."""
        q, k, v, y_idx = self._project(x, cos, sin, self.msa is not None)
        if self.msa is None:
            return q, k, v, None, None
        return (q, k, v, *self.index_branch(x, cos, sin, y_idx))

    def _project(self, x, cos, sin, index: bool):
        """(q, k, v, y_idx): y_idx the index projections [B, T, (Hi + 1) * Di] where `index` and fused, else None."""
        B, T, _ = x.shape
        f = self.fused(x)
        if f is None:
            q, k, v, y_idx = self.q_proj(x), self.k_proj(x), self.v_proj(x), None
        else:  # [q | k | v (| index q | index k)] from one matmul, each part read in place
            weight, bias = (f.weight, f.bias) if index or self.msa is None else f.rows(3)  # (oracle / dense)
            with scope("m3c.proj_mlp"):
                y = F.linear(x, weight, bias)
            q, k, v, *rest = y.split(f.sizes[:3] + ((sum(f.sizes[3:]),) if index else ()), dim=-1)
            y_idx = rest[0] if rest else None
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, Hq, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        rope = apply_rope_triton if self.kernels else apply_rope
        q = rope(q, cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = rope(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        return q, k, v.transpose(1, 2), y_idx

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # an MSA layer's index branch runs unless dense attention (with the kernels) or oracle selection replace it
        index = self.msa is not None and not (self.kernels and not self.sparse) and not (
            self.selection == "oracle" and self.sparse)
        q, k, v, *idx = self.project_with_index(x, cos, sin) if index else self.project(x, cos, sin)
        if self.msa is not None:
            o = self._msa(q, k, v, idx)
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

    def index_branch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     projected: torch.Tensor | None = None):
        """q_idx [B, T, Hi, Di], k_idx [B, T, Di]; input detached (the index branch never trains the backbone).
        projected: x's index projections [B, T, (Hi + 1) * Di] where the caller computed them (project_with_index's
        fused matmul, no gradient); then only the norms and RoPE run here."""
        x = x.detach()
        qn, kn = self.index_q_norm, self.index_k_norm
        m = self.msa
        if self.kernels and qn.eps == kn.eps and qn.style == kn.style == "gemma":  # one matmul, one norm + RoPE kernel
            if projected is not None:
                return index_norm_rope_triton(projected, qn.weight, kn.weight, cos, sin, qn.eps, rope=m.index_rope)
            return index_branch_triton(x, self.index_q_proj.weight, self.index_k_proj.weight, qn.weight, kn.weight,
                                       cos, sin, qn.eps, qk_weight=self.fused_index_weight() if use_triton(x) else None,
                                       rope=m.index_rope)
        width = m.index_heads * m.index_dim
        yq = self.index_q_proj(x) if projected is None else projected[..., :width]
        yk = self.index_k_proj(x) if projected is None else projected[..., width:]
        q_idx = self.index_q_norm(split_heads(yq, m.index_heads, m.index_dim))
        k_idx = self.index_k_norm(split_heads(yk, 1, m.index_dim))
        rope = m.index_rope
        return apply_index_rope(q_idx, cos, sin, rope), apply_index_rope(k_idx, cos, sin, rope)[:, :, 0]

    def fused_index_weight(self) -> torch.Tensor | None:
        """[W_qi; W_ki] [(Hi + 1) * Di, hidden], the two index projections' weights as index_branch_triton's one
        matmul reads them: with the projections fused, the fused weight's last rows (no copy); else concatenated
        once and kept while both weights are the same tensors with the same in-place version and storage (a plain
        optimizer step, load_state_dict or .to() rebuilds it on the next call; a fused optimizer's step bumps no
        version: its caller drops the kept weight, Decoder.drop_kept_weights).
        None (the op then concatenates per call) for a dense layer, where a gradient is needed (a kept
        concatenation would carry a spent autograd graph) and for inference-mode weights (no version counter: an
        in-place change would go unseen). A CUDA graph that read it keeps reading the tensor it had."""
        if self.msa is None:
            return None
        f = self.fused()
        if f is not None:
            return f.weight[sum(f.sizes[:3]):]
        wq, wk = self.index_q_proj.weight, self.index_k_proj.weight
        grad = torch.is_grad_enabled() and (wq.requires_grad or wk.requires_grad)
        if grad or wq.is_inference() or wk.is_inference():
            return None
        key = (wq._version, wk._version, wq.data_ptr(), wk.data_ptr(), wq.dtype, wk.dtype, wq.device, wk.device)
        kept = self._index_weight
        if kept is None or kept[0] is not wq or kept[1] is not wk or kept[2] != key:
            with torch.no_grad():
                kept = self._index_weight = (wq, wk, key, torch.cat((wq, wk)))
        return kept[3]

    def _msa(self, q, k, v, idx):
        """idx: (q_idx, k_idx), the index branch's output (empty where dense attention or oracle selection run)."""
        m = self.msa
        if self.kernels and not self.sparse:  # dense: no selection to compute (the reference path still runs it)
            return msa_attention(q, k, v, None, block_size=m.block_size, scale=self.scale, sparse=False)
        if self.selection == "oracle" and self.sparse:
            blocks = oracle_blocks(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                   local_blocks=m.local_blocks, scale=self.scale,
                                   backend="auto" if self.kernels else "torch")
        else:
            q_idx, k_idx = idx
            select = msa_select_triton if self.kernels else msa_select
            blocks = select(q_idx, k_idx, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                            local_blocks=m.local_blocks, index_dtype=m.index_dtype)
        if self.probe is not None and self.sparse:
            self.probe(self, q, k, blocks)
        if not self.kernels:
            o = msa_attention(q, k, v, blocks, block_size=m.block_size, scale=self.scale, sparse=self.sparse)
            if self.lse_probe is not None and self.sparse:
                self.lse_probe(self, q, k, blocks, None)
            return o
        if self.lse_probe is None:
            return msa_attention_triton(q, k, v, blocks, block_size=m.block_size, scale=self.scale)
        o, lse, _ = msa_attention_lse_triton(q, k, v, blocks, block_size=m.block_size, scale=self.scale)
        self.lse_probe(self, q, k, blocks, lse)
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
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.mlp = MoE(args) if args.is_moe(layer) else MLP(args, args.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # _weight skips Embedding's own normal_ init, which on the meta device imports torch._dynamo (seconds)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size))
        if not self.embed_tokens.weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.rotary_emb = RotaryEmbedding(args)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(input_ids))  # [B, T, hidden]

    def forward_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """The layers and final norm from input embeddings [B, T, hidden] (multimodal inputs enter here)."""
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rotary_emb(x, positions)  # [1, T, R]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Decoder(nn.Module):
    """Causal LM: input_ids [B, T] -> logits [B, T, vocab]. State-dict names follow Hugging Face (`model.`, `lm_head`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._kernels = False  # the last set_kernels / using_kernels setting

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

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

    def set_sparse(self, enabled: bool) -> None:
        """Run MSA layers sparsely (True) or with dense causal attention (False)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.sparse = enabled

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
        self.args = self.args.replace(msa=dataclasses.replace(self.args.msa, index_dtype=index_dtype))
        for module in self.modules():
            if isinstance(module, Attention) and module.msa is not None:
                module.msa = self.args.msa

    def set_kernels(self, enabled: bool) -> None:
        """Run the whole model with the lowered ops (True) or the plain-torch reference ops (False, the default,
        what tracing sees). True: every RMSNorm (input, post-attention and final norms, QK norms) is rms_norm_triton
        (one kernel where no gradient is needed, its own formula where one is), the attention's RoPE
        apply_rope_triton, each MSA layer's index branch index_branch_triton (one matmul over the two index weights,
        concatenated once per layer: Attention.fused_index_weight; one norm + RoPE kernel) and its selection and
        attention msa_select_triton / msa_attention(_lse)_triton. They launch Triton on CUDA tensors or under
        TRITON_INTERPRET=1 and run the references elsewhere. Same results within the kernels' tolerance.
        False also drops the kept index weights. The switch of the model: set module flags through it (or
        `using_kernels`), which remembers the setting."""
        for module in self.modules():
            if isinstance(module, (Attention, RMSNorm)):
                module.kernels = enabled
        if not enabled:
            self.drop_kept_weights()
        self._kernels = enabled

    def drop_kept_weights(self) -> None:
        """Forget every layer's kept [W_qi; W_ki] (Attention.fused_index_weight), so that the next forward reads the
        index weights as they are now. Needed after weights change in place without a version bump: a fused
        optimizer's step (torch.optim.AdamW(fused=True), the distillation's) changes neither version counter nor
        storage, so the kept concatenation would go on serving the weights of before."""
        for module in self.modules():
            if isinstance(module, Attention):
                module._index_weight = None

    @contextlib.contextmanager
    def using_kernels(self, enabled: bool):
        """set_kernels(enabled) inside the block, each module's own setting restored after (the kept index
        weights stay: the next block with kernels on reuses them). A no-op where the model is already so set."""
        if self._kernels == enabled:
            yield
            return
        kept = [(m, m.kernels) for m in self.modules() if isinstance(m, (Attention, RMSNorm))]
        before = self._kernels
        for m, _ in kept:
            m.kernels = enabled
        self._kernels = enabled
        try:
            yield
        finally:
            for m, k in kept:
                m.kernels = k
            self._kernels = before

    def set_selection(self, selection: Selection) -> None:
        """How sparse MSA layers pick their blocks: "index" (the index branch) or "oracle" (each layer's dense
        attention's own top-k blocks, from that layer's q/k in this forward; MSA_SPEC section 2's forced blocks kept)."""
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
