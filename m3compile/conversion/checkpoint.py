"""A checkpoint directory (or a preset) -> a converted checkpoint directory. Fails before writing anything."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from m3compile.config import MSAConfig, parse_dtype
from m3compile.conversion.calibration import DEFAULT_CALIB_TOKENS
from m3compile.conversion.convert import ConversionReport, convert
from m3compile.conversion.save import save
from m3compile.conversion.streaming import convert_streaming
from m3compile.data import load_tokens
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import args_from_config, read_config
from m3compile.io.load import check_device, from_preset
from m3compile.outputs import check_output_dir

__all__ = ["convert_checkpoint"]


def convert_checkpoint(src: str | os.PathLike | None, out_dir: str | os.PathLike, config: MSAConfig | None = None,
                       preset: str | None = None, force: bool = False, dtype: str | None = None,
                       max_shard_size: int = 5 * 10**9,
                       progress: Callable[[int, int, str], None] | None = None,
                       calib: str | os.PathLike | None = None, calib_tokens: int = DEFAULT_CALIB_TOKENS,
                       calib_seq_len: int | None = None, calib_device: str = "cpu",
                       layer_costs: dict | None = None) -> ConversionReport:
    """Checkpoint directory (or preset) -> converted checkpoint directory. Fails before writing anything.

    A checkpoint directory is converted streaming (m3compile.conversion.streaming): memory holds one layer, not the model.
    calib: a data file (.bin, .npy, .txt/.jsonl through SRC's tokenizer) whose first `calib_tokens` tokens calibrate
    the index init (m3compile/conversion/calibration.py) in windows of `calib_seq_len` tokens [default: 2048, at most the model's
    positions]; without it the init uses the weights alone. Every input (SRC, calib) is checked against the output
    before anything is read.
    layer_costs: what chose config.dense_layers, for the report (evaluation.loss.LayerCostReport.to_dict: `m3c
    convert --dense-costliest N`).
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, (src, calib), force)
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise M3CompileError(f"max shard size must be a positive number of bytes, got {max_shard_size!r}")
    model = None if src is not None else from_preset(preset or "m3-tiny")
    ids = None
    if calib is not None:
        if calib_tokens < 2 or (calib_seq_len is not None and calib_seq_len < 2):
            raise M3CompileError(f"--calib-tokens and --calib-seq-len must be at least 2, got {calib_tokens} and "
                                 f"{calib_seq_len}")
        check_device(calib_device)
        vocab = model.args.vocab_size if model is not None else args_from_config(read_config(src))[0].vocab_size
        ids = load_tokens(calib, vocab, tokenizer_dir=src)[:calib_tokens]
        if ids.numel() < 2:
            raise M3CompileError(f"{calib}: {ids.numel()} tokens, too few to calibrate")
    if src is not None:
        return convert_streaming(src, out_dir, config, force=force, dtype=dtype, max_shard_size=max_shard_size,
                                 progress=progress, calib=ids, calib_seq_len=calib_seq_len, calib_device=calib_device,
                                 calib_source=None if calib is None else str(calib), layer_costs=layer_costs)
    if dtype:
        model = model.to(parse_dtype(dtype))
    gm, report = convert(model, config, calib=ids, calib_seq_len=calib_seq_len,
                         calib_device=torch.device(calib_device) if ids is not None else None)
    if ids is not None:
        report.index_init = dataclasses.replace(report.index_init, source=str(calib))
    report.model = f"preset {preset or 'm3-tiny'}"
    report.layer_costs = layer_costs
    save(gm, report, out_dir, None, force, max_shard_size)
    return report
