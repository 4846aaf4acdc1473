"""Sharded training state with FSDP2 (torch.distributed.fsdp.fully_shard): no rank holds the whole model.

    Decoder on the meta device -> trace + distill pipeline -> fully_shard per layer (its backbone leaves; its index
    branch's leaves) and the rest (embeddings, final norm, head) under a root wrapper -> to_empty -> every rank
    copies its rows of each tensor from the memory-mapped checkpoint, one layer at a time -> train: a group is
    all-gathered before its first leaf runs and resharded after its last, gradients are reduce-scattered as the mean
    over ranks, AdamW keeps its moments for the local rows only -> save: tensors gathered one at a time

Groups of leaf modules, not DecoderLayers: the traced graph calls the leaves (linears, norms, embeddings, MoE
blocks) directly, so a DecoderLayer's forward hooks, where FSDP would all-gather, never run. `fully_shard([leaves of
layer i])` makes one all-gather group whose hooks fire on its first and last leaf. The index branch is a group of
its own, kept unsharded from forward to backward (it is small): its input is detached, so its gradients arrive
outside the backbone's backward and its first and last leaf do not bracket its backward. In distillation it is the
only trained group; the frozen backbone groups build no autograd graph, are resharded after the forward and never
gathered again. A leaf called twice, or sharing a parameter with a module outside its group (tied weights), stays
in the root group, which is gathered for the whole step.

A parameter is a DTensor sharded on dim 0 as torch.chunk cuts it (rank r holds rows [r*c, (r+1)*c), c = ceil(n /
world)); `copy_rows` fills such a tensor from a full tensor or a safetensors slice, reading only the local rows.

torch.distributed.fsdp and torch.distributed.tensor are imported by the functions that shard: they take a second to
import (sympy), which every m3c command would otherwise pay; no DTensor exists before they are.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.fx

from m3compile.errors import M3CompileError
from m3compile.io.load import check_device
from m3compile.memory import available_bytes

__all__ = ["ShardedGraph", "process_group", "shard_groups", "shard_graph", "materialize", "copy_rows",
           "full_tensor", "local_bytes", "needs_sharding"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@contextlib.contextmanager
def process_group(device: str, single: bool = False):
    """Yields (rank, world size) inside torchrun's process group (gloo on CPU, NCCL on CUDA), created for the block
    and destroyed after it; a group that already exists is used and kept. With `single`, one process without
    torchrun gets a group of one (the sharded path needs a group at any size)."""
    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not multi and not single:
        yield 0, 1
        return
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # before NCCL's first collective picks its device
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if multi or "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


class ShardedGraph(torch.nn.Module):
    """The root FSDP module around the traced graph. fully_shard swaps a module's class for a subclass, and
    GraphModule.recompile (a distillation mode switch) installs its call wrapper on the module's class, so the
    GraphModule itself stays unwrapped."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, x: torch.Tensor):
        return self.gm(x)


def shard_groups(gm: torch.fx.GraphModule) -> list[tuple[str, list[str]]]:
    """The all-gather groups, in the order the graph calls them: per layer, `layer N` (its backbone leaves) and
    `layer N index` (its index branch's leaves). Everything else is left to the root group (see the module doc)."""
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    groups: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_module" or calls[n.target] != 1:
            continue
        m = _LAYER.search(n.target)
        if m is None or next(gm.get_submodule(n.target).parameters(), None) is None:
            continue
        groups.setdefault(f"layer {m[1]}{' index' if '.index_' in n.target else ''}", []).append(n.target)
    grouped = {name for names in groups.values() for name in names}
    owner: dict[int, str] = {}
    demoted = set()
    for key, names in groups.items():
        for name in names:
            for p in gm.get_submodule(name).parameters():
                if owner.setdefault(id(p), key) != key:
                    demoted |= {key, owner[id(p)]}
    for n in gm.graph.nodes:  # leaves and attributes outside the groups: their parameters must not be in one
        if n.op in ("call_module", "get_attr") and n.target not in grouped:
            obj = gm.get_submodule(n.target) if n.op == "call_module" else None
            tensors = obj.parameters() if obj is not None else [_attr(gm, n.target)]
            demoted |= {owner[id(t)] for t in tensors if id(t) in owner}
    return [(k, v) for k, v in groups.items() if k not in demoted]


