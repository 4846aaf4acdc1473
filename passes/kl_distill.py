"""kl_distill: add the index-branch distillation hooks (docs/msa.md section 4) to a converted graph, and remove them.

    msa_select(q_idx, k_idx) -> blocks --> msa_attention(q, k, v, blocks)          (inference graph)
    becomes
    msa_select(q_idx, k_idx) -> blocks --> msa_attention_lse(q, k, v, blocks) -> out, lse, csr
                                     \\--> msa_index_kl(q, k, q_idx, k_idx, blocks, teacher_lse=lse, csr=csr)
                                            -> (kl, recall) per layer
                                     \\--> msa_block_loss(q, k, q_idx, k_idx) -> block loss per layer (block_loss)
    output: logits  ->  (logits, kl [n_msa_layers], recall [n_msa_layers] [, block [n_msa_layers]])

The attention gives the hook its per-head log-sum-exp and the CSR of the selection where its kernel ran (lowered,
m3compile.ops.lowering): the KL's teacher normaliser and its kernel's layout come without an attention pass or a CSR
build of its own; the references give None and the hook computes what it needs.

Mode "warmup": the support of teacher and student is every visible key and the main branch runs dense attention
(the warm-up of a dense checkpoint); mode "sparse": the support is the selected blocks and the main branch is
sparse. With `block_loss`, each layer also gets the block-ranking loss (teacher block mass vs the index branch's
block-max scores, kernels/block_stats/naive.py: block_rank_kl; the same in both modes), returned as a fourth output;
the distillation weighs it (DistillConfig.block_loss). Running the pass again with the other mode switches the mode;
the `strip_kl_distill` pass undoes it exactly: the graph's code is again the inference graph's.

`drop_logits` is for a graph whose logits nobody reads (distillation trains the index branch on the hooks' outputs
alone): the output's logits become None and dead code is removed, so the step no longer runs the lm head (at 32K
tokens with a 151,936-token vocabulary: 8.9 TFLOP and a 10 GB bf16 logits tensor per sequence for Qwen2.5-0.5B's
width), the final norm, or the last layer's o_proj and MLP. Such a graph cannot be stripped back.
`hidden_output` is for a step that makes the next-token loss itself: the output's logits become the lm head's input
(the final norm's output), and the step applies the returned head a few thousand tokens at a time
(m3compile.train.lm_loss), so no step holds the whole [T, vocabulary] logits. Such a graph cannot be stripped back
either.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from m3compile.errors import M3CompileError
from m3compile.graph.matching import msa_layer, msa_nodes
from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.ops import is_op, msa_attention, msa_attention_lse, msa_block_loss, msa_index_kl, msa_select, op_args, \
    set_op_arg

__all__ = ["KLDistill", "StripKLDistill", "KLHook", "DistillGraph", "MODES", "drop_logits", "hidden_output"]

MODES = ("warmup", "sparse")


@dataclass(frozen=True)
class KLHook:
    """node.meta["m3_kl_hook"] of a hooked attention node (msa_attention_lse after the pass): its layer and its
    `sparse` flag before the pass."""

    layer: int
    sparse_before: bool
    kl_node: str
    block_node: str | None = None  # its msa_block_loss node (with block_loss)


@dataclass
class DistillGraph:
    """gm.meta["m3_kl_distill"]: the hooked layers in output order, the mode, and the output before the pass."""

    mode: str
    layers: list[int]
    output_before: tuple
    block_loss: bool = False  # the output carries the block-ranking loss per layer
    logits: bool = True  # False after drop_logits (the output's first item is None) or hidden_output (the hidden
    #                      state the lm head would read): the lm head node is gone


@register_pass
class KLDistill(Pass):
    """Add KL-distillation hooks: teacher and student distributions per (KV group, token), the loss and recall per layer.

    The graph then returns (logits, kl, recall), kl and recall holding one mean per MSA layer in graph order, and
    with `block_loss` (logits, kl, recall, block), block the block-ranking loss per layer (msa_block_loss).
    Requires: MSA layers (run gqa_to_msa first). Running it again switches the mode or changes nothing (a hooked
    graph keeps the block loss it was hooked with).
    """

    name = "kl_distill"
    stage = "distil"
    revisits = True  # on a hooked graph it only switches the mode

    def __init__(self, mode: str = "warmup", block_loss: bool = False):
        if mode not in MODES:
            raise M3CompileError(f"unknown distillation mode {mode!r} (use {' or '.join(MODES)})")
        self.mode = mode
        self.block_loss = block_loss

    def requires(self, gm: torch.fx.GraphModule) -> None:
        if gm.meta.get("m3_kl_distill") is not None:
            return
        if not msa_nodes(gm):
            raise M3CompileError("the graph has no MSA layers to distil (convert the model first)")

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        state: DistillGraph | None = gm.meta.get("m3_kl_distill")
        if state is not None:
            if state.block_loss != self.block_loss:
                raise M3CompileError(f"the graph's distillation hooks were added with block_loss={state.block_loss}: "
                                     "strip them (strip_kl_distill) before hooking with block_loss="
                                     f"{self.block_loss}")
            if state.mode != self.mode:
                report.details.append(f"mode {state.mode} -> {self.mode}")
                _set_mode(gm, self.mode)
                report.modified = True
            return report
        g = gm.graph
        kls, recalls, blocks, layers = [], [], [], []
        for n in msa_nodes(gm):
            att = op_args(n)
            select = att["blocks"]
            if not is_op(select, msa_select):
                raise M3CompileError(f"{n.name}: block ids do not come from msa_select")
            sel = op_args(select)
            sparse = att["sparse"]
            n.target = msa_attention_lse  # (out, lse, csr): out to the layer, lse and csr to the hook
            with g.inserting_after(n):
                out = g.call_function(operator.getitem, (n, 0))
            n.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
            with g.inserting_after(out):
                lse = g.call_function(operator.getitem, (n, 1))
            with g.inserting_after(lse):
                csr = g.call_function(operator.getitem, (n, 2))
            with g.inserting_after(csr):
                hook = g.call_function(msa_index_kl, (), dict(
                    q=att["q"], k=att["k"], q_idx=sel["q_idx"], k_idx=sel["k_idx"], blocks=select,
                    block_size=att["block_size"], scale=att["scale"], sparse=self.mode == "sparse", teacher_lse=lse,
                    csr=csr, adaptive=att["adaptive"]))
            with g.inserting_after(hook):
                kl = g.call_function(operator.getitem, (hook, 0))
            with g.inserting_after(kl):
                recall = g.call_function(operator.getitem, (hook, 1))
            block = None
            if self.block_loss:
                with g.inserting_after(recall):
                    block = g.call_function(msa_block_loss, (), dict(
                        q=att["q"], k=att["k"], q_idx=sel["q_idx"], k_idx=sel["k_idx"], block_size=att["block_size"],
                        scale=att["scale"], topk=sel["topk"], init_blocks=sel["init_blocks"],
                        local_blocks=sel["local_blocks"]))
                blocks.append(block)
            n.meta["m3_kl_hook"] = KLHook(msa_layer(n), sparse, hook.name, None if block is None else block.name)
            set_op_arg(n, "sparse", self.mode == "sparse" and sparse)
            kls.append(kl)
            recalls.append(recall)
            layers.append(msa_layer(n))
            report.replaced += 1
            report.details.append(f"layer {layers[-1]}: KL hook ({self.mode} support)"
                                  + (" + block-ranking loss" if self.block_loss else ""))
        out = g.output_node()
        before = out.args
        with g.inserting_before(out):
            stacks = [g.call_function(torch.stack, (rows,)) for rows in ([kls, recalls] + [blocks] * self.block_loss)]
        out.args = ((before[0], *stacks),)
        gm.meta["m3_kl_distill"] = DistillGraph(self.mode, layers, before, self.block_loss)
        report.modified = True
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        state = gm.meta["m3_kl_distill"]
        hooks = list(_hooks(gm))  # by the hooks' records: also on a lowered graph
        assert len(state.layers) == len(hooks), "every MSA layer has a KL hook"
        assert all(op_args(kl)["sparse"] == (state.mode == "sparse") for _, _, kl in hooks), "hooks in the mode"
        assert all((hook.block_node is not None) == state.block_loss for _, hook, _ in hooks), "block-loss nodes"


def drop_logits(gm: torch.fx.GraphModule) -> int:
    """Return None instead of the logits from a hooked graph and remove the code that only they needed (the lm head,
    the final norm, the last layer's o_proj and MLP); returns how many nodes went. The hooks' outputs (KL, recall,
    block loss) and their gradients are unchanged. Irreversible: strip_kl_distill refuses the graph afterwards."""
    state: DistillGraph | None = gm.meta.get("m3_kl_distill")
    if state is None:
        raise M3CompileError("drop_logits needs a graph with distillation hooks (run kl_distill first)")
    if not state.logits:
        return 0
    g = gm.graph
    out = g.output_node()
    before = len(g.nodes)
    out.args = ((None, *out.args[0][1:]),)
    for n in reversed(g.nodes):  # dead-code elimination that keeps the hooked attention nodes (their records)
        if n.op not in ("placeholder", "output") and not n.users and not n.is_impure() and "m3_kl_hook" not in n.meta:
            g.erase_node(n)
    g.lint()
    gm.recompile()
    state.logits = False
    return before - len(g.nodes)


def hidden_output(gm: torch.fx.GraphModule) -> torch.nn.Linear:
    """Return the lm head's input (the final hidden state, [batch, T, hidden]) in place of the logits from a hooked
    graph, remove the lm head's node, and return the head (the module itself: its weight stays the graph's
    parameter, tied to the embeddings where the model ties them). Irreversible: strip_kl_distill refuses the graph
    afterwards."""
    state: DistillGraph | None = gm.meta.get("m3_kl_distill")
    if state is None:
        raise M3CompileError("hidden_output needs a graph with distillation hooks (run kl_distill first)")
    if not state.logits:
        raise M3CompileError("the graph's logits are already dropped or replaced")
    g = gm.graph
    out = g.output_node()
    head = out.args[0][0]
    module = gm.get_submodule(head.target) if isinstance(head, torch.fx.Node) and head.op == "call_module" else None
    if not isinstance(module, torch.nn.Linear) or len(head.args) != 1 or head.kwargs or len(head.users) != 1:
        raise M3CompileError(f"hidden_output: the graph's logits do not come from one linear lm head ({head})")
    out.args = ((head.args[0], *out.args[0][1:]),)
    g.erase_node(head)
    g.lint()
    gm.recompile()
    state.logits = False
    return module


def _hooks(gm: torch.fx.GraphModule):
    """(attention node, its KLHook, its msa_index_kl node) for every hooked layer."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in list(gm.graph.nodes):  # by the hook's record
        hook = n.meta.get("m3_kl_hook")
        if hook is not None:
            yield n, hook, by_name[hook.kl_node]


