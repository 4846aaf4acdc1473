"""`m3c bench --distill MODEL`: distillation and continued training against the frozen dense forward, one run.

On the same random token batch [batch, seq_len] of one model (a checkpoint directory, converted or dense, or a
shape preset with random weights built on the device):
    dense forward     the frozen dense model, no autograd (what distillation's teacher costs at the least)
    distill warm-up   one step of `m3c distill` in warm-up mode (dense support, dense main branch), the same
                      DistillStep the command runs (lowered to the Triton kernels on CUDA, bf16 autocast)
    distill sparse    the same step after warm-up (the selected blocks)
    dense train       forward + backward + AdamW of the dense model on the next-token loss (--train)
    msa train         one step of `m3c train` (LM + KL, sparse attention, every parameter) (--train)
With `shard` the two distillation steps and the MSA training step run sharded with FSDP2 (as `m3c distill --shard`;
under torchrun each process times its own step on the same batch, else in a process group of one), so two runs,
with and without, give the sharded path's overhead.
Each is timed as the median of repeated steps after warm-up (CUDA events on a GPU), with its peak memory and a
per-stage breakdown from one profiled step (torch.profiler): selection, sparse attention, KL (forward and
backward), the rest of the forward (backbone and index projections), the rest of the backward, the optimizer,
and the host time the GPU waited (wall time minus the kernels' busy time).
"""
from __future__ import annotations

import contextlib
import platform
from dataclasses import asdict, dataclass

import torch

from m3compile.config import parse_dtype
from m3compile.errors import M3CompileError
from m3compile.tools.bench_common import bench_models, is_cuda, kernel_us, median_ms, profile_run
from m3compile.train.distill import DistillConfig, DistillStep, TrainConfig
from m3compile.train.shard import process_group

__all__ = ["DistillBenchConfig", "run_distill_bench"]

_SCOPES = {"select": "m3c.msa_select", "attention": "m3c.msa_attention", "kl": "m3c.msa_index_kl",
           "forward": "m3c.forward", "backward": "m3c.backward", "optimizer": "m3c.optimizer"}


@dataclass(frozen=True)
class DistillBenchConfig:
    model: str  # checkpoint directory or preset name
    seq_len: int = 8192
    batch: int = 2
    block: int = 64  # for a dense model or preset: the conversion's block size and top-k
    topk: int = 8
    dtype: str = "bfloat16"  # the backbone's weights (index weights are fp32 under autocast)
    autocast: str = "auto"  # as DistillConfig.autocast
    train: bool = True
    shard: bool = False  # FSDP2 for the distillation and MSA training steps
    steps: int = 5
    warmup: int = 2
    device: str = "cuda"

    def __post_init__(self):
        for name in ("seq_len", "batch", "block", "topk", "steps"):
            if getattr(self, name) < 1:
                raise M3CompileError(f"{name} must be >= 1, got {getattr(self, name)}")
        parse_dtype(self.dtype)
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise M3CompileError("--device cuda: no CUDA device is available (use --device cpu)")


def _time(fn, cfg: DistillBenchConfig) -> tuple[float, float]:
    """(median ms, peak memory GB) of fn() over cfg.steps runs after cfg.warmup."""
    return median_ms(fn, steps=cfg.steps, warmup=cfg.warmup, device=cfg.device)


def _profile(fn, cfg: DistillBenchConfig) -> dict:
    """Per-stage GPU milliseconds of one step (see the module doc): kernel time attributed to the profiler range of
    the op that launched it; host wait = wall time minus the kernels' total."""
    if not is_cuda(cfg.device):
        return {}
    fn()
    prof = profile_run(fn, cfg.device)
    wall, busy = prof.wall_ms, prof.device_busy_ms

    def backward_of(word):  # autograd functions run outside the forward's ranges
        return sum(kernel_us(e) for e in prof.events if e.name.endswith("Backward") and word in e.name
                   and not e.name.startswith("autograd::")) / 1e3

    stage = {k: prof.scope_ms(v) for k, v in _SCOPES.items()}
    kl_bwd, attn_bwd = backward_of("KL"), backward_of("SparseAttention")
    out = {
        "select_ms": stage["select"], "attention_fwd_ms": stage["attention"], "kl_fwd_ms": stage["kl"],
        "rest_of_forward_ms": stage["forward"] - stage["select"] - stage["attention"] - stage["kl"],
        "kl_bwd_ms": kl_bwd, "attention_bwd_ms": attn_bwd,
        # the autograd engine launches the backward from its own thread, outside the m3c.backward range
        "rest_of_backward_ms": busy - stage["forward"] - stage["optimizer"] - kl_bwd - attn_bwd,
        "optimizer_ms": stage["optimizer"], "gpu_busy_ms": busy, "wall_ms": wall, "host_wait_ms": max(0.0, wall - busy),
        "host_cpu_ms": sum(e.self_cpu_time_total for e in prof.events) / 1e3,
    }
    return {k: round(v, 3) for k, v in out.items()}


