"""recompute_mlp: run each dense MLP of a traced training graph under torch.utils.checkpoint.

    h -> gate_proj -> act \\
    h -> up_proj --------- * -> down_proj -> y            (the traced MLP: its intermediates saved for the backward)
    becomes
    h -> m3c_recompute_model_layers_L_mlp(h) -> y         (the model's own MLP module, checkpointed)

A SwiGLU MLP keeps three or four [T, intermediate] tensors for its backward (gate, up, the activation and their
product): at 32K tokens on Qwen2.5-0.5B (intermediate 4,864, 24 layers) about 30 GB in bf16, most of a training step's
memory. Checkpointed, the MLP saves only its input and runs its forward again in the backward (about a third more MLP
FLOPs). The rewritten node calls the model's own MLP module, whose weights are the graph's parameters: their names,
and so a checkpoint's tensor names, do not change. MoE blocks are left as they are.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from m3compile.models.decoder import MLP

__all__ = ["recompute_mlps", "RecomputedMLP"]


class RecomputedMLP(torch.nn.Module):
    """Calls `mlp` under torch.utils.checkpoint when a gradient is wanted. The MLP is held without registering it, so
    its parameters keep the names the graph gave them."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "_mlp", mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return checkpoint(self._mlp, x, use_reentrant=False, preserve_rng_state=False)
        return self._mlp(x)


def recompute_mlps(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[int]:
    """Replace each traced dense MLP of `gm` (gate_proj, up_proj and down_proj of `model`'s module `<prefix>.mlp`, and
    the nodes between them) by one call of that module under checkpoint; returns the layers rewritten, in graph
    order. `model` is the module `gm` was traced from."""
    g = gm.graph
    by_target = {n.target: n for n in g.nodes if n.op == "call_module"}
    done = []
    for down in [n for n in g.nodes if n.op == "call_module" and str(n.target).endswith(".mlp.down_proj")]:
        prefix = str(down.target)[:-len(".down_proj")]
        gate, up = by_target.get(prefix + ".gate_proj"), by_target.get(prefix + ".up_proj")
        try:
            mlp = model.get_submodule(prefix)
        except AttributeError:
            continue
        if not isinstance(mlp, MLP) or gate is None or up is None or gate.args[0] is not up.args[0]:
            continue
        x = gate.args[0]
        inner = _between(x, down)
        if any(u not in inner and u is not down for n in inner for u in n.users):
            continue  # an intermediate read elsewhere: not a plain MLP
        name = "m3c_recompute_" + prefix.replace(".", "_")
        gm.add_submodule(name, RecomputedMLP(mlp))
        with g.inserting_before(down):
            call = g.call_module(name, (x,))
        call.meta = dict(down.meta)
        down.replace_all_uses_with(call)
        for n in [down, *reversed(inner)]:
            g.erase_node(n)
        done.append(int(prefix.split(".")[-2]))  # <...>.layers.L.mlp
    if done:
        g.lint()
        gm.recompile()
    return done


def _between(x: torch.fx.Node, down: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes on the paths from x to down (both excluded), in graph order: down's ancestors that descend from x."""
    ancestors, stack = set(), list(down.all_input_nodes)
    while stack:
        n = stack.pop()
        if n is x or n in ancestors:
            continue
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    between, stack = set(), [u for u in x.users if u in ancestors]
    while stack:
        n = stack.pop()
        if n not in between:
            between.add(n)
            stack.extend(u for u in n.users if u in ancestors)
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    return sorted(between, key=order.__getitem__)
