"""Loading: a checkpoint directory (dense or converted, any supported layout) or a preset as a runnable model."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from m3compile.config import DTYPES, parse_dtype
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import args_from_config, read_config
from m3compile.io.shards import SourceTensors
from m3compile.io.tensor_names import VISION_TENSOR, internal_names
from m3compile.io.weights import check_state, checkpoint_dtype, load_state_dict, read_checkpoint
from m3compile.models.decoder import PRESETS, Decoder, RMSNorm, RotaryEmbedding
from m3compile.models.vision import MultimodalDecoder, VisionRotary, apply_window

__all__ = ["load", "load_meta", "weights_by_layer", "from_preset", "check_device", "auto_dtype"]


def check_device(device) -> torch.device:
    """A device this machine has: a one-line error for a malformed name or CUDA without CUDA."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise M3CompileError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise M3CompileError(f"device {device!r} asked for, but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise M3CompileError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise M3CompileError(f"unsupported device {device!r} (use cpu, cuda or cuda:N)")
    return dev


def auto_dtype(config: dict, stored: torch.dtype, device) -> torch.dtype:
    """The compute dtype "auto" picks for a checkpoint on `device`: float32 on a CPU (its bf16 matmuls are slow);
    elsewhere the checkpoint's floating dtype: config.json's torch_dtype (or dtype), else `stored`, the dtype its
    tensors are stored in (bf16 if any is)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    for key in ("torch_dtype", "dtype"):
        name = config.get(key) if isinstance(config, dict) else None
        if isinstance(name, str) and name.replace("torch.", "") in DTYPES:
            return parse_dtype(name.replace("torch.", ""))
    return stored


def load(path: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str = "cpu",
         attn_impl: str = "sdpa_gqa") -> Decoder:
    """A checkpoint directory (dense or converted, any supported layout) as a runnable Decoder. dtype: a name
    ("bfloat16", "fp32", ...) or torch dtype; None (the default): the dtype its tensors are stored in, on any device
    (a bf16 checkpoint computes in bf16 on a CPU too); "auto": `auto_dtype`, as m3c's commands load (float32 on a
    CPU, the checkpoint's own elsewhere)."""
    check_device(device)
    ck = read_checkpoint(path, attn_impl)
    target = auto_dtype(ck.config, ck.dtype, device) if dtype == "auto" else parse_dtype(dtype) or ck.dtype
    with torch.device("meta"):
        model = Decoder(ck.args)
    # the checkpoint's tensors become the parameters (assign): no empty model to allocate, fill and copy into; each
    # is converted once, by the .to(dtype) at the end
    load_state_dict(model, {n: t.to(device) for n, t in ck.state_dict.items()}, ck.path, assign=True)
    if ck.args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = RotaryEmbedding.frequencies(ck.args).to(device)  # not in the checkpoint
    model.source_config = ck.config
    model.source_dtype = ck.dtype
    if ck.vision_args is not None:  # minimax_m3_vl with its vision tower: the multimodal wrapper
        with torch.device("meta"):
            mm = MultimodalDecoder(model, ck.vision_args)
        mm.vision_tower = mm.vision_tower.to_empty(device=device)
        mm.multi_modal_projector = mm.multi_modal_projector.to_empty(device=device)
        mm.language = model
        vis = {k: v for k, v in mm.state_dict().items() if not k.startswith("language.")}
        check_state(vis, ck.vision_state, ck.path)
        _, unexpected = mm.load_state_dict(ck.vision_state, strict=False)  # names and shapes checked above
        assert not unexpected, unexpected
        mm.vision_tower.rotary_emb.inv_freq = VisionRotary.frequencies(ck.vision_args).to(device)
        window = (ck.config.get("vision_config") or {}).get("vit_3d_window")
        if window:
            apply_window(mm, int(window))
        mm.source_config, mm.source_dtype = ck.config, ck.dtype
        model = mm
    return model.to(target).eval()


def load_meta(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
              attn_impl: str = "sdpa_gqa") -> Decoder:
    """What `load` returns, on the meta device: no tensor data is read, the tensors' names and shapes are checked
    against config.json from the safetensors headers. `weights_by_layer` gives the weights to fill it with, one layer
    at a time (the sharded training path copies each rank's rows from them). Text checkpoints only."""
    path = Path(path)
    cfg = read_config(path)
    args, _ = args_from_config(cfg, attn_impl)
    source = SourceTensors(path)
    if any(VISION_TENSOR.match(n) for n in source.where):
        raise M3CompileError(f"{path} has a vision tower: loading without the whole model in memory (sharded "
                             f"training) supports text checkpoints only")
    source.check(args)
    metas, _ = internal_names({n: source.meta(n) for n in source.where}, args)
    with torch.device("meta"):
        model = Decoder(args)
    model.source_config = cfg
    model.source_dtype = checkpoint_dtype(metas.values())
    return model.to(parse_dtype(dtype) or model.source_dtype).eval()


def weights_by_layer(path: str | os.PathLike, args) -> Iterator[dict[str, torch.Tensor]]:
    """The text model's tensors of a checkpoint directory under our names, one layer at a time (read from the
    memory-mapped shards; memory holds one layer's tensors)."""
    return SourceTensors(Path(path)).by_layer(args)


def from_preset(name: str, seed: int = 0, attn_impl: str = "sdpa_gqa", n_layers: int | None = None) -> Decoder:
    """A preset model: `m3-tiny` with seeded random weights, `m3` on the meta device (shapes only). `n_layers`:
    only the preset's first layers (a model of the same shapes, shallower)."""
    if name not in PRESETS:
        raise M3CompileError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    args = PRESETS[name].replace(attn_impl=attn_impl)
    if n_layers is not None:
        if not 1 <= n_layers <= args.n_layers:
            raise M3CompileError(f"n_layers must be in [1, {args.n_layers}] for preset {name}, got {n_layers}")
        types = args.mlp_layer_types[:n_layers] if args.mlp_layer_types else None
        args = args.replace(n_layers=n_layers, mlp_layer_types=types)
    if name == "m3":
        with torch.device("meta"):
            return Decoder(args).eval()
    torch.manual_seed(seed)
    model = Decoder(args)
    with torch.no_grad():  # non-trivial norm weights, as in a trained model (around 1 for w * x, 0 for x * (1 + w))
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.normal_(1.0 if module.style == "rms" else 0.0, 0.1)
    return model.eval()
