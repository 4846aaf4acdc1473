"""What the model benches share (`m3c bench distill`, `m3c bench model`): the dense and converted models,
CUDA-event timing, and per-stage attribution of one profiled run through torch.profiler ranges.

    bench_models(model, ...)      (dense Decoder, converted Decoder sharing its weights, description, conversion check)
    median_ms(fn, ...)            median milliseconds of repeated runs after warm-up (CUDA events on a GPU), peak memory
    profile_run(fn, device)       one run under torch.profiler -> Profile
    Profile.scope_ms(name)        device ms of the kernels launched inside the ranges called `name`
    Profile.attribute(labels)     the run's work booked to stages, each kernel once (on a CPU each op's self time),
                                  to the innermost labelled range that launched it, "rest" outside every one,
                                  "unattributed" where the profiler recorded no launch (named, never dropped)
    Profile.stages(labels)        the same plus "host" (the time the device waited), summing to the wall time
    module_ranges(model, classify)  profiler ranges around the modules `classify` names (hooks, while active)

Ranges come from the graph ops (m3compile.ops: m3c.msa_select, m3c.msa_attention, ...), the decode step
(m3c.decode_select, m3c.decode_attention), the training steps (m3c.forward, ...) and `module_ranges`.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from m3compile.config import MSAConfig, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.io.load import from_preset, load
from m3compile.models.decoder import PRESETS, Decoder
from m3compile.conversion.convert import convert

__all__ = ["bench_models", "conversion_check", "median_ms", "profile_run", "union_us", "Profile", "Attribution",
           "kernel_us", "module_ranges", "sync", "is_cuda", "bench_presets"]


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def bench_presets() -> list[str]:
    """Presets a bench can build with random weights (m3 itself is too large for one device)."""
    return [p for p in PRESETS if p != "m3"]


def bench_models(model: str, *, device, dtype: str = "bfloat16", block: int | None = None, topk: int | None = None,
                 dense_layers: tuple[int, ...] | None = None, n_layers: int | None = None, index_dtype: str = "auto",
                 index_dim: int | None = None, default_msa: tuple[int, int] = (128, 16),
                 top_p: float | None = None, min_blocks: int | None = None,
                 ) -> tuple[Decoder, Decoder, str, dict | None]:
    """(dense model, converted model sharing its weights, description, conversion check) for a checkpoint
    directory (dense: converted in memory with block / topk / dense_layers, None: `default_msa`'s; converted: the
    dense twin without the index branch, and a block or topk other than its own is refused) or a preset (random weights built directly on `device`). The check (`conversion_check`) is None
    for a checkpoint that was already converted. `n_layers`: a preset's first layers only (same shapes, shallower).
    `index_dtype` "fp8": the MSA layers score with e4m3 (MSAConfig.index_dtype; a converted checkpoint's is replaced).
    `index_dim`: the conversion's index head dim (MSAConfig.index_dim; a dense model or preset only). `top_p`,
    `min_blocks`: the conversion's adaptive budget (MSAConfig's; a dense model or preset only; None: none).
    `dense_layers`: the conversion's (None: layer 0; a converted model's own, which another is refused)."""
    torch_dtype = parse_dtype(dtype)
    path = Path(model)
    if path.is_dir():
        dense = load(path, dtype=torch_dtype, device=device)
        what = str(path)
    elif model in bench_presets():
        with torch.device(device):
            dense = from_preset(model, n_layers=n_layers).to(torch_dtype)
        what = f"preset {model} (random weights)" + (f", first {n_layers} layers" if n_layers else "")
    else:
        raise M3CompileError(f"{model}: neither a checkpoint directory nor a preset ({', '.join(bench_presets())})")
    args = dense.args
    check = None
    if args.msa is None:  # dense: convert in memory
        adaptive = {k: v for k, v in (("top_p", top_p), ("min_blocks", min_blocks)) if v is not None}
        gm, _ = convert(dense, MSAConfig(block_size=block or default_msa[0], topk=topk or default_msa[1],
                                         dense_layers=(0,) if dense_layers is None else dense_layers,
                                         index_dtype=index_dtype, index_dim=index_dim, **adaptive))
        check = conversion_check(gm, dense)
        sparse_args = gm.meta["model_args"]
        state = dict(gm.state_dict())
    else:
        for option, asked, own in (("--index-dim", index_dim, args.msa.index_dim),
                                   ("--block", block, args.msa.block_size), ("--topk", topk, args.msa.topk),
                                   ("--top-p", top_p, args.msa.top_p),
                                   ("--min-blocks", min_blocks, args.msa.min_blocks),
                                   ("--dense-layers", dense_layers, None if dense_layers is None else tuple(
                                       i for i in range(args.n_layers) if not args.is_sparse(i)))):
            if asked is not None and asked != own:
                raise M3CompileError(f"{model} is already converted with {option[2:]} {own}: {option} {asked} "
                                     f"cannot apply to it (it needs its dense source)")
        sparse_args, state, converted = args, dict(dense.state_dict()), dense
        if index_dtype != "auto":
            sparse_args = args.replace(msa=dataclasses.replace(args.msa, index_dtype=index_dtype))
        with torch.device("meta"):
            dense = Decoder(args.replace(sparse_layers=None, msa=None))
        dense.load_state_dict({k: v for k, v in state.items() if ".index_" not in k}, strict=False, assign=True)
        dense.model.rotary_emb.inv_freq = converted.model.rotary_emb.inv_freq
    with torch.device("meta"):
        sparse = Decoder(sparse_args)
    sparse.load_state_dict({k: v for k, v in state.items() if k in sparse.state_dict()}, strict=False, assign=True)
    sparse.model.rotary_emb.inv_freq = dense.model.rotary_emb.inv_freq
    if args.tie_embeddings:
        for m in (dense, sparse):
            m.lm_head.weight = m.model.embed_tokens.weight
    return dense.eval(), sparse.eval(), what, check


def conversion_check(gm: torch.nn.Module, source: torch.nn.Module) -> dict:
    """Whether conversion kept the source model's device and dtype for the tensors it added: every parameter and
    buffer of `gm` on the source's device, floating ones in its dtype (RoPE frequencies stay fp32 by design)."""
    p0 = next(source.parameters())
    bad = []
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        if t.device != p0.device or (t.is_floating_point() and t.dtype != p0.dtype):
            bad.append(f"{name}: {t.device} {str(t.dtype).replace('torch.', '')}")
    added = sorted(n for n, _ in gm.named_parameters() if ".index_" in n)
    return {"device": str(p0.device), "dtype": str(p0.dtype).replace("torch.", ""), "tensors_added": len(added),
            "mismatched": bad, "ok": not bad}


