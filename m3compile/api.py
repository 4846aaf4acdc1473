"""The public verbs, one per job, re-exported from the stage that implements each.

    load / from_preset          io/load.py                  a checkpoint directory or a preset as a model
    convert                     conversion/convert.py       the convert pipeline on a model in memory
    convert_checkpoint / save   conversion/checkpoint.py,   converted checkpoints on disk (streaming for
                                conversion/save.py          directories)
    lower                       pipelines.py                a model running the ops' lowerings (the Triton kernels)
    load_module                 io/module_io.py             the generated graph/module.py of a converted checkpoint
    evaluate                    evaluation/loss.py          dense vs sparse loss and recall
    attention_map               tools/attention_map.py      what the index branch selects
    distill / train             train/distill.py            the index branch's KL distillation; continued training
    export_onnx                 export/onnx.py              model.onnx (+ model.onnx.data, vision.onnx)
    generate                    runtime/generate.py         batched decoding over runtime/'s paged KV and index-K caches
"""
from m3compile.config import MSAConfig, parse_dtype
from m3compile.export.onnx import export_onnx
from m3compile.conversion.checkpoint import convert_checkpoint
from m3compile.io.load import from_preset, load
from m3compile.io.module_io import load_module
from m3compile.conversion.save import save
from m3compile.conversion.convert import ConversionReport, convert
from m3compile.pipelines import lower
from m3compile.tools.attention_map import attention_map
from m3compile.evaluation.loss import EvalReport, evaluate
from m3compile.runtime.generate import GenerationResult, generate
from m3compile.train.distill import DistillConfig, DistillInterrupted, DistillReport, TrainConfig, distill, train

__all__ = [
    "MSAConfig", "parse_dtype", "load", "from_preset", "convert", "lower", "save", "convert_checkpoint",
    "load_module", "evaluate", "EvalReport", "attention_map", "distill", "train", "DistillConfig", "TrainConfig",
    "DistillReport", "DistillInterrupted", "export_onnx", "generate", "GenerationResult", "ConversionReport",
]
