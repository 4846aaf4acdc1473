"""fuse_msa: one node per MSA layer for export, torch.ops.m3compile.msa (ONNX: the custom node m3compile::MSA).

    msa_select(q_idx, k_idx, ...) -> blocks -> msa_attention(q, k, v, blocks, ...)
        ==>  msa(q, k, v, q_idx, k_idx, block_size, topk, init_blocks, local_blocks, scale, top_p, min_blocks)

It runs on the reference inference graph (after strip_kl_distill, never on a lowered graph): the export's
translation table turns the fused op into the ONNX node whose function body is standard operators. A layer that
scores its index in fp8 (index_dtype "fp8") is refused: the ONNX node has no fp8 scoring.
"""
from __future__ import annotations

import torch.fx

from m3compile.errors import M3CompileError
from m3compile.graph.matching import msa_nodes
from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.ops import msa_fused, op_args

__all__ = ["FuseMSA"]


@register_pass
class FuseMSA(Pass):
    """Replace each msa_select + msa_attention pair by one torch.ops.m3compile.msa node (what ONNX export emits)."""

    name = "fuse_msa"
    stage = "lower"

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        g = gm.graph
        for n in msa_nodes(gm):
            att = op_args(n)
            select = att["blocks"]
            sel = op_args(select)
            if sel["index_dtype"] != "auto":
                raise M3CompileError(f"{select.name}: index scoring in {sel['index_dtype']} has no ONNX form (the "
                                     "m3compile::MSA node scores in the model's dtype); export a model converted "
                                     "without --index-dtype fp8")
            with g.inserting_before(n):
                fused = g.call_function(msa_fused, (
                    att["q"], att["k"], att["v"], sel["q_idx"], sel["k_idx"], att["block_size"], sel["topk"],
                    sel["init_blocks"], sel["local_blocks"], att["scale"], float(sel["top_p"]), sel["min_blocks"]))
            n.replace_all_uses_with(fused)
            g.erase_node(n)
            if not select.users:
                g.erase_node(select)
            report.replaced += 1
            report.details.append(f"{fused.name}: msa_select + msa_attention -> m3compile::msa")
        report.modified = bool(report.replaced)
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        assert not msa_nodes(gm), "msa_attention left after fuse_msa"
