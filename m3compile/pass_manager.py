"""Passes and the pass manager (after torch.fx.passes.infra): named units with preconditions and a report.

A pass is a class with a docstring, `requires(gm)` (raises M3CompileError when it cannot run), `call(gm)` (mutates
and returns a PassReport) and `ensures(gm)` (checks its postcondition). The manager lints and recompiles the graph
after every pass and counts the nodes each one added and removed. Passes are idempotent: running a pipeline twice
changes nothing the second time.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch.fx

__all__ = ["Pass", "PassReport", "PassManager", "PASSES", "register_pass"]


@dataclass
class PassReport:
    """What one pass did."""

    name: str
    modified: bool = False
    replaced: int = 0  # attention outputs (or other anchors) replaced
    added: int = 0  # graph nodes
    removed: int = 0
    details: list[str] = field(default_factory=list)  # one line per change, e.g. per converted layer

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "modified", "replaced", "added", "removed", "details")}


class Pass:
    """Base class; subclasses set `name` and a docstring whose first line says what they do."""

    name: str = "pass"

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Raise M3CompileError when the pass cannot run on `gm`."""

    def call(self, gm: torch.fx.GraphModule) -> PassReport:
        raise NotImplementedError

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Raise AssertionError when the postcondition does not hold."""

    @classmethod
    def summary(cls) -> str:
        return (inspect.getdoc(cls) or "").splitlines()[0]


PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    PASSES[cls.name] = cls
    return cls


class PassManager:
    def __init__(self, passes: list[Pass]):
        self.passes = passes

    def run(self, gm: torch.fx.GraphModule) -> list[PassReport]:
        reports = []
        for p in self.passes:
            p.requires(gm)
            before = set(gm.graph.nodes)
            report = p.call(gm)
            gm.graph.lint()
            gm.recompile()
            after = set(gm.graph.nodes)
            report.added, report.removed = len(after - before), len(before - after)
            report.modified = report.modified or bool(report.added or report.removed)
            p.ensures(gm)
            reports.append(report)
        return reports
