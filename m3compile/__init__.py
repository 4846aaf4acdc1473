"""m3compile: rewrite dense GQA transformers into MiniMax Sparse Attention (MSA).

    trace -> match attention -> rewrite (gqa_to_msa) -> distil / train (kl_distill) -> lower (Triton) -> export

One import name: the layers install as m3compile.kernels, .models, .ops, .graph, .passes, .pipelines, .io, .train,
.export, .tools and .cli. Importing the package initialises no GPU and imports no Triton code, nor torch: the public
names below (m3compile.api's) are imported on first use, so `m3c --help` and a usage error answer without loading
torch (about 2 s of imports).
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from m3compile.errors import M3CompileError

if TYPE_CHECKING:
    from m3compile.api import (
        ConversionReport, DistillConfig, DistillInterrupted, DistillReport, EvalReport, GenerationResult, MSAConfig,
        TrainConfig, attention_map, convert, convert_checkpoint, distill, evaluate, export_onnx, from_preset,
        generate, load, load_module, lower, save, train,
    )

__all__ = [
    "MSAConfig", "M3CompileError", "convert", "convert_checkpoint", "save", "load", "from_preset", "evaluate",
    "ConversionReport", "EvalReport", "distill", "DistillConfig", "DistillReport", "DistillInterrupted",
    "load_module", "lower", "generate", "GenerationResult", "train", "TrainConfig", "attention_map", "export_onnx",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name (from m3compile.api) or a subpackage, imported when first asked for (PEP 562)."""
    if name in __all__:
        value = getattr(importlib.import_module("m3compile.api"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package module: a public name stays the API's when a subpackage of that name is imported later
    (`m3compile.train` is the verb; importing m3compile.train.distill would otherwise rebind it to the subpackage,
    which stays importable by its full name)."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
