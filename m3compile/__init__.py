"""m3compile: rewrite dense GQA transformers into MiniMax Sparse Attention (MSA).

    trace -> analyse (match attention) -> rewrite (gqa_to_msa) -> distil (kl_distill) -> save / load / evaluate

Importing the package initialises no GPU and imports no Triton code.
"""
from m3compile.api import (
    ConversionReport, EvalReport, convert, convert_checkpoint, evaluate, from_preset, load, lower, save,
)
from m3compile.config import MSAConfig
from m3compile.distill import DistillConfig, DistillInterrupted, DistillReport, TrainConfig, distill, train
from m3compile.errors import M3CompileError
from m3compile.generate import GenerationResult, generate
from m3compile.module_io import load_module

__all__ = [
    "MSAConfig", "M3CompileError", "convert", "convert_checkpoint", "save", "load", "from_preset", "evaluate",
    "ConversionReport", "EvalReport", "distill", "DistillConfig", "DistillReport", "DistillInterrupted",
    "load_module", "lower", "generate", "GenerationResult", "train", "TrainConfig",
]
__version__ = "0.1.0"
