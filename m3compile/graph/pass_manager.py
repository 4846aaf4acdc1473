"""Passes and the pass manager (after torch.fx.passes.infra): named units with preconditions and a report.

A pass is a class with a docstring, `requires(gm)` (raises M3CompileError when it cannot run), `call(gm)` (mutates
and returns a PassReport) and `ensures(gm)` (checks its postcondition). The manager lints and recompiles the graph
after every pass and counts the nodes each one added and removed. Passes are idempotent: running a pipeline twice
changes nothing the second time.

Ordering: every pass belongs to a stage, rewrite -> distil -> lower. A pass list must go through the stages in that
order, and a graph remembers the last stage run on it (gm.meta["m3_stage"]), so no rewrite or hook is added after
lowering. A pass that only reconfigures what an earlier stage added (`revisits = True`, e.g. switching the
distillation mode of a lowered training graph) may run later.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch.fx

from m3compile.errors import M3CompileError

__all__ = ["Pass", "PassReport", "PassManager", "PASSES", "register_pass", "STAGES"]

STAGES = ("rewrite", "distil", "lower")


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
    stage: str = "rewrite"
    revisits: bool = False  # may run on a graph that a later stage has already seen (reconfigures, adds nothing)

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
    """Runs passes in order; refuses a list or a graph whose stages would run backwards (see the module doc)."""

    def __init__(self, passes: list[Pass]):
        order = [STAGES.index(p.stage) for p in passes]
        for (a, ia), (b, ib) in zip(zip(passes, order), zip(passes[1:], order[1:])):
            if ib < ia and not b.revisits:
                raise M3CompileError(f"pass {b.name} ({b.stage}) cannot run after {a.name} ({a.stage}): the stages "
                                     f"run {' -> '.join(STAGES)}")
        self.passes = passes

    def run(self, gm: torch.fx.GraphModule) -> list[PassReport]:
        reports = []
        for p in self.passes:
            stage, done = STAGES.index(p.stage), gm.meta.get("m3_stage", 0)
            if stage < done and not p.revisits:
                raise M3CompileError(f"pass {p.name} ({p.stage}) cannot run on a graph that went through "
                                     f"{STAGES[done]}: {p.stage} passes come first")
            p.requires(gm)
            before = set(gm.graph.nodes)
            report = p.call(gm)
            gm.graph.lint()
            gm.recompile()
            after = set(gm.graph.nodes)
            report.added, report.removed = len(after - before), len(before - after)
            report.modified = report.modified or bool(report.added or report.removed)
            p.ensures(gm)
            gm.meta["m3_stage"] = max(stage, done)
            reports.append(report)
        return reports