def median_ms(fn: Callable[[], object], *, steps: int, warmup: int, device) -> tuple[float, float]:
    """(median ms, peak memory GB) of fn() over `steps` runs after `warmup` untimed ones."""
    cuda = is_cuda(device)
    for _ in range(warmup):
        fn()
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
    return statistics.median(times), peak


def kernel_us(event) -> float:
    """Device microseconds of the kernels the profiler tied to an op, its children's included. Not exclusive: a
    record_function range's list also holds its GPU annotation (a device event spanning the range's kernels), and a
    kernel launched with no aten op on the stack is tied to nothing (`Profile.attribute` does not use these lists)."""
    total = sum(float(getattr(k, "duration", 0.0)) for k in getattr(event, "kernels", ()) or ())
    return total + sum(kernel_us(c) for c in getattr(event, "cpu_children", ()) or ())


_LAUNCH_TYPES = ("cuda_runtime", "cuda_driver")
_LAUNCH_NAME = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def _activity(event) -> str:
    return str(getattr(event, "activity_type", "") or "")


def _is_launch(event) -> bool:
    """A CUDA runtime or driver call on the host (its id is the CUPTI correlation id of what it launched)."""
    kind = _activity(event)
    return kind in _LAUNCH_TYPES if kind else bool(_LAUNCH_NAME.match(event.name))


