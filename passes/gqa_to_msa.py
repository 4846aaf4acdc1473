"""gqa_to_msa: replace causal GQA attention by MiniMax Sparse Attention (MSA_SPEC sections 2-3)."""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn

from m3compile.config import MSAConfig
from m3compile.errors import M3CompileError
from m3compile.index_init import init_index_weights
from m3compile.matching import AttentionMatch, find_attention, msa_nodes
from m3compile.pass_manager import Pass, PassReport, register_pass
from m3compile.tracing import propagate_shapes
from models.decoder import MSALayerArgs, RMSNorm, apply_rope, msa_attention, msa_select, split_heads

__all__ = ["GQAToMSA"]


@register_pass
class GQAToMSA(Pass):
    """Rewrite each chosen layer's causal GQA attention into MSA: index branch + per-group block-sparse attention.

    Adds, per converted layer, `index_q_proj` [Hkv*Di, hidden], `index_k_proj` [Di, hidden], `index_q_norm` and
    `index_k_norm` [Di] beside the layer's q/k/v projections (M3's names), initialised from the dense weights
    (m3compile.index_init). The index branch reads the detached input of the projections, applies the main
    branch's RoPE, and `msa_select` picks top-k blocks per KV group; `msa_attention` replaces the attention op.
    Layers listed in `dense_layers` keep dense attention. Requires: shapes propagated (done if missing).
    """

    name = "gqa_to_msa"

    def __init__(self, config: MSAConfig | None = None):
        self.config = config or MSAConfig()
        self.layer_settings: dict[int, MSALayerArgs] = {}

    def requires(self, gm: torch.fx.GraphModule) -> None:
        if not any(n.op == "placeholder" for n in gm.graph.nodes):
            raise M3CompileError("the graph has no inputs")
        propagate_shapes(gm)

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        matches, failures = find_attention(gm)
        existing = len(msa_nodes(gm))
        if not matches and not existing:
            why = f": {failures[0]}" if failures else " (no scaled_dot_product_attention or softmax found)"
            raise M3CompileError(f"no causal GQA attention found in the graph{why}")
        for m in matches:
            if m.layer in self.config.dense_layers:
                report.details.append(f"layer {m.layer}: kept dense (dense_layers)")
                continue
            self._rewrite(gm, m)
            report.replaced += 1
            s = self.layer_settings[m.layer]
            report.details.append(
                f"layer {m.layer}: {m.form} attention -> MSA (Hq {m.n_heads}, Hkv {m.n_kv_heads}, "
                f"index {s.index_heads}x{s.index_dim}, block {s.block_size}, top-k {s.topk})"
            )
        if report.replaced:
            gm.graph.eliminate_dead_code()
            gm.delete_all_unused_submodules()
        report.modified = bool(report.replaced)
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        for n in msa_nodes(gm):
            assert n.args[3].target is msa_select, f"{n.name}: block ids do not come from msa_select"

    def _rewrite(self, gm: torch.fx.GraphModule, m: AttentionMatch) -> None:
        cfg = self.config
        index_heads = cfg.index_heads or m.n_kv_heads
        if index_heads != m.n_kv_heads:
            raise M3CompileError(
                f"layer {m.layer}: index_heads ({index_heads}) must equal the KV head count ({m.n_kv_heads}): "
                "each KV group selects its own blocks"
            )
        index_dim = cfg.index_dim or m.head_dim
        settings = MSALayerArgs(index_heads, index_dim, cfg.block_size, cfg.topk, cfg.init_blocks, cfg.local_blocks)
        self.layer_settings[m.layer] = settings
        wq_idx, wk_idx = self._init_weights(gm, m, index_dim)
        eps = getattr(gm.get_submodule(m.q_norm), "eps", 1e-6) if m.q_norm else 1e-6
        names = {}
        for leaf, module in (
            ("index_q_proj", _linear(wq_idx)),
            ("index_k_proj", _linear(wk_idx)),
            ("index_q_norm", RMSNorm(index_dim, eps, "gemma").to(device=wq_idx.device, dtype=wq_idx.dtype)),
            ("index_k_norm", RMSNorm(index_dim, eps, "gemma").to(device=wq_idx.device, dtype=wq_idx.dtype)),
        ):
            names[leaf] = f"{m.prefix}.{leaf}"
            gm.add_submodule(names[leaf], module)
        g = gm.graph
        with g.inserting_before(m.output):
            x = g.call_method("detach", (m.x,))
            q_idx = g.call_module(names["index_q_proj"], (x,))
            k_idx = g.call_module(names["index_k_proj"], (x,))
            q_idx = g.call_function(split_heads, (q_idx, index_heads, index_dim))
            k_idx = g.call_function(split_heads, (k_idx, 1, index_dim))
            q_idx = g.call_module(names["index_q_norm"], (q_idx,))
            k_idx = g.call_module(names["index_k_norm"], (k_idx,))
            q_idx = g.call_function(apply_rope, (q_idx, m.cos, m.sin))
            k_idx = g.call_function(apply_rope, (k_idx, m.cos, m.sin))
            k_idx = g.call_function(operator.getitem, (k_idx, (slice(None), slice(None), 0)))
            blocks = g.call_function(
                msa_select, (q_idx, k_idx, cfg.block_size, cfg.topk, cfg.init_blocks, cfg.local_blocks)
            )
            out = g.call_function(msa_attention, (m.q, m.k, m.v, blocks, cfg.block_size, m.scale, True))
        out.meta["m3_msa_layer"] = m.layer
        m.output.replace_all_uses_with(out)

    @staticmethod
    def _init_weights(gm: torch.fx.GraphModule, m: AttentionMatch, index_dim: int):
        def norm_scale(target):
            if target is None:
                return None
            norm = gm.get_submodule(target)
            w = norm.weight.detach()
            return (1.0 + w.float()) if getattr(norm, "style", "rms") == "gemma" else w.float()

        with torch.no_grad():
            return init_index_weights(
                gm.get_submodule(m.q_proj).weight.detach(), gm.get_submodule(m.k_proj).weight.detach(),
                n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, rope_dim=m.rope_dim,
                index_dim=index_dim, q_scale=norm_scale(m.q_norm), k_scale=norm_scale(m.k_norm),
            )


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.contiguous())
    return layer
