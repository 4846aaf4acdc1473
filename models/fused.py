"""Fused projections for inference: the nn.Linear layers that read one input (a layer's q/k/v and index q/k, an
MLP's gate/up) share one contiguous weight [W_1; W_2; ...] (and one bias), so one matmul computes them all.

Each Linear keeps its Parameter, re-pointed (`.data`) to its rows of the fused tensor: no weight is held twice, the
state dict keeps its names and tensors, an in-place change (load_state_dict, an optimizer step) reaches the fused
tensor too. The fused matmul runs only while every Linear's weight and bias still lie where fusing put them
(`FusedLinear.live`); once one is re-pointed (`.to()`, load_state_dict(assign=True)) the module falls back to its
separate Linears and drops the fused tensor. It never runs where a gradient is needed, under torch.fx tracing or
torch.compile / torch.export (they see the separate Linears, as in the checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.fx
import torch.nn as nn

__all__ = ["FusedLinear", "fuse_linears", "Fusable"]


@dataclass(eq=False)
class FusedLinear:
    """weight [sum(sizes), in] and bias [sum(sizes)] (zeros in the rows of a Linear without one; None where no
    Linear has one); `ptrs`: the data pointers of each Linear's weight (and bias) as fusing left them."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    ptrs: tuple[int, ...]

    def live(self, linears: Iterable[nn.Linear]) -> bool:
        """Whether the Linears' parameters are still the fused tensors' rows."""
        return _ptrs(linears) == self.ptrs

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the first n Linears: a view of the leading rows."""
        end = sum(self.sizes[:n])
        return self.weight[:end], None if self.bias is None else self.bias[:end]


def _ptrs(linears: Iterable[nn.Linear]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for lin in linears for p in (lin.weight, lin.bias) if p is not None)


def _adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one tensor without a copy where they already lie one after another in one storage (contiguous,
    in order, one dtype): a twin model's weights re-pointed to this one's fused rows. None otherwise."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        same = p.dtype == first.dtype and p.device == first.device and p.shape[1:] == first.shape[1:]
        if not same or not p.is_contiguous() or p.storage_offset() != offset \
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        offset += p.numel()
    size = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return first.detach().as_strided(size, torch.empty(size, device="meta").stride(), first.storage_offset())


def fuse_linears(linears: Sequence[nn.Linear]) -> FusedLinear:
    """Copy the Linears' weights (and biases) into one new contiguous tensor each, or adopt them where they already
    are one, and re-point every Linear's parameters to their rows. Extra memory while converting: these Linears'
    weights once (their old tensors are freed when nothing else holds them)."""
    sizes = tuple(lin.out_features for lin in linears)
    with torch.no_grad():
        weights = [lin.weight.detach() for lin in linears]
        weight = _adjacent(weights)
        if weight is None:
            weight = torch.cat(weights)
        bias = None
        if any(lin.bias is not None for lin in linears):
            biases = [lin.bias.detach() if lin.bias is not None else weight.new_zeros(n)
                      for lin, n in zip(linears, sizes)]
            bias = _adjacent(biases) if all(lin.bias is not None for lin in linears) else None
            if bias is None:
                bias = torch.cat(biases)
        for lin, w, b in zip(linears, weight.split(sizes), (None,) * len(sizes) if bias is None else bias.split(sizes)):
            lin.weight.data = w
            if lin.bias is not None:
                lin.bias.data = b
    return FusedLinear(weight, bias, sizes, _ptrs(linears))


class Fusable(nn.Module):
    """A module whose `projections()` (the Linears reading its input, in fused order) can be fused for inference:
    `fuse()` builds the fused weight, `fused(x)` gives it where this call may use it."""

    _fused: FusedLinear | None = None

    def projections(self) -> dict[str, nn.Linear]:
        raise NotImplementedError

    def fuse(self) -> None:
        """Fuse the projections (a no-op while they are fused; nothing on the meta device)."""
        linears = list(self.projections().values())
        if any(lin.weight.is_meta for lin in linears):
            return
        if self._fused is None or not self._fused.live(linears):
            self._fused = fuse_linears(linears)

    def fused(self, x: torch.Tensor | None = None) -> FusedLinear | None:
        """The fused weight for a call on input x, or None: not fused, a parameter re-pointed since (the fused
        tensor is then dropped), a gradient needed (of x or of a weight), tracing or compiling."""
        f = self._fused
        if f is None or isinstance(x, torch.fx.Proxy) or torch.compiler.is_compiling():
            return None
        linears = self.projections().values()
        if not f.live(linears):
            self._fused = None
            return None
        if torch.is_grad_enabled() and ((x is not None and x.requires_grad) or any(
                p.requires_grad for lin in linears for p in (lin.weight, lin.bias) if p is not None)):
            return None
        return f

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self._fused is not None and not self._fused.live(self.projections().values()):
            self._fused = None  # .to() / .half() gave the parameters tensors of their own: free the fused ones
        return self
