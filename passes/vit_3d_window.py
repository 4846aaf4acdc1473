"""vit_3d_window: per-frame ViT attention -> 3D windowed attention across frames (docs/msa.md section 6).

In a traced vision tower every attention op is `segment_attention(q, k, v, cu_seqlens, scale)`: bidirectional
attention inside the segments that `cu_seqlens` cuts the packed patch sequence into. The per-frame (2D) ViT takes
its segments from `frame_segments(grid_thw)`: one per temporal step, so frames never meet. The pass finds the
attention ops fed by frame segments and feeds them `window_segments(grid_thw, W)` instead: consecutive windows of
at most W temporal steps of the same video (an image is one step), derived from the video grid, with no attention
across windows. W = 1 is the per-frame model exactly; running the pass again with the same W changes nothing.
"""
from __future__ import annotations

import torch.fx

from m3compile.errors import M3CompileError
from m3compile.graph.pass_manager import Pass, PassReport, register_pass
from m3compile.ops import frame_segments, is_op, op_args, segment_attention, set_op_arg, window_segments

__all__ = ["ViT3DWindow"]


def _attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_op(n, segment_attention)]


@register_pass
class ViT3DWindow(Pass):
    """Rewrite per-frame ViT attention into 3D windows of at most W temporal steps (no attention across windows)."""

    name = "vit_3d_window"

    def __init__(self, window: int = 4):
        if window < 1:
            raise M3CompileError(f"the 3D window must hold >= 1 temporal step, got {window}")
        self.window = window

    def requires(self, gm: torch.fx.GraphModule) -> None:
        if not _attention_nodes(gm):
            raise M3CompileError("no ViT attention (segment_attention) in the graph: nothing to window")

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        report = PassReport(self.name)
        g = gm.graph
        rewritten: dict[torch.fx.Node, torch.fx.Node] = {}  # segments node -> its windowed replacement
        for att in _attention_nodes(gm):
            seg = op_args(att)["segments"]
            if not isinstance(seg, torch.fx.Node) or seg.op != "call_function":
                raise M3CompileError(f"{att.name}: its segments do not come from the video grid")
            if seg in rewritten.values():
                report.replaced += 1
            elif seg.target is frame_segments:
                with g.inserting_after(seg):
                    rewritten[seg] = g.call_function(window_segments, (), dict(
                        grid_thw=op_args(seg)["grid_thw"], window=self.window))
                seg.replace_all_uses_with(rewritten[seg])
                report.replaced += 1
            elif seg.target is window_segments and op_args(seg)["window"] != self.window:
                set_op_arg(seg, "window", self.window)
                rewritten[seg] = seg
                report.replaced += 1
        for old in rewritten:
            if old not in rewritten.values():
                g.erase_node(old)
        for att in _attention_nodes(gm):
            report.details.append(f"{att.name}: per-frame -> 3D windows of <= {self.window} temporal steps")
        report.modified = bool(report.replaced)
        return report

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        for att in _attention_nodes(gm):
            seg = op_args(att)["segments"]
            assert is_op(seg, window_segments) and op_args(seg)["window"] == self.window, f"{att.name} is not windowed"
