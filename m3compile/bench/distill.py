"""`m3c bench distill MODEL`: distillation and continued training against the frozen dense forward, one run.

On the same random token batch [batch, seq_len] of one model (a checkpoint directory, converted or dense, or a
shape preset with random weights built on the device):
    dense forward     the frozen dense model, no autograd (what distillation's teacher costs at the least)
    distill warm-up   one step of `m3c distill` in warm-up mode (dense support, dense main branch), the same
                      DistillStep the command runs (lowered to the Triton kernels on CUDA, bf16 autocast)
    distill sparse    the same step after warm-up (the selected blocks)
    converted dense forward, msa forward, oracle forward  (`eval`) the converted model's three forwards as
                      `m3c eval` runs them (no autograd, its MSA layers dense / sparse with the index selection /
                      sparse with the oracle selection), each with its ratio to the dense forward
    eval              tools.evaluate.evaluate over the batch's windows (batch windows per forward, with the oracle
                      pass): its `ratio` is the sum of its three forwards' ms over its own ms (1: eval runs at
                      its forwards' speed), `passes` 3
    eval --no-oracle  the same without the oracle pass (2 forwards)
    dense train       forward + backward + AdamW of the dense model on the next-token loss (--train)
    msa train         one step of `m3c train` (LM + KL, sparse attention, every parameter) (--train)
With `shard` the two distillation steps and the MSA training step run sharded with FSDP2 (as `m3c distill --shard`;
under torchrun each process times its own step on the same batch, else in a process group of one), so two runs,
with and without, give the sharded path's overhead.
Each is timed as the median of repeated steps after warm-up (CUDA events on a GPU), with its peak memory and a
per-stage breakdown from one profiled step (torch.profiler): selection, sparse attention, KL (forward and
backward), the block loss (forward and backward, with `block_loss`), the rest of the forward (backbone and
index projections), the rest of the backward, the optimizer, and the host time the GPU waited (wall time minus
the kernels' busy time).

The `eval` rows run as `m3c eval` does: the lowered ops on CUDA (m3compile.ops.lowering), the reference ops
elsewhere, in the weights' own dtype with no autocast (the dense forward row runs under the distillation's
autocast: on CUDA by default bf16, the same compute dtype as bf16 weights). They are timed before the
distillation rows, on the model as converted (a distillation step casts its index weights to fp32 and trains
them, and `shard` shards it), and listed after them; evaluate() restores the model's switches, and the
forwards' switches are restored after each call, so the rows after them see the model as before.

Each distillation row also counts one step's host dispatches (bench/op_count.py: aten ops and Triton launches,
by stage and layer), the host-cost proxy that needs no GPU: `count_only` skips the timing and counts one step
per mode, on the lowered graph (on CPU under TRITON_INTERPRET=1 it runs the Triton kernels' host path), and
`layers` keeps only a preset's first layers, so a full-size model's count is measured shallow and extrapolated
(`ops_at_full_depth`: the count plus the missing MSA layers at the count of a middle one).
"""
from __future__ import annotations

import contextlib
import copy
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.table import Table

from m3compile.config import check_size, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.kernels._common import interpreting
from m3compile.models.decoder import PRESETS, Attention, Decoder
from m3compile.ops import lowering
from m3compile.bench.common import bench_models, is_cuda, median_ms, profile_run, sync
from m3compile.evaluation.loss import evaluate
from m3compile.bench.op_count import count_ops
from m3compile.train.distill import DistillConfig, DistillStep, TrainConfig
from m3compile.train.shard import process_group

__all__ = ["DistillBenchConfig", "run_distill_bench", "render"]

_SCOPES = {"select": "m3c.msa_select", "attention": "m3c.msa_attention", "kl": "m3c.msa_index_kl",
           "block_loss": "m3c.msa_block_loss", "forward": "m3c.forward", "backward": "m3c.backward", "optimizer": "m3c.optimizer"}


