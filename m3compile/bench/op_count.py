"""Host cost of a step, counted: the aten ops it dispatches and the Triton kernels it launches, by layer and stage.

A GPU step whose kernels are short is bound by the host: every aten op costs a few microseconds of dispatch (and
usually a kernel launch), every Triton launch ~10-20 us of argument binding. Counting them needs no GPU: on CPU
under TRITON_INTERPRET=1 a lowered graph takes the same host path as on CUDA (only autocast's casts are missing),
so the count is a CPU-measurable proxy of the host time (`m3c bench distill` reports it per mode).

    count_ops(step, gm) -> OpCount    # runs step() once under a TorchDispatchMode; gm's forward runs node by node

Attribution: in the forward each op belongs to the graph node that ran it (an fx Interpreter stands in for the
generated forward while counting); the backward's ops to the graph node whose forward built the autograd node
that runs them (autograd nodes are tagged while the forward runs); what runs outside the graph to the innermost
`m3c.*` range (ops.scope, opened for the count: the step's `m3c.loss`, `m3c.optimizer`; `m3c.recall` inside the
KL op; the ranges' own dispatches are not counted, an unprofiled step has none). A node's layer is
its module path's `layers.N` (MSA ops take their inputs' layer). Triton launches are counted at `kernel[grid]`
(the KernelInterface of triton.runtime.jit, patched while counting); under the interpreter the torch ops a kernel
runs inside are not counted (on a GPU they do not exist).
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from m3compile import ops

__all__ = ["OpCount", "count_ops", "node_categories", "CATEGORIES"]

# graph-node categories, in report order; "(bwd)" is appended to those of backward ops
CATEGORIES = ("embedding", "rope tables", "backbone", "rope", "index projections", "index norms", "index rope",
              "index branch", "select", "attention", "KL", "recall", "block loss", "lm head", "loss", "optimizer",
              "other")
_RANGES = {"m3c.recall": "recall", "m3c.loss": "loss", "m3c.optimizer": "optimizer"}  # ranges that name a stage
_CASTS = ("_to_copy", "copy_")
_SYNCS = ("_local_scalar_dense", "item")
_TAG = "m3c_op_count"


@dataclass
class OpCount:
    """Dispatches of one step. `stages`: {stage: {"aten": n, "triton": n}}; `layers`: {layer: {stage: n}} (aten +
    Triton, "model" = outside any layer); `casts` / `syncs`: dtype copies and host reads (.item()) among the aten
    ops; `top`: the most frequent aten ops."""

    aten: int = 0
    triton: int = 0
    casts: int = 0
    syncs: int = 0
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    layers: dict[str, dict[str, int]] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    top: dict[str, int] = field(default_factory=dict)
    ops: dict[str, dict[str, int]] = field(default_factory=dict)  # {stage: {aten op or kernel: n}}, all layers

    @property
    def total(self) -> int:
        return self.aten + self.triton

    def per_layer(self, layer: int | str) -> int:
        return sum(self.layers.get(str(layer), {}).values())

    def to_dict(self) -> dict:
        return {"total": self.total, "aten": self.aten, "triton": self.triton, "casts": self.casts,
                "syncs": self.syncs, "stages": self.stages, "layers": self.layers, "kernels": self.kernels,
                "top_aten": self.top, "ops": self.ops}


def node_categories(gm: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    """{node name: (layer, category)} for every node of `gm` (layer "model" outside the decoder layers)."""
    out: dict[str, tuple[str, str]] = {}
    outputs = set(gm.graph.output_node().all_input_nodes)
    for n in gm.graph.nodes:
        inputs = [out[a.name] for a in n.all_input_nodes if a.name in out]
        path = n.target if n.op == "call_module" else next(reversed(n.meta.get("nn_module_stack", {}) or {"": 0}))
        layer = re.search(r"layers\.(\d+)", str(path))
        layer = layer.group(1) if layer else max((i[0] for i in inputs if i[0] != "model"), default="model",
                                                key=lambda s: int(s))
        out[n.name] = (layer, _category(n, str(path), inputs, outputs))
    return out


def _category(n: torch.fx.Node, path: str, inputs: list[tuple[str, str]], outputs: set) -> str:
    if n.op == "call_module":
        if ".index_" in path:
            return "index norms" if "norm" in path.rsplit(".", 1)[-1] else "index projections"
        if "embed" in path:
            return "embedding"
        return "lm head" if path == "lm_head" else "backbone"
    if ops.is_op(n, ops.apply_rope):
        return "rope"
    if ops.is_op(n, ops.index_branch, ops.index_norm_rope):
        return "index branch"
    if ops.is_op(n, ops.msa_select):
        return "select"
    if ops.is_op(n, ops.msa_attention, ops.msa_attention_lse, F.scaled_dot_product_attention):
        return "attention"
    if ops.is_op(n, ops.msa_index_kl):
        return "KL"
    if ops.is_op(n, ops.msa_block_loss):
        return "block loss"
    if ops.is_op(n, ops.rms_norm, ops.add_rms_norm):
        return "backbone"
    if n in outputs and n.op == "call_function" and n.target is torch.stack:
        return "loss"
    if "rotary_emb" in path:
        return "rope tables"
    if path:  # inside a decoder module: views, residual adds, the MLP's activation
        return "backbone"
    # nodes the rewrite inserted (no module path): the index branch's glue, getitems of ops
    if n.op == "call_method" and n.target == "detach":
        return "index projections"
    return inputs[0][1] if inputs else "other"


class _Counter(TorchDispatchMode):
    def __init__(self, categories: dict[str, tuple[str, str]]):
        super().__init__()
        self.categories = categories
        self.node: str | None = None  # the graph node running in the forward
        self.ranges: list[str] = []
        self.paused = 0  # inside a Triton launch (the interpreter's own torch ops)
        self.aten: Counter = Counter()
        self.stage: Counter = Counter()  # (layer, stage, "aten"|"triton")
        self.kernels: Counter = Counter()
        self.detail: Counter = Counter()  # (stage, aten op or kernel)

    def where(self) -> tuple[str, str]:
        ranged = next((_RANGES[r] for r in reversed(self.ranges) if r in _RANGES), None)
        grad_node = torch._C._current_autograd_node()
        if grad_node is not None:
            tag = grad_node.metadata.get(_TAG)
            if tag is not None and tag[0] == id(self):
                layer, cat = self.categories[tag[1]]
                return layer, f"{ranged or cat} (bwd)"
            return "model", "accumulate grad (bwd)" if "AccumulateGrad" in grad_node.name() else "other (bwd)"
        if self.node is not None:
            layer, cat = self.categories[self.node]
            return layer, ranged or cat
        return "model", ranged or "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_record_function_enter_new":
            self.ranges.append(args[0])
        out = func(*args, **(kwargs or {}))
        if name == "_record_function_exit" and self.ranges:
            self.ranges.pop()
        if name in ("_record_function_enter_new", "_record_function_exit"):
            return out  # the ranges are open for the count only (ops.scope): an uncounted step has none
        if not self.paused:
            self.aten[name] += 1
            layer, stage = self.where()
            self.stage[(layer, stage, "aten")] += 1
            self.detail[(stage, name)] += 1
        return out

    def launch(self, kernel: str) -> None:
        if not self.paused:
            self.kernels[kernel] += 1
            layer, stage = self.where()
            self.stage[(layer, stage, "triton")] += 1
            self.detail[(stage, kernel)] += 1

    def tag(self, node: str, value) -> None:
        """Tag the autograd nodes `value` was built by (those not tagged yet) with the graph node that ran."""
        stack = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
        while stack:
            g = stack.pop()
            if g is None:
                continue
            tag = g.metadata.get(_TAG)
            if tag is not None and tag[0] == id(self):
                continue
            g.metadata[_TAG] = (id(self), node)
            stack.extend(f for f, _ in g.next_functions)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


class _Tagging(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, counter: _Counter):
        super().__init__(gm)
        self.counter = counter

    def run_node(self, n: torch.fx.Node):
        self.counter.node = n.name
        try:
            value = super().run_node(n)
        finally:
            self.counter.node = None
        if torch.is_grad_enabled():
            self.counter.tag(n.name, value)
        return value


@contextlib.contextmanager
def _counting_launches(counter: _Counter):
    """Count `kernel[grid](...)` launches (JIT functions and autotuners alike) while the block runs."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:  # no Triton: nothing launches
        yield
        return
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        run = original(self, grid)
        name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "kernel")

        def launch(*args, **kwargs):
            counter.launch(name)
            counter.paused += 1
            try:
                return run(*args, **kwargs)
            finally:
                counter.paused -= 1
        return launch

    KernelInterface.__getitem__ = getitem
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def count_ops(step: Callable[[], object], gm: torch.fx.GraphModule | None = None) -> OpCount:
    """Run `step()` once and count its aten dispatches and Triton launches; with `gm` (the graph the step runs) by
    layer and stage. The step runs for real (its optimizer steps too)."""
    counter = _Counter(node_categories(gm) if gm is not None else {})
    if gm is not None:
        gm.forward = lambda *a, **k: _Tagging(gm, counter).run(*a, **k)  # instance attribute: Module.__call__ uses it
    try:
        with ops.recording_scopes(), _counting_launches(counter), counter:
            step()
    finally:
        if gm is not None:
            del gm.forward
    result = OpCount(aten=sum(counter.aten.values()), triton=sum(counter.kernels.values()))
    result.casts = sum(counter.aten[n] for n in _CASTS)
    result.syncs = sum(counter.aten[n] for n in _SYNCS)
    order = {c: i for i, c in enumerate(CATEGORIES)}
    for (layer, stage, kind), n in sorted(counter.stage.items(), key=lambda kv: (
            order.get(kv[0][1].removesuffix(" (bwd)"), len(order)), kv[0][1])):
        result.stages.setdefault(stage, {"aten": 0, "triton": 0})[kind] += n
        row = result.layers.setdefault(layer, {})
        row[stage] = row.get(stage, 0) + n
    result.layers = dict(sorted(result.layers.items(), key=lambda kv: (kv[0] == "model", int(kv[0]) if kv[0].isdigit() else 0)))
    result.kernels = dict(counter.kernels.most_common())
    result.top = dict(counter.aten.most_common(25))
    for (stage, name), n in counter.detail.most_common():
        result.ops.setdefault(stage, {})[name] = n
    return result
