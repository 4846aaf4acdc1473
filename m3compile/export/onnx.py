"""ONNX export of a converted model: input_ids -> logits, dynamic batch and sequence length.

Each MSA layer is one node `m3compile::MSA` (opset domain "m3compile", version 1) whose ONNX function body is made
of standard operators (index scores, causal block max, forced blocks, TopK, block mask, masked softmax
attention), so onnxruntime runs it as is and a runtime with a native MSA kernel can replace the node. The body is
the plain formulation (it materialises [T, T] scores, like the reference it mirrors), not a fast one, and computes
in fp32 whatever the model's dtype.

    checks before the work (dtype / provider pair, never converted, room on disk, never-external model too large)
    -> converted checkpoint -> load (in the export dtype) -> trace -> export pipeline (fuse_msa: msa_select +
    msa_attention -> torch.ops.m3compile.msa) -> torch.onnx.export (dynamo) with a translation that emits the custom
    node -> add the FunctionProto -> free the torch model -> write (weights streamed tensor by tensor to
    model.onnx.data, or one protobuf file) -> onnx.checker's full check

Weights: protobuf cannot serialise a message of 2 GiB or more, so past SINGLE_FILE_MAX bytes of initializers
(`external_data="auto"`) or always (`"always"`) they go to OUT_DIR/model.onnx.data as ONNX external data (one file
beside model.onnx, which names it relative to itself: the layout onnxruntime and onnx.checker.check_model(path)
read). The torch model is dropped before writing, so the process holds one copy of the weights while it writes.

A multimodal (minimax_m3_vl) checkpoint also gets vision.onnx: pixel_values [N, C*tp*p*p], positions [N, 3] and
segment_ids [N] -> visual tokens [N / merge^2, text hidden] (models.vision.VisionExport: the ViT with its 3D-window
attention as a masked SDPA per layer, then the projector; `models.vision.onnx_vision_inputs(grid_thw, ...)` builds
positions and segment ids on the host), dynamic patch count. model.onnx is then the language model's
input_ids -> logits; the visual tokens replace the placeholder embeddings outside the two graphs.
"""
from __future__ import annotations

import gc
import math
import os
import shutil
from pathlib import Path

import torch

from m3compile.config import parse_dtype
from m3compile.errors import M3CompileError
from m3compile.export.onnx_providers import EXTERNAL_DATA, check_pair, missing_kernels
from m3compile.graph.tracing import trace
from m3compile.io.hf_config import args_from_config, read_config
from m3compile.io.load import load
from m3compile.outputs import atomic_output_dir, check_output_dir
from m3compile.io.shards import SourceTensors
from m3compile.io.tensor_names import VISION_TENSOR
from m3compile.models.vision import MultimodalDecoder, VisionExport, onnx_vision_inputs, patchify
from m3compile.ops import msa_fused
from m3compile.pipelines import run_pipeline

__all__ = ["export_onnx", "MSA_DOMAIN", "EXTERNAL_DATA", "SINGLE_FILE_MAX", "weight_bytes"]

MSA_DOMAIN = "m3compile"
OPSET = 20
PROTOBUF_LIMIT = 2**31  # bytes: protobuf serialises no message of 2 GiB or more
# the most initializer bytes kept inside one model.onnx: the graph, the MSA function and the shapes take a few MB,
# so 256 MiB under the limit leaves a wide margin
SINGLE_FILE_MAX = PROTOBUF_LIMIT - 2**28
DISK_MARGIN = 2**26  # bytes asked of the disk over the weights (graph protos, the data file's tail)
_INLINE_BYTES = 1024  # initializers up to this size stay in model.onnx (shape constants), as onnx's own default


