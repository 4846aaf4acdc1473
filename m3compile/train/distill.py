"""Index-branch distillation (docs/msa.md section 4): teach a converted model's index branch to select the blocks the
dense model attends to.

    load converted model -> trace -> distill pipeline (kl_distill; the lowered ops on CUDA) -> AdamW on the index
    parameters only -> checkpoint (resumable)

Only the index projections and norms learn (the backbone is frozen and bit-identical afterwards). The first
`warmup_steps` use dense support with a dense main branch, then the support becomes the selected blocks. Data
order is a pure function of (seed, step), so a resumed run continues bit for bit. Under `torchrun` each rank takes
its slice of the global batch and either holds a replica (DistributedDataParallel) or, with `shard` (or when a
replica would not fit), its shard of every parameter, gradient and AdamW moment (FSDP2, see train/shard.py): the
model is then streamed from the checkpoint into the shards and saved tensor by tensor, so no rank ever holds it.

Output directory: a loadable converted checkpoint (config.json, safetensors in the source dtype) plus
`distill_state/` (fp32 index weights, optimizer state, run fingerprint; all safetensors and JSON) and
`distill_report.json`. Sharded or not, the files are the same (whole tensors), so either kind of run resumes either.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import safe_open

from m3compile.config import check_size, max_positions, parse_dtype
from m3compile.errors import DistillInterrupted, M3CompileError
from m3compile.graph.tracing import trace
from m3compile.data import load_tokens, windows
from m3compile.io.hf_config import check_positions, read_config
from m3compile.io.load import load, load_meta, weights_by_layer
from m3compile.outputs import atomic_output_dir, check_output_dir, output_lock, signals_recorded
from m3compile.export.remote_code import remote_config, write_modeling_file
from m3compile.io.shards import CheckpointWriter, SafetensorsWriter
from m3compile.io.tensor_names import checkpoint_names, written_together
from m3compile.io.weights import checkpoint_digest, copy_tokenizer_files, first_non_finite
from m3compile.models.decoder import RotaryEmbedding
from m3compile.ops import lowering, scope
from m3compile.passes.kl_distill import drop_logits, hidden_output
from m3compile.passes.recompute_mlp import recompute_mlps
from m3compile.pipelines import run_pipeline
from m3compile.train.holdout import HeldOut, split_holdout
from m3compile.train.lm_loss import lm_kl, lm_loss
from m3compile.train.shard import (
    copy_rows, full_tensor, local_bytes, materialize, needs_sharding, process_group, shard_graph,
)

__all__ = ["DistillConfig", "TrainConfig", "DistillReport", "DistillInterrupted", "DistillStep", "distill", "train",
           "index_parameters"]

STATE_DIR = "distill_state"
TRAIN_STATE_DIR = "train_state"
# The data-order seed: the permutation of epoch e is seeded with seed * 100003 + e, which torch takes up to 2**63
SEED_LIMIT = 2**46
# Fingerprint keys a state saved before they existed lacks: such a state resumes without their check
_ADDED_KEYS = ("weights", "tokens")


@dataclass(frozen=True)
class DistillConfig:
    """Settings of a distillation run. `batch` is sequences per process per step (global batch = batch x ranks)."""

    steps: int
    seq_len: int = 8192
    batch: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0
    checkpoint_every: int = 100
    seed: int = 0
    dtype: str = "float32"
    weight_decay: float = 0.0
    autocast: str = "auto"  # compute dtype on CUDA: "auto" = bf16 autocast on CUDA (fp32 master weights), or "none"
    cuda_graph: bool = False  # capture the step in a CUDA graph after warm-up (DistillStep); not part of a resume
    # weight of the block-ranking loss added to the KL (kernels.block_stats.naive.block_rank_kl): teacher block mass vs
    # the index branch's block-max scores, on the queries that have a choice; 0 = the KL alone (no node is added).
    # 1 by default: better on both checkpoints measured (SmolLM2 +2.25% against +3.08% at 14.7M tokens; BENCHMARKS.md)
    block_loss: float = 1.0
    # tokens held out from the end of the data (whole windows) to evaluate the run at its start and checkpoints; the
    # output keeps the best state (train/holdout.py). None: 4 windows, at most a tenth of the data; 0: none
    holdout_tokens: int | None = None
    # the learning rate per step (lr_at): a linear ramp from lr / lr_warmup_steps over the first lr_warmup_steps
    # steps, then "constant" at lr or "cosine" from lr down to lr_min x lr at step lr_decay_steps (None: `steps`; a run
    # grown by --resume names it, or the curve would change under it) and lr_min x lr after it (None: 0.1). The
    # cosine's two settings cannot apply to the constant schedule, and are refused with it
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None
    lr_min: float | None = None

    def __post_init__(self):
        for name in ("lr", "weight_decay", "loss_coeff", "block_loss", "lr_min"):
            value = getattr(self, name, 0.0)
            if name == "lr_min" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise M3CompileError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.cuda_graph, bool):
            raise M3CompileError(f"cuda_graph must be a boolean, got {self.cuda_graph!r}")
        for name in ("steps", "seq_len", "batch", "checkpoint_every", "warmup_steps", "seed", "lr_warmup_steps"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise M3CompileError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise M3CompileError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_size(self.seq_len, "seq_len")
        check_size(self.batch, "batch", "batch")
        if self.warmup_steps < 0:
            raise M3CompileError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise M3CompileError(f"lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.lr_warmup_steps < 0:
            raise M3CompileError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_schedule == "constant":
            given = [n for n in ("lr_decay_steps", "lr_min") if getattr(self, n) is not None]
            if given:
                raise M3CompileError(f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the cosine "
                                     f"schedule and cannot apply to the constant one (set lr_schedule cosine, or "
                                     f"leave {'them' if len(given) > 1 else 'it'} out)")
        if not 0 <= self.lr_floor <= 1:
            raise M3CompileError(f"lr_min is a fraction of lr, in [0, 1], got {self.lr_min}")
        if self.lr_decay_steps is not None and (isinstance(self.lr_decay_steps, bool)
                                                or not isinstance(self.lr_decay_steps, int)
                                                or self.lr_decay_steps <= self.lr_warmup_steps):
            raise M3CompileError(f"lr_decay_steps must be an integer above lr_warmup_steps ({self.lr_warmup_steps}), "
                                 f"got {self.lr_decay_steps!r}")
        if not -SEED_LIMIT < self.seed < SEED_LIMIT:
            raise M3CompileError(f"seed must be in (-2**46, 2**46), got {self.seed}")
        if self.holdout_tokens is not None and (isinstance(self.holdout_tokens, bool)
                                                or not isinstance(self.holdout_tokens, int) or self.holdout_tokens < 0):
            raise M3CompileError(f"holdout_tokens must be an integer >= 0, got {self.holdout_tokens!r}")
        if not self.lr > 0:
            raise M3CompileError(f"lr must be > 0, got {self.lr}")
        if self.block_loss < 0:
            raise M3CompileError(f"block_loss must be >= 0, got {self.block_loss}")
        parse_dtype(self.dtype)
        if self.autocast not in ("auto", "bf16", "none"):
            raise M3CompileError(f"autocast must be auto, bf16 or none, got {self.autocast!r}")

    def compute_dtype(self, device: str) -> torch.dtype | None:
        """The autocast dtype on this device, or None (compute in the weights' dtype)."""
        cuda = str(device).startswith("cuda")
        return torch.bfloat16 if cuda and self.autocast in ("auto", "bf16") else None

    def autocast_context(self, device: str, cache: bool = True) -> torch.autocast:
        """The context the forward runs in: bf16 autocast on CUDA unless turned off, a no-op elsewhere. `cache`
        False: no cache of cast weights (what a CUDA-graph capture needs)."""
        amp = self.compute_dtype(device)
        return torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None, cache_enabled=cache)

    def mode(self, step: int) -> str:
        return "warmup" if step < self.warmup_steps else "sparse"

    @property
    def lr_floor(self) -> float:
        """The cosine's floor as a fraction of lr (lr_min, 0.1 unless set)."""
        return 0.1 if self.lr_min is None else self.lr_min

    @property
    def lr_varies(self) -> bool:
        return self.lr_schedule != "constant" or self.lr_warmup_steps > 0

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        if step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        end = self.steps if self.lr_decay_steps is None else self.lr_decay_steps
        if end <= self.lr_warmup_steps:  # the whole run is the ramp
            return self.lr
        t = min(1.0, (step - self.lr_warmup_steps) / (end - self.lr_warmup_steps))
        return self.lr * (self.lr_floor + (1 - self.lr_floor) * 0.5 * (1 + math.cos(math.pi * t)))

    def fingerprint(self, world_size: int) -> dict:
        """What a resumed run must share with the run it continues (steps may grow). `block_loss` only when set, so
        a state saved before it existed still resumes (the check compares the keys of both)."""
        out = {"seq_len": self.seq_len, "global_batch": self.batch * world_size, "lr": self.lr,
               "warmup_steps": self.warmup_steps, "seed": self.seed, "dtype": self.dtype, "autocast": self.autocast,
               "weight_decay": self.weight_decay}
        if self.block_loss:
            out["block_loss"] = self.block_loss
        if self.lr_varies:  # only when set, as block_loss; the decay's end resolved (a grown run must name it)
            curve = {"schedule": self.lr_schedule, "warmup_steps": self.lr_warmup_steps}
            if self.lr_schedule == "cosine":
                curve |= {"decay_steps": self.steps if self.lr_decay_steps is None else self.lr_decay_steps,
                          "min": self.lr_floor}
            out["lr_schedule"] = curve
        return out


