"""The held-out slice of a distillation or training run: the run keeps the best state it has seen, the start included.

    data tokens:  [ training windows ................................ | held out: whole windows of seq_len ]

The run evaluates the model on the held-out tokens at its start and at every checkpoint: the next-token loss with
sparse attention (MSA active, the index branch selecting), against the same model run densely (every MSA layer as
dense causal attention), in windows of the training length and of 2x and 4x it (JUDGED, where the model's positions
and the held-out tokens allow: users evaluate at longer contexts than a run trains at, and a state can gain at one
length while losing at another). The output directory's checkpoint is the state of lowest held-out sparse loss at
the training length (ties keep the earlier one) among the states no worse than the start at any judged length, the
start included, so a run that makes the model worse anywhere leaves it as it was; the resume state
(`distill_state/`, `train_state/`) stays the last step's, so a resumed run continues bit for bit. Distillation leaves
the backbone frozen, so the dense losses are measured once; training moves it, so they are measured at every
evaluation. (A sharded run, whose model lives in its training graph, judges the training length alone.)

    split_holdout(tokens, seq_len, holdout_tokens)   -> (training tokens, held-out windows or None)
    HeldOut(windows, ...).evaluate(stepper, step)    -> {"step", "loss", "dense_loss", "gap"}
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from m3compile.data import windows
from m3compile.errors import M3CompileError
from m3compile.models.decoder import Attention
from m3compile.ops import lowering
from m3compile.train.lm_loss import lm_loss

__all__ = ["DEFAULT_HOLDOUT_WINDOWS", "split_holdout", "HeldOut", "summary"]

# The default held-out slice: this many windows of the run's sequence length, at most a tenth of the data's windows
# (none for data of fewer than ten windows)
DEFAULT_HOLDOUT_WINDOWS = 4
# the lengths a state is judged at, as multiples of the training length
JUDGED = (1, 2, 4)


def split_holdout(tokens: torch.Tensor, seq_len: int, holdout_tokens: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training tokens, held-out windows [N, seq_len + 1] or None): the held-out windows are the data's last tokens.
    holdout_tokens None: DEFAULT_HOLDOUT_WINDOWS windows, at most a tenth of the data (none for data of fewer than
    ten windows, so the default never takes what the run needs); 0: none; otherwise that many tokens, in whole
    windows (at least one), and the rest must still hold a window."""
    total = (tokens.numel() - 1) // seq_len
    if holdout_tokens is None:
        held = min(DEFAULT_HOLDOUT_WINDOWS, total // 10)
    elif holdout_tokens == 0:
        held = 0
    else:
        held = holdout_tokens // seq_len
        if held < 1:
            raise M3CompileError(f"--holdout-tokens {holdout_tokens} is less than one sequence of {seq_len} tokens "
                                 f"(use 0 for no held-out data)")
    if held == 0:
        return tokens, None
    cut = tokens.numel() - held * seq_len - 1
    if cut < seq_len + 1:
        raise M3CompileError(f"holding out {held * seq_len:,} tokens leaves {max(cut, 0):,} of the data's "
                             f"{tokens.numel():,} for training, fewer than one sequence of {seq_len} + 1 (use a "
                             f"smaller --holdout-tokens, or 0)")
    return tokens[:cut], windows(tokens[cut:], seq_len)


class HeldOut:
    """Evaluations of one run on its held-out windows, and the best state's figures. `history` entries are plain
    dicts (kept in the resume state and the report).

    The loss is the model's own forward, sparse (MSA active) or dense, no KL hooks: `model` (the run's Decoder,
    whose parameters the training graph shares) with its kernels on CUDA; a sharded run's model lives in the
    training graph's shards, so there the training graph runs (in its sparse mode, and its warm-up mode for dense
    attention), its KL computed and ignored."""

    def __init__(self, wins: torch.Tensor, model, config, device: str, trains_backbone: bool, rank: int = 0,
                 world: int = 1, history: list[dict] | None = None, max_len: int | None = None,
                 sharded: bool = False):
        self.wins, self.model, self.config, self.device = wins, model, config, device
        self.trains_backbone, self.rank, self.world = trains_backbone, rank, world
        self.history: list[dict] = list(history or [])
        seq_len = wins.shape[1] - 1
        stream = torch.cat([wins[:, :-1].flatten(), wins[-1, -1:]])  # the held-out tokens, in order
        self.by_length = {seq_len: wins}
        for factor in JUDGED[1:] if not sharded else ():
            n = factor * seq_len
            if (max_len is None or n <= max_len) and stream.numel() >= n + 1:
                self.by_length[n] = windows(stream, n)

    @property
    def lengths(self) -> list[int]:
        return sorted(self.by_length)

    @property
    def best(self) -> dict | None:
        """The evaluation of lowest sparse loss at the training length (the earliest among equals) of those no worse
        than the start at any judged length."""
        if not self.history:
            return None
        start = self.history[0].get("lengths", {})
        ok = [h for h in self.history
              if all(v["loss"] <= start[n]["loss"] for n, v in h.get("lengths", {}).items() if n in start)]
        return min(ok, key=lambda h: h["loss"])

    @property
    def start(self) -> dict | None:
        return self.history[0] if self.history else None

    @torch.no_grad()
    def _loss(self, stepper, sparse: bool, wins: torch.Tensor) -> float:
        """Mean next-token loss of the held-out windows, with sparse attention or dense. Every rank runs every window
        (a sharded model's forward is collective), and rank 0's figure is the one every rank keeps, so all ranks
        decide alike."""
        if stepper.sharded:
            stepper.set_mode("sparse" if sparse else "warmup")  # the warm-up mode's main branch is dense
            forward, context = (lambda x: stepper.net(x)[0]), lowering(stepper.lowered)
        else:
            attention = [m for m in self.model.modules() if isinstance(m, Attention)]
            before = [m.selection for m in attention]
            self.model.set_selection("index" if sparse else "dense")
            context = lowering(str(self.device).startswith("cuda"))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batch = max(1, self.config.batch * (self.wins.shape[1] - 1) // (wins.shape[1] - 1))  # the tokens of a batch
        try:
            with context:
                for b in range(0, wins.shape[0], batch):
                    chunk = wins[b:b + batch].to(self.device)
                    with self.config.autocast_context(self.device):
                        if stepper.sharded:
                            loss = F.cross_entropy(forward(chunk[:, :-1]).float().flatten(0, 1),
                                                   chunk[:, 1:].flatten(), reduction="sum")
                        else:  # the logits a chunk of tokens at a time: a 32K window's whole logits hold 20 GB
                            loss = lm_loss(self.model.model(chunk[:, :-1]), self.model.lm_head, chunk[:, 1:],
                                           reduction="sum")
                    total += loss.double()
        finally:
            if not stepper.sharded:
                for m, s in zip(attention, before):
                    m.selection = s
        out = total / wins[:, 1:].numel()
        if self.world > 1:
            dist.broadcast(out, 0)
        return out.item()

    def evaluate(self, stepper, step: int) -> dict:
        """Evaluate the current state (at `step`) at every judged length and add it to the history; the trainer's
        mode is left as it was. The entry's loss, dense_loss and gap are the training length's; `lengths` holds
        each judged length's."""
        mode = stepper.mode
        figures = {}
        try:
            for n, wins in self.by_length.items():
                known = (self.start or {}).get("lengths", {}).get(str(n)) if not self.trains_backbone else None
                dense = known["dense_loss"] if known else self._loss(stepper, sparse=False, wins=wins)
                loss = self._loss(stepper, sparse=True, wins=wins)
                figures[str(n)] = {"loss": loss, "dense_loss": dense, "gap": loss / dense - 1.0 if dense else None}
        finally:
            stepper.set_mode(mode)
        own = figures[str(self.wins.shape[1] - 1)]
        entry = {"step": step, **own, "lengths": figures}
        self.history.append(entry)
        return entry

    def to_dict(self, final_step: int) -> dict:
        """The report: the held-out slice, the start, the kept (best) and the final step's evaluations, and all."""
        final = next((h for h in reversed(self.history) if h["step"] == final_step), None)
        return {"windows": int(self.wins.shape[0]), "tokens": int(self.wins[:, 1:].numel()), "lengths": self.lengths,
                "start": self.start, "kept": self.best, "final": final, "evaluations": self.history}


def summary(holdout: dict | None) -> str:
    """One line for a run's report (`m3c distill` / `m3c train`): the start, final and kept held-out figures."""
    if holdout is None:
        return ("no held-out data (--holdout-tokens 0, or data of fewer than 10 sequences): the output is the last "
                "step's state")

    def fig(h: dict) -> str:
        gap = "" if h["gap"] is None else f" ({100 * h['gap']:+.2f}% over dense)"
        return f"loss {h['loss']:.4f}{gap} at step {h['step']}"

    start, kept, final = holdout["start"], holdout["kept"], holdout["final"]
    judged = holdout.get("lengths") or []
    at = f", judged at {', '.join(f'{n:,}' for n in judged)} tokens" if len(judged) > 1 else ""
    line = f"held out {holdout['windows']} windows ({holdout['tokens']:,} tokens{at}): start {fig(start)}"
    if final is not None and final["step"] != start["step"]:
        line += f"; final {fig(final)}"
    if kept["step"] == start["step"]:
        worse = "better" if len(judged) < 2 else "better at its length and no worse at the others"
        return line + f"; the output keeps the start (no evaluated state was {worse})"
    return line + f"; the output keeps step {kept['step']}" + ("" if final is kept else f": {fig(kept)}")