def _attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def shard_graph(gm: torch.fx.GraphModule, device: str) -> ShardedGraph:
    """Apply fully_shard to the groups of `gm` (on the meta device or materialised) over all ranks; returns the root
    module to call. Parameters become DTensors sharded on dim 0 (new Parameter objects: read them again by name)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    for key, names in shard_groups(gm):
        fully_shard([gm.get_submodule(n) for n in names], mesh=mesh,
                    reshard_after_forward=not key.endswith(" index"))
    root = ShardedGraph(gm)
    fully_shard(root, mesh=mesh)
    return root


def _is_dtensor(t: torch.Tensor) -> bool:
    """isinstance(t, DTensor), without importing torch.distributed.tensor before any DTensor can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _rows(t: torch.Tensor) -> tuple[int, int] | None:
    """This rank's rows [start, stop) of a DTensor sharded on dim 0; None for a whole (replicated or plain) tensor."""
    if not _is_dtensor(t):
        return None
    from torch.distributed.tensor import Shard

    if tuple(t.placements) != (Shard(0),):
        raise AssertionError(f"unexpected placements {t.placements}")
    n, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = math.ceil(n / world)
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    if t.to_local().shape[0] != stop - start:
        raise AssertionError(f"local shard of {stop - start} rows expected, FSDP holds {t.to_local().shape[0]}")
    return start, stop


def copy_rows(dst: torch.Tensor, src) -> None:
    """dst.copy_(src), where `dst` may be sharded (an FSDP parameter or its AdamW moment): only this rank's rows of
    `src` are read (a tensor, or a safetensors slice: then only those rows are read from the file)."""
    shape = list(src.get_shape()) if hasattr(src, "get_shape") else list(src.shape)
    if shape != list(dst.shape):
        raise ValueError(f"shape {shape}, expected {list(dst.shape)}")
    rows = _rows(dst)
    with torch.no_grad():
        if rows is None:
            dst.copy_(src if isinstance(src, torch.Tensor) else src[:])
        elif rows[1] > rows[0]:
            dst.to_local().copy_(src[rows[0]:rows[1]])


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one is all-gathered (a collective: every rank calls it, in the same order)."""
    with torch.no_grad():
        return t.full_tensor() if _is_dtensor(t) else t


def materialize(root: torch.nn.Module, gm: torch.fx.GraphModule, weights, device: str,
                buffers: dict[str, torch.Tensor]) -> None:
    """Allocate the sharded model built on the meta device on `device` and fill it: every parameter's local rows from
    `weights` (dicts of full tensors by our names, one layer at a time), the named buffers from `buffers`."""
    root.to_empty(device=device)
    params = dict(gm.named_parameters())  # a tied head is the embedding's parameter, listed once
    loaded = set()
    for state in weights:
        for name, t in state.items():
            if name in params:
                copy_rows(params[name], t)
                loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise M3CompileError(f"the checkpoint has no tensor {missing[0]} ({len(missing)} missing in all)")
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(owner), leaf, value.to(device))


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank keeps between steps: the local shard of a sharded parameter, all of a
    whole one."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if _is_dtensor(p) else p
        total += local.numel() * local.element_size()
    return total


def needs_sharding(model: torch.nn.Module, trained: dict[str, torch.nn.Parameter], device: str,
                   trained_dtype: torch.dtype | None = None) -> bool:
    """Whether one replica of the run would take more than 80% of the memory free to this rank: the weights plus,
    for the trained parameters, their gradients and AdamW's two moments (in `trained_dtype`, e.g. fp32 master
    weights, else their own). Free memory: the GPU's on CUDA; on the CPU, MemAvailable shared by the local ranks.
    Activations are not counted (they shrink with --batch and --seq-len, the model does not)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = sum(p.numel() * (torch.empty((), dtype=trained_dtype).element_size() if trained_dtype else p.element_size())
                for p in trained.values()) * 3
    dev = torch.device(device)
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        free = _available_ram() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return weights + extra > 0.8 * free


def _available_ram() -> int:
    return int(available_bytes("cpu") or 0)  # the one reading of the system's available memory