def _set_mode(gm: torch.fx.GraphModule, mode: str) -> None:
    """Switch a hooked graph between warm-up (dense support, dense main branch) and sparse support."""
    for n, hook, kl in _hooks(gm):
        set_op_arg(kl, "sparse", mode == "sparse")
        set_op_arg(n, "sparse", mode == "sparse" and hook.sparse_before)
    gm.meta["m3_kl_distill"].mode = mode


@register_pass
class StripKLDistill(Pass):
    """Remove the KL-distillation hooks: the graph computes and returns exactly what it did before kl_distill."""

    name = "strip_kl_distill"
    stage = "distil"

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        state: DistillGraph | None = gm.meta.get("m3_kl_distill")
        if state is None:
            return report
        if not state.logits:
            raise M3CompileError("the graph's logits were dropped (drop_logits, hidden_output): its inference graph "
                                 "cannot be restored; trace the model again")
        del gm.meta["m3_kl_distill"]
        g = gm.graph
        out = g.output_node()
        stacks = list(out.args[0][1:])
        out.args = state.output_before
        for s in stacks:
            g.erase_node(s)
        by_name = {n.name: n for n in g.nodes}
        for n, hook, kl in list(_hooks(gm)):
            if hook.block_node is not None:
                g.erase_node(by_name[hook.block_node])
            for user in list(kl.users):
                g.erase_node(user)
            g.erase_node(kl)
            out = next(u for u in n.users if u.args[1] == 0)  # the attention's output; its lse and csr went
            for user in [u for u in n.users if u is not out]:
                g.erase_node(user)
            out.replace_all_uses_with(n)
            g.erase_node(out)
            n.target = msa_attention
            set_op_arg(n, "sparse", hook.sparse_before)
            del n.meta["m3_kl_hook"]
            report.replaced += 1
            report.details.append(f"layer {hook.layer}: KL hook removed")
        report.modified = True
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        assert not any("m3_kl_hook" in n.meta for n in gm.graph.nodes), "KL hooks left"
