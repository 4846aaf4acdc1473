"""The pipelines, declared once: which registered passes run, in which order, for each job.

    convert   gqa_to_msa                                   dense GQA attention -> MSA (index branch + selection;
                                                           calibrated init when given attention-input moments)
    vision    vit_3d_window                                a ViT's per-frame attention -> 3D windows
    distill   kl_distill [-> the lower passes on CUDA]     KL hooks for the index branch (+ the block-ranking loss),
                                                           then the Triton kernels (sharded with FSDP2: lower_triton
                                                           only, no fusions)
    lower     lower_triton -> fuse_index_branch -> lower_norms   reference ops -> Triton-backed ops (last)
    export    strip_kl_distill -> fuse_msa                 one torch.ops.m3compile.msa node per layer (ONNX)

The pass manager enforces the stage order (rewrite -> distil -> lower). `lower(model)` is the in-memory verb built
on them; m3compile.conversion runs the convert pipeline (in memory and streaming).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from m3compile.errors import M3CompileError
from m3compile.graph.pass_manager import Pass, PassManager, PassReport
from m3compile.graph.tracing import trace
from m3compile.models.decoder import Decoder
from m3compile.passes import (
    FuseIndexBranch, FuseMSA, GQAToMSA, KLDistill, LowerNorms, LowerTriton, StripKLDistill, ViT3DWindow,
)

__all__ = ["PIPELINES", "pipeline", "run_pipeline", "lower"]

def _lowering(fused: bool = True) -> list[Pass]:
    """The lowering passes; `fused` False keeps the module calls (FSDP2 all-gathers a module's shard around its
    call: the fusions' get_attr reads of norm and index weights would see the shards)."""
    return [LowerTriton()] + ([FuseIndexBranch(), LowerNorms()] if fused else [])


PIPELINES: dict[str, Callable[..., list[Pass]]] = {
    "convert": lambda config=None, moments=None: [GQAToMSA(config, moments)],
    "vision": lambda window=4: [ViT3DWindow(window)],
    "distill": lambda mode="warmup", lowered=False, fused=True, block_loss=False: (
        [KLDistill(mode, block_loss)] + (_lowering(fused) if lowered else [])),
    "lower": lambda: _lowering(),
    "export": lambda: [StripKLDistill(), FuseMSA()],
}


def pipeline(name: str, **options) -> PassManager:
    """The PassManager of one declared pipeline; `options` go to its passes (see PIPELINES)."""
    if name not in PIPELINES:
        raise M3CompileError(f"unknown pipeline {name!r} (pipelines: {', '.join(PIPELINES)})")
    return PassManager(PIPELINES[name](**options))


def run_pipeline(name: str, gm: torch.fx.GraphModule, **options) -> list[PassReport]:
    return pipeline(name, **options).run(gm)


def lower(model: torch.nn.Module, require_msa: bool = True) -> torch.fx.GraphModule:
    """The model (a converted GraphModule, or a Decoder loaded from a converted checkpoint) with its MSA ops lowered
    to the Triton kernels (passes/lower_triton.py). The result runs Triton on CUDA and the torch reference on CPU.
    `require_msa` False also lowers a dense model (its RoPE and norms: the fair dense baseline of a benchmark)."""
    gm = model if isinstance(model, torch.fx.GraphModule) else trace(model)
    if isinstance(model, Decoder):
        gm.meta["model_args"] = model.args
    report = run_pipeline("lower", gm)[0]
    if require_msa and not report.replaced:
        raise M3CompileError("the model has no MSA layer to lower (convert it first)")
    gm.meta["lowering"] = report
    return gm
