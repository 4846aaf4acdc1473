"""gqa_to_msa: replace causal GQA attention by MiniMax Sparse Attention (docs/msa.md sections 2-3)."""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn

from m3compile.config import MSAConfig, budget_words
from m3compile.errors import M3CompileError
from m3compile.graph.matching import AttentionMatch, find_attention, msa_nodes
from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.graph.tracing import propagate_shapes
from m3compile.models.decoder import MSALayerArgs, RMSNorm
from m3compile.kernels.norm_rope.index_rope import index_rope_rule
from m3compile.models.index_init import index_branch_weights
from m3compile.ops import index_branch, is_op, msa_attention, msa_select, op_args, set_op_arg

__all__ = ["GQAToMSA"]


@register_pass
class GQAToMSA(Pass):
    """Rewrite each chosen layer's causal GQA attention into MSA: index branch + per-group block-sparse attention.

    Adds, per converted layer, `index_q_proj` [Hkv*Di, hidden], `index_k_proj` [Di, hidden], `index_q_norm` and
    `index_k_norm` [Di] beside the layer's q/k/v projections (M3's names), initialised from the dense weights
    (models/index_init.py). The index branch is the model's own (models.decoder.Attention.project): one
    `index_branch` op on the detached input of the layer's projections (both index projections as one matmul, then
    per head the Gemma norm and the index RoPE from the main branch's tables, by the rule
    kernels/norm_rope/index_rope.py picks for the widths); then
    `msa_select` picks top-k blocks per KV group (scored as `index_dtype` says: the compute dtype, or fp8; with
    top_p < 1 the adaptive budget of docs/msa.md 2.8) and `msa_attention` replaces the attention op. The budget
    (top_p, min_blocks) is a setting of the selection, not of the weights: layers that were MSA already take the
    config's too.
    Layers listed in `dense_layers` keep dense attention. `moments` {layer: [hidden, hidden]}: the second moments
    of the layers' attention inputs on calibration data (m3compile/conversion/calibration.py), for the calibrated init; a layer
    without one gets the weight-only init. Requires: shapes propagated (done if missing).
    """

    name = "gqa_to_msa"

    def __init__(self, config: MSAConfig | None = None, moments: dict[int, torch.Tensor] | None = None):
        self.config = config or MSAConfig()
        self.moments = moments or {}
        self.layer_settings: dict[int, MSALayerArgs] = {}
        self.layer_changes: dict[int, str] = {}  # what the last call did to each matched layer (the report's lines)

    def requires(self, gm: torch.fx.GraphModule) -> None:
        if not any(n.op == "placeholder" for n in gm.graph.nodes):
            raise M3CompileError("the graph has no inputs")
        propagate_shapes(gm)

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        self.layer_changes = {}
        matches, failures = find_attention(gm)
        existing = msa_nodes(gm)
        for n in existing:  # the selection's budget is the config's on every MSA layer
            select = op_args(n)["blocks"]
            if select.target is msa_select:
                set_op_arg(select, "top_p", self.config.top_p)
                set_op_arg(select, "min_blocks", self.config.min_blocks)
                set_op_arg(n, "adaptive", self.config.top_p < 1)
        if not matches and not existing:
            why = f": {failures[0]}" if failures else " (no scaled_dot_product_attention or softmax found)"
            raise M3CompileError(f"no causal GQA attention found in the graph{why}")
        for m in matches:
            if m.layer in self.config.dense_layers:
                self.layer_changes[m.layer] = "kept dense (dense_layers)"
            else:
                self._rewrite(gm, m)
                report.replaced += 1
                s = self.layer_settings[m.layer]
                self.layer_changes[m.layer] = (
                    f"{m.form} attention -> MSA (Hq {m.n_heads}, Hkv {m.n_kv_heads}, "
                    f"index {s.index_heads}x{s.index_dim}{'' if s.index_rope == 'm3' else f' rope {s.index_rope}'}, "
                    f"block {s.block_size}, {budget_words(s.topk, s.top_p, s.min_blocks)})")
            report.details.append(f"layer {m.layer}: {self.layer_changes[m.layer]}")
        if report.replaced:
            gm.graph.eliminate_dead_code()
            gm.delete_all_unused_submodules()
        report.modified = bool(report.replaced)
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        for n in msa_nodes(gm):
            assert is_op(op_args(n)["blocks"], msa_select), f"{n.name}: block ids do not come from msa_select"

    def _rewrite(self, gm: torch.fx.GraphModule, m: AttentionMatch) -> None:
        cfg = self.config
        index_heads = cfg.index_heads or m.n_kv_heads
        if index_heads != m.n_kv_heads:
            raise M3CompileError(
                f"layer {m.layer}: index_heads ({index_heads}) must equal the KV head count ({m.n_kv_heads}): "
                "each KV group selects its own blocks"
            )
        index_dim = cfg.index_dim or m.head_dim
        # first: the init refuses an index dim it cannot fit (odd below the rotary width) before any setting is made
        weights = self._index_weights(gm, m, index_dim, self.moments.get(m.layer))
        # narrower than the rotary width: the index head's pairs turn at the model's lowest frequencies ("low"); M3's
        # own rule (the table cut to the index width) is no rotation there. Wider than a fully rotated head: every
        # index pair turns ("tile"), so the init can fit each dense pair's KV groups with more than one shared-key
        # rank (models/index_init.py)
        rope = index_rope_rule(m.head_dim, m.rope_dim, index_dim)
        settings = MSALayerArgs(index_heads, index_dim, cfg.block_size, cfg.topk, cfg.init_blocks, cfg.local_blocks,
                                cfg.index_dtype, rope, cfg.top_p, cfg.min_blocks, cfg.answer_budget,
                                cfg.answer_tokens, cfg.decode_budget)
        self.layer_settings[m.layer] = settings
        eps = getattr(gm.get_submodule(m.q_norm), "eps", 1e-6) if m.q_norm else 1e-6
        like = weights["index_q_proj.weight"]
        names = {}
        for leaf, module in (
            ("index_q_proj", _linear(weights["index_q_proj.weight"])),
            ("index_k_proj", _linear(weights["index_k_proj.weight"])),
            ("index_q_norm", RMSNorm(index_dim, eps, "gemma").to(device=like.device, dtype=like.dtype)),
            ("index_k_norm", RMSNorm(index_dim, eps, "gemma").to(device=like.device, dtype=like.dtype)),
        ):
            names[leaf] = f"{m.prefix}.{leaf}"
            gm.add_submodule(names[leaf], module)
        g = gm.graph
        with g.inserting_before(m.output):
            x = g.call_method("detach", (m.x,))
            weights = {leaf: g.get_attr(f"{name}.weight") for leaf, name in names.items()}
            index = g.call_function(index_branch, (), dict(
                x=x, q_weight=weights["index_q_proj"], k_weight=weights["index_k_proj"],
                q_norm_weight=weights["index_q_norm"], k_norm_weight=weights["index_k_norm"], cos=m.cos, sin=m.sin,
                eps=eps, rope=rope))
            q_idx = g.call_function(operator.getitem, (index, 0))
            k_idx = g.call_function(operator.getitem, (index, 1))
            blocks = g.call_function(msa_select, (), dict(
                q_idx=q_idx, k_idx=k_idx, block_size=cfg.block_size, topk=cfg.topk, init_blocks=cfg.init_blocks,
                local_blocks=cfg.local_blocks, index_dtype=cfg.index_dtype, top_p=cfg.top_p,
                min_blocks=cfg.min_blocks))
            out = g.call_function(msa_attention, (), dict(
                q=m.q, k=m.k, v=m.v, blocks=blocks, block_size=cfg.block_size, scale=m.scale, sparse=True,
                adaptive=cfg.top_p < 1))
        out.meta["m3_msa_layer"] = m.layer
        m.output.replace_all_uses_with(out)

    @staticmethod
    def _index_weights(gm: torch.fx.GraphModule, m: AttentionMatch, index_dim: int,
                       moment: torch.Tensor | None) -> dict[str, torch.Tensor]:
        norms = [gm.get_submodule(t) if t else None for t in (m.q_norm, m.k_norm)]
        style = next((getattr(n, "style", "rms") for n in norms if n is not None), "rms")
        return index_branch_weights(
            gm.get_submodule(m.q_proj).weight, gm.get_submodule(m.k_proj).weight, n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, rope_dim=m.rope_dim, index_dim=index_dim,
            q_norm=None if norms[0] is None else norms[0].weight, k_norm=None if norms[1] is None else norms[1].weight,
            norm_style=style, x_moment=moment,
        )


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.contiguous())
    return layer
