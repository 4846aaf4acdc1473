"""Tracing with torch.fx, and shape propagation on fake tensors (no compute, works on the meta device).

Leaves: torch.nn modules, RMSNorm-like norms and MoE blocks (data-dependent routing). Attention is never a leaf:
the matcher has to see its dataflow. Every graph op of m3compile.ops stays one node, whichever module calls it.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from m3compile.errors import M3CompileError
from m3compile.models.decoder import MoE, RMSNorm
from m3compile.ops import GRAPH_OPS

__all__ = ["Tracer", "trace", "propagate_shapes", "is_norm_module"]

LEAF_TYPES: tuple[type, ...] = (RMSNorm, MoE)


def is_norm_module(module: torch.nn.Module) -> bool:
    return isinstance(module, (RMSNorm, torch.nn.LayerNorm)) or type(module).__name__.endswith("RMSNorm")


class Tracer(torch.fx.Tracer):
    """fx Tracer whose leaves are torch.nn modules, norms and MoE blocks, and whose graph ops are single nodes."""

    def __init__(self):
        super().__init__(autowrap_functions=GRAPH_OPS)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if isinstance(m, LEAF_TYPES) or is_norm_module(m) or "moe" in type(m).__name__.lower():
            return True
        return super().is_leaf_module(m, qualname)


def trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    """Symbolically trace `model` (forward(input_ids) -> logits) into a GraphModule with the same state-dict names.
    Every graph op of m3compile.ops is one node, which runs its reference or its lowering as the ops' switch says
    when the graph runs."""
    tracer = Tracer()
    # optional inputs (a Decoder's positions and cache) are traced as absent: the graph is the whole-sequence forward
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    absent = {p.name: None for p in params if p.default is None}
    try:
        graph = tracer.trace(model, concrete_args=absent or None)
    except Exception as e:  # fx raises TraceError / TypeError with long messages
        raise M3CompileError(f"torch.fx could not trace {type(model).__name__}: {str(e).splitlines()[0]}") from None
    for n in [n for n in graph.nodes if n.op == "placeholder"]:
        checks = [u for u in n.users if u.op == "call_function" and getattr(u.target, "__name__", "") == "_assert_is_none"]
        if checks and len(checks) == len(n.users):  # an absent input and fx's check that it stays absent
            for user in checks:
                graph.erase_node(user)
            graph.erase_node(n)
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    _share_parameter_owners(gm, tracer.root)
    if hasattr(model, "args"):
        gm.meta["model_args"] = model.args
    return gm


class _FakeProp(torch.fx.Interpreter):
    """Runs the graph on fake tensors, recording each node's value; leaf MoE blocks keep their input's shape."""

    def __init__(self, gm: torch.fx.GraphModule, record: dict | None = None):
        super().__init__(gm)
        self.record = record

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if self.record is None:
            n.meta["val"] = result
        else:
            self.record[n] = result
        return result

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if isinstance(module, MoE) or "moe" in type(module).__name__.lower():
            return torch.empty_like(args[0])
        return super().call_module(target, args, kwargs)


def propagate_shapes(gm: torch.fx.GraphModule, seq_len: int = 7, batch: int = 1, record: dict | None = None) -> None:
    """Fake-run the graph on [batch, seq_len] token ids: node.meta['val'] gets each value (or `record`, if given)."""
    param = next(iter(gm.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        _FakeProp(gm, record).run(ids)


def _share_parameter_owners(gm: torch.fx.GraphModule, root: torch.nn.Module) -> None:
    """The modules whose parameters the graph reads by get_attr (an MSA layer's index norms, read by
    index_norm_rope), as the model's own objects: fx builds a fresh container around such a parameter, and whatever
    re-registers the module's parameters afterwards (FSDP2's sharding, `.to()`) would then reach the graph's copy
    but not the model."""
    params = dict(gm.named_parameters())
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target not in params:
            continue
        owner, _, _ = n.target.rpartition(".")
        parent, _, leaf = owner.rpartition(".")
        try:
            original = root.get_submodule(owner)
        except AttributeError:
            continue
        holder = gm.get_submodule(parent) if parent else gm
        if getattr(holder, leaf) is not original:
            setattr(holder, leaf, original)
