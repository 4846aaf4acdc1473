"""Kernels compiled ahead, the reading side: MODEL/kernel-cache (what `m3c compile MODEL` writes, through
m3compile.runtime.compile_ahead), what it was built for, and pointing this process's Triton cache at it.

A run's Triton kernels are JIT specialisations that depend on the model's shapes, the dtypes and the run's sizes,
never on the weights; compiled once into the model's folder, later runs load them instead of compiling.

    MODEL/kernel-cache/manifest.json  what it was built for (`identity`: the model's config.json, the GPU, Triton,
                                      torch, m3compile), the options, the variants and the seconds it took
    MODEL/kernel-cache/variants.json  every kernel variant the synthetic runs launched (timings.kernel_census keys)
    MODEL/kernel-cache/<hash>/...     Triton's compiled kernels (its persistent cache layout)

`activate(MODEL)` points this process's Triton cache (TRITON_CACHE_DIR) at MODEL/kernel-cache when the manifest
matches this model and this GPU; a cache built for another model, GPU, Triton or torch is never used: rebuilt by the
caller's `rebuild` where the folder is writable (m3c generate), otherwise left aside (the run compiles into Triton's
default cache). A kernel-cache without m3compile's manifest is not m3compile's (a build moves its folder into place
whole): never used, replaced nor rebuilt. The remote code (modeling_m3compile.py) activates it too.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from m3compile.errors import M3CompileError
from m3compile.kernels._common import interpreting

__all__ = ["CACHE_DIR", "MANIFEST", "VARIANTS", "identity", "status", "relocate", "read_manifest", "activate",
           "Activation"]

CACHE_DIR = "kernel-cache"
MANIFEST = "manifest.json"
VARIANTS = "variants.json"
FORMAT = 1


def _gpu() -> tuple[str, str | None]:
    """(this process's kernel target, its compute capability): the CUDA device's name, or the interpreter's."""
    import torch

    if interpreting():
        return "triton-interpreter", None
    if not torch.cuda.is_available():
        raise M3CompileError("compiling kernels ahead needs a CUDA GPU (or TRITON_INTERPRET=1 to run them on the CPU)")
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"{major}.{minor}"


def identity(model_dir: str | os.PathLike) -> dict:
    """What a kernel cache must have been built for to be used here: the model (sha256 of its config.json: shapes,
    MSA settings), the GPU and its compute capability, Triton, torch and m3compile."""
    import torch
    import triton

    config = Path(model_dir) / "config.json"
    try:
        digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    except OSError as e:
        raise M3CompileError(f"{config}: cannot read ({e.strerror or e})") from None
    gpu, capability = _gpu()
    return {"format": FORMAT, "model": digest, "gpu": gpu, "capability": capability, "triton": triton.__version__,
            "torch": torch.__version__, "m3compile": importlib.metadata.version("m3compile")}


def _foreign(folder: Path) -> str:
    """Why `folder` (MODEL/kernel-cache) is not m3compile's: a build moves its folder into place whole, manifest
    included, so one without a readable manifest was put there by someone else, and is neither used nor replaced."""
    what = "a folder" if folder.is_dir() else "a file"
    return f"{folder} is {what} m3compile did not write (no readable {MANIFEST}): move it aside for a kernel cache"


def relocate(folder: str | os.PathLike, at: str | os.PathLike | None = None) -> int:
    """Point the cache's file groups at the folder's place: Triton's FileCacheManager records a compiled kernel's
    files in `<hash>/__grp__<name>.json` by absolute path, and takes a group whose paths are missing for a miss, so a
    cache built elsewhere (the build's temporary folder; a model folder moved or copied since) would compile every
    kernel again. at: where the folder is or will be (default: where it is). Returns the groups rewritten."""
    folder = Path(folder)
    at = Path(at if at is not None else folder).resolve()
    rewritten = 0
    for group in folder.glob("*/__grp__*.json"):
        try:
            data = json.loads(group.read_text())
        except (OSError, ValueError):
            continue  # not a group Triton can read either: a miss, as before
        paths = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(paths, dict):
            continue
        here = {name: str(at / group.parent.name / Path(str(p)).name) for name, p in paths.items()}
        if here != paths:
            tmp = group.with_name(f".{group.name}.tmp")
            tmp.write_text(json.dumps(data | {"child_paths": here}))
            os.replace(tmp, group)
            rewritten += 1
    return rewritten


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """A kernel-cache folder's manifest, or None where it is missing or unreadable."""
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_WHAT = {"model": "another model (config.json differs)", "gpu": "GPU {0}", "capability": "compute capability {0}",
         "triton": "Triton {0}", "torch": "torch {0}", "m3compile": "m3compile {0}", "format": "cache format {0}"}


def status(model_dir: str | os.PathLike) -> tuple[str, str]:
    """("none" | "valid" | "stale" | "foreign", why): whether MODEL/kernel-cache exists, is m3compile's (foreign: a
    folder or file without its manifest) and was built for this model and GPU."""
    folder = Path(model_dir) / CACHE_DIR
    if not folder.exists():
        return "none", ""
    manifest = read_manifest(folder)
    if manifest is None:
        return "foreign", _foreign(folder)
    here = identity(model_dir)
    for key in _WHAT:
        if manifest.get(key) != here[key]:
            return "stale", f"built for {_WHAT[key].format(manifest.get(key))}, not {here[key]}" if key != "model" \
                else f"built for {_WHAT[key]}"
    return "valid", ""


@dataclass
class Activation:
    """What `activate` did: state "used" (a valid cache), "rebuilt" (a stale one, built again), "stale" (a stale
    one in a folder it cannot write: not used), "foreign" (a kernel-cache m3compile did not write: not used, not
    replaced), "none" (no cache); why (a stale or foreign cache's reason); seconds."""
    state: str
    why: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"kernel_cache": self.state, "kernel_cache_s": round(self.seconds, 4)}


