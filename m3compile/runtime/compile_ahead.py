"""Kernels compiled ahead, the building side (`m3c compile MODEL`, which `m3c convert` runs on a GPU): MODEL's
Triton kernel variants compiled once into MODEL/kernel-cache (m3compile.io.kernel_cache: the layout, the manifest,
activation), so that `m3c generate` and the remote code's generate() load them instead of compiling on a first run.

`build` runs the model's own generation on synthetic prompts chosen to meet every specialisation a real prompt can
(lengths of 1, under 16, past the top-k's blocks and not a multiple of 16, past them and a multiple of 16; one
sequence and several; a whole and a chunked prefill; the CUDA-graph and the eager decode step; and, for a model with
remote code, its prompt forward through transformers), in worker processes side by side, each compiling into the
cache folder through Triton's own persistent cache (TRITON_CACHE_DIR). The folder is written as a temporary sibling
and moved into place complete. `activate` is io.kernel_cache's, rebuilding a stale cache with `build`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from m3compile import memory
from m3compile.config import max_positions, parse_budget
from m3compile.errors import M3CompileError
from m3compile.io import kernel_cache as cache
from m3compile.io.hf_config import args_from_config, read_config
from m3compile.io.load import load
from m3compile.kernels._common import interpreting
from m3compile.outputs import atomic_output_dir
from m3compile.runtime.generate import generate
from m3compile.runtime.timings import kernel_census

__all__ = ["build", "activate", "scenarios", "BuildReport", "NEW_TOKENS"]

NEW_TOKENS = 20  # a synthetic run's new tokens: > 8 (generate's CUDA-graph threshold) and past a multiple of 16
EAGER_NEW_TOKENS = 6  # <= 8: generate decodes eagerly
CACHE_CAP = 1 << 18  # the largest cache a synthetic run allocates (positions)


def scenarios(args, max_positions: int | None, batches=(1, 2), new_tokens: int = NEW_TOKENS,
              max_cache: int = CACHE_CAP) -> list[dict]:
    """The synthetic generations whose kernel variants cover a real run's (module docstring): each {"lengths": prompt
    lengths (one per sequence), "new": new tokens, "chunk": prefill chunk or None, "cache": the caches' positions
    where more than the run needs}. `args`: the model's ModelArgs. new_tokens: of the CUDA-graph runs (the eager one
    has at most EAGER_NEW_TOKENS). max_cache: the largest cache a run allocates. A model that stores an answer or
    decode budget, which generate runs by default, gets the runs twice: at its stored budgets, past the largest
    top-k's blocks, and at its own budget alone ("answer_budget": "off", as `--answer-budget off` runs it)."""
    sparse = args.msa is not None and any(args.is_sparse(i) for i in range(args.n_layers))
    topk = args.msa.topk if sparse else 1
    runs = lambda k: _scenarios(args, k, sparse, max_positions, batches, new_tokens, max_cache)  # noqa: E731
    specs = [b for b in (args.msa.answer_budget, args.msa.decode_budget) if b is not None] if sparse else []
    if not specs:
        return runs(topk)
    largest = max([topk] + [parse_budget(b)["topk"] for b in specs if b != "off"])
    return runs(largest) + [dict(s, answer_budget="off") for s in runs(topk)]


