"""Where a generation's time goes: seconds per phase, the Triton compiles inside them, the kernel variants launched.

    timings = Timings(device)
    with timings.watch():                      # counts compiles and kernel variants while the run lasts
        timings.mark("prefill")                # ends the phase before; CUDA synchronised here (only when timing)
        ...
        timings.mark("decode")
    timings.to_dict()  # {"prefill": s, ..., "compile": s, "compiles": n, "kernel_variants": n, ...}

A phase's seconds exclude the Triton compiles that ran inside it; those are summed, per phase and in all, as
"compile" (each first launch of a kernel specialisation: a compile on a cold cache, a load from Triton's persistent
cache, TRITON_CACHE_DIR or ~/.triton/cache, on a warm one; an autotuning sweep where M3C_AUTOTUNE is on and the
sweep's result is not on disk yet). Which kernels were compiled anew rather than loaded is "compiled_anew" (the
binaries Triton wrote to its cache in the run), with "modules_built" (the C launchers and driver modules it built).
So "prefill" is the steady cost of the prompt and "compile_prefill" what the first run adds.

The kernel census (`kernel_census`) counts the distinct specialisations the run launches, as Triton keys its
compiled binaries: each kernel's constexpr values, the launch options, the dtype and 16-byte alignment of every
pointer, and for integer arguments Triton specialises (all but `do_not_specialize`) whether they are 1 or a multiple
of 16. On a cold cache each variant is one compile. It works on CUDA and under TRITON_INTERPRET=1 (CPU), where no
compile happens, so the CPU suite checks that a prompt's length does not add variants.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import time
from collections import defaultdict

import torch

from m3compile.kernels._common import interpreting

__all__ = ["Timings", "kernel_census", "NULL_TIMINGS"]


def _python_function(kernel):
    """(the plain Python function under a Triton kernel object, its do_not_specialize names)."""
    obj, dns = kernel, []
    while not inspect.isfunction(obj):
        dns = getattr(obj, "do_not_specialize", None) or (getattr(obj, "kwargs", None) or {}).get(
            "do_not_specialize") or dns
        obj = obj.fn
    names = list(inspect.signature(obj).parameters)
    return obj, {names[d] if isinstance(d, int) else d for d in dns or ()}


class _Census:
    """Distinct launch specialisations per kernel (see the module docstring)."""

    def __init__(self):
        self.variants: dict[str, set] = defaultdict(set)
        self._signatures: dict[int, tuple] = {}

    def _signature(self, kernel):
        key = id(kernel)
        if key not in self._signatures:
            fn, dns = _python_function(kernel)
            params = inspect.signature(fn).parameters
            const = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
            self._signatures[key] = (fn.__name__, list(params), const, dns)
        return self._signatures[key]

    def record(self, kernel, args, kwargs) -> None:
        name, names, const, dns = self._signature(kernel)
        bound = dict(zip(names, args)) | kwargs
        key = []
        for n, v in sorted(bound.items()):
            if n in const or n not in names:  # constexprs, and launch options (num_warps, num_stages)
                key.append((n, v))
            elif isinstance(v, torch.Tensor):
                key.append((n, str(v.dtype), v.data_ptr() % 16 == 0))
            elif isinstance(v, bool) or n in dns:
                key.append((n, type(v).__name__))
            elif isinstance(v, int):
                key.append((n, v == 1, v % 16 == 0))
            elif v is None or isinstance(v, float):
                key.append((n, type(v).__name__))
            else:  # a tensor descriptor and the like: its type and block shape
                key.append((n, type(v).__name__, tuple(getattr(v, "block_shape", ()))))
        self.variants[name].add(tuple(key))

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.variants.values())

    def per_kernel(self) -> dict[str, int]:
        return {k: len(v) for k, v in sorted(self.variants.items())}


@contextlib.contextmanager
def kernel_census():
    """Record every `kernel[grid](...)` launch's specialisation while the block runs; yields the census (`.count`,
    `.per_kernel()`). Autotuned kernels are counted per launch arguments (their config's constexprs are the
    tuner's: one config under M3C_AUTOTUNE=0 or the interpreter)."""
    census = _Census()
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:  # no Triton: nothing launches
        yield census
        return
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)

        def counted(*args, **kwargs):
            census.record(self, args, kwargs)
            return launch(*args, **kwargs)
        return counted

    KernelInterface.__getitem__ = getitem
    try:
        yield census
    finally:
        KernelInterface.__getitem__ = original