_WORK_TYPES = ("kernel", "gpu_memcpy", "gpu_memset")


def _is_work(event, host_names: set[str]) -> bool:
    """A device event that occupies the device: a kernel, copy or set; not a range's device-side mirror (GPU user
    annotation), a stream synchronisation or profiler overhead. Without activity types (older torch): every device
    event not named like a host op or range."""
    kind = _activity(event)
    if kind:
        return kind in _WORK_TYPES
    return not getattr(event, "is_user_annotation", False) and event.name not in host_names


@dataclass(frozen=True)
class Attribution:
    """Work of one profiled run booked to stages, each piece once (`Profile.attribute`)."""

    stages: dict[str, float]  # ms per stage, "rest" (launched outside every labelled range) and "unattributed"
    work_ms: float  # the sum of every kernel, copy and set (on a CPU: of every op's self time): sum(stages)
    busy_ms: float  # the union of the device work's intervals (< work_ms where streams overlap; work_ms on a CPU)
    routes: dict[str, int]  # device work by how its launch was found: "launch", "op", "none" (empty on a CPU)
    top: dict[str, list]  # per stage, its largest kernels (ops on a CPU): [name, ms], largest first


class _Segments:
    """The labelled ranges flattened on the host's time line: each time -> the range that owns work launched then.

    Owner: the innermost active range (the latest started), except that a range in `enclosing` keeps everything
    launched inside it (the innermost enclosing one wins)."""

    def __init__(self, ranges: list, enclosing: frozenset[str]):
        points = sorted({t for e in ranges for t in (e.time_range.start, e.time_range.end)})
        by_start = sorted(ranges, key=lambda e: (e.time_range.start, -e.time_range.end))
        self.starts, self.owners, active, i = points, [], [], 0
        for t in points:
            while i < len(by_start) and by_start[i].time_range.start <= t:
                active.append(by_start[i])
                i += 1
            active = [e for e in active if e.time_range.end > t]
            pick = [e for e in active if e.name in enclosing] or active
            self.owners.append(max(pick, key=lambda e: e.time_range.start).name if pick else None)

    def owner(self, t: float) -> str | None:
        j = bisect.bisect_right(self.starts, t) - 1
        return self.owners[j] if j >= 0 else None