def run_distill_bench(cfg: DistillBenchConfig, log=print) -> dict:
    with process_group(cfg.device, single=True) if cfg.shard else contextlib.nullcontext((0, 1)) as (_, world):
        return {**_bench(cfg, log), "world_size": world}


def _bench(cfg: DistillBenchConfig, log) -> dict:
    dense, sparse, what, _ = bench_models(cfg.model, device=cfg.device, dtype=cfg.dtype, block=cfg.block,
                                          topk=cfg.topk)
    args = sparse.args
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (cfg.batch, cfg.seq_len + 1), generator=g).to(cfg.device)
    x, y = ids[:, :-1], ids[:, 1:]
    tokens = cfg.batch * cfg.seq_len
    compute = DistillConfig(steps=1, dtype=cfg.dtype, autocast=cfg.autocast)
    amp = compute.compute_dtype(cfg.device)
    rows = []

    def record(name, fn, profiled=True):
        log(f"{name} ...")
        ms, peak = _time(fn, cfg)
        row = {"stage": name, "ms": round(ms, 3), "tokens_per_s": round(tokens / ms * 1e3, 1),
               "peak_gb": round(peak, 2)}
        if profiled:
            row["breakdown"] = _profile(fn, cfg)
        rows.append(row)
        log(f"{name}: {ms:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s, peak {peak:.1f} GB")

    def dense_forward():
        with torch.no_grad(), compute.autocast_context(cfg.device):
            dense(x)

    record("dense forward", dense_forward, profiled=False)
    step = DistillStep(sparse, DistillConfig(steps=1, seq_len=cfg.seq_len, batch=cfg.batch, dtype=cfg.dtype,
                                             autocast=cfg.autocast),
                       cfg.device, "warmup", shard=cfg.shard)
    record("distill warm-up", lambda: step(x))
    step.set_mode("sparse")
    record("distill sparse", lambda: step(x))
    step = None  # frees the distillation graph before the training steps
    if cfg.train:
        opt = torch.optim.AdamW([p for p in dense.parameters()], lr=1e-5, betas=(0.9, 0.95))
        for p in dense.parameters():
            p.requires_grad_(True)

        def dense_train():
            with compute.autocast_context(cfg.device):
                logits = dense(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        record("dense train", dense_train, profiled=False)
        del opt
        dense.zero_grad(set_to_none=True)
        if cfg.shard:  # the distillation step sharded this model's modules: a fresh one
            sparse = bench_models(cfg.model, device=cfg.device, dtype=cfg.dtype, block=cfg.block, topk=cfg.topk)[1]
        train = DistillStep(sparse, TrainConfig(steps=1, seq_len=cfg.seq_len, batch=cfg.batch, dtype=cfg.dtype,
                                                lr=1e-5, autocast=cfg.autocast), cfg.device, "sparse",
                            shard=cfg.shard)
        record("msa train", lambda: train(x, y))
    base = {r["stage"]: r for r in rows}
    for r in rows:
        ref = base["dense train"] if r["stage"] == "msa train" else base["dense forward"]
        r["ratio"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
        r["ratio_to"] = ref["stage"]
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": cfg.device}
    if str(cfg.device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    return {"model": what, "config": asdict(cfg), "layers": args.n_layers, "msa": asdict(args.msa),
            "autocast": str(amp).replace("torch.", "") if amp else None, "rows": rows, "env": env}
