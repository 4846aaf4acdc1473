"""Lowering: swap a converted graph's reference MSA ops for the Triton-backed ones (m3compile.ops.LOWERING).

    msa_select(q_idx, k_idx, ...)      -> msa_select_triton     fused scores + causal block max + top-k
    msa_attention(q, k, v, blocks, ...) -> msa_attention_triton  gather-Q sparse prefill + LSE combine (+ backward)
    msa_index_kl(q, k, q_idx, ...)      -> msa_index_kl_triton   fused sparse-support KL (+ backward), streamed recall
    msa_block_loss(q, k, q_idx, ...)    -> msa_block_loss_triton fused per-block stats of the sampled rows, then the
                                                                  block-ranking loss (+ backward) in vectorised torch
    apply_rope / apply_index_rope       -> apply_rope_triton / apply_index_rope_triton   one RoPE kernel (+ backward)

A layer with a KL hook gets msa_attention_lse_triton instead, which also returns the attention's per-head
log-sum-exp and the CSR of the selection it walked; the hook takes them as its teacher's normaliser
(`teacher_lse`) and its kernel's layout (`csr`) instead of running an LSE pass and a CSR build itself:

    msa_attention_lse_triton(q, k, v, blocks, ...) -> (out, lse, csr);  out -> the layer;  lse, csr -> msa_index_kl_triton

The lowered ops take the same arguments and dispatch on the device: Triton kernels on CUDA tensors, the torch
reference on CPU, so a lowered graph still runs anywhere. Lowering is the last graph pass: distillation hooks
(kl_distill) are added before it (training lowers a hooked graph; set_distill_mode still switches it), and ONNX
export works on the reference ops and refuses a lowered graph.
"""
from __future__ import annotations

import operator

import torch.fx

from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.ops import (
    LOWERING, apply_index_rope_triton, apply_rope_triton, msa_attention_lse_triton, msa_attention_triton,
    msa_block_loss_triton, msa_index_kl_triton, set_op_arg,
)

__all__ = ["LowerTriton"]


@register_pass
class LowerTriton(Pass):
    """Swap the reference msa_select / msa_attention / msa_index_kl / msa_block_loss ops for Triton kernels (fused
    indexer, gather-Q prefill, fused sparse KL, fused block statistics)."""

    name = "lower_triton"
    stage = "lower"

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        g = gm.graph
        by_name = {n.name: n for n in g.nodes}
        ropes = 0
        for n in list(g.nodes):
            if n.op == "call_function" and n.target in LOWERING:
                n.target = LOWERING[n.target]
                if n.target in (apply_rope_triton, apply_index_rope_triton):
                    ropes += 1
                    continue
                report.replaced += 1  # the MSA ops
                layer = n.meta.get("m3_msa_layer")
                if layer is not None:
                    report.details.append(f"layer {layer}: msa_attention -> {msa_attention_triton.__name__}")
                elif n.target is msa_index_kl_triton:
                    report.details.append(f"{n.name}: msa_index_kl -> {msa_index_kl_triton.__name__}")
                elif n.target is msa_block_loss_triton:
                    report.details.append(f"{n.name}: msa_block_loss -> {msa_block_loss_triton.__name__}")
        for n in list(g.nodes):  # hooked layers: the attention's log-sum-exp feeds the KL's teacher
            hook = n.meta.get("m3_kl_hook")
            if hook is None or n.target is not msa_attention_triton:
                continue
            kl = by_name[hook.kl_node]
            n.target = msa_attention_lse_triton
            with g.inserting_after(n):
                out = g.call_function(operator.getitem, (n, 0))
            n.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
            with g.inserting_after(out):
                lse = g.call_function(operator.getitem, (n, 1))
            with g.inserting_after(lse):
                csr = g.call_function(operator.getitem, (n, 2))
            set_op_arg(kl, "teacher_lse", lse)
            set_op_arg(kl, "csr", csr)
            report.details.append(f"layer {n.meta.get('m3_msa_layer')}: KL teacher log-sum-exp and CSR from the "
                                  f"attention ({msa_attention_lse_triton.__name__})")
        if ropes:
            report.details.append(f"{ropes} RoPE nodes -> {apply_rope_triton.__name__}")
        report.modified = bool(report.replaced or ropes)
        gm.meta["m3_lowered"] = True
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        left = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in LOWERING]
        assert not left, f"reference MSA ops left after lowering: {left}"
