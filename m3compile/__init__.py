"""m3compile: rewrite dense GQA transformers into MiniMax Sparse Attention (MSA).

    trace -> match attention -> rewrite (gqa_to_msa) -> distil / train (kl_distill) -> lower (Triton) -> export

One import name: the layers install as m3compile.kernels, .models, .ops, .graph, .passes, .pipelines, .io, .train,
.export, .tools and .cli. Importing the package initialises no GPU and imports no Triton code.
"""
from m3compile.api import (
    ConversionReport, DistillConfig, DistillInterrupted, DistillReport, EvalReport, GenerationResult, MSAConfig,
    TrainConfig, attention_map, convert, convert_checkpoint, distill, evaluate, export_onnx, from_preset, generate,
    load, load_module, lower, save, train,
)
from m3compile.errors import M3CompileError

__all__ = [
    "MSAConfig", "M3CompileError", "convert", "convert_checkpoint", "save", "load", "from_preset", "evaluate",
    "ConversionReport", "EvalReport", "distill", "DistillConfig", "DistillReport", "DistillInterrupted",
    "load_module", "lower", "generate", "GenerationResult", "train", "TrainConfig", "attention_map", "export_onnx",
]
__version__ = "0.1.0"
