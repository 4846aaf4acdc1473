"""kl_distill: add the index-branch distillation hooks (MSA_SPEC section 4) to a converted graph, and remove them.

    msa_select(q_idx, k_idx) -> blocks --> msa_attention(q, k, v, blocks)          (inference graph)
                                     \\--> msa_index_kl(q, k, q_idx, k_idx, blocks) -> (kl, recall) per layer
    output: logits  ->  (logits, kl [n_msa_layers], recall [n_msa_layers])

Mode "warmup": the support of teacher and student is every visible key and the main branch runs dense attention
(the warm-up of a dense checkpoint); mode "sparse": the support is the selected blocks and the main branch is
sparse. `strip_kl_distill` undoes the pass exactly: the graph's code is again the inference graph's.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from kernels import reference as ref
from m3compile.errors import M3CompileError
from m3compile.matching import msa_layer, msa_nodes
from m3compile.pass_manager import Pass, PassReport, register_pass
from models.decoder import msa_select

__all__ = ["KLDistill", "KLHook", "DistillGraph", "msa_index_kl", "set_distill_mode", "strip_kl_distill", "MODES"]

MODES = ("warmup", "sparse")
_SPARSE_ARG = 6  # msa_attention(q, k, v, blocks, block_size, scale, sparse)


@torch.fx.wrap
def msa_index_kl(q, k, q_idx, k_idx, blocks, block_size: int, scale: float, sparse: bool):
    """Mean KL(teacher || student) and mean block recall of one MSA layer over (batch, group, token).

    q [B, Hq, T, D], k [B, Hkv, T, D], q_idx [B, T, Hi, Di], k_idx [B, T, Di], blocks [B, Hi, T, K] -> two scalars.
    """
    kl, recall = ref.index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=block_size, sparse=sparse,
                              scale=scale)
    return kl.mean(), recall.mean()


@dataclass(frozen=True)
class KLHook:
    """node.meta["m3_kl_hook"] of a hooked msa_attention node: its layer and its `sparse` flag before the pass."""

    layer: int
    sparse_before: bool
    kl_node: str


@dataclass
class DistillGraph:
    """gm.meta["m3_kl_distill"]: the hooked layers in output order, the mode, and the output before the pass."""

    mode: str
    layers: list[int]
    output_before: tuple


@register_pass
class KLDistill(Pass):
    """Add KL-distillation hooks: teacher and student distributions per (KV group, token), the loss and recall per layer.

    The graph then returns (logits, kl, recall), kl and recall holding one mean per MSA layer in graph order.
    Requires: MSA layers (run gqa_to_msa first). Running it again switches the mode or changes nothing.
    """

    name = "kl_distill"

    def __init__(self, mode: str = "warmup"):
        if mode not in MODES:
            raise M3CompileError(f"unknown distillation mode {mode!r} (use {' or '.join(MODES)})")
        self.mode = mode

    def requires(self, gm: torch.fx.GraphModule) -> None:
        if not msa_nodes(gm):
            raise M3CompileError("the graph has no MSA layers to distil (convert the model first)")

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        state: DistillGraph | None = gm.meta.get("m3_kl_distill")
        if state is not None:
            if state.mode != self.mode:
                set_distill_mode(gm, self.mode)
                report.modified = True
                report.details.append(f"mode {state.mode} -> {self.mode}")
            return report
        g = gm.graph
        kls, recalls, layers = [], [], []
        for n in msa_nodes(gm):
            select = n.args[3]
            if select.target is not msa_select:
                raise M3CompileError(f"{n.name}: block ids do not come from msa_select")
            q, k, _, blocks, block_size, scale, sparse = n.args
            with g.inserting_after(n):
                hook = g.call_function(msa_index_kl, (q, k, select.args[0], select.args[1], blocks, block_size, scale,
                                                      self.mode == "sparse"))
            with g.inserting_after(hook):
                kl = g.call_function(operator.getitem, (hook, 0))
            with g.inserting_after(kl):
                recall = g.call_function(operator.getitem, (hook, 1))
            n.meta["m3_kl_hook"] = KLHook(msa_layer(n), sparse, hook.name)
            n.update_arg(_SPARSE_ARG, self.mode == "sparse" and sparse)
            kls.append(kl)
            recalls.append(recall)
            layers.append(msa_layer(n))
            report.replaced += 1
            report.details.append(f"layer {layers[-1]}: KL hook ({self.mode} support)")
        out = g.output_node()
        before = out.args
        with g.inserting_before(out):
            kl_all = g.call_function(torch.stack, (kls,))
            recall_all = g.call_function(torch.stack, (recalls,))
        out.args = ((before[0], kl_all, recall_all),)
        gm.meta["m3_kl_distill"] = DistillGraph(self.mode, layers, before)
        report.modified = True
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        state = gm.meta["m3_kl_distill"]
        assert len(state.layers) == len(msa_nodes(gm)), "every MSA layer has a KL hook"


def _hooks(gm: torch.fx.GraphModule):
    """(msa_attention node, its KLHook, its msa_index_kl node) for every hooked layer."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in list(gm.graph.nodes):  # by the hook's record, so a lowered graph (other op targets) works too
        hook = n.meta.get("m3_kl_hook")
        if hook is not None:
            yield n, hook, by_name[hook.kl_node]


def set_distill_mode(gm: torch.fx.GraphModule, mode: str) -> None:
    """Switch a hooked graph between warm-up (dense support, dense main branch) and sparse support."""
    if mode not in MODES:
        raise M3CompileError(f"unknown distillation mode {mode!r} (use {' or '.join(MODES)})")
    state: DistillGraph | None = gm.meta.get("m3_kl_distill")
    if state is None:
        raise M3CompileError("the graph has no KL hooks (run the kl_distill pass first)")
    for n, hook, kl in _hooks(gm):
        kl.update_arg(7, mode == "sparse")
        n.update_arg(_SPARSE_ARG, mode == "sparse" and hook.sparse_before)
    state.mode = mode
    gm.recompile()


def strip_kl_distill(gm: torch.fx.GraphModule) -> bool:
    """Remove the hooks: the graph computes and returns exactly what it did before the pass. False if none."""
    state: DistillGraph | None = gm.meta.pop("m3_kl_distill", None)
    if state is None:
        return False
    g = gm.graph
    out = g.output_node()
    stacks = list(out.args[0][1:])
    out.args = state.output_before
    for s in stacks:
        g.erase_node(s)
    for n, hook, kl in list(_hooks(gm)):
        for user in list(kl.users):
            g.erase_node(user)
        g.erase_node(kl)
        n.update_arg(_SPARSE_ARG, hook.sparse_before)
        del n.meta["m3_kl_hook"]
    g.lint()
    gm.recompile()
    return True
