"""Checkpoint directory (or preset) -> converted checkpoint directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from m3compile.config import MSAConfig, parse_dtype
from m3compile.io.checkpoint import check_output_dir
from m3compile.io.load import from_preset
from m3compile.io.save import save
from m3compile.io.streaming import convert_streaming
from m3compile.pipelines import ConversionReport, convert

__all__ = ["convert_checkpoint"]


def convert_checkpoint(src: str | os.PathLike | None, out_dir: str | os.PathLike, config: MSAConfig | None = None,
                       preset: str | None = None, force: bool = False, dtype: str | None = None,
                       max_shard_size: int = 5 * 10**9,
                       progress: Callable[[int, int, str], None] | None = None) -> ConversionReport:
    """Checkpoint directory (or preset) -> converted checkpoint directory. Fails before writing anything.

    A checkpoint directory is converted streaming (m3compile.io.streaming): memory holds one layer, not the model.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, () if src is None else (src,), force)
    if src is not None:
        return convert_streaming(src, out_dir, config, force=force, dtype=dtype, max_shard_size=max_shard_size,
                                 progress=progress)
    model = from_preset(preset or "m3-tiny")
    if dtype:
        model = model.to(parse_dtype(dtype))
    gm, report = convert(model, config)
    report.model = f"preset {preset or 'm3-tiny'}"
    save(gm, report, out_dir, None, force, max_shard_size)
    return report
