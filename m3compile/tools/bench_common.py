"""What the model benches share (`m3c bench --distill`, `m3c bench --model`): the dense and converted models,
CUDA-event timing, and per-stage attribution of one profiled run through torch.profiler ranges.

    bench_models(model, ...)      (dense Decoder, converted Decoder sharing its weights, description, conversion check)
    median_ms(fn, ...)            median milliseconds of repeated runs after warm-up (CUDA events on a GPU), peak memory
    profile_run(fn, device)       one run under torch.profiler -> Profile
    Profile.scope_ms(name)        device ms of the kernels launched inside the ranges called `name`
    Profile.stages(labels)        the run's time split over groups of ranges: each kernel (or, on a CPU, each op)
                                  counts for the outermost labelled range around it, the rest for "rest", and the
                                  time the device waited ("host") closes the sum to the run's wall time
    module_ranges(model, classify)  profiler ranges around the modules `classify` names (hooks, while active)

Ranges come from the graph ops (m3compile.ops: m3c.msa_select, m3c.msa_attention, ...), the decode step
(m3c.decode_select, m3c.decode_attention), the training steps (m3c.forward, ...) and `module_ranges`.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from m3compile.config import MSAConfig, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.io.load import from_preset, load
from m3compile.models.decoder import PRESETS, Decoder
from m3compile.pipelines import convert

__all__ = ["bench_models", "conversion_check", "median_ms", "profile_run", "Profile", "kernel_us", "module_ranges",
           "sync", "is_cuda", "bench_presets"]


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def bench_presets() -> list[str]:
    """Presets a bench can build with random weights (m3 itself is too large for one device)."""
    return [p for p in PRESETS if p != "m3"]


def bench_models(model: str, *, device, dtype: str = "bfloat16", block: int = 128, topk: int = 16,
                 dense_layers: tuple[int, ...] = (0,), n_layers: int | None = None
                 ) -> tuple[Decoder, Decoder, str, dict | None]:
    """(dense model, converted model sharing its weights, description, conversion check) for a checkpoint
    directory (dense: converted in memory with block / topk / dense_layers; converted: the dense twin without the
    index branch) or a preset (random weights built directly on `device`). The check (`conversion_check`) is None
    for a checkpoint that was already converted. `n_layers`: a preset's first layers only (same shapes, shallower)."""
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
        gm, _ = convert(dense, MSAConfig(block_size=block, topk=topk, dense_layers=dense_layers))
        check = conversion_check(gm, dense)
        sparse_args = gm.meta["model_args"]
        state = dict(gm.state_dict())
    else:
        sparse_args, state, converted = args, dict(dense.state_dict()), dense
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
    """Device microseconds of the kernels an op launched, its children's included."""
    total = sum(float(getattr(k, "duration", 0.0)) for k in getattr(event, "kernels", ()) or ())
    return total + sum(kernel_us(c) for c in getattr(event, "cpu_children", ()) or ())


def _own_kernel_us(event) -> float:
    return sum(float(getattr(k, "duration", 0.0)) for k in getattr(event, "kernels", ()) or ())


@dataclass
class Profile:
    """One profiled run: its host-side events (ops and ranges, with their kernels on a GPU) and wall time."""

    events: list
    cuda: bool
    wall_ms: float
    device_busy_ms: float  # the device events' total time (0 on a CPU)
    device_kernel_ms: float = 0.0  # the same without events named like a host op or range (GPU annotations)

    def scope_ms(self, name: str) -> float:
        """Device ms of the kernels launched inside every range called `name` (CPU ms of those ranges on a CPU)."""
        if self.cuda:
            return sum(kernel_us(e) for e in self.events if e.name == name) / 1e3
        return sum(e.cpu_time_total for e in self.events if e.name == name and not _inside(e, name)) / 1e3

    def stages(self, labels: dict[str, str]) -> dict[str, float]:
        """{stage: ms} over the stages of `labels` (range name -> stage), plus "rest" (kernels, or ops on a CPU,
        outside every labelled range) and "host" (wall time minus everything attributed: launch gaps, Python).
        A kernel inside nested labelled ranges counts once, for the outermost. The values sum to wall_ms."""
        out = dict.fromkeys(list(dict.fromkeys(labels.values())) + ["rest"], 0.0)

        def walk(e):
            stage = labels.get(e.name)
            if stage is not None:
                out[stage] += (kernel_us(e) if self.cuda else e.cpu_time_total) / 1e3
                return
            out["rest"] += (_own_kernel_us(e) if self.cuda else e.self_cpu_time_total) / 1e3
            for c in e.cpu_children or ():
                walk(c)

        for e in self.events:
            if e.cpu_parent is None:
                walk(e)
        out["host"] = self.wall_ms - sum(out.values())
        return out


    def kernels_outside_ops_ms(self) -> float:
        """Device ms of kernels the profiler tied to no host op (they count in no stage; 0 on a CPU): a check
        that the stages saw every kernel. Ranges mirrored on the device (GPU user annotations) are not kernels."""
        if not self.cuda:
            return 0.0
        return max(0.0, self.device_kernel_ms - sum(kernel_us(e) for e in self.events if e.cpu_parent is None) / 1e3)


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
    return Profile(cpu, cuda, wall, busy, kernels)


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
