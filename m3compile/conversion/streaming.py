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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from m3compile.config import MSAConfig, parse_dtype
from m3compile.conversion.calibration import Calibration
from m3compile.conversion.convert import ConversionReport, convert
from m3compile.conversion.save import output_config, write_extras
from m3compile.errors import M3CompileError
from m3compile.graph.tracing import trace
from m3compile.io.hf_config import args_from_config, max_positions, read_config, vision_args_from_config
from m3compile.io.shards import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter, SourceTensors, nbytes, tensor_group
from m3compile.io.tensor_names import VISION_TENSOR, checkpoint_names, internal_names, vision_names, vision_release_names
from m3compile.io.weights import check_finite, copy_tokenizer_files
from m3compile.models.decoder import Decoder, DecoderLayer, ModelArgs, MSALayerArgs
from m3compile.models.index_init import index_branch_weights
from m3compile.models.vision import VisionTower
from m3compile.outputs import atomic_output_dir, check_output_dir
from m3compile.pipelines import run_pipeline

__all__ = ["convert_streaming"]


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
        self.out_config: dict = {}  # the output's config.json, which decides the tensor names written
        self.groups: dict[tuple[int, str], list[str]] = {}
        for name in self.source.where:
            self.groups.setdefault(tensor_group(name), []).append(name)

    def group(self, g: tuple[int, str], materialise: bool) -> dict[str, torch.Tensor]:
        """Output tensors of one group (a layer: what one name fuses is in it), in the names the output's config
        takes (checkpoint_names): the source's (cast if asked) plus the new index branch."""
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
        return checkpoint_names(state, self.out_config)

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
    layer_costs: dict | None = None,
) -> ConversionReport:
    """Convert the checkpoint directory `src` into `out_dir` with memory bounded by one layer (see module doc).

    progress(bytes_written, total_bytes, what) is called after every tensor. calib: 1-D token ids for the
    calibrated index init (m3compile/conversion/calibration.py), run layer by layer on `calib_device` as the layers are written
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
    model.source_config = cfg  # as m3compile.load sets it: convert checks the budget against its positions
    gm, report = convert(model, config)
    report.model = str(src)
    report.layer_costs = layer_costs  # what chose the dense layers (m3c convert --dense-costliest)
    out_args: ModelArgs = gm.meta["model_args"]
    settings = {i: out_args.msa for i in range(args.n_layers) if out_args.is_sparse(i) and not args.is_sparse(i)}
    out_cfg = output_config(cfg, out_args, report.config)  # before any tensor is read: its refusals come first
    conv = _Converter(src, args, settings, parse_dtype(dtype))
    conv.out_config = out_cfg
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
