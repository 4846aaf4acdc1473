"""Streaming conversion of checkpoint directories with bounded memory (any size: 7B, 70B, M3 itself).

    config.json --> Decoder on the meta device --> trace + gqa_to_msa (shapes only) --> output plan (names, shapes,
    dtypes, shard split) --> per layer: read its tensors from the memory-mapped source shards, derive the index
    branch, write the tensors into the current output shard --> index.json --> rename into place

At any time memory holds one layer's tensors (plus the float64 scratch of that layer's index initialisation),
never the model. Output shards are written tensor by tensor in safetensors format (a header computed from the
plan, then the raw bytes), because safetensors' own writer takes a whole shard as a dict in memory. dtypes are
kept per tensor (bf16 in, bf16 out) unless a dtype is asked for. Nothing is written unless everything succeeds.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from m3compile.config import MSAConfig, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.graph.tracing import trace
from m3compile.io.hf_config import args_from_config, max_positions, read_config, vision_args_from_config
from m3compile.io.output_dir import atomic_output_dir, check_output_dir
from m3compile.io.save import output_config, write_extras
from m3compile.io.tensor_names import (
    VISION_TENSOR, internal_names, strip_prefix, to_release_names, vision_names, vision_release_names,
)
from m3compile.io.weights import (
    check_finite, check_state, check_weight_map, copy_tokenizer_files, plan_shards, read_weight_map, shard_files,
    write_shard_index,
)
from m3compile.models.decoder import Decoder, DecoderLayer, ModelArgs, MSALayerArgs
from m3compile.models.vision import Projector, VisionTower
from m3compile.passes.calibration import Calibration
from m3compile.passes.index_init import index_branch_weights
from m3compile.pipelines import ConversionReport, convert, run_pipeline

__all__ = ["convert_streaming", "SafetensorsWriter", "CheckpointWriter", "SourceTensors", "nbytes",
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
                groups.setdefault(_group_of(name), []).append(name)
        for g in sorted(groups):
            state, _ = internal_names(self.load(groups[g]), args)
            yield state


def _group_of(name: str) -> tuple[int, str]:
    """Read-and-write unit of a source tensor: a whole layer, or one tensor outside the layers (embeddings first,
    then the layers in order, then the final norm and the head). Sorting the keys gives the output order."""
    stripped = strip_prefix(name) or name
    m = re.match(r"model\.layers\.(\d+)\.", stripped)
    if m:
        return int(m[1]), ""
    return (-1 if "embed" in stripped else 1 << 30), stripped


@dataclass
class _Planned:
    group: tuple[int, str]
    name: str  # output (release) name
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Converter:
    def __init__(self, src: Path, args: ModelArgs, settings: dict[int, MSALayerArgs], dtype: torch.dtype | None):
        self.source = SourceTensors(src)
        self.args, self.settings, self.dtype = args, settings, dtype
        self.vision = None  # VisionArgs when the vision tower is kept
        self.calibration: Calibration | None = None  # the calibrated init: fed each group as it is written
        self.groups: dict[tuple[int, str], list[str]] = {}
        for name in self.source.where:
            self.groups.setdefault(_group_of(name), []).append(name)

    def group(self, g: tuple[int, str], materialise: bool) -> dict[str, torch.Tensor]:
        """Output tensors of one group, release names: the source's (cast if asked) plus the new index branch."""
        names = self.groups[g]
        raw = self.source.load(names) if materialise else {n: self.source.meta(n) for n in names}
        if self.dtype is not None and materialise:
            for n, t in raw.items():
                check_finite(n, t, self.source.where[n], self.dtype)
        if self.dtype is not None:
            raw = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in raw.items()}
        if self.vision is not None and all(VISION_TENSOR.match(n) for n in names):  # vision tower: copied through
            return vision_release_names(vision_names(raw))
        state, _ = internal_names(raw, self.args)
        moment = self._calibrate(g[0], state) if materialise and self.calibration is not None else None
        if g[0] in self.settings:
            state.update(self._index_branch(g[0], state, moment))
        if self.args.tie_embeddings:
            state.pop("lm_head.weight", None)
        return to_release_names(state)

    def _calibrate(self, layer: int, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Feed the calibration forward: the embeddings, then each layer (up to the last converted one) in order;
        the moment of a converted layer's attention input."""
        cal = self.calibration
        if "model.embed_tokens.weight" in state:
            cal.embed(state["model.embed_tokens.weight"])
        if layer < 0 or layer > max(self.settings, default=-1):
            return None
        with torch.device("meta"):
            module = DecoderLayer(self.args, layer)
        prefix = f"model.layers.{layer}."
        module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True,
                               assign=True)
        if layer in self.settings:
            return cal.moment(layer, module)
        cal.advance(layer, module)
        return None

    def _index_branch(self, layer: int, state: dict[str, torch.Tensor],
                      moment: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        a, s = self.args, self.settings[layer]
        pre = f"model.layers.{layer}.self_attn"
        weights = index_branch_weights(
            state[f"{pre}.q_proj.weight"], state[f"{pre}.k_proj.weight"], n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
            head_dim=a.head_dim, rope_dim=a.rope_dim, index_dim=s.index_dim, q_norm=state.get(f"{pre}.q_norm.weight"),
            k_norm=state.get(f"{pre}.k_norm.weight"), norm_style=a.qk_norm or "rms", x_moment=moment,
        )
        return {f"{pre}.{name}": t for name, t in weights.items()}


def _window_vision(vision, window: int):
    """Trace the vision tower on the meta device and run the vision pipeline on it; returns the pass report."""
    with torch.device("meta"):
        tower = VisionTower(vision)
    return run_pipeline("vision", trace(tower), window=window)[0]


def convert_streaming(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: MSAConfig | None = None,
    *,
    force: bool = False,
    dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[int, int, str], None] | None = None,
    calib: torch.Tensor | None = None,
    calib_seq_len: int | None = None,
    calib_device: str = "cpu",
    calib_source: str | None = None,
) -> ConversionReport:
    """Convert the checkpoint directory `src` into `out_dir` with memory bounded by one layer (see module doc).

    progress(bytes_written, total_bytes, what) is called after every tensor. calib: 1-D token ids for the
    calibrated index init (passes/calibration.py), run layer by layer on `calib_device` as the layers are written
    (memory: the calibration hidden states plus one layer in fp32); the index branches equal those of
    `pipelines.convert(load(src), config, calib=...)`.
    """
    start = time.perf_counter()
    src, out_dir = Path(src), Path(out_dir)
    check_output_dir(out_dir, (src, calib_source), force)
    if max_shard_size < 1:
        raise M3CompileError(f"max shard size must be positive, got {max_shard_size}")
    cfg = read_config(src)
    args, _ = args_from_config(cfg)
    if config is not None and args.msa is not None:
        for key in ("block_size", "topk", "index_dtype"):
            have, asked = getattr(args.msa, key), getattr(config, key)
            if have != asked:
                raise M3CompileError(f"{src} already has MSA layers with {key} {have}; re-converting it with {key} "
                                     f"{asked} is not supported (convert the dense source again)")
    with torch.device("meta"):
        model = Decoder(args)
    gm, report = convert(model, config)
    report.model = str(src)
    out_args: ModelArgs = gm.meta["model_args"]
    settings = {i: out_args.msa for i in range(args.n_layers) if out_args.is_sparse(i) and not args.is_sparse(i)}
    out_cfg = output_config(cfg, out_args, report.config)  # before any tensor is read: its refusals come first
    conv = _Converter(src, args, settings, parse_dtype(dtype))
    if calib is not None and settings:
        conv.calibration = Calibration(args, calib, calib_seq_len, calib_device, calib_source, max_positions(cfg))
        report.index_init = conv.calibration.info
    has_vision = any(VISION_TENSOR.match(n) for n in conv.source.where)
    vision = vision_args_from_config(cfg) if has_vision else None
    if has_vision and vision is None:
        raise M3CompileError(f"{src}: vision tensors present but config.json has no minimax_m3_vl vision_config")
    if vision is not None:
        conv.vision = vision
        report.passes.append(_window_vision(vision, (config or MSAConfig()).vision_window))

    # Plan from headers alone: validates names and shapes, fixes every output tensor's place before any write.
    conv.source.check(args, vision)
    plan: list[_Planned] = []
    for g in sorted(conv.groups):
        plan += [_Planned(g, n, tuple(t.shape), t.dtype) for n, t in conv.group(g, materialise=False).items()]
    total = sum(nbytes(p.shape, p.dtype) for p in plan)

    written = 0
    with atomic_output_dir(out_dir, force, inputs=(src, calib_source)) as tmp:
        writer = CheckpointWriter(tmp, [(p.name, p.shape, p.dtype) for p in plan], max_shard_size)
        fnames = {n: fname for fname, names in writer.shards for n in names}
        current, tensors = None, {}
        try:
            for p in plan:
                if p.group != current:
                    current, tensors = p.group, None
                    tensors = conv.group(p.group, materialise=True)
                written += writer.write(p.name, tensors.pop(p.name))
                if progress:
                    progress(written, total, f"{p.group[1] or 'layer ' + str(p.group[0])} -> {fnames[p.name]}")
        except BaseException:
            writer.abort()
            raise
        writer.close()
        if vision is not None:
            out_cfg["vision_config"]["vit_3d_window"] = (config or MSAConfig()).vision_window
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(src, tmp)
        report.seconds = time.perf_counter() - start
        write_extras(tmp, gm, report, out_cfg)
    return report
