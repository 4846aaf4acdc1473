"""The next-token loss of a long sequence without its whole logits.

At 32K tokens a 151,936-token vocabulary (Qwen2.5) makes logits of 10 GB in bf16 and 20 GB in fp32, and
cross_entropy's backward holds as much again: more than the rest of a 0.5B model's training step. `lm_loss` applies
the lm head LOGIT_ROWS tokens at a time; under autograd each chunk is a torch.utils.checkpoint region, so its logits
are freed after the forward and made again in the backward, and the loss never holds more than one chunk's logits
(4,096 x 151,936 fp32: 2.5 GB). The price is one more lm-head matmul per step (at 32K on Qwen2.5-0.5B, 8.9 TFLOP).
`lm_kl` does the same for the KL from a teacher's next-token distribution (its own hidden state and head) to the
model's, KL_ROWS tokens at a time (it holds two distributions a chunk).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from m3compile.errors import M3CompileError

__all__ = ["lm_loss", "lm_kl", "LOGIT_ROWS", "KL_ROWS"]

LOGIT_ROWS = 4096  # tokens whose logits exist at once
KL_ROWS = 2048  # the same for lm_kl, whose chunk holds the teacher's distribution too


def lm_loss(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, reduction: str = "mean",
            rows: int = LOGIT_ROWS) -> torch.Tensor:
    """Cross-entropy of `head(hidden)` against `targets` (fp32; "mean" over the tokens or their "sum"), the logits
    made `rows` tokens at a time. `hidden` [..., hidden_size], `targets` the same leading shape. Under autocast the
    head runs in the autocast dtype, as a whole-logits loss would."""
    h, y = hidden.flatten(0, -2), targets.flatten()
    _check("lm_loss", h, y, "targets", reduction)
    total = _in_chunks(_ce_chunk, (h, y), (head.weight, head.bias), rows, _wants_grad(h, head))
    return total / max(1, y.numel()) if reduction == "mean" else total


def lm_kl(hidden: torch.Tensor, head: torch.nn.Linear, teacher_hidden: torch.Tensor, teacher_head: torch.nn.Linear,
          reduction: str = "mean", rows: int = KL_ROWS) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, summed over the vocabulary (fp32; "mean" over the tokens
    or their "sum"): the teacher's are softmax(teacher_head(teacher_hidden)), which gets no gradient; the model's
    softmax(head(hidden)). The logits are made `rows` tokens at a time, as in lm_loss."""
    h, t = hidden.flatten(0, -2), teacher_hidden.flatten(0, -2).detach()
    _check("lm_kl", h, t, "teacher rows", reduction)
    total = _in_chunks(_kl_chunk, (h, t), (head.weight, head.bias, teacher_head.weight, teacher_head.bias), rows,
                       _wants_grad(h, head))
    return total / max(1, h.shape[0]) if reduction == "mean" else total


def _check(name: str, h: torch.Tensor, other: torch.Tensor, what: str, reduction: str) -> None:
    if h.shape[0] != other.shape[0]:
        raise M3CompileError(f"{name}: {h.shape[0]} hidden rows against {other.shape[0]} {what}")
    if reduction not in ("mean", "sum"):
        raise M3CompileError(f"{name}: reduction is 'mean' or 'sum', got {reduction!r}")


def _wants_grad(h: torch.Tensor, head: torch.nn.Linear) -> bool:
    return torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))


def _in_chunks(fn, sliced: tuple, fixed: tuple, rows: int, grad: bool) -> torch.Tensor:
    """The sum of fn(each `rows`-row slice of `sliced`, *fixed), each a checkpoint region when `grad`."""
    total = sliced[0].new_zeros((), dtype=torch.float32)
    for i in range(0, sliced[0].shape[0], rows):
        args = (*(a[i:i + rows] for a in sliced), *fixed)
        # the head has no randomness: no RNG state to save (a CUDA graph's capture could not read it)
        total = total + (checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False) if grad else fn(*args))
    return total


def _ce_chunk(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight, bias).float(), y, reduction="sum")


def _kl_chunk(h, t, weight, bias, t_weight, t_bias) -> torch.Tensor:
    log_q = F.log_softmax(F.linear(h, weight, bias).float(), dim=-1)
    with torch.no_grad():
        log_p = F.log_softmax(F.linear(t, t_weight, t_bias).float(), dim=-1)
    return F.kl_div(log_q, log_p, reduction="sum", log_target=True)