def activate(model_dir: str | os.PathLike, *, rebuild=None, warn=None) -> Activation:
    """Point this process's Triton cache (TRITON_CACHE_DIR) at MODEL/kernel-cache when it was built for this model
    and GPU; before any kernel compiles. A stale cache is rebuilt first by rebuild(the stale manifest or {}) where
    one is given and the folder is writable, else not used; warn(line) says which."""
    start = time.perf_counter()
    folder = Path(model_dir) / CACHE_DIR
    state, why = status(model_dir)
    if state == "foreign":
        if warn is not None:
            warn(f"{why}; not used (kernels compile into Triton's own cache)")
        return Activation("foreign", why, time.perf_counter() - start)
    if state == "stale":
        if rebuild is not None and os.access(model_dir, os.W_OK):
            if warn is not None:
                warn(f"kernel cache {folder} was {why}: rebuilding it")
            rebuild(read_manifest(folder) or {})
            state = "rebuilt"
        else:
            if warn is not None:
                warn(f"kernel cache {folder} was {why}; not used (kernels compile into Triton's own cache; "
                     f"m3c compile {model_dir} rebuilds it)")
            return Activation("stale", why, time.perf_counter() - start)
    if state in ("valid", "rebuilt"):
        try:
            relocate(folder)  # a model folder moved or copied since the build
        except OSError as e:
            why = f"moved since it was built, and its file groups cannot be rewritten ({e.strerror or e})"
            if warn is not None:
                warn(f"kernel cache {folder} was {why}; not used")
            return Activation("stale", why, time.perf_counter() - start)
        path = str(folder.resolve())
        os.environ["TRITON_CACHE_DIR"] = path
        try:  # a Triton that reads its knobs once: set it there too
            from triton import knobs

            knobs.cache.dir = path
        except (ImportError, AttributeError):
            pass
        return Activation("used" if state == "valid" else state, why, time.perf_counter() - start)
    return Activation("none", "", time.perf_counter() - start)


