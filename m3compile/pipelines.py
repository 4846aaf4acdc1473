"""The pipelines, declared once: which registered passes run, in which order, for each job; and lowering.

    convert   gqa_to_msa                   dense GQA attention -> MSA (index branch + selection; calibrated init when
                                           given attention-input moments)
    vision    vit_3d_window                a ViT's per-frame attention -> 3D windows
    distill   kl_distill                   KL hooks for the index branch (+ the block-ranking loss)
    export    strip_kl_distill -> fuse_msa one torch.ops.m3compile.msa node per layer (ONNX)

The pass manager enforces the stage order (rewrite -> distil -> lower). Lowering rewrites no graph: every graph op
carries its lowering (m3compile.ops.LOWERING), and `lower(model)` wraps a model, eager or traced, so that it runs
inside the ops' switch (m3compile.ops.lowering): the one place that decides which kernel an op runs.
m3compile.conversion runs the convert pipeline (in memory and streaming).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from m3compile.errors import M3CompileError
from m3compile.graph.matching import msa_nodes
from m3compile.graph.pass_manager import Pass, PassManager, PassReport
from m3compile.models.decoder import Attention
from m3compile.ops import lowering
from m3compile.passes import FuseMSA, GQAToMSA, KLDistill, StripKLDistill, ViT3DWindow

__all__ = ["PIPELINES", "pipeline", "run_pipeline", "lower", "Lowered"]


PIPELINES: dict[str, Callable[..., list[Pass]]] = {
    "convert": lambda config=None, moments=None: [GQAToMSA(config, moments)],
    "vision": lambda window=4: [ViT3DWindow(window)],
    "distill": lambda mode="warmup", block_loss=False: [KLDistill(mode, block_loss)],
    "export": lambda: [StripKLDistill(), FuseMSA()],
}


def pipeline(name: str, **options) -> PassManager:
    """The PassManager of one declared pipeline; `options` go to its passes (see PIPELINES)."""
    if name not in PIPELINES:
        raise M3CompileError(f"unknown pipeline {name!r} (pipelines: {', '.join(PIPELINES)})")
    return PassManager(PIPELINES[name](**options))


def run_pipeline(name: str, gm: torch.fx.GraphModule, **options) -> list[PassReport]:
    return pipeline(name, **options).run(gm)


class Lowered(torch.nn.Module):
    """A model that runs its graph ops' lowerings: the Triton kernels on CUDA tensors (and under TRITON_INTERPRET=1),
    the references elsewhere. Its forward is the wrapped model's, inside m3compile.ops.lowering(); the parameters,
    the state dict and any graph are the model's own."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with lowering():
            return self.model(*args, **kwargs)


def lower(model: torch.nn.Module, require_msa: bool = True) -> Lowered:
    """The model (a Decoder, its Backbone, or a traced or converted GraphModule) running the lowered ops (Lowered).
    `require_msa` False also lowers a dense model (its RoPE and norms: the fair dense baseline of a benchmark)."""
    if isinstance(model, Lowered):
        return model
    if require_msa:
        if isinstance(model, torch.fx.GraphModule):
            has_msa = bool(msa_nodes(model))
        else:
            has_msa = any(isinstance(m, Attention) and m.msa is not None for m in model.modules())
        if not has_msa:
            raise M3CompileError("the model has no MSA layer to lower (convert it first)")
    return Lowered(model)
