"""Safetensors files read and written tensor by tensor, so that memory holds one tensor (or one layer) whatever the
checkpoint's size.

    SourceTensors      a checkpoint directory's tensors by name: shapes and dtypes from the headers, data on demand
    SafetensorsWriter  one safetensors file, its header first (from the planned names, shapes and dtypes)
    CheckpointWriter   a checkpoint's shards and their index, cut from a planned order as plan_shards cuts them

Hugging Face's own writer takes a whole shard as a dict in memory; the conversion and the distillation's outputs
stream instead.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from m3compile.errors import M3CompileError
from m3compile.io.tensor_names import VISION_TENSOR, internal_names, strip_prefix, vision_names
from m3compile.io.weights import (
    check_finite, check_state, check_weight_map, plan_shards, read_weight_map, shard_files, write_shard_index,
)
from m3compile.models.decoder import Decoder, ModelArgs
from m3compile.models.vision import Projector, VisionTower

__all__ = ["SafetensorsWriter", "CheckpointWriter", "SourceTensors", "nbytes", "tensor_group",
           "DEFAULT_MAX_SHARD_SIZE"]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", as Hugging Face counts

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor: the header (from the known names, shapes and dtypes) first."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in entries:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.expected = [(n, tuple(s), d) for n, s, d in entries]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.done = 0

    def write(self, name: str, t: torch.Tensor) -> int:
        want_name, want_shape, want_dtype = self.expected[self.done]
        if (name, tuple(t.shape), t.dtype) != (want_name, want_shape, want_dtype):
            raise AssertionError(f"writing {name} {tuple(t.shape)} {t.dtype}; the plan has {want_name} {want_shape} {want_dtype}")
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.done += 1
        return data.numel()

    def close(self) -> None:
        self.file.close()
        if self.done != len(self.expected):
            raise AssertionError(f"{self.done} of {len(self.expected)} tensors written")


class CheckpointWriter:
    """A checkpoint's safetensors shards (and their index) written tensor by tensor in a planned order.

    `entries` is every tensor's (name, shape, dtype) in the order `write` will get them; the shards are cut from that
    order as `plan_shards` does (at most `max_shard_size` bytes each, a larger tensor alone). Memory holds one
    tensor, whatever the checkpoint's size. `close` checks that every planned tensor came and writes the index."""

    def __init__(self, out_dir: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
        self.out_dir = Path(out_dir)
        self.entries = {n: (n, tuple(s), d) for n, s, d in entries}
        self.total = sum(nbytes(s, d) for _, s, d in entries)
        self.shards = plan_shards([(n, nbytes(s, d)) for n, s, d in entries], max_shard_size)
        self.pending = list(reversed(self.shards))  # shards not yet opened, the next last
        self.writer: SafetensorsWriter | None = None
        self.left = 0  # tensors still due in the open shard

    def write(self, name: str, t: torch.Tensor) -> int:
        """Write the next planned tensor; returns its bytes."""
        if self.left == 0:
            if self.writer is not None:
                self.writer.close()
            if not self.pending:
                raise AssertionError(f"writing {name}: every planned tensor was written")
            fname, names = self.pending.pop()
            self.writer = SafetensorsWriter(self.out_dir / fname, [self.entries[n] for n in names])
            self.left = len(names)
        self.left -= 1
        return self.writer.write(name, t)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.pending or self.left:
            raise AssertionError(f"{len(self.pending)} shard(s) of {len(self.shards)} not written")
        write_shard_index(self.out_dir, self.shards, self.total)

    def abort(self) -> None:
        """Close the open file after a failure (the caller removes the directory)."""
        if self.writer is not None:
            self.writer.file.close()


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class SourceTensors:
    """The tensors of a checkpoint directory by name: headers for shapes and dtypes, data read on demand.

    Files are opened per read batch and closed after it, so no memory map outlives the layer being converted
    (mapped pages that were read count towards resident memory for as long as the map exists)."""

    def __init__(self, path: Path):
        self.path = path
        self.where: dict[str, Path] = {}
        self.headers: dict[str, tuple[list[int], str]] = {}
        found: dict[str, list[Path]] = {}
        for f in shard_files(path):
            with self._open(f) as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    self.where[name] = f
                    self.headers[name] = (sl.get_shape(), sl.get_dtype())
                    found.setdefault(name, []).append(f)
        check_weight_map(path, read_weight_map(path), found)

    @staticmethod
    def _open(f: Path):
        try:
            return safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise M3CompileError(f"{f}: cannot read safetensors file ({str(e).splitlines()[0]})") from None

    def check(self, args: ModelArgs, vision=None) -> int:
        """Every tensor's name and shape against config.json (from headers alone); returns the count checked."""
        metas = {n: self.meta(n) for n in self.where}
        internal, _ = internal_names(metas, args)
        with torch.device("meta"):
            check_state(Decoder(args).state_dict(), internal, self.path, args.tie_embeddings)
        if vision is None:
            return len(internal)
        with torch.device("meta"):
            expected = {f"vision_tower.{k}": v for k, v in VisionTower(vision).state_dict().items()}
            expected.update({f"multi_modal_projector.{k}": v for k, v in Projector(vision).state_dict().items()})
        found = vision_names(metas)
        check_state(expected, found, self.path)
        return len(internal) + len(found)

    def meta(self, name: str) -> torch.Tensor:
        shape, code = self.headers[name]
        if code not in _CODE_DTYPES:
            raise M3CompileError(f"{self.where[name]}: tensor {name} has unsupported dtype {code}")
        return torch.empty(shape, dtype=_CODE_DTYPES[code], device="meta")

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted({self.where[n] for n in names}):
            with self._open(f) as h:
                for name in (n for n in names if self.where[n] == f):
                    try:
                        out[name] = h.get_tensor(name)
                    except Exception as e:
                        raise M3CompileError(f"{f}: cannot read tensor {name} ({str(e).splitlines()[0]})") from None
                    check_finite(name, out[name], f)
        return out

    def by_layer(self, args: ModelArgs) -> Iterator[dict[str, torch.Tensor]]:
        """The text model's tensors under our names, one layer at a time (embeddings first, then the layers in
        order, then the final norm and the head): memory holds one layer's tensors, never the model."""
        groups: dict[tuple[int, str], list[str]] = {}
        for name in self.where:
            if not VISION_TENSOR.match(name):
                groups.setdefault(tensor_group(name), []).append(name)
        for g in sorted(groups):
            state, _ = internal_names(self.load(groups[g]), args)
            yield state


def tensor_group(name: str) -> tuple[int, str]:
    """Read-and-write unit of a source tensor: a whole layer, or one tensor outside the layers (embeddings first,
    then the layers in order, then the final norm and the head). Sorting the keys gives the output order."""
    stripped = strip_prefix(name) or name
    m = re.match(r"model\.layers\.(\d+)\.", stripped)
    if m:
        return int(m[1]), ""
    return (-1 if "embed" in stripped else 1 << 30), stripped
