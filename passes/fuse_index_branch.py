"""fuse_index_branch: one node per MSA layer for its index branch, on a lowered graph (one matmul + one kernel).

    x.detach() -> index_q_proj -> split_heads -> index_q_norm -> apply_index_rope -----------> q_idx
               \\-> index_k_proj -> split_heads -> index_k_norm -> apply_index_rope -> [:, :, 0] -> k_idx
    becomes
    x.detach() -> index_branch_triton(x, W_qi, W_ki, w_qn, w_kn, cos, sin) -> (q_idx, k_idx)

Matched from each msa_select's q_idx / k_idx along use-def links (the projections bias-free nn.Linear, the norms
Gemma RMSNorms with one eps, both RoPEs on the same tables, both projections on the same input); a layer that does
not fit keeps its nodes. The parameters stay where they are (the node reads them by get_attr), so the state dict,
training and checkpoints are unchanged. On CUDA the fused op is one matmul over both projections' weights and one
norm + RoPE kernel (forward and backward; kernels/norm_rope/) instead of ~60 ops and their backwards per layer;
elsewhere it runs the layer's own ops (kernels.norm_rope.naive). Runs after lower_triton.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn

from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.models.decoder import RMSNorm
from m3compile.ops import (
    apply_index_rope, apply_index_rope_triton, index_branch_triton, is_op, msa_select, msa_select_triton, op_args,
    split_heads,
)

__all__ = ["FuseIndexBranch"]

_ROPES = (apply_index_rope, apply_index_rope_triton)


def _head(gm: torch.fx.GraphModule, rope: torch.fx.Node, heads: int | None):
    """(rope, norm, split, projection) nodes and (projection input, weight name, norm weight name, eps, cos, sin,
    index rope rule) of one index head chain ending in `rope`, or None."""
    if not is_op(rope, *_ROPES):
        return None
    r = op_args(rope)
    norm = r["x"]
    if not (isinstance(norm, torch.fx.Node) and norm.op == "call_module"):
        return None
    norm_mod = gm.get_submodule(norm.target)
    if not isinstance(norm_mod, RMSNorm) or norm_mod.style != "gemma" or len(norm.args) != 1 or norm.kwargs:
        return None
    split = norm.args[0]
    if not is_op(split, split_heads):
        return None
    s = op_args(split)
    proj = s["x"]
    if not (isinstance(proj, torch.fx.Node) and proj.op == "call_module"):
        return None
    proj_mod = gm.get_submodule(proj.target)
    if not isinstance(proj_mod, nn.Linear) or proj_mod.bias is not None or len(proj.args) != 1 or proj.kwargs:
        return None
    if (heads is not None and s["n_heads"] != heads) or s["head_dim"] != norm_mod.weight.shape[0]:
        return None
    return (rope, norm, split, proj), (proj.args[0], f"{proj.target}.weight", f"{norm.target}.weight", norm_mod.eps,
                                       r["cos"], r["sin"], r.get("rope", "m3"))


@register_pass
class FuseIndexBranch(Pass):
    """Fuse each MSA layer's index branch (projections, Gemma norms, RoPE) into one node (one matmul + one kernel)."""

    name = "fuse_index_branch"
    stage = "lower"

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        g = gm.graph
        for select in [n for n in g.nodes if is_op(n, msa_select, msa_select_triton)]:
            sel = op_args(select)
            q_out, k_out = sel["q_idx"], sel["k_idx"]
            q = _head(gm, q_out, None)
            if q is None or not (k_out.op == "call_function" and k_out.target is operator.getitem
                                 and k_out.args[1] == (slice(None), slice(None), 0)):
                continue
            k = _head(gm, k_out.args[0], 1)
            if k is None:
                continue
            (x, wq, nq, eps, cos, sin, rope), (xk, wk, nk, eps_k, cos_k, sin_k, rope_k) = q[1], k[1]
            if (x, cos, sin, eps, rope) != (xk, cos_k, sin_k, eps_k, rope_k):
                continue
            with g.inserting_before(select):
                weights = [g.get_attr(name) for name in (wq, wk, nq, nk)]
                fused = g.call_function(index_branch_triton, (), dict(
                    x=x, q_weight=weights[0], k_weight=weights[1], q_norm_weight=weights[2],
                    k_norm_weight=weights[3], cos=cos, sin=sin, eps=eps, rope=rope))
                new_q = g.call_function(operator.getitem, (fused, 0))
                new_k = g.call_function(operator.getitem, (fused, 1))
            q_out.replace_all_uses_with(new_q)
            k_out.replace_all_uses_with(new_k)
            for n in (k_out, *k[0], *q[0]):  # consumers first
                if not n.users:
                    g.erase_node(n)
            report.replaced += 1
            report.details.append(f"{select.name}: index branch -> {index_branch_triton.__name__}")
        report.modified = bool(report.replaced)
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            if is_op(n, index_branch_triton):
                assert all(u.target is operator.getitem for u in n.users), "the fused branch's outputs are getitems"