@dataclass
class Profile:
    """One profiled run: its host-side events (ops, ranges, CUDA runtime calls), its device events (kernels, copies,
    sets, range annotations; empty on a CPU) and wall time."""

    events: list
    cuda: bool
    wall_ms: float
    device_busy_ms: float  # the device events' total time, range annotations included (0 on a CPU)
    device_kernel_ms: float = 0.0  # the same without events named like a host op or range (GPU annotations)
    device_events: list = field(default_factory=list)

    def scope_ms(self, name: str) -> float:
        """Device ms of the kernels launched inside every range called `name` (CPU ms of those ranges on a CPU)."""
        if self.cuda:
            return sum(kernel_us(e) for e in self.events if e.name == name) / 1e3
        return sum(e.cpu_time_total for e in self.events if e.name == name and not _inside(e, name)) / 1e3

    def attribute(self, labels: dict[str, str], enclosing: tuple[str, ...] = ()) -> Attribution:
        """Book every piece of work once, to the stage of the labelled range that launched it (`labels`: range
        name -> stage): the innermost labelled range around the launch, except that a range in `enclosing` keeps
        all work inside it.

        GPU: a kernel's launch is the CUDA runtime or driver call with its CUPTI correlation id (route "launch"),
        else the host op the profiler linked it to ("op"); its stage is the owner of that call's start on the host
        time line (`_Segments`), "rest" where no labelled range was open. A kernel with neither is "unattributed"
        (route "none") and named in `top`. The profiler's per-op kernel lists are not used: a range's list also
        holds its GPU annotation (double counting), and kernels launched with no aten op on the stack (Triton
        kernels called directly inside a range) are in no list at all.
        CPU: each op's self time, to the innermost labelled range among the op and its ancestors (the same
        precedence); outside every one, "rest"."""
        stages = dict.fromkeys(list(dict.fromkeys(labels.values())) + ["rest", "unattributed"], 0.0)
        names: dict[str, dict[str, float]] = {s: {} for s in stages}
        enclosing_set = frozenset(enclosing)
        routes: dict[str, int] = {}

        def book(stage: str, name: str, us: float) -> None:
            stages[stage] += us / 1e3
            names[stage][name] = names[stage].get(name, 0.0) + us / 1e3

        if self.cuda:
            ranges = [e for e in self.events if e.name in labels and not getattr(e, "is_async", False)]
            segments = _Segments(ranges, enclosing_set)
            host_names = {e.name for e in self.events}
            launches, ops = {}, {}
            for e in self.events:
                (launches if _is_launch(e) else ops).setdefault(e.id, e)
            work = [d for d in self.device_events if _is_work(d, host_names)]
            for d in work:
                host, route = launches.get(d.id), "launch"
                if host is None:
                    linked = int(getattr(d, "linked_correlation_id", 0) or 0)
                    host, route = ops.get(linked) if linked > 0 else None, "op"
                route = route if host is not None else "none"
                routes[route] = routes.get(route, 0) + 1
                if host is None:
                    stage = "unattributed"
                else:
                    owner = segments.owner(host.time_range.start)
                    stage = labels[owner] if owner is not None else "rest"
                book(stage, d.name, d.time_range.elapsed_us())
            busy = union_us([(d.time_range.start, d.time_range.end) for d in work]) / 1e3
        else:
            def walk(e, owner: str | None) -> None:
                if e.name in labels and (owner not in enclosing_set or e.name in enclosing_set):
                    owner = e.name
                book(labels[owner] if owner is not None else "rest", e.name, e.self_cpu_time_total)
                for c in e.cpu_children or ():
                    walk(c, owner)

            for e in self.events:
                if e.cpu_parent is None:
                    walk(e, None)
            busy = sum(stages.values())
        top = {s: [[n[:100], round(ms, 3)] for n, ms in sorted(v.items(), key=lambda kv: -kv[1])[:5]]
               for s, v in names.items() if v}
        return Attribution(stages, sum(stages.values()), busy, routes, top)

    def stages(self, labels: dict[str, str], enclosing: tuple[str, ...] = ()) -> dict[str, float]:
        """{stage: ms} of `attribute`, plus "host" (wall time minus the work: launch gaps, Python, and on a CPU the
        time outside every op). The values sum to wall_ms (host may be negative where streams overlap)."""
        a = self.attribute(labels, enclosing)
        return a.stages | {"host": self.wall_ms - a.work_ms}


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlaps counted once): a device time line's busy time."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _inside(event, name: str) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name == name:
            return True
        p = p.cpu_parent
    return False


def profile_run(fn: Callable[[], object], device) -> Profile:
    """Run fn() once under torch.profiler (CPU and, on a GPU, CUDA activity) and return its events."""
    from torch.profiler import ProfilerActivity, profile

    cuda = is_cuda(device)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    cpu = [e for e in events if getattr(e.device_type, "name", "") == "CPU"]
    device = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
    busy = sum(e.time_range.elapsed_us() for e in device) / 1e3
    host_names = {e.name for e in cpu}
    kernels = sum(e.time_range.elapsed_us() for e in device if e.name not in host_names) / 1e3
    return Profile(cpu, cuda, wall, busy, kernels, device)


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module, classify: Callable[[str, torch.nn.Module], str | None]):
    """While active, each module for which classify(qualified name, module) gives a range name runs inside a
    profiler range of that name (forward pre- and post-hooks; a GraphModule's leaf modules included)."""
    handles = []
    for qual, module in model.named_modules():
        name = classify(qual, module)
        if name is None:
            continue
        stack: list = []

        def enter(mod, args, name=name, stack=stack):
            r = torch.profiler.record_function(name)
            r.__enter__()
            stack.append(r)

        def leave(mod, args, out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