DEFAULT_MSA = (64, 8)  # block size and top-k of a dense model's conversion, unless asked


@dataclass(frozen=True)
class DistillBenchConfig:
    model: str  # checkpoint directory or preset name
    seq_len: int = 8192
    batch: int = 2
    # for a dense model or preset: the conversion's block size and top-k (None: 64 and 8; a converted model's own,
    # another refused); the result's config records what ran
    block: int | None = None
    topk: int | None = None
    dtype: str = "bfloat16"  # the backbone's weights (index weights are fp32 under autocast)
    autocast: str = "auto"  # as DistillConfig.autocast
    block_loss: float = 1.0  # as DistillConfig.block_loss, its default (the distillation rows; training keeps the KL)
    train: bool = True
    eval: bool = True  # the eval rows (m3c eval's forwards and evaluate() itself)
    shard: bool = False  # FSDP2 for the distillation and MSA training steps
    steps: int = 5
    warmup: int = 2
    device: str = "cuda"
    layers: int | None = None  # a preset's first layers only (op counts are extrapolated to its full depth)
    count_only: bool = False  # count one step's dispatches per distillation mode, time nothing
    cuda_graph: bool = False  # also each distillation mode's step captured in a CUDA graph: checked, then timed

    def __post_init__(self):
        for name in ("block", "topk", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise M3CompileError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_size(self.seq_len, "seq_len")
        check_size(self.batch, "batch", "batch")
        if not (math.isfinite(self.block_loss) and self.block_loss >= 0):
            raise M3CompileError(f"block_loss must be a finite number >= 0, got {self.block_loss}")
        if self.cuda_graph and (self.count_only or not str(self.device).startswith("cuda")):
            raise M3CompileError("--cuda-graph needs --device cuda (and timing: not with --count-ops)")
        if self.layers is not None and (self.layers < 2 or Path(self.model).is_dir()):
            raise M3CompileError("--layers takes a preset and at least 2 layers (layer 0 stays dense)")
        parse_dtype(self.dtype)
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise M3CompileError("--device cuda: no CUDA device is available (use --device cpu)")


def _time(fn, cfg: DistillBenchConfig) -> tuple[float, float]:
    """(median ms, peak memory GB) of fn() over cfg.steps runs after cfg.warmup."""
    return median_ms(fn, steps=cfg.steps, warmup=cfg.warmup, device=cfg.device)


def _profile(fn, cfg: DistillBenchConfig) -> dict:
    """Per-stage GPU milliseconds of one step (see the module doc); {} on a CPU."""
    if not is_cuda(cfg.device):
        return {}
    fn()
    return _breakdown(profile_run(fn, cfg.device))


def _breakdown(prof) -> dict:
    """One profiled step's kernels, each booked once (Profile.attribute: the innermost labelled range whose host call
    launched it): selection, sparse attention and KL forward inside the m3c.forward range, their autograd backward
    functions (which the engine runs outside the forward's ranges), the rest of the forward and of the backward, the
    optimizer, kernels launched outside every range, and any with no launch record. Host wait = wall time minus the
    device's busy time (the union of the kernels' intervals)."""
    labels = {v: k for k, v in _SCOPES.items()}
    for name in {e.name for e in prof.events}:
        if "Backward" in name and "BlockRank" in name:  # the block loss's (before the KL's: its name has "KL")
            labels[name] = "block_loss_bwd"
        elif "Backward" in name and "KL" in name:
            labels[name] = "kl_bwd"
        elif "Backward" in name and "SparseAttention" in name:
            labels[name] = "attention_bwd"
    a = prof.attribute(labels)
    st = a.stages
    out = {
        "select_ms": st.get("select", 0.0), "attention_fwd_ms": st.get("attention", 0.0),
        "kl_fwd_ms": st.get("kl", 0.0), "block_loss_fwd_ms": st.get("block_loss", 0.0),
        "rest_of_forward_ms": st.get("forward", 0.0), "kl_bwd_ms": st.get("kl_bwd", 0.0),
        "block_loss_bwd_ms": st.get("block_loss_bwd", 0.0), "attention_bwd_ms": st.get("attention_bwd", 0.0),
        "rest_of_backward_ms": st.get("backward", 0.0), "optimizer_ms": st.get("optimizer", 0.0),
        "outside_ranges_ms": st.get("rest", 0.0), "unattributed_ms": st.get("unattributed", 0.0),
        "gpu_work_ms": a.work_ms, "gpu_busy_ms": a.busy_ms, "wall_ms": prof.wall_ms,
        "host_wait_ms": max(0.0, prof.wall_ms - a.busy_ms),
        "host_cpu_ms": sum(e.self_cpu_time_total for e in prof.events) / 1e3,
    }
    return {k: round(v, 3) for k, v in out.items()}


def _op_counts(step: DistillStep, x: torch.Tensor, full_layers: int) -> dict:
    """One step's dispatches (bench/op_count.py), and the count at the preset's full depth when it was cut."""
    counted = count_ops(lambda: step(x), step.gm)
    out = counted.to_dict()
    msa = [int(k) for k in out["layers"] if k.isdigit() and int(k) in step.gm.meta["m3_kl_distill"].layers]
    middle = msa[len(msa) // 2 - 1] if len(msa) > 1 else (msa[0] if msa else None)  # not the last (the lm head's)
    out["per_msa_layer"] = counted.per_layer(middle) if middle is not None else 0
    out["msa_layers"] = len(msa)
    n_layers = len([k for k in out["layers"] if k.isdigit()])
    out["ops_at_full_depth"] = counted.total + (full_layers - n_layers) * out["per_msa_layer"]
    out["full_depth_layers"] = full_layers
    return out


def _graph_check(model: Decoder, dcfg: DistillConfig, cfg: DistillBenchConfig, mode: str, x: torch.Tensor) -> dict:
    """A CUDA-graph step against the eager step from the same state: warm the graphed step up (its eager steps,
    then the capture), copy its parameters and AdamW state into an eager step on another copy of the model, run
    one step of each on the same batch, compare KL, recall, gradients and updated parameters; then time the
    graphed step. Relative differences are |a - b| / max(|b|, 1e-12) over all elements (norm-wise for tensors)."""
    graphed = DistillStep(copy.deepcopy(model), dcfg, cfg.device, mode, cuda_graph=True)
    for _ in range(graphed.GRAPH_WARMUP + 1):  # the last call captures, then replays
        graphed(x)
    eager = DistillStep(copy.deepcopy(model), dcfg, cfg.device, mode)
    with torch.no_grad():
        for name, p in eager.params.items():
            p.copy_(graphed.params[name])
    eager.opt.load_state_dict(copy.deepcopy(graphed.opt.state_dict()))  # its own tensors, not the graph's
    kl_e, rec_e, *_ = eager(x)
    kl_g, rec_g, *_ = graphed(x)
    sync(cfg.device)

    def rel(a, b):
        return (a.float() - b.float()).norm().item() / max(b.float().norm().item(), 1e-12)

    grads = max(rel(graphed.params[n].grad, p.grad) for n, p in eager.params.items())
    params = max(rel(graphed.params[n], p) for n, p in eager.params.items())
    check = {"kl_rel": rel(kl_g, kl_e), "recall_rel": rel(rec_g, rec_e), "grad_rel_max": grads,
             "param_rel_max": params}
    check["ok"] = check["kl_rel"] < 1e-4 and check["recall_rel"] < 1e-4 and grads < 1e-3 and params < 1e-5
    ms, peak = _time(lambda: graphed(x), cfg)
    return {"ms": round(ms, 3), "peak_gb": round(peak, 2), "check": {k: (round(v, 8) if isinstance(v, float) else v)
                                                                      for k, v in check.items()}}


@contextlib.contextmanager
def _switched(model: Decoder, selection: str):
    """The model's MSA layers pick their blocks as `selection` says inside the block; each attention module's own
    setting restored after."""
    kept = [(m, m.selection) for m in model.modules() if isinstance(m, Attention)]
    model.set_selection(selection)
    try:
        yield
    finally:
        for m, sel in kept:
            m.selection = sel


def _eval_rows(model: Decoder, ids: torch.Tensor, cfg: DistillBenchConfig, record) -> list[dict]:
    """The eval rows (module doc): the three forwards `m3c eval` runs, then evaluate() with and without the oracle
    pass over the batch's windows: x = ids[:, :-1] flattened plus the last target token, which windows() cuts back
    into x's rows (their targets are y's but for each row's last one: the same work)."""
    x = ids[:, :-1]
    kernels = is_cuda(cfg.device)
    rows = []

    def forward(selection: str):
        def fn():
            with torch.no_grad(), lowering(kernels), _switched(model, selection):
                model(x)
        return fn

    for name, selection in (("converted dense forward", "dense"), ("msa forward", "index"),
                            ("oracle forward", "oracle")):
        rows.append(record(name, forward(selection), profiled=False, into=None))
    tokens = torch.cat((x.flatten(), ids[-1, -1:]))
    ms = {r["stage"]: r["ms"] for r in rows}
    for name, oracle, passes in (("eval", True, 3), ("eval --no-oracle", False, 2)):
        row = record(name, lambda o=oracle: evaluate(model, tokens, cfg.seq_len, oracle=o, batch=cfg.batch,
                                                    kernels=kernels), profiled=False, into=None)
        forwards = ms["converted dense forward"] + ms["msa forward"] + (ms["oracle forward"] if oracle else 0.0)
        row.update(passes=passes, forwards_ms=round(forwards, 3), ratio=round(forwards / row["ms"], 3),
                   ratio_to="its forwards")
        rows.append(row)
    for row in rows:
        row.update(dtype=cfg.dtype, autocast=None, kernels=kernels)
    return rows


def run_distill_bench(cfg: DistillBenchConfig, log=print) -> dict:
    with process_group(cfg.device, single=True) if cfg.shard else contextlib.nullcontext((0, 1)) as (_, world):
        return {**_bench(cfg, log), "world_size": world}


def _bench(cfg: DistillBenchConfig, log) -> dict:
    dense, sparse, what, _ = bench_models(cfg.model, device=cfg.device, dtype=cfg.dtype, block=cfg.block,
                                          topk=cfg.topk, n_layers=cfg.layers, default_msa=DEFAULT_MSA)
    args = sparse.args
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (cfg.batch, cfg.seq_len + 1), generator=g).to(cfg.device)
    x, y = ids[:, :-1], ids[:, 1:]
    tokens = cfg.batch * cfg.seq_len
    compute = DistillConfig(steps=1, dtype=cfg.dtype, autocast=cfg.autocast)
    amp = compute.compute_dtype(cfg.device)
    rows = []

    full_layers = (PRESETS[cfg.model].n_layers if cfg.layers else args.n_layers)

    def record(name, fn, profiled=True, stepper=None, into=rows):
        log(f"{name} ...")
        if cfg.count_only:
            fn()  # one untimed step first (caches, autotuning), then the counted one
            row = {"stage": name, "ops": _op_counts(stepper, x, full_layers)}
            rows.append(row)
            log(f"{name}: {row['ops']['total']:,} dispatches per step ({row['ops']['per_msa_layer']} per MSA layer)")
            return
        ms, peak = _time(fn, cfg)
        row = {"stage": name, "ms": round(ms, 3), "tokens_per_s": round(tokens / ms * 1e3, 1),
               "peak_gb": round(peak, 2)}
        if profiled:
            row["breakdown"] = _profile(fn, cfg)
        if stepper is not None:
            try:
                row["ops"] = _op_counts(stepper, x, full_layers)
            except Exception as e:  # noqa: BLE001 - the timings stand; the count's failure is reported in the row
                row["ops_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log(f"{name}: counting the dispatches failed ({row['ops_error']})")
        if into is not None:
            into.append(row)
        log(f"{name}: {ms:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s, peak {peak:.1f} GB"
            + (f", {row['ops']['total']:,} dispatches" if "ops" in row else ""))
        return row

    def dense_forward():
        with torch.no_grad(), compute.autocast_context(cfg.device):
            dense(x)

    if not cfg.count_only:
        record("dense forward", dense_forward, profiled=False)
    # timed on the model as converted (see the module doc), listed after the distillation rows
    eval_rows = _eval_rows(sparse, ids, cfg, record) if cfg.eval and not cfg.count_only else []
    # lowered on CUDA; counting alone, lowered anywhere (on CPU: the Triton kernels under TRITON_INTERPRET=1)
    step = DistillStep(sparse, DistillConfig(steps=1, seq_len=cfg.seq_len, batch=cfg.batch, dtype=cfg.dtype,
                                             autocast=cfg.autocast, block_loss=cfg.block_loss),
                       cfg.device, "warmup", shard=cfg.shard, lowered=True if cfg.count_only else None)
    record("distill warm-up", lambda: step(x), stepper=step)
    step.set_mode("sparse")
    record("distill sparse", lambda: step(x), stepper=step)
    step = None  # frees the distillation graph before the training steps
    graph_errors: dict[str, str] = {}
    if cfg.cuda_graph:
        dcfg = DistillConfig(steps=1, seq_len=cfg.seq_len, batch=cfg.batch, dtype=cfg.dtype, autocast=cfg.autocast,
                             block_loss=cfg.block_loss)
        for mode, name in (("warmup", "distill warm-up"), ("sparse", "distill sparse")):
            log(f"{name}, CUDA graph ...")
            try:
                got = _graph_check(sparse, dcfg, cfg, mode, x)
            except M3CompileError as e:  # capture refused: reported, the other rows stand
                graph_errors[name] = str(e)
                log(f"{name}, CUDA graph: {e}")
                continue
            rows.append({"stage": f"{name} (CUDA graph)", "ms": got["ms"],
                         "tokens_per_s": round(tokens / got["ms"] * 1e3, 1), "peak_gb": got["peak_gb"],
                         "check": got["check"]})
            log(f"{name}, CUDA graph: {got['ms']:.1f} ms, same as eager: {got['check']['ok']} {got['check']}")
    rows.extend(eval_rows)
    if cfg.train and not cfg.count_only:
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
            sparse = bench_models(cfg.model, device=cfg.device, dtype=cfg.dtype, block=cfg.block, topk=cfg.topk,
                                  n_layers=cfg.layers, default_msa=DEFAULT_MSA)[1]
        train = DistillStep(sparse, TrainConfig(steps=1, seq_len=cfg.seq_len, batch=cfg.batch, dtype=cfg.dtype,
                                                lr=1e-5, autocast=cfg.autocast), cfg.device, "sparse",
                            shard=cfg.shard)
        record("msa train", lambda: train(x, y))
    base = {r["stage"]: r for r in rows}
    for r in rows if not cfg.count_only else ():
        if r.get("ratio_to") == "its forwards":
            continue
        ref = base["dense train"] if r["stage"] == "msa train" else base["dense forward"]
        r["ratio"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
        r["ratio_to"] = ref["stage"]
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": cfg.device,
           "triton_kernels": str(cfg.device).startswith("cuda") or interpreting()}
    if str(cfg.device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    ran = asdict(cfg) | {"block": args.msa.block_size, "topk": args.msa.topk}  # what ran, not what was asked
    return {"model": what, "config": ran, "layers": args.n_layers, "msa": asdict(args.msa),
            "autocast": str(amp).replace("torch.", "") if amp else None, "rows": rows, "env": env,
            **({"cuda_graph_errors": graph_errors} if graph_errors else {})}


def render(result: dict, cfg: DistillBenchConfig, path: Path) -> list:
    """What `m3c bench distill` prints (rich tables and lines): the host dispatches counted, the timed stages with
    their breakdown, the CUDA-graph checks and eval's ratio, then where `result` was written."""
    out = []
    counted = [r for r in result["rows"] if "ops" in r]
    if counted:
        t = Table(title=f"host dispatches per step ({result['layers']} layers"
                        + (f", extrapolated to {counted[0]['ops']['full_depth_layers']}" if cfg.layers else "") + ")")
        for c in ("stage", "total", "aten", "triton", "per MSA layer", "casts", "syncs", "at full depth"):
            t.add_column(c, justify="right")
        for r in counted:
            o = r["ops"]
            t.add_row(r["stage"], f"{o['total']:,}", f"{o['aten']:,}", f"{o['triton']:,}", str(o["per_msa_layer"]),
                      str(o["casts"]), str(o["syncs"]), f"{o['ops_at_full_depth']:,}")
        out.append(t)
        for r in counted:
            stages = sorted(r["ops"]["stages"].items(), key=lambda kv: -sum(kv[1].values()))[:6]
            out.append(f"{r['stage']}, largest stages: " + ", ".join(f"{k} {sum(v.values())}" for k, v in stages))
    if cfg.count_only:
        out.append(f"wrote {path}")
        return out
    t = Table(title=f"{result['model']}: {result['layers']} layers, {cfg.batch} x {cfg.seq_len:,} tokens, block "
                    f"{result['msa']['block_size']}, top-{result['msa']['topk']}, autocast {result['autocast']}"
                    f"{', sharded over ' + str(result['world_size']) + ' process(es)' if cfg.shard else ''}")
    for c in ("stage", "ms", "tokens/s", "ratio", "vs", "peak GB", "select", "attention", "KL fwd", "KL bwd",
              "block loss", "rest fwd", "rest bwd", "optimizer", "host wait"):
        t.add_column(c, justify="right")
    for r in result["rows"]:
        b = r.get("breakdown") or {}
        cell = (lambda k: f"{b[k]:.1f}" if k in b else "-")
        attention = f"{b['attention_fwd_ms'] + b['attention_bwd_ms']:.1f}" if b else "-"
        block = f"{b['block_loss_fwd_ms'] + b['block_loss_bwd_ms']:.1f}" if b else "-"
        t.add_row(r["stage"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.2f}", r["ratio_to"],
                  f"{r['peak_gb']:.1f}", cell("select_ms"), attention, cell("kl_fwd_ms"), cell("kl_bwd_ms"),
                  block, cell("rest_of_forward_ms"), cell("rest_of_backward_ms"), cell("optimizer_ms"),
                  cell("host_wait_ms"))
    out.append(t)
    for r in result["rows"]:
        if "check" in r:
            c = r["check"]
            out.append(f"{r['stage']}: {'same' if c['ok'] else 'DIFFERENT'} as the eager step (relative: KL "
                          f"{c['kl_rel']:.1e}, recall {c['recall_rel']:.1e}, gradients {c['grad_rel_max']:.1e}, "
                          f"weights {c['param_rel_max']:.1e})")
    for name, error in result.get("cuda_graph_errors", {}).items():
        out.append(f"{name}, CUDA graph: {error}")
    for r in result["rows"]:
        if "passes" in r:
            out.append(f"{r['stage']}: its {r['passes']} forwards {r['forwards_ms']:.1f} ms / its {r['ms']:.1f} ms "
                          f"= {r['ratio']:.2f} (1: at the forwards' speed; {r['dtype']}, no autocast, "
                          f"{'lowered' if r['kernels'] else 'reference'} ops)")
    out.append(f"stage columns: GPU ms of one profiled step; wrote {path}")
    return out