def export_onnx(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False,
                check: bool = True, dtype: str = "float32", external_data: str = "auto", provider: str = "cpu",
                progress=None) -> Path:
    """Write OUT_DIR/model.onnx (+ model.onnx.data, + vision.onnx) for the converted checkpoint in `model_dir`.
    Nothing is written on failure; bad input is refused before the work where it can be.

    dtype          the weights' and the compute's dtype: float32, float16 or bfloat16
    external_data  auto (weights in model.onnx.data once they pass SINGLE_FILE_MAX), always, or never (a one-line
                   error for a model that does not fit one protobuf file)
    provider       the onnxruntime execution provider the file is for (cpu or cuda): a dtype it cannot run is
                   refused (export.onnx_providers says which pairs run)
    progress       progress(done, total, what): bytes written so far of `total` (None while loading and exporting)
    """
    import onnx  # optional dependencies: pip install ".[onnx]"

    if external_data not in EXTERNAL_DATA:
        raise M3CompileError(f"unknown external-data mode {external_data!r} (use one of {', '.join(EXTERNAL_DATA)})")
    check_pair(dtype, provider)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_dir(out_dir, (model_dir,), force)
    _check_before_work(model_dir, out_dir, dtype, external_data)
    report = progress or (lambda done, total, what: None)
    graphs = _export(model_dir, dtype, report)  # file name -> onnx_ir.Model; the torch model is gone
    _check_graphs(graphs, dtype, provider, external_data)
    with atomic_output_dir(out_dir, force, inputs=(model_dir,)) as tmp:
        for name in list(graphs):
            try:
                _write(graphs, name, tmp / name, external_data, report)
            except OSError as e:  # a full disk, a quota: one line, and the temporary directory goes
                raise M3CompileError(f"cannot write {out_dir / name}: {e.strerror or e}") from None
            if check:
                report(0, None, f"checking {name}")
                onnx.checker.check_model(str(tmp / name), full_check=True)
    return out_dir / "model.onnx"


def weight_bytes(model_dir: str | os.PathLike, dtype: str = "float32") -> tuple[int, int]:
    """Bytes of the language model's and of the vision tower's weights in `dtype`, from the safetensors headers
    alone (the exported initializers, give or take a few buffers)."""
    size = parse_dtype(dtype).itemsize
    source = SourceTensors(Path(model_dir))
    text = vision = 0
    for name, (shape, _) in source.headers.items():
        n = math.prod(shape) * size
        if VISION_TENSOR.match(name):
            vision += n
        else:
            text += n
    return text, vision