class Timings:
    """Seconds per phase of a run, with the Triton compile time inside each phase counted apart (module docstring).
    CUDA is synchronised at each phase boundary, so a phase's seconds are its GPU work, not its launch time."""

    def __init__(self, device=None):
        try:
            device = torch.device(device if device is not None else "cpu")
        except (RuntimeError, TypeError):  # a malformed name: the loader that follows reports it
            device = torch.device("cpu")
        self._cuda = device if device.type == "cuda" else None
        # Triton runs on CUDA and under the interpreter: only then are its launches and compiles watched, and it is
        # imported now, not inside a timed phase (elsewhere generation never imports it)
        self._triton = (self._cuda is not None or interpreting()) and importlib.util.find_spec("triton") is not None
        if self._triton:
            importlib.import_module("triton.runtime.autotuner")
            importlib.import_module("triton.compiler.compiler")
        self.seconds: dict[str, float] = {}
        self.compile_seconds: dict[str, float] = defaultdict(float)
        self.compiles = 0
        self.written: set[str] = set()  # files Triton wrote to its persistent cache in the run (FileCacheManager.put)
        self.census: _Census | None = None
        self._phase: str | None = None
        self._started = self._compiled_before = 0.0
        self.extra: dict[str, float | int] = {}

    def _sync(self) -> None:
        if self._cuda is not None and torch.cuda.is_initialized():  # (before CUDA starts, nothing can be pending)
            torch.cuda.synchronize(self._cuda)

    def mark(self, name: str | None) -> None:
        """End the current phase and start phase `name` (None: none); a phase's seconds add up over its entries,
        less the compiles inside it."""
        self._sync()
        now = time.perf_counter()
        if self._phase is not None:
            spent = now - self._started - (self.compile_seconds[self._phase] - self._compiled_before)
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + spent
        self._phase, self._started = name, now
        self._compiled_before = self.compile_seconds[name] if name is not None else 0.0

    def stop(self) -> None:
        self.mark(None)

    def add(self, name: str, value) -> None:
        """A figure of the run besides the phases (a count, a length)."""
        self.extra[name] = value

    @contextlib.contextmanager
    def watch(self):
        """Count Triton compiles (with their seconds, per phase) and the kernel variants launched inside the block."""
        if not self._triton:
            try:
                yield self
            finally:
                self.stop()
            return
        with kernel_census() as census, self._compile_hooks():
            self.census = census
            try:
                yield self
            finally:
                self.stop()

    @contextlib.contextmanager
    def _compile_hooks(self):
        """Wrap Triton's compile entry (JITFunction._do_compile: a compile, or a load from the persistent cache), a
        compiled kernel's first load onto the GPU (CompiledKernel._init_handles) and the autotuner's sweep
        (Autotuner._bench); each is absent from some Triton versions, and then not counted."""
        try:
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.autotuner import Autotuner
            from triton.runtime.jit import JITFunction
        except ImportError:
            yield
            return
        patched = []
        depth = [0]  # a sweep compiles its configs: only the outermost wrapped call adds its seconds

        def wrap(cls, name, counts: bool):
            original = getattr(cls, name, None)
            if original is None:
                return

            def timed(obj, *args, **kwargs):
                start = time.perf_counter()
                depth[0] += 1
                try:
                    return original(obj, *args, **kwargs)
                finally:
                    depth[0] -= 1
                    self.compiles += counts
                    if depth[0] == 0:
                        self.compile_seconds[self._phase or "other"] += time.perf_counter() - start
            setattr(cls, name, timed)
            patched.append((cls, name, original))

        wrap(JITFunction, "_do_compile", True)
        wrap(CompiledKernel, "_init_handles", False)
        wrap(Autotuner, "_bench", False)
        try:  # what was compiled anew, not loaded: the files Triton puts into its persistent cache
            from triton.runtime.cache import FileCacheManager
        except ImportError:
            FileCacheManager = None
        if FileCacheManager is not None:
            put = FileCacheManager.put

            def recorded(manager, data, filename, *args, **kwargs):
                self.written.add(str(filename))
                return put(manager, data, filename, *args, **kwargs)
            FileCacheManager.put = recorded
            patched.append((FileCacheManager, "put", put))
        try:
            yield
        finally:
            for cls, name, original in reversed(patched):
                setattr(cls, name, original)

    @property
    def timed(self) -> float:
        """The seconds of every phase and of the compiles inside them."""
        return sum(self.seconds.values()) + sum(self.compile_seconds.values())

    def to_dict(self) -> dict:
        """{phase: s}, "timed": their sum with the compiles', "compile": s in all, "compile_<phase>": s where a phase
        compiled, "compiles", the census' "kernel_variants" and per kernel, the added figures, and what follows from
        them: "decode_per_token" (decode seconds over "decode_steps") and "new_tokens_per_s" ("new_tokens" over
        decode seconds)."""
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        out["timed"] = round(self.timed, 4)
        out["compile"] = round(sum(self.compile_seconds.values()), 4)
        out.update({f"compile_{k}": round(v, 4) for k, v in self.compile_seconds.items() if v})
        out["compiles"] = self.compiles
        if self._triton:  # kernels compiled anew (their binaries written to Triton's cache), and C modules built
            out["compiled_anew"] = sorted(f.rsplit(".", 1)[0] for f in self.written if f.endswith((".cubin", ".hsaco")))
            out["modules_built"] = sum(f.endswith(".so") for f in self.written)
        if self.census is not None:
            out["kernel_variants"] = self.census.count
            out["kernel_variants_per_kernel"] = self.census.per_kernel()
        out.update(self.extra)
        if out.get("decode_steps") and "decode" in out:
            out["decode_per_token"] = round(out["decode"] / out["decode_steps"], 5)
        if out.get("new_tokens") and out.get("decode", 0) > 0:  # a batch's throughput: all its sequences' tokens
            out["new_tokens_per_s"] = round(out["new_tokens"] / out["decode"], 2)
        return out


class _NoTimings:
    """What generate uses when not timing: phases that do nothing (no synchronisation, no hooks)."""

    def mark(self, name: str | None) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextlib.contextmanager
    def watch(self):
        yield self

    def add(self, name: str, value) -> None:
        pass


NULL_TIMINGS = _NoTimings()
