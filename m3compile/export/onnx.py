"""ONNX export of a converted model: input_ids -> logits, dynamic batch and sequence length.

Each MSA layer is one node `m3compile::MSA` (opset domain "m3compile", version 1) whose ONNX function body is made
of standard operators (index scores, causal block max, forced blocks, TopK, block mask, masked softmax
attention), so onnxruntime runs it as is and a runtime with a native MSA kernel can replace the node. The body is
the plain formulation (it materialises [T, T] scores, like the reference it mirrors), not a fast one.

    converted checkpoint -> load -> trace -> export pipeline (fuse_msa: msa_select + msa_attention
    -> torch.ops.m3compile.msa)
    -> torch.onnx.export (dynamo) with a translation that emits the custom node -> add the FunctionProto -> check

A multimodal (minimax_m3_vl) checkpoint also gets vision.onnx: pixel_values [N, C*tp*p*p], positions [N, 3] and
segment_ids [N] -> visual tokens [N / merge^2, text hidden] (models.vision.VisionExport: the ViT with its 3D-window
attention as a masked SDPA per layer, then the projector; `models.vision.onnx_vision_inputs(grid_thw, ...)` builds
positions and segment ids on the host), dynamic patch count. model.onnx is then the language model's
input_ids -> logits; the visual tokens replace the placeholder embeddings outside the two graphs.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from m3compile.errors import M3CompileError
from m3compile.graph.tracing import trace
from m3compile.io.output_dir import atomic_output_dir, check_output_dir
from m3compile.io.load import load
from m3compile.models.vision import MultimodalDecoder, VisionExport, onnx_vision_inputs, patchify
from m3compile.ops import msa_fused
from m3compile.pipelines import run_pipeline

__all__ = ["export_onnx", "MSA_DOMAIN"]

MSA_DOMAIN = "m3compile"
OPSET = 20


def export_onnx(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False,
                check: bool = True) -> Path:
    """Write OUT_DIR/model.onnx for the converted checkpoint in `model_dir` (fp32). Nothing is written on failure."""
    import onnx  # optional dependencies: pip install ".[onnx]"

    from m3compile.export.onnx_msa import MSA as function
    from m3compile.export.onnx_msa import translate

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_dir(out_dir, (model_dir,), force)
    model = load(model_dir, dtype="float32")  # raises a one-line error for anything that is not a checkpoint
    if model.args.msa is None and not (model_dir / "conversion_report.json").is_file():
        raise M3CompileError(f"{model_dir} was never converted: run m3c convert first (it has no MSA layers)")
    vision = _vision_proto(model) if isinstance(model, MultimodalDecoder) else None
    if vision is not None:
        model = model.language
    gm = trace(model)
    n_msa = run_pipeline("export", gm)[-1].replaced
    block = model.args.msa.block_size if model.args.msa else 16
    example = torch.zeros(2, 2 * block + 3, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("sequence", min=2)
    try:
        program = torch.onnx.export(
            gm, (example,), dynamo=True, opset_version=OPSET, input_names=["input_ids"], output_names=["logits"],
            dynamic_shapes=({0: batch, 1: seq},),
            custom_translation_table={msa_fused: translate}, verbose=False,
        )
    except Exception as e:
        raise M3CompileError(f"ONNX export failed: {str(e).splitlines()[0]}") from None
    proto = program.model_proto
    if n_msa:
        proto.functions.append(function.to_function_proto())
        if not any(o.domain == MSA_DOMAIN for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid(MSA_DOMAIN, 1))
    with atomic_output_dir(out_dir, force, inputs=(model_dir,)) as tmp:
        for name, p in (("model.onnx", proto), ("vision.onnx", vision)):
            if p is not None:
                onnx.save(p, str(tmp / name))
                if check:
                    onnx.checker.check_model(str(tmp / name), full_check=True)
    return out_dir / "model.onnx"


def _vision_proto(model):
    """vision.onnx's ModelProto for a MultimodalDecoder (see the module docstring)."""
    args = model.vision_args
    m = args.spatial_merge_size
    side = 2 * m * args.patch_size  # example: 2 images of 2m x 2m patches, 2 temporal steps each
    pixels, grid = patchify(torch.zeros(2 * args.temporal_patch_size, args.n_channels, side, side), args)
    pixels, grid = pixels.repeat(2, 1), grid.repeat(2, 1)
    positions, segments = onnx_vision_inputs(grid, args, model.vision_tower.window)
    merged = torch.export.Dim("merged_tokens", min=1)
    try:
        program = torch.onnx.export(
            VisionExport(model).eval(), (pixels, positions, segments), dynamo=True, opset_version=OPSET,
            input_names=["pixel_values", "positions", "segment_ids"], output_names=["visual_tokens"],
            dynamic_shapes=({0: merged * m * m}, {0: merged * m * m}, {0: merged * m * m}), verbose=False,
        )
    except Exception as e:
        raise M3CompileError(f"ONNX export of the vision tower failed: {str(e).splitlines()[0]}") from None
    return program.model_proto