@dataclass(frozen=True)
class TrainConfig(DistillConfig):
    """Continued training of a converted model (docs/msa.md section 4): every parameter learns from the LM loss with
    sparse attention active, plus `loss_coeff` x the index KL (which reaches only the index branch).

    `lm_target` is what the LM loss fits: "data", the next token of the training data (cross-entropy); "dense", the
    model's own output with dense attention, from a frozen copy of the model as given (the KL from its next-token
    distribution to the sparse model's, over the whole vocabulary): the sparse model learns to match what the dense
    one did on the same text rather than to fit the text itself."""

    loss_coeff: float = 1.0
    block_loss: float = 0.0  # continued training has no block loss unless asked (its LM loss moves the backbone too)
    lm_target: str = "data"
    # run each dense MLP under torch.utils.checkpoint (passes/recompute_mlp.py): its [T, intermediate] tensors are made
    # again in the backward instead of kept; the same step, less memory. Not part of a resume (the math is unchanged)
    recompute_mlp: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.loss_coeff < 0:
            raise M3CompileError(f"loss_coeff must be >= 0, got {self.loss_coeff}")
        if self.lm_target not in LM_TARGETS:
            raise M3CompileError(f"lm_target must be one of {', '.join(LM_TARGETS)}, got {self.lm_target!r}")

    def fingerprint(self, world_size: int) -> dict:
        extra = {} if self.lm_target == "data" else {"lm_target": self.lm_target}  # a state saved before it resumes
        return {**super().fingerprint(world_size), "loss_coeff": self.loss_coeff, **extra}