def _check_before_work(model_dir: Path, out_dir: Path, dtype: str, external_data: str) -> None:
    """The one-line errors that need no model in memory: not converted, too large for `never`, no room on disk."""
    args, _ = args_from_config(read_config(model_dir))
    if args.msa is None and not (model_dir / "conversion_report.json").is_file():
        raise M3CompileError(f"{model_dir} was never converted: run m3c convert first (it has no MSA layers)")
    text, vision = weight_bytes(model_dir, dtype)
    if external_data == "never" and max(text, vision) > SINGLE_FILE_MAX:
        raise M3CompileError(f"{model_dir}: {_gb(max(text, vision))} of {dtype} weights do not fit one protobuf "
                             f"file (2 GiB at most): use --external-data auto")
    parent = Path(os.path.abspath(out_dir)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if text + vision + DISK_MARGIN > free:
        raise M3CompileError(f"not enough room in {parent} for the export: it writes about "
                             f"{_gb(text + vision + DISK_MARGIN)} ({dtype} weights), {_gb(free)} are free")


def _check_graphs(graphs: dict, dtype: str, provider: str, external_data: str) -> None:
    """The exported graphs against the provider's kernels and, for `never`, the protobuf limit (exact sizes now).
    (A function of its own: a loop variable left in export_onnx would keep the last graph's weights alive while
    the others are written.)"""
    for name, graph in graphs.items():
        missing = missing_kernels(graph, dtype, provider)
        if missing:
            raise M3CompileError(f"{name}: onnxruntime's {provider.upper()} provider has no kernel for "
                                 f"{', '.join(missing)}; export float16 or float32")
        size = _initializer_bytes(graph)
        if external_data == "never" and size > SINGLE_FILE_MAX:
            raise M3CompileError(f"{name}: {_gb(size)} of weights do not fit one protobuf file (2 GiB at most): "
                                 f"use --external-data auto")


def _export(model_dir: Path, dtype: str, report) -> dict:
    """The ONNX graphs of the converted checkpoint as onnx_ir Models; everything torch-side is freed on return, so
    their initializers are the one copy of the weights left."""
    import onnx_ir as ir

    from m3compile.export.onnx_msa import MSA as function
    from m3compile.export.onnx_msa import translate

    report(0, None, "loading")
    model = load(model_dir, dtype=dtype)  # raises a one-line error for anything that is not a checkpoint
    graphs = {}
    if isinstance(model, MultimodalDecoder):
        report(0, None, "exporting vision.onnx")
        graphs["vision.onnx"] = _vision_graph(model)
        model = model.language
    report(0, None, "exporting model.onnx")
    block = model.args.msa.block_size if model.args.msa else 16
    gm = trace(model)
    del model
    n_msa = run_pipeline("export", gm)[-1].replaced
    example = torch.zeros(2, 2 * block + 3, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("sequence", min=2)
    try:
        program = torch.onnx.export(
            gm, (example,), dynamo=True, opset_version=OPSET, input_names=["input_ids"], output_names=["logits"],
            dynamic_shapes=({0: batch, 1: seq},), custom_translation_table={msa_fused: translate}, verbose=False,
            optimize=False,  # run below, to release the weights it replaces
        )
    except Exception as e:
        raise M3CompileError(f"ONNX export failed: {str(e).splitlines()[0]}") from None
    del gm
    graph = _optimized(program)
    if n_msa:
        body = ir.serde.deserialize_function(function.to_function_proto())
        graph.functions[body.identifier()] = body
        graph.opset_imports.setdefault(MSA_DOMAIN, 1)
    return {"model.onnx": graph, **graphs}


def _optimized(program):
    """program.model after torch.onnx's optimizer (what torch.onnx.export(optimize=True) returns), with the torch
    weights it replaced released: it folds each Linear weight's Transpose into a new transposed initializer, and the
    graph keeps referencing the values it dropped (in its inputs' use counts), which would hold a second copy of
    the weights until the end of the export."""
    before = list(program.model.graph.initializers.values())
    program.optimize()
    graph = program.model
    del program  # its ExportedProgram holds the torch weights too
    kept = graph.graph.initializers
    for value in before:
        if kept.get(value.name) is not value:
            value.const_value = None
    gc.collect()
    return graph


def _vision_graph(model):
    """vision.onnx's onnx_ir Model for a MultimodalDecoder (see the module docstring)."""
    args = model.vision_args
    m = args.spatial_merge_size
    side = 2 * m * args.patch_size  # example: 2 images of 2m x 2m patches, 2 temporal steps each
    pixels, grid = patchify(torch.zeros(2 * args.temporal_patch_size, args.n_channels, side, side,
                                        dtype=next(model.vision_tower.parameters()).dtype), args)
    pixels, grid = pixels.repeat(2, 1), grid.repeat(2, 1)
    positions, segments = onnx_vision_inputs(grid, args, model.vision_tower.window)
    merged = torch.export.Dim("merged_tokens", min=1)
    try:
        program = torch.onnx.export(
            VisionExport(model).eval(), (pixels, positions, segments), dynamo=True, opset_version=OPSET,
            input_names=["pixel_values", "positions", "segment_ids"], output_names=["visual_tokens"],
            dynamic_shapes=({0: merged * m * m}, {0: merged * m * m}, {0: merged * m * m}), verbose=False,
            optimize=False,
        )
    except Exception as e:
        raise M3CompileError(f"ONNX export of the vision tower failed: {str(e).splitlines()[0]}") from None
    return _optimized(program)


def _write(graphs: dict, name: str, path: Path, external_data: str, report) -> None:
    """Write graphs[name] to `path` and drop it from `graphs`, holding one tensor's bytes at a time beyond the
    graph's own: its weights go to `<path>.data` (external data), or one protobuf file is written piece by piece."""
    import onnx_ir as ir

    graph = graphs.pop(name)
    total = _initializer_bytes(graph)
    if external_data == "always" or (external_data == "auto" and total > SINGLE_FILE_MAX):
        done = [0]

        def written(tensor, info):
            report(done[0], total, f"writing {name}.data")
            done[0] += tensor.nbytes

        ir.save(graph, path, external_data=f"{name}.data", size_threshold_bytes=_INLINE_BYTES, callback=written)
        for value in graph.graph.initializers.values():
            value.const_value = None  # whoever still holds the graph (onnxscript's rewrite rules do) holds no weight
        report(total, total, f"writing {name}.data")
        return
    # One protobuf file without serialising the whole model in memory (that takes the proto, the encoder's buffer
    # and the bytes: three more copies of the weights): the model without its initializers, then one
    # ModelProto(graph=GraphProto(initializer=[t])) per tensor. Protobuf parses concatenated messages as one
    # message merged field by field (a repeated field's elements appended), so the file reads back as the whole.
    import onnx

    values = [graph.graph.initializers.pop(key) for key in list(graph.graph.initializers)]
    done = 0
    with open(path, "wb") as f:
        f.write(ir.serde.serialize_model(graph).SerializeToString())
        for value in values:
            report(done, total, f"writing {name}")
            tensor = ir.serde.serialize_tensor(value.const_value)
            tensor.name = value.name
            done += value.const_value.nbytes
            value.const_value = None  # the last reference to this weight
            f.write(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())
    report(total, total, f"writing {name}")


def _initializer_bytes(graph) -> int:
    return sum(v.const_value.nbytes for v in graph.graph.initializers.values() if v.const_value is not None)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