def _scenarios(args, topk: int, sparse: bool, max_positions, batches, new_tokens, max_cache) -> list[dict]:
    """scenarios' runs for selections of at most `topk` blocks."""
    block = args.msa.block_size if sparse else 128
    past = (topk + 2) * block  # more blocks than the top-k keeps: the selection's paths
    odd = past + 3 if (past + 3) % 16 else past + 5
    even = -(-(past + 1) // 16) * 16
    limit = (max_positions or 1 << 62) - new_tokens
    odd, even = min(odd, limit - (limit % 16 == 0)), min(even, limit - limit % 16)
    out = [{"lengths": [n], "new": new_tokens, "chunk": None} for n in sorted({1, 13, odd, even}) if n >= 1]
    out.append({"lengths": [odd], "new": min(new_tokens, EAGER_NEW_TOKENS), "chunk": None})
    out.append({"lengths": [odd], "new": new_tokens, "chunk": 2 * block})  # a chunked prefill over its cached prefix
    for b in batches:
        if b > 1:
            out.append({"lengths": ([odd, 13, even] * b)[:b], "new": new_tokens, "chunk": None})
    # the decode's top-k is built per power of two of the caches' pages (16 to 1024, then chunked past 256): caches
    # of each such size, up to the model's positions and max_cache, behind a short prompt
    top = min(limit + new_tokens, max_cache)  # positions a cache may hold
    pages = 16
    while pages <= 2048 and (pages // 2) * block < top:  # some cache of (pages / 2, pages] pages fits
        size = min(pages * block, top)
        if size > odd + new_tokens:
            out.append({"lengths": [odd], "new": min(3, new_tokens), "chunk": None, "cache": size})
        pages *= 2
    return out


def _run_jobs(model_dir: str, device: str, jobs: list[dict]) -> list[tuple[str, str]]:
    """A worker's jobs: per dtype the model loaded once, then each scenario generated (compiling into
    TRITON_CACHE_DIR); the kernel variants they launched, as (kernel, key) strings."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for job in (j for j in jobs if "remote" in j):
        _run_remote(model_dir, device, job)
    for dtype in dict.fromkeys(j["dtype"] for j in jobs if "remote" not in j):
        model = load(model_dir, dtype=dtype, device=device)
        with kernel_census() as census:
            for job in (j for j in jobs if j["dtype"] == dtype and "remote" not in j):
                s = job["scenario"]
                prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen).tolist() for n in s["lengths"]]
                generate(model, prompts, s["new"], prefill_chunk=s["chunk"], kv_cache_dtype=job["kv_cache"],
                         kernels=True if interpreting() else None, cache_len=s.get("cache"),
                         answer_budget=s.get("answer_budget"))
        seen.update((name, repr(k)) for name, keys in census.variants.items() for k in keys)
        del model
    return sorted(seen)


def _run_remote(model_dir: str, device: str, job: dict) -> None:
    """The remote code's prompt forward (modeling_m3compile.py through transformers: m3compile's indexer and sparse
    attention kernels on CUDA) at each of the job's prompt lengths."""
    from transformers import AutoModelForCausalLM

    dtype = job["dtype"] if job["dtype"] == "auto" else getattr(torch, job["dtype"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in job["remote"]:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
            model(input_ids=ids)


def _plan(model_dir: Path, dtypes, kv_caches, batches, new_tokens: int = NEW_TOKENS,
          max_cache: int = CACHE_CAP) -> list[dict]:
    """Every (dtype, kv cache, scenario) job of a build."""
    config = read_config(model_dir)
    args, _ = args_from_config(config)
    runs = scenarios(args, max_positions(config), batches, new_tokens, max_cache)
    jobs = [{"dtype": d, "kv_cache": kv, "scenario": s} for d in dtypes for kv in kv_caches for s in runs]
    if (model_dir / "modeling_m3compile.py").is_file() and not interpreting() \
            and importlib.util.find_spec("transformers") is not None:  # the remote code's kernels run on CUDA only
        lengths = sorted({n for s in runs for n in s["lengths"] if n > 13})
        jobs += [{"dtype": d, "kv_cache": "auto", "remote": lengths} for d in dtypes]
    return jobs


def _cache_bytes(model_dir: Path, jobs: list[dict]) -> int:
    """The largest caches one job allocates: its scenario's batch at its cache's positions (or its prompts' and new
    tokens'), in the model's dtype (fp32 for a float32 job) whatever the job's K/V cache, and index keys."""
    args, _ = args_from_config(read_config(model_dir))
    shape = memory.ModelShape.from_args(args)
    page = args.msa.block_size if args.msa is not None else 128
    most = 0
    for job in jobs:
        s = job.get("scenario")
        if s is None:
            continue
        dtype = torch.float32 if job["dtype"] == "float32" else torch.bfloat16
        tokens = s.get("cache") or max(s["lengths"]) + s["new"]
        most = max(most, len(s["lengths"]) * memory.cache_bytes(shape, tokens, dtype, dtype, dtype, page))
    return most


def _split(model_dir: Path, jobs: list[dict], device: str, workers: int | None) -> list[list[dict]]:
    """The jobs of each worker process. Without `workers`: as many as the CPU count, 8 and the GPU's free memory
    allow (each worker holds the model's weights, a quarter more for its runs and 1 GiB of CUDA context; on top of
    that, the one worker that runs the scenarios of large caches holds the largest of them), at most one per job."""
    big = [j for j in jobs if j.get("scenario", {}).get("cache")]
    rest = [j for j in jobs if not j.get("scenario", {}).get("cache")]
    n = workers or min(os.cpu_count() or 1, 8)
    if workers is None and not interpreting() and str(device).startswith("cuda"):
        weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        if any(j["dtype"] == "float32" for j in jobs):
            weights *= 2  # a bf16 checkpoint loaded in fp32
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        n = min(n, max(1, int((0.8 * free - _cache_bytes(model_dir, big)) // (1.25 * weights + (1 << 30)))))
    n = max(1, min(n, len(jobs)))
    groups = [rest[i::n] for i in range(n)]
    groups[0] = big + groups[0]  # the large caches in one process, so only one holds them at a time
    return [g for g in groups if g]


@dataclass
class BuildReport:
    path: Path
    variants: int
    kernels: int
    seconds: float
    workers: int

    def to_dict(self) -> dict:
        return {"path": str(self.path), "variants": self.variants, "kernels": self.kernels,
                "seconds": round(self.seconds, 2), "workers": self.workers}


def build(model_dir: str | os.PathLike, *, dtypes=("auto",), kv_caches=("auto",), batches=(1, 2),
          device: str | None = None, workers: int | None = None, new_tokens: int = NEW_TOKENS,
          max_cache: int = CACHE_CAP, progress=None) -> BuildReport:
    """Compile MODEL's kernel variants into MODEL/kernel-cache (module docstring), `workers` processes side by side
    (default: one per job, at most the CPU count, 8, and what fits the GPU's free memory: _split).
    device: default cuda where a GPU is present, else the CPU (under the interpreter).
    progress(done, total) after each worker ends.
    new_tokens, max_cache: the synthetic runs' (smaller only to test the build quickly under the interpreter)."""
    model_dir = Path(model_dir).resolve()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # (the CPU: under TRITON_INTERPRET=1)
    if not (model_dir / "config.json").is_file():
        raise M3CompileError(f"{model_dir}: not a model directory (no config.json)")
    if not os.access(model_dir, os.W_OK):
        raise M3CompileError(f"{model_dir} is not writable: the kernel cache is written into the model's folder")
    state, why = cache.status(model_dir)
    if state == "foreign":  # not m3compile's to replace
        raise M3CompileError(why)
    folder = model_dir / cache.CACHE_DIR
    here = cache.identity(model_dir)
    for b in batches:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise M3CompileError(f"batch sizes must be whole numbers >= 1, got {b!r}")
    jobs = _plan(model_dir, dtypes, kv_caches, batches, new_tokens, max_cache)
    groups = _split(model_dir, jobs, device, workers)
    n = len(groups)
    start = time.perf_counter()
    with atomic_output_dir(folder, force=True) as tmp:
        procs = []
        for i, group in enumerate(groups):
            env = dict(os.environ, TRITON_CACHE_DIR=str(tmp.resolve()))
            env.setdefault("M3C_AUTOTUNE", "0")  # as m3c generate runs
            spec = json.dumps({"model": str(model_dir), "device": device, "jobs": group,
                               "variants": str(tmp / f".variants-{i}.json")})
            procs.append(subprocess.Popen([sys.executable, "-m", "m3compile.runtime.compile_ahead", spec], env=env,
                                          cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            # (cwd: the new folder, so that a source checkout in the caller's folder cannot shadow the package)
        failed = []
        for done, p in enumerate(procs, 1):
            _, err = p.communicate()
            if p.returncode:
                lines = [ln for ln in err.strip().splitlines() if ln.strip()]
                failed.append(lines[-1] if lines else f"exit status {p.returncode}")
            if progress is not None:
                progress(done, len(procs))
        if failed:
            raise M3CompileError(f"compiling kernels failed: {failed[0]}")
        seen = set()
        for i in range(n):
            part = tmp / f".variants-{i}.json"
            seen.update(map(tuple, json.loads(part.read_text())))
            part.unlink()
        kernels = sum(1 for d in tmp.iterdir() if d.is_dir())
        seconds = time.perf_counter() - start
        (tmp / cache.VARIANTS).write_text(json.dumps(sorted(seen), indent=0) + "\n")
        manifest = here | {"dtypes": list(dtypes), "kv_caches": list(kv_caches), "batches": list(batches),
                           "runs": len(jobs), "workers": n, "variants": len(seen), "kernels": kernels,
                           "seconds": round(seconds, 2)}
        (tmp / cache.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        cache.relocate(tmp, at=folder)  # Triton recorded the temporary folder's paths
    return BuildReport(folder, len(seen), kernels, seconds, n)


def activate(model_dir: str | os.PathLike, *, dtype: str = "auto", kv_cache: str = "auto", device: str = "cuda",
             warn=None) -> cache.Activation:
    """io.kernel_cache.activate, a stale cache rebuilt with its own options and this run's dtype and K/V cache."""
    def rebuild(manifest: dict) -> None:
        build(model_dir, dtypes=list(dict.fromkeys([*manifest.get("dtypes", []), dtype])),
              kv_caches=list(dict.fromkeys([*manifest.get("kv_caches", []), kv_cache])),
              batches=manifest.get("batches", (1, 2)), device=device)

    return cache.activate(model_dir, rebuild=rebuild, warn=warn)


def _main(argv: list[str]) -> None:
    """A build's worker process: python -m m3compile.runtime.compile_ahead SPEC_JSON (build writes the spec)."""
    parser = argparse.ArgumentParser(prog="m3compile.runtime.compile_ahead")
    parser.add_argument("spec")
    spec = json.loads(parser.parse_args(argv).spec)
    seen = _run_jobs(spec["model"], spec["device"], spec["jobs"])
    Path(spec["variants"]).write_text(json.dumps(seen))


if __name__ == "__main__":
    _main(sys.argv[1:])
