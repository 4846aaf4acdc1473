"""The one exception type users see (its message is a single line that names the problem), and the interruption
that says where a training run's state was saved. Importing this imports no torch (the command line needs both
names at startup)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["M3CompileError", "DistillInterrupted"]


class M3CompileError(Exception):
    """Bad input or an unsupported model: the CLI prints the message on one line and exits with status 2."""


class DistillInterrupted(KeyboardInterrupt):
    """Ctrl-C during distillation: the state after the last finished step was saved."""

    def __init__(self, step: int, out_dir: Path):
        super().__init__(f"interrupted after step {step}; state saved in {out_dir} (continue with --resume)")
        self.step, self.out_dir = step, out_dir
