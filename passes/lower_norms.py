"""lower_norms: every RMSNorm module call of a lowered graph becomes one fused kernel where no gradient is needed.

    call_module model.layers.3.input_layernorm(x)  ->  rms_norm_triton(x, get_attr(...weight), eps, style)

The reference RMSNorm is six to eight ops per call (upcast, square, mean, rsqrt, two products, downcast); the
frozen backbone of a distillation step calls it twice per layer. rms_norm_triton runs the kernel only where
neither x nor the weight needs a gradient (distillation's frozen backbone, inference) and the module's own formula
elsewhere (training the backbone), so the pass is safe on any lowered graph. The parameters stay in their
modules (read by get_attr). Runs after fuse_index_branch, which matches the index norms as modules.
"""
from __future__ import annotations

import torch.fx

from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.models.decoder import RMSNorm
from m3compile.ops import rms_norm_triton

__all__ = ["LowerNorms"]


@register_pass
class LowerNorms(Pass):
    """Swap RMSNorm module calls for rms_norm_triton (one kernel where no gradient is needed)."""

    name = "lower_norms"
    stage = "lower"

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        g = gm.graph
        for n in list(g.nodes):
            if n.op != "call_module" or len(n.args) != 1 or n.kwargs:
                continue
            mod = gm.get_submodule(n.target)
            if not isinstance(mod, RMSNorm):
                continue
            with g.inserting_before(n):
                weight = g.get_attr(f"{n.target}.weight")
                fused = g.call_function(rms_norm_triton, (n.args[0], weight, mod.eps, mod.style))
            fused.meta = dict(n.meta)
            n.replace_all_uses_with(fused)
            g.erase_node(n)
            report.replaced += 1
        if report.replaced:
            report.details.append(f"{report.replaced} RMSNorm calls -> {rms_norm_triton.__name__}")
        report.modified = bool(report.replaced)
        return report