LM_TARGETS = ("data", "dense")


@dataclass
class DistillReport:
    model: str
    out_dir: str
    start_step: int
    steps: int
    world_size: int
    tokens: int = 0  # tokens processed by this run (all ranks)
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # per step: step, mode, kl, recall (block), per-layer lists
    interrupted: bool = False
    sharded: bool = False  # FSDP2: each rank held its shard of the parameters (else a replica)
    param_bytes_per_rank: list[int] = field(default_factory=list)  # parameter storage each rank kept between steps
    # the held-out evaluations (train/holdout.py: HeldOut.to_dict): start, kept (what the output holds), final; None
    # without held-out data
    holdout: dict | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


def index_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The index branch's parameters (index_q_proj, index_k_proj, index_q_norm, index_k_norm of every MSA layer)."""
    return {n: p for n, p in module.named_parameters() if ".index_" in n}


def _model_fingerprint(model_dir: Path) -> str:
    """config.json and the shards' names and sizes (the "weights" key holds the digest of their content)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _tokens_digest(tokens: torch.Tensor) -> str:
    """SHA-256 of the token ids a run reads (another file, or the same text through another tokenizer, differs)."""
    return hashlib.sha256(memoryview(tokens.to(torch.int64).contiguous().numpy())).hexdigest()[:32]


def _batch_ids(step: int, rank: int, batch: int, world: int, n_windows: int, seed: int) -> list[int]:
    """Window indices of one rank at one step: a seeded permutation per epoch, sliced by rank."""
    out = []
    for i in range(batch):
        p = (step * world + rank) * batch + i  # position in the global stream
        epoch, pos = divmod(p, n_windows)
        perm = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[pos]))
    return out


def distill(
    model_dir: str | os.PathLike,
    data: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: DistillConfig,
    *,
    device: str = "cpu",
    resume: bool = False,
    force: bool = False,
    shard: bool | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> DistillReport:
    """Distil the index branch of the converted model in `model_dir` on token `data`; write to `out_dir`.

    `shard`: True = FSDP2 (each rank holds its shard of the model; also in one process), False = a replica per
    rank, None = shard under torchrun when a replica would not fit the device (see train/shard.needs_sharding).
    Raises M3CompileError (nothing written) on bad input: an unconverted model, data shorter than one sequence,
    token ids outside the vocabulary, an existing `out_dir` without `force`/`resume`, or `resume` from a run with
    other settings. Ctrl-C or SIGTERM (main thread) lets the step in flight finish, saves the state and raises
    DistillInterrupted.
    """
    return _launch(model_dir, data, out_dir, config, device, resume, force, shard, progress)


def _launch(model_dir, data, out_dir, config, device, resume, force, shard, progress) -> DistillReport:
    """One rank's run (torchrun's environment read here); a process group it created is destroyed after."""
    if str(device).startswith("cuda") and "LOCAL_RANK" in os.environ and ":" not in str(device):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    with process_group(device, single=shard is True) as (rank, world):
        run = _Run(Path(model_dir), Path(data), Path(out_dir), config, device, rank, world)
        return run.run(resume, force, shard, progress)


def train(
    model_dir: str | os.PathLike,
    data: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: TrainConfig,
    *,
    device: str = "cpu",
    resume: bool = False,
    force: bool = False,
    shard: bool | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> DistillReport:
    """Continue training the converted model in `model_dir`: LM loss through the sparse attention plus
    `loss_coeff` x the index KL. Same data order, checkpoints (`train_state/`: the parameters, AdamW state),
    Ctrl-C, resume, torchrun and `shard` behaviour as `distill`. On CUDA the MSA ops are lowered to the Triton
    kernels (forward and backward)."""
    if not isinstance(config, TrainConfig):
        raise M3CompileError("train needs a TrainConfig")
    return _launch(model_dir, data, out_dir, config, device, resume, force, shard, progress)


def _dense_teacher(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """A frozen copy of `model` (in `dtype` when given) that runs dense attention: lm_target "dense"'s teacher."""
    teacher = copy.deepcopy(model)
    if dtype is not None:
        teacher.to(dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.set_selection("dense")
    return teacher.eval()


class DistillStep:
    """One optimisation step, shared by the run loop and `m3c bench distill`: the traced model with its KL hooks
    (lowered to the Triton kernels on CUDA), the trained parameters, AdamW, and the compute dtype.

    Distillation trains the index branch only: under autocast its parameters are fp32 whatever the backbone's
    dtype, the backbone has no gradients (its inputs to the hooks are detached, so no autograd graph is built for
    it), and on CUDA the forward runs under bf16 autocast. Training (a TrainConfig) trains every parameter on LM + KL.
    Calls return detached per-layer KL, recall (and LM loss) without synchronising with the host.

    With `world` > 1 the graph is wrapped in DistributedDataParallel; with `shard` it is sharded with FSDP2 instead
    (train/shard.py; a process group must exist). A `model` on the meta device (`load_meta`) is then allocated
    shard by shard and filled from `weights` (`weights_by_layer` of its checkpoint).

    `cuda_graph` (CUDA, one process, lowered, not sharded): the first GRAPH_WARMUP calls in a mode run eagerly on a
    side stream (real steps: autotuning and the shape caches fill), the next captures the whole step (forward,
    backward, AdamW, with a capturable optimizer and no autocast cache) into a torch.cuda.CUDAGraph and every later
    call copies its batch into the static input and replays it: one launch per step instead of thousands. A new mode
    or batch shape captures again. A step that cannot be captured (a host read, as MoE routing does) raises
    M3CompileError.
    """

    GRAPH_WARMUP = 2

    def __init__(self, model: torch.nn.Module, config: DistillConfig, device: str, mode: str, world: int = 1,
                 shard: bool = False, weights=None, lowered: bool | None = None, cuda_graph: bool = False):
        if cuda_graph:
            if not str(device).startswith("cuda") or not torch.cuda.is_available():
                raise M3CompileError("--cuda-graph needs a CUDA device")
            if world > 1 or shard:
                raise M3CompileError("--cuda-graph captures one process's unsharded step: not with --shard or "
                                     "under torchrun (world size > 1)")
            if lowered is False:
                raise M3CompileError("--cuda-graph captures the lowered step (the Triton kernels)")
        self.cuda_graph = cuda_graph
        self._graph = self._graph_key = self._static = None
        self._warm = 0
        self.config, self.device, self.sharded = config, device, shard
        self.training = isinstance(config, TrainConfig)
        self.amp = config.compute_dtype(device)
        self.gm = trace(model)
        # on CUDA (or when asked: lowered ops take the Triton kernels on CPU under TRITON_INTERPRET=1, the torch
        # reference otherwise): the fused indexer, sparse attention and fused KL (+ backwards); every step's forward
        # runs inside the ops' switch (m3compile.ops.lowering)
        self.lowered = str(device).startswith("cuda") if lowered is None else lowered
        self.block_loss = config.block_loss > 0
        run_pipeline("distill", self.gm, mode=mode, block_loss=self.block_loss)
        if not self.training and not shard:
            # the index branch learns from the hooks' outputs alone: no lm head, final norm or last o_proj / MLP.
            # (A sharded run keeps them: its held-out loss runs this graph, train/holdout.py.)
            drop_logits(self.gm)
        # training, unsharded: the graph returns the final hidden state and the step applies the lm head a chunk of
        # tokens at a time (train/lm_loss.py): at 32K the whole logits and their backward would hold about 60 GB.
        # (A sharded graph keeps its logits: FSDP gathers the head's weight inside the graph's forward.)
        self.head = hidden_output(self.gm) if self.training and not shard else None
        # lm_target "dense": a frozen copy of the model as given, its attention dense, in the compute dtype (a resumed
        # run loads its trained state into the graph's parameters after this, so the copy stays the start's)
        self.teacher = None
        if self.training and config.lm_target == "dense":
            if shard:
                raise M3CompileError("--lm-target dense keeps a whole frozen copy of the model: not with --shard "
                                     "(each process would hold every weight)")
            self.teacher = _dense_teacher(model, self.amp)
        if self.training and config.recompute_mlp:
            if shard:
                raise M3CompileError("--recompute-mlp is not supported with --shard (FSDP wraps the graph's modules, "
                                     "not the model's MLPs)")
            recompute_mlps(self.gm, model)
        names = list(dict(self.gm.named_parameters()) if self.training else index_parameters(self.gm))
        for p in self.gm.parameters():
            p.requires_grad_(False)
        for name, p in self.gm.named_parameters():
            if name in names:
                if not self.training and self.amp is not None:
                    p.data = p.data.float()  # fp32 master weights for the index branch; autocast computes in bf16
                p.requires_grad_(True)
        self.net = self.gm
        if shard:
            buffers = {n: RotaryEmbedding.frequencies(model.args) for n, b in self.gm.named_buffers()
                       if b.is_meta and n.endswith("rotary_emb.inv_freq")}
            self.net = shard_graph(self.gm, device)
            if weights is not None:
                materialize(self.net, self.gm, weights, device, buffers)
        elif world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.gm, device_ids=None if device == "cpu" else [device])
        params = dict(self.gm.named_parameters())  # read after sharding: FSDP registers new parameters
        self.params = {n: params[n] for n in names}
        # fused: one kernel for every parameter (per-parameter ops were the step's largest share of dispatches);
        # sharded, the same kernel runs on each rank's DTensor shards (elementwise: bit-identical to unsharded)
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=config.lr, betas=(0.9, 0.95),
                                     weight_decay=config.weight_decay, fused=True, capturable=cuda_graph)

    @property
    def mode(self) -> str:
        return self.gm.meta["m3_kl_distill"].mode

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step. Under a CUDA graph with a varying rate it lives in a device tensor
        (the captured step reads it there; a float would be frozen into the graph)."""
        for group in self.opt.param_groups:
            if self.cuda_graph and self.config.lr_varies:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:  # before the capture (a resumed state brings floats)
                    group["lr"] = torch.tensor(lr, dtype=torch.float32, device=self.device)
            else:
                group["lr"] = lr

    def set_mode(self, mode: str) -> None:
        if self.mode != mode:  # switches the hooks' mode
            run_pipeline("distill", self.gm, mode=mode, block_loss=self.block_loss)

    def backward(self, x: torch.Tensor, y: torch.Tensor | None = None, cache: bool = True):
        """Forward and backward of one batch: the trained parameters' .grad (the mean over ranks, sharded as the
        parameters are); returns detached (kl, recall, lm, block), lm None when distilling, block (the block-ranking
        loss per layer) None without config.block_loss."""
        with scope("m3c.forward"), self.config.autocast_context(self.device, cache), lowering(self.lowered):
            out, kl, recall, *block = self.net(x)  # out: the hidden state (self.head), the logits or None
            block = block[0] if block else None
            lm = None
            if self.teacher is not None:  # the dense copy's next-token distribution, made a chunk of tokens at a time
                with torch.no_grad():
                    target = self.teacher.model(x)
                lm = lm_kl(out, self.head, target, self.teacher.lm_head)
            elif self.training:  # next-token loss through the sparse attention + the index KL
                lm = (lm_loss(out, self.head, y) if self.head is not None
                      else torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten()))
        self.opt.zero_grad(set_to_none=True)
        with scope("m3c.backward"):
            with scope("m3c.loss"):
                loss = kl.float().sum() if lm is None else lm + self.config.loss_coeff * kl.float().sum()
                if block is not None:
                    loss = loss + self.config.block_loss * block.float().sum()
            loss.backward()
        return (kl.detach(), recall.detach(), None if lm is None else lm.detach(),
                None if block is None else block.detach())

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None):
        if not self.cuda_graph:
            return self._step(x, y)
        return self._graphed(x, y)

    def _step(self, x: torch.Tensor, y: torch.Tensor | None = None, cache: bool = True):
        out = self.backward(x, y, cache)
        with scope("m3c.optimizer"):
            self.opt.step()
        return out

    def _graphed(self, x: torch.Tensor, y: torch.Tensor | None):
        key = (self.mode, tuple(x.shape))
        if key != self._graph_key:  # a new mode or shape: warm up, then capture again
            self._graph, self._graph_key, self._warm = None, key, 0
        if self._graph is None and self._warm < self.GRAPH_WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._step(x, y, cache=False)
            torch.cuda.current_stream().wait_stream(side)
            self._warm += 1
            return out
        if self._graph is None:
            for group in self.opt.param_groups:  # a resumed optimizer state may carry other flags
                group["capturable"] = True
            static_x, static_y = x.clone(), None if y is None else y.clone()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    out = self._step(static_x, static_y, cache=False)
            except Exception as e:  # noqa: BLE001 - what capture refused, in one line
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise M3CompileError(f"--cuda-graph: the distillation step cannot be captured ({first})") from None
            self._graph, self._static = graph, (static_x, static_y, out)
        static_x, static_y, out = self._static
        static_x.copy_(x)
        if y is not None:
            static_y.copy_(y)
        self._graph.replay()
        return tuple(None if t is None else t.clone() for t in out)  # the static outputs change at the next replay


class _Run:
    def __init__(self, model_dir: Path, data: Path, out_dir: Path, config: DistillConfig, device: str, rank: int,
                 world: int):
        self.model_dir, self.data, self.out_dir, self.config = model_dir, data, out_dir, config
        self.device, self.rank, self.world = device, rank, world
        self.training = isinstance(config, TrainConfig)  # all parameters + LM loss, else the index branch only
        self.state_dir = TRAIN_STATE_DIR if self.training else STATE_DIR
        self.weights_file = "params.safetensors" if self.training else "index.safetensors"
        self.report_file = "train_report.json" if self.training else "distill_report.json"

    def run(self, resume: bool, force: bool, shard: bool | None, progress) -> DistillReport:
        out = self.out_dir
        # overlap, file, symlink, parent, name; the lock on rank 0 only (the run's writer, which holds it throughout)
        check_output_dir(out, (self.model_dir, self.data), force=True, lock=self.rank == 0)
        if not resume and out.exists() and not force:
            raise M3CompileError(f"{out} already exists (use --force to replace it or --resume to continue it)")
        if self.rank == 0:  # one writer of the output for the whole run
            with output_lock(out):
                return self._run(resume, shard, progress)
        return self._run(resume, shard, progress)

    def _load(self, shard: bool | None):
        """(model, sharded): on the meta device when sharded (streamed into the shards later), else loaded whole."""
        cfg = self.config
        if shard is False or (shard is None and self.world == 1):
            return load(self.model_dir, dtype=cfg.dtype, device=self.device), False
        try:
            model = load_meta(self.model_dir, dtype=cfg.dtype)
        except M3CompileError:
            if shard:
                raise
            return load(self.model_dir, dtype=cfg.dtype, device=self.device), False  # e.g. a vision tower: no sharding
        if shard is None:
            trained = dict(model.named_parameters()) if self.training else index_parameters(model)
            amp = cfg.compute_dtype(self.device) if not self.training else None
            flags = torch.tensor([needs_sharding(model, trained, self.device, amp)], dtype=torch.int64,
                                 device=self.device)
            dist.all_reduce(flags)  # one decision for all ranks: shard if any rank lacks the room
            if not flags.item():
                return load(self.model_dir, dtype=cfg.dtype, device=self.device), False
        return model, True

    def _run(self, resume: bool, shard: bool | None, progress) -> DistillReport:
        cfg, out = self.config, self.out_dir
        state = self._read_state() if resume else None
        check_positions(cfg.seq_len, read_config(self.model_dir), f"--seq-len {cfg.seq_len}")
        model, sharded = self._load(shard)
        if model.args.msa is None:
            raise M3CompileError(f"{self.model_dir} has no MSA layers: it was never converted (run m3c convert first)")
        tokens = load_tokens(self.data, model.args.vocab_size, self.model_dir)
        train_tokens, held = split_holdout(tokens, cfg.seq_len, cfg.holdout_tokens)
        wins = windows(train_tokens, cfg.seq_len)
        fingerprint = {"model": _model_fingerprint(self.model_dir), "weights": checkpoint_digest(self.model_dir),
                       "data": f"{self.data.name}:{tokens.numel()}", "tokens": _tokens_digest(tokens),
                       **cfg.fingerprint(self.world)}
        if held is not None:  # the tokens held out (absent without: a state saved before held-out data resumes with 0)
            fingerprint["holdout_tokens"] = int(held[:, 1:].numel())
        start = 0
        history: list[dict] = []
        if state is not None:
            start, history = self._check_resume(state, fingerprint)

        weights = weights_by_layer(self.model_dir, model.args) if sharded else None
        stepper = DistillStep(model, cfg, self.device, cfg.mode(start), self.world, shard=sharded, weights=weights,
                              cuda_graph=cfg.cuda_graph)
        params, opt, gm = stepper.params, stepper.opt, stepper.gm
        self.sharded, self.trained_names = sharded, list(params)
        if state is not None:
            try:
                self._load_state(params, opt)
            except M3CompileError:
                raise
            except Exception as e:  # missing or truncated files, missing tensors, mismatched optimizer state
                raise M3CompileError(f"--resume: {out / self.state_dir} is corrupt "
                                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r})") from None

        report = DistillReport(str(self.model_dir), str(out), start, cfg.steps, self.world, history=history,
                               sharded=sharded, param_bytes_per_rank=self._gather_ints(local_bytes(gm)))
        self.holdout = None if held is None else HeldOut(held, model, cfg, self.device, self.training, self.rank,
                                                         self.world, (state or {}).get("holdout"),
                                                         max_positions(read_config(self.model_dir)), sharded)
        self.kept, self.kept_step, self.holdout_seconds = {}, None, 0.0
        t0 = time.perf_counter()  # report.seconds: the steps' time (the evaluations' is report.holdout["seconds"])
        if self.holdout is not None:
            self._start_holdout(stepper, model, params, start, report)
        step = start
        # SIGINT / SIGTERM recorded, not raised, while the loop runs (main thread): the loop stops after the step in
        # flight and saves. Raising at the signal (the CLI's handler) could stop torch anywhere inside a step: a run
        # killed by `timeout` on the GPU would die that way without saving. Signals during the save are
        # recorded too, and dropped. In another thread the handlers stay and Ctrl-C raises where it lands.
        with signals_recorded() as stop:
            try:
                while step < cfg.steps:
                    mode = cfg.mode(step)
                    stepper.set_mode(mode)
                    lr = cfg.lr_at(step)
                    stepper.set_lr(lr)
                    ids = _batch_ids(step, self.rank, cfg.batch, self.world, wins.shape[0], cfg.seed)
                    x = wins[ids, :-1].to(self.device)
                    y = wins[ids, 1:].to(self.device) if self.training else None
                    kl, recall, lm, block = stepper(x, y)
                    step += 1
                    metrics = self._metrics(step, mode, kl, recall, gm.meta["m3_kl_distill"].layers, lm, block)
                    if cfg.lr_varies:
                        metrics["lr"] = lr
                    report.history.append(metrics)
                    report.tokens += cfg.batch * self.world * cfg.seq_len
                    report.seconds = time.perf_counter() - t0 - self.holdout_seconds
                    if progress is not None:
                        progress(step, cfg.steps, {**metrics, "tokens_per_s": report.tokens_per_s})
                    if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                        if self.holdout is not None:
                            self._evaluate(stepper, model, params, step, report)
                        self._save(model, params, opt, step, fingerprint, report)
                    if step < cfg.steps and self._any_rank(bool(stop)):
                        raise KeyboardInterrupt  # a SIGINT / SIGTERM during the step (on any rank): stop here
            except KeyboardInterrupt:
                report.interrupted = True
                report.seconds = time.perf_counter() - t0 - self.holdout_seconds
                if self.holdout is not None:  # not evaluated: the output keeps the best state evaluated so far
                    report.holdout = self.holdout.to_dict(step)
                self._save(model, params, opt, step, fingerprint, report)
                raise DistillInterrupted(step, out) from None
        report.seconds = time.perf_counter() - t0 - self.holdout_seconds
        return report

    # -- held-out data: the output keeps the best state ---------------------------------------------------------

    def _start_holdout(self, stepper: DistillStep, model, params, start: int, report: DistillReport) -> None:
        """A new run evaluates its start; a resumed one takes its evaluations from the state and the kept state's
        trained tensors from the output's checkpoint (which holds it), or from the state just loaded when the kept
        state is the last step's."""
        if not self.holdout.history:
            self._evaluate(stepper, model, params, start, report)
            return
        self.kept_step = self.holdout.best["step"]
        if self.kept_step == start:
            self._keep(params, model.source_dtype)
        elif self.rank == 0:
            wanted = set(params)
            self.kept = {n: t.to(model.source_dtype) for layer in weights_by_layer(self.out_dir, model.args)
                         for n, t in layer.items() if n in wanted}
            if set(self.kept) != wanted:
                raise M3CompileError(f"--resume: {self.out_dir}'s checkpoint lacks trained tensors "
                                     f"({sorted(wanted - set(self.kept))[0]}, ...)")
        report.holdout = self.holdout.to_dict(start)

    def _evaluate(self, stepper: DistillStep, model, params, step: int, report: DistillReport) -> None:
        """Evaluate the state at `step` on the held-out windows; a new best is copied (what the output will hold)."""
        t = time.perf_counter()
        entry = self.holdout.evaluate(stepper, step)
        if self.holdout.best is entry:
            self._keep(params, model.source_dtype)
            self.kept_step = step
        report.holdout = self.holdout.to_dict(step)
        self.holdout_seconds += time.perf_counter() - t
        report.holdout["seconds"] = round(self.holdout_seconds, 3)

    def _keep(self, params, dtype: torch.dtype) -> None:
        """The trained tensors as the output writes them (whole, in the checkpoint's dtype, on the CPU of rank 0;
        sharded, every rank takes part in each gather)."""
        kept = {}
        for name, p in params.items():
            whole = full_tensor(p).detach().to("cpu", dtype, copy=True)
            if self.rank == 0:
                kept[name] = whole
        self.kept = kept

    def _kept_instead(self, step: int) -> set[str]:
        """The trained tensors the output takes from the kept state instead of the state at `step` (none when that
        state is the kept one, or without held-out data); the same on every rank."""
        return set() if self.holdout is None or self.kept_step in (None, step) else set(self.trained_names)

    def _metrics(self, step: int, mode: str, kl: torch.Tensor, recall: torch.Tensor, layers: list[int],
                 lm: torch.Tensor | None = None, block: torch.Tensor | None = None) -> dict:
        rows = [kl.float(), recall.float()]
        if block is not None:
            rows.append(block.float())
        if lm is not None:
            rows.append(lm.float().expand_as(rows[0]))
        both = torch.stack(rows)
        if self.world > 1:
            dist.all_reduce(both)
            both /= self.world
        kl_l, rec_l = both[:2].tolist()
        out = {"step": step, "mode": mode, "kl": sum(kl_l) / len(kl_l), "recall": sum(rec_l) / len(rec_l),
               "layers": layers, "kl_layers": kl_l, "recall_layers": rec_l}
        if block is not None:
            block_l = both[2].tolist()
            out.update(block=sum(block_l) / len(block_l), block_layers=block_l)
        if lm is not None:
            out["lm"] = both[-1, 0].item()
        return out

    # -- state -------------------------------------------------------------------------------------------------

    def _read_state(self) -> dict:
        path = self.out_dir / self.state_dir / "state.json"
        if not path.is_file():
            raise M3CompileError(f"{self.out_dir} holds no {'training' if self.training else 'distillation'} state "
                                 f"to resume ({path} missing)")
        try:
            state = json.loads(path.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise M3CompileError(f"{path}: not valid JSON (corrupt resume state)") from None
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(
                state.get("fingerprint"), dict):
            raise M3CompileError(f"{path}: corrupt resume state (no step or fingerprint)")
        return state

    def _check_resume(self, state: dict, fingerprint: dict) -> tuple[int, list[dict]]:
        saved = state.get("fingerprint", {})
        for key in [*fingerprint, *(k for k in saved if k not in fingerprint)]:  # a setting either run has
            value = fingerprint.get(key)
            if key in _ADDED_KEYS and key not in saved:
                continue  # a state from before this key: it cannot say (the rest still must match)
            if key == "weights" and saved[key] != value:
                raise M3CompileError(f"--resume: {self.out_dir} continues a run on other weights than those of "
                                     f"{self.model_dir} (content digest {saved[key]}, this model {value})")
            if key == "tokens" and saved[key] != value:
                raise M3CompileError(f"--resume: {self.out_dir} continues a run on other tokens than those of "
                                     f"{self.data} (content digest {saved[key]}, these {value})")
            if saved.get(key) != value:
                hint = ""
                if key == "lr_schedule" and isinstance(saved.get(key), dict) and "decay_steps" in saved[key]:
                    hint = f" (pass --lr-decay-steps {saved[key]['decay_steps']} to keep the run's learning-rate curve)"
                verb = "trained" if isinstance(self.config, TrainConfig) else "distilled"
                raise M3CompileError(f"--resume: {self.out_dir} was {verb} with {key} = {saved.get(key)!r}, "
                                     f"this run has {value!r}{hint}")
        step = int(state["step"])
        if step >= self.config.steps:
            raise M3CompileError(f"--resume: {self.out_dir} already holds {step} steps; ask for more than {step} with --steps")
        report = self.out_dir / self.report_file
        history = []
        if report.is_file():
            try:
                history = json.loads(report.read_bytes().decode("utf-8"))["history"]
                return step, [h for h in history if h["step"] <= step]
            except (ValueError, KeyError, TypeError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise M3CompileError(f"{report}: not a valid run report (corrupt resume state)") from None
        return step, history

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (every rank gets the same answer, so all stop at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _gather_ints(self, value: int) -> list[int]:
        """`value` of every rank, in rank order."""
        if self.world == 1:
            return [value]
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64, device=self.device))
        return [int(t.item()) for t in out]

    def _load_state(self, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        """Parameters and AdamW state from the saved whole tensors; a sharded run reads only its rows of each."""
        folder = self.out_dir / self.state_dir
        with safe_open(str(folder / self.weights_file), framework="pt") as h:
            if set(h.keys()) != set(params):
                raise M3CompileError(f"--resume: {folder} holds other tensors than this model trains")
            for name, p in params.items():
                copy_rows(p, h.get_slice(name))
        bad = first_non_finite((name, p.detach()) for name, p in params.items())
        if bad is not None:
            raise M3CompileError(f"--resume: {folder / self.weights_file}: tensor {bad[0]} holds non-finite values "
                                 f"({bad[1]}); refusing to continue from it")
        meta = json.loads((folder / "state.json").read_text())
        order = list(params)
        sd = {"state": {}, "param_groups": meta["param_groups"]}
        with safe_open(str(folder / "optimizer.safetensors"), framework="pt") as h:
            for key in h.keys():
                i, name = key.split(".", 1)
                param = params[meta["param_names"][int(i)]]
                if h.get_slice(key).get_shape() == list(param.shape):  # a moment: sharded as its parameter is
                    t = torch.zeros_like(param)
                    copy_rows(t, h.get_slice(key))
                else:  # the step count
                    t = h.get_tensor(key)
                sd["state"].setdefault(order.index(meta["param_names"][int(i)]), {})[name] = t
        for g in sd["param_groups"]:
            g["betas"] = tuple(g["betas"])
        opt.load_state_dict(sd)

    def _save(self, model, params, opt, step: int, fingerprint: dict, report: DistillReport) -> None:
        """Rank 0 writes the checkpoint and the resume state. Sharded, every rank takes part: each tensor is gathered
        whole in turn (only rank 0 keeps it, to write it), so no rank holds more than its shards plus one tensor."""
        if self.rank == 0:
            with atomic_output_dir(self.out_dir, force=True) as tmp:
                self._write(tmp, model, params, opt, step, fingerprint, report)
        elif self.sharded:
            self._write(None, model, params, opt, step, fingerprint, report)
        if self.world > 1:
            dist.barrier()

    def _write(self, tmp: Path | None, model, params, opt, step: int, fingerprint: dict,
               report: DistillReport) -> None:
        """Write into `tmp` (None: a rank that only takes part in the gathers)."""
        dtype = model.source_dtype
        state = model.state_dict()
        if model.args.tie_embeddings:
            state.pop("lm_head.weight", None)
        config = remote_config(model.source_config)  # a checkpoint transformers runs (remote code)
        # the checkpoint's names (checkpoint_names): MoE experts one tensor of ours -> one per expert, or a gate and up
        # pair -> one; written a group at a time, so no rank holds more than its shards plus one group
        groups = written_together(list(state), config)
        plan = [checkpoint_names({n: torch.empty(state[n].shape, dtype=dtype, device="meta") for n in g}, config)
                for g in groups]
        writer = None
        if tmp is not None:
            writer = CheckpointWriter(tmp, [(n, tuple(t.shape), dtype) for out in plan for n, t in out.items()])
        instead = self._kept_instead(step)
        try:
            for group in groups:
                wholes = {}
                for name in group:
                    if name in instead:  # the kept (best held-out) state's tensor, not this step's; rank 0 holds it
                        wholes[name] = self.kept.get(name)
                    else:
                        wholes[name] = full_tensor(state[name]).detach().to("cpu", dtype)
                if writer is not None:
                    for n, piece in checkpoint_names(wholes, config).items():
                        writer.write(n, piece)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        folder = None
        if tmp is not None:
            writer.close()
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            write_modeling_file(tmp, config)
            copy_tokenizer_files(self.model_dir, tmp)
            folder = tmp / self.state_dir
            folder.mkdir()
        _write_tensors(folder, self.weights_file, dict(params))
        sd = opt.state_dict()
        _write_tensors(folder, "optimizer.safetensors",
                       {f"{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items()})
        if tmp is not None:
            groups = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
                      | {"params": g["params"]} for g in sd["param_groups"]]
            (folder / "state.json").write_text(json.dumps(
                {"step": step, "fingerprint": fingerprint, "param_names": list(params), "param_groups": groups,
                 "holdout": None if self.holdout is None else self.holdout.history}, indent=2))
            (tmp / self.report_file).write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _write_tensors(folder: Path | None, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file of whole tensors, gathered one at a time where sharded (every rank calls this in the
    same order; only a rank with a `folder` writes)."""
    writer = None
    if folder is not None:
        writer = SafetensorsWriter(folder / name, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    try:
        for n, t in tensors.items():
            whole = full_tensor(t).detach().to("cpu")
            if writer is not None:
                writer.write(n, whole)
    except BaseException:
        if writer is not None:
            writer.file.close()
        raise
    if writer is not None:
        writer.close()
