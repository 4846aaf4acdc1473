"""Hugging Face checkpoint directories: config.json -> ModelArgs, safetensors <-> our tensor names, atomic writes.

Read: model_type llama, mistral, qwen2, qwen3, minimax_m3_vl_text, the text model of minimax_m3_vl, and
m3compile_msa (a converted Llama-family model as transformers remote code, m3compile.io.remote_code), in both
M3 layouts (MSA_SPEC section 1): the release naming (`language_model.model.`, `block_sparse_moe.`, per-expert
w1/w2/w3, `index_q_proj`) and what `transformers` saves (`indexer.q_proj`, fused `gate_up_proj`, packed experts).
Write: the release naming, without the `language_model.` prefix for text-only models.
Tensors are read through safetensors only; nothing is unpickled.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3compile.config import INDEX_DTYPES, INDEX_ROPES
from m3compile.errors import M3CompileError
from m3compile.io.remote_code import REMOTE_MODEL_TYPE, source_config
from m3compile.models.decoder import ModelArgs, MSALayerArgs
from m3compile.models.vision import VisionArgs

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Checkpoint",
    "read_config",
    "args_from_config",
    "read_checkpoint",
    "checkpoint_dtype",
    "load_state_dict",
    "check_state",
    "to_release_names",
    "signals_recorded",
    "write_checkpoint",
    "plan_shards",
    "write_shard_index",
    "atomic_output_dir",
    "check_output_dir",
    "output_lock",
    "copy_tokenizer_files",
    "TOKENIZER_FILES",
    "shard_files",
    "internal_names",
    "strip_prefix",
    "VISION_TENSOR",
    "vision_names",
    "vision_release_names",
    "vision_args_from_config",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "minimax_m3_vl_text", "minimax_m3_vl", REMOTE_MODEL_TYPE)
_M3_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")
# Tensors that carry no weights of the text model (recomputed buffers, multi-token-prediction heads).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|((^|\.)mtp\.)")
VISION_TENSOR = re.compile(r"^(vision_tower|multi_modal_projector|patch_merge_mlp|model\.vision_tower|model\.multi_modal_projector)\.")


# release name prefix -> our (and transformers' unprefixed) name prefix, for the vision tower and projector
_VISION_RENAMES = (
    ("vision_tower.vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.proj."),
    ("vision_tower.vision_model.encoder.layers.", "vision_tower.layers."),
    ("vision_tower.vision_model.pre_layrnorm.", "vision_tower.pre_layrnorm."),
    ("patch_merge_mlp.linear_1.", "multi_modal_projector.merge_linear_1."),
    ("patch_merge_mlp.linear_2.", "multi_modal_projector.merge_linear_2."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION_RELEASE = {new: old for old, new in _VISION_RENAMES[:5]}


def vision_names(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The vision tower and projector tensors of a minimax_m3_vl checkpoint (either layout) under our names."""
    out = {}
    for name, t in raw.items():
        if not VISION_TENSOR.match(name):
            continue
        for old, new in _VISION_RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = t
    return out


def vision_release_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our vision names -> M3's release naming (`vision_tower.vision_model.`, `patch_merge_mlp.`)."""
    out = {}
    for name, t in state.items():
        for new, old in _VISION_RELEASE.items():
            if name.startswith(new):
                name = old + name[len(new):]
                break
        out[name] = t
    return out


def vision_args_from_config(cfg: dict):
    """VisionArgs of a minimax_m3_vl config.json, or None for text-only configs and configs without a vision tower."""
    v = cfg.get("vision_config")
    if cfg.get("model_type") != "minimax_m3_vl" or not isinstance(v, dict):
        return None
    text = cfg.get("text_config") or {}
    rope = v.get("rope_parameters") or {}
    try:
        return VisionArgs(
            hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], n_layers=v["num_hidden_layers"],
            n_heads=v["num_attention_heads"], n_channels=v.get("num_channels", 3), patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
            layer_norm_eps=v.get("layer_norm_eps", 1e-5), rope_theta=rope.get("rope_theta", v.get("rope_theta", 1e4)),
            projector_hidden_size=cfg.get("projector_hidden_size", 6144), text_hidden_size=text["hidden_size"],
            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 200025)),
            video_token_id=cfg.get("video_token_index", cfg.get("video_token_id", 200026)),
        )
    except KeyError as e:
        raise M3CompileError(f"config.json vision_config lacks {e.args[0]!r}") from None


@dataclass
class Checkpoint:
    """A parsed checkpoint directory: its raw config, the model args, and tensors under our names."""

    path: Path
    config: dict  # config.json as written
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    layout: str  # "hf" (llama family), "m3-release" or "m3-transformers"
    dtype: torch.dtype
    vision_args: VisionArgs | None = None  # when the checkpoint has a vision tower
    vision_state: dict = None  # its tensors under our names (vision_tower.*, multi_modal_projector.*)


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise M3CompileError(f"{path}: not a directory")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise M3CompileError(f"{path}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise M3CompileError(f"{cfg_path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise M3CompileError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise M3CompileError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


# config.json keys checked by type and range before they are used: (key, kind, minimum, null allowed)
_CONFIG_TYPES = (
    ("vocab_size", int, 1, False), ("hidden_size", int, 1, False), ("num_hidden_layers", int, 1, False),
    ("num_attention_heads", int, 1, False), ("num_key_value_heads", int, 1, True), ("head_dim", int, 1, True),
    ("intermediate_size", int, 1, False), ("dense_intermediate_size", int, 1, False),
    ("shared_intermediate_size", int, 1, False), ("max_position_embeddings", int, 1, False),
    ("sliding_window", int, 1, True), ("num_local_experts", int, 1, False), ("num_experts_per_tok", int, 1, False),
    ("rotary_dim", int, 1, False), ("index_n_heads", int, 1, False), ("index_head_dim", int, 1, False),
    ("index_block_size", int, 1, False), ("index_topk_blocks", int, 1, False), ("index_local_blocks", int, 0, False),
    ("rms_norm_eps", float, 0, False), ("rope_theta", float, 0, False), ("partial_rotary_factor", float, 0, False),
    ("tie_word_embeddings", bool, None, False), ("attention_bias", bool, None, False),
    ("use_sliding_window", bool, None, False),
)
_SPARSE_TYPES = (
    ("sparse_num_index_heads", int, 1), ("sparse_index_dim", int, 1), ("sparse_block_size", int, 1),
    ("sparse_topk_blocks", int, 1), ("sparse_init_block", int, 0), ("sparse_local_block", int, 0),
    ("use_sparse_attention", bool, None),
)


def _check_value(where: str, key: str, value, kind, minimum, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise M3CompileError(f"config.json {where}{key} must be true or false, got {json.dumps(value)}")
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        ok = (ok or isinstance(value, float)) and math.isfinite(value)
    if not ok:
        name = "an integer" if kind is int else "a finite number"
        raise M3CompileError(f"config.json {where}{key} must be {name}, got {json.dumps(value)}")
    if minimum is not None and (value < minimum or (kind is float and value <= minimum)):
        bound = f">= {minimum}" if kind is int else f"> {minimum}"
        raise M3CompileError(f"config.json {where}{key} must be {bound}, got {json.dumps(value)}")


def check_config_types(cfg: dict, where: str = "") -> None:
    """Every known numeric or boolean key of a (text) config.json has the right JSON type and range."""
    for key, kind, minimum, nullable in _CONFIG_TYPES:
        if key in cfg:
            _check_value(where, key, cfg[key], kind, minimum, nullable)
    for key in ("rope_parameters", "rope_scaling", "sparse_attention_config"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise M3CompileError(f"config.json {where}{key} must be an object, got {json.dumps(cfg[key])}")
    rope = cfg.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            _check_value(f"{where}rope_parameters.", key, rope[key], float, 0)
    sparse = cfg.get("sparse_attention_config") or {}
    for key, kind, minimum in _SPARSE_TYPES:
        if key in sparse:
            _check_value(f"{where}sparse_attention_config.", key, sparse[key], kind, minimum)
    if "sparse_index_dtype" in sparse and sparse["sparse_index_dtype"] not in INDEX_DTYPES:
        raise M3CompileError(f"config.json {where}sparse_attention_config.sparse_index_dtype must be one of "
                             f"{', '.join(map(json.dumps, INDEX_DTYPES))}, got {json.dumps(sparse['sparse_index_dtype'])}")
    if "sparse_index_rope" in sparse and sparse["sparse_index_rope"] not in INDEX_ROPES:
        raise M3CompileError(f"config.json {where}sparse_attention_config.sparse_index_rope must be one of "
                             f"{', '.join(map(json.dumps, INDEX_ROPES))}, got {json.dumps(sparse['sparse_index_rope'])}")
    for key in ("sparse_attention_freq", "moe_layer_freq", "layer_types", "mlp_layer_types"):
        value = sparse.get(key) if key == "sparse_attention_freq" else cfg.get(key)
        if value is not None and not isinstance(value, list):
            raise M3CompileError(f"config.json {where}{key} must be a list, got {json.dumps(value)}")


def _rope(cfg: dict) -> tuple[float, float, dict | None]:
    """(theta, partial_rotary_factor, scaling) from either the old keys or transformers 5's rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", "default")
    if kind != "default":
        scaling = params
    return float(theta), float(factor), scaling


def args_from_config(cfg: dict, attn_impl: str = "sdpa_gqa") -> tuple[ModelArgs, str | None]:
    """ModelArgs for a config.json dict; also the M3 flavour ("release"/"transformers") or None."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise M3CompileError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    cfg = source_config(cfg)  # m3compile_msa: the source's model_type (llama, ...) and its keys
    model_type = cfg["model_type"]
    if model_type == "minimax_m3_vl":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise M3CompileError("minimax_m3_vl config.json has no text_config")
        cfg = dict(text, model_type="minimax_m3_vl_text")
        check_config_types(cfg, "text_config.")
    else:
        check_config_types(cfg)
    try:
        return _args_from_config(cfg, attn_impl)
    except KeyError as e:
        raise M3CompileError(f"config.json lacks {e.args[0]!r}, needed for model_type {model_type}") from None


def _args_from_config(cfg: dict, attn_impl: str) -> tuple[ModelArgs, str | None]:
    model_type = cfg["model_type"]
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // n_heads
    n_layers = cfg["num_hidden_layers"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    theta, partial, scaling = _rope(cfg)
    window = cfg.get("sliding_window")
    uses_window = model_type == "mistral" or cfg.get("use_sliding_window", False)
    if window is not None and uses_window and window < cfg.get("max_position_embeddings", 0):
        raise M3CompileError(f"sliding-window attention (sliding_window={window}) is not supported; only full causal")
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), attn_impl=attn_impl,
    )
    if cfg.get("hidden_act", "silu") != "silu" and model_type not in _M3_TYPES:
        raise M3CompileError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    rotary = int(head_dim * partial)
    if model_type not in _M3_TYPES:
        bias = cfg.get("attention_bias", model_type == "qwen2")
        args = ModelArgs(
            **common, intermediate_size=cfg["intermediate_size"], rotary_dim=rotary, qkv_bias=bool(bias),
            o_bias=bool(bias) and model_type != "qwen2", qk_norm="rms" if model_type == "qwen3" else None,
        )
        msa = _msa_from_release(cfg.get("sparse_attention_config"), args)
        return (args.replace(**msa) if msa else args), None

    # M3 text model: two flavours of config keys, like the two flavours of tensor names.
    sparse_cfg = cfg.get("sparse_attention_config") or {}
    flavour = "transformers" if "layer_types" in cfg or "index_n_heads" in cfg else "release"
    if flavour == "release" and "rotary_dim" in cfg and "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
        rotary = int(cfg["rotary_dim"])
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None and "moe_layer_freq" in cfg:
        mlp_types = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    mlp_types = tuple(mlp_types or ["sparse"] * n_layers)
    args = ModelArgs(
        **common, intermediate_size=cfg.get("dense_intermediate_size", 12288), rotary_dim=rotary,
        qk_norm="gemma", norm_style="gemma", mlp_act="swiglu_oai", swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
        swiglu_limit=cfg.get("swiglu_limit", 7.0), mlp_layer_types=mlp_types,
        n_experts=cfg.get("num_local_experts", 128), experts_per_tok=cfg.get("num_experts_per_tok", 4),
        moe_intermediate_size=cfg.get("intermediate_size", 3072),
        shared_intermediate_size=cfg.get("shared_intermediate_size", 3072),
        routed_scaling_factor=cfg.get("routed_scaling_factor", 2.0),
    )
    if flavour == "transformers":
        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        sparse = tuple(t == "minimax_m3_sparse" for t in layer_types)
        msa = MSALayerArgs(
            index_heads=cfg.get("index_n_heads", 4), index_dim=cfg.get("index_head_dim", 128),
            block_size=cfg.get("index_block_size", 128), topk=cfg.get("index_topk_blocks", 16),
            init_blocks=sparse_cfg.get("sparse_init_block", 0), local_blocks=cfg.get("index_local_blocks", 1),
            index_dtype=sparse_cfg.get("sparse_index_dtype", "auto"), index_rope=sparse_cfg.get("sparse_index_rope", "m3"),
        )
        return args.replace(sparse_layers=sparse, msa=msa if any(sparse) else None), flavour
    msa = _msa_from_release(sparse_cfg, args)
    return (args.replace(**msa) if msa else args), flavour


def _msa_from_release(sparse_cfg: dict | None, args: ModelArgs) -> dict | None:
    """sparse_layers/msa from M3's `sparse_attention_config`, or None when the model has no MSA layers."""
    if not sparse_cfg or not sparse_cfg.get("use_sparse_attention", True):
        return None
    freq = sparse_cfg.get("sparse_attention_freq") or [0] * args.n_layers
    if len(freq) != args.n_layers:
        raise M3CompileError(f"sparse_attention_freq has {len(freq)} entries for {args.n_layers} layers")
    if sparse_cfg.get("sparse_score_type", "max") != "max":
        raise M3CompileError(f"sparse_score_type {sparse_cfg['sparse_score_type']!r} is not supported (max only)")
    if not any(freq):
        return None
    msa = MSALayerArgs(
        index_heads=sparse_cfg.get("sparse_num_index_heads", args.n_kv_heads),
        index_dim=sparse_cfg.get("sparse_index_dim", args.head_dim),
        block_size=sparse_cfg.get("sparse_block_size", 128), topk=sparse_cfg.get("sparse_topk_blocks", 16),
        init_blocks=sparse_cfg.get("sparse_init_block", 0), local_blocks=sparse_cfg.get("sparse_local_block", 1),
        index_dtype=sparse_cfg.get("sparse_index_dtype", "auto"), index_rope=sparse_cfg.get("sparse_index_rope", "m3"),
    )
    return {"sparse_layers": tuple(bool(f) for f in freq), "msa": msa}


# ----------------------------------------------------------------------------------------------------------------
# Tensors


def read_weight_map(path: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's weight_map (tensor -> shard file inside `path`), or None without an index."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
    except UnicodeDecodeError:
        raise M3CompileError(f"{index}: not UTF-8 text") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise M3CompileError(f"{index}: not a valid safetensors index (no weight_map)") from None
    if not isinstance(weight_map, dict):
        raise M3CompileError(f"{index}: weight_map must be an object of tensor -> file, got {type(weight_map).__name__}")
    for name, f in weight_map.items():
        if not isinstance(f, str) or not f:
            raise M3CompileError(f"{index}: weight_map entry {name!r} must name a file, got {json.dumps(f)}")
        norm = os.path.normpath(f)  # lexically: shards may be symlinks (the Hugging Face cache's are)
        if os.path.isabs(f) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
            raise M3CompileError(f"{index}: shard {f!r} of tensor {name!r} is outside the checkpoint directory")
    return weight_map


def check_weight_map(path: Path, weight_map: dict[str, str] | None, found: dict[str, list[Path]]) -> None:
    """The index against what the shards hold: every tensor in exactly one shard, the one the index names."""
    for name, files in found.items():
        if len(files) > 1:
            raise M3CompileError(f"{path}: tensor {name} is in two shards ({files[0].name} and {files[1].name})")
    if weight_map is None:
        return
    index = path / "model.safetensors.index.json"
    for name, files in found.items():
        if name not in weight_map:
            raise M3CompileError(f"{index}: tensor {name} (in {files[0].name}) has no weight_map entry")
        if weight_map[name] != files[0].name:
            raise M3CompileError(f"{index}: weight_map puts tensor {name} in {weight_map[name]}, it is in {files[0].name}")
    for name, f in weight_map.items():
        if name not in found:
            raise M3CompileError(f"{index}: weight_map lists tensor {name} in {f}, which does not hold it")


def shard_files(path: Path) -> list[Path]:
    weight_map = read_weight_map(path)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise M3CompileError(f"{path}: shard {f} listed in model.safetensors.index.json is missing")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise M3CompileError(f"{path}: only pickle checkpoints (.bin/.pt) found; convert them to safetensors first")
    raise M3CompileError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: list[Path], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    found: dict[str, list[Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as h:
                for name in h.keys():
                    tensors[name] = h.get_tensor(name)
                    found.setdefault(name, []).append(f)
        except M3CompileError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise M3CompileError(f"{f}: cannot read safetensors file ({str(e).splitlines()[0]})") from None
    if files:
        check_weight_map(files[0].parent, read_weight_map(files[0].parent), found)
    return tensors


def strip_prefix(name: str) -> str | None:
    """Our name for a text-model tensor name of any layout, or None for tensors outside the text model."""
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def internal_names(raw: dict[str, torch.Tensor], args: ModelArgs) -> tuple[dict[str, torch.Tensor], str]:
    """Map any supported layout to our names; returns the tensors and the layout detected."""
    out: dict[str, torch.Tensor] = {}
    layout = "hf"
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, t in raw.items():
        if _IGNORED.search(name) or VISION_TENSOR.match(name):
            continue
        name = strip_prefix(name)
        if ".block_sparse_moe." in name or ".index_q_proj." in name or re.search(r"\.experts\.\d+\.w[123]\.", name):
            layout = "m3-release"
        if ".indexer." in name or ".experts.gate_up_proj" in name:
            layout = "m3-transformers"
        m = re.match(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", name)
        if m:
            experts[(int(m[1]), int(m[2]), m[3])] = t
            continue
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias")
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        name = re.sub(r"\.self_attn\.indexer\.(q|k)_(proj|norm)\.", r".self_attn.index_\1_\2.", name)
        if name.endswith(".experts.gate_up_proj"):
            out[name.replace(".experts.gate_up_proj", ".w13")] = t
        elif name.endswith(".experts.down_proj"):
            out[name.replace(".experts.down_proj", ".w2")] = t
        elif name.endswith(".gate_up_proj.weight"):  # fused dense MLP: gate rows, then up rows
            gate, up = t.chunk(2, dim=0)
            out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[name] = t
    if experts:
        for layer in sorted({k[0] for k in experts}):
            n = args.n_experts
            try:
                w1 = torch.stack([experts[(layer, e, "w1")] for e in range(n)])
                w3 = torch.stack([experts[(layer, e, "w3")] for e in range(n)])
                w2 = torch.stack([experts[(layer, e, "w2")] for e in range(n)])
            except KeyError as e:
                raise M3CompileError(f"layer {layer}: expert tensor {e.args[0]} missing") from None
            out[f"model.layers.{layer}.mlp.w13"] = torch.cat([w1, w3], dim=1)
            out[f"model.layers.{layer}.mlp.w2"] = w2
    return out, layout


def read_checkpoint(path: str | os.PathLike, attn_impl: str = "sdpa_gqa") -> Checkpoint:
    """Parse a checkpoint directory; tensors come back under our names, validated against config.json later."""
    path = Path(path)
    cfg = read_config(path)
    args, _ = args_from_config(cfg, attn_impl)
    raw = _read_tensors(shard_files(path))
    state, layout = internal_names(raw, args)
    dtype = checkpoint_dtype(state.values())
    vision = vision_names(raw)
    vision_args = vision_args_from_config(cfg) if vision else None
    return Checkpoint(path, cfg, args, state, layout, dtype, vision_args, vision if vision_args else None)


def checkpoint_dtype(tensors) -> torch.dtype:
    """A checkpoint's dtype from its text-model tensors (real or meta): bf16 if any is, else the one floating dtype
    they share, else fp32."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    return torch.bfloat16 if torch.bfloat16 in dtypes else (dtypes.pop() if len(dtypes) == 1 else torch.float32)


def check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: Path | str,
                tied: bool = False) -> None:
    """Missing, unexpected or mis-shaped tensors (against `expected`, e.g. a meta model's state dict) as one-line errors."""
    missing = [n for n in expected if n not in state and not (tied and n == "lm_head.weight")]
    if missing:
        raise M3CompileError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    unexpected = [n for n in state if n not in expected]
    if unexpected:
        raise M3CompileError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise M3CompileError(
                f"{source}: tensor {name} has shape {list(t.shape)} but config.json implies {list(expected[name].shape)}"
            )


def load_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path | str) -> None:
    """Copy `state` into `model` by name; missing, unexpected or mis-shaped tensors are one-line errors."""
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    check_state(model.state_dict(), state, source, tied)
    model.load_state_dict(state, strict=not tied, assign=False)


def to_release_names(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Our names -> M3's release naming: MoE under `block_sparse_moe.` with per-expert w1/w2/w3."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = re.match(r"(model\.layers\.\d+)\.mlp\.(w13|w2|gate\.weight|e_score_correction_bias|shared_experts\..*)$", name)
        if m:
            base, leaf = m[1] + ".block_sparse_moe", m[2]
            if leaf == "w13":
                w1, w3 = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{base}.experts.{e}.w1.weight"] = w1[e]
                    out[f"{base}.experts.{e}.w3.weight"] = w3[e]
            elif leaf == "w2":
                for e in range(t.shape[0]):
                    out[f"{base}.experts.{e}.w2.weight"] = t[e]
            else:
                out[f"{base}.{leaf}"] = t
            continue
        out[prefix + name if prefix else name] = t
    return {k: v.contiguous() for k, v in out.items()}


def check_output_dir(out: str | os.PathLike, inputs=(), force: bool = False) -> None:
    """The one check before any command writes the directory `out` (one-line errors, nothing written):
    `out` may not equal, contain or lie inside any of `inputs` (with or without force), may not be a file or a
    dangling symlink, must exist only with `force`, and its nearest existing parent must be a writable directory."""
    out = Path(out)
    target = Path(os.path.abspath(out)).resolve()
    for given in inputs:
        if given is None:
            continue
        inp = Path(os.path.abspath(given)).resolve()
        if target == inp:
            raise M3CompileError(f"output {out} is the input {given}; write to another directory")
        if target in inp.parents:
            raise M3CompileError(f"output {out} contains the input {given}; write to another directory")
        if inp in target.parents:
            raise M3CompileError(f"output {out} is inside the input {given}; write to another directory")
    if out.is_symlink() and not out.exists():
        raise M3CompileError(f"output {out} is a dangling symlink")
    if out.exists() and not out.is_dir():
        raise M3CompileError(f"output {out} is a file, not a directory")
    if out.exists() and not force:
        raise M3CompileError(f"{out} already exists (use --force to replace it)")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise M3CompileError(f"output {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise M3CompileError(f"output {out}: cannot write in {parent} (permission denied)")


_HELD_LOCKS: dict[str, list] = {}  # lock file -> [fd, depth]: a process may nest writes of one output


@contextlib.contextmanager
def output_lock(out: str | os.PathLike):
    """Exclusive lock of the output `out` (fcntl.flock on `.NAME.lock` beside it) for as long as the block runs;
    a second writer of the same output, in another process, is refused at once. Reentrant within a process."""
    out = Path(os.path.abspath(out))
    lock = out.parent / f".{out.name}.lock"
    key = str(lock)
    if key in _HELD_LOCKS:
        _HELD_LOCKS[key][1] += 1
        try:
            yield
        finally:
            _HELD_LOCKS[key][1] -= 1
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(lock).st_ino:  # the holder removed it as we opened it: still contended
            raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        raise M3CompileError(f"{out} is being written by another process (lock {lock} is held)") from None
    _HELD_LOCKS[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD_LOCKS[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


COMMITTED: list[Path] = []  # outputs atomic_output_dir has put in place (m3c says so if a signal comes after)


@contextlib.contextmanager
def signals_recorded(got: list[int] | None = None):
    """SIGINT / SIGTERM recorded in `got` (yielded; a new list by default) instead of handled, for the block, in the
    main thread; the previous handlers come back after it. Elsewhere (another thread cannot set handlers) nothing
    changes and the list stays empty. (Python handlers, swapped rather than a thread's signal mask: any thread may
    take a process signal.)"""
    got = [] if got is None else got
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    before = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in (signal.SIGINT,
                                                                                         signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_held():
    """SIGINT / SIGTERM held back for the block (signals_recorded): the handler the first one would have run runs
    when the block ends, so a commit and its record in COMMITTED happen together or not at all."""
    pending: list[int] = []
    try:
        with signals_recorded(pending):
            yield
    finally:
        for signum in pending[:1]:
            handler = signal.getsignal(signum)  # the handler signals_recorded put back
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False, inputs=()):
    """Yield a temporary sibling directory that becomes `out` only if the block completes.

    check_output_dir runs first; the output is locked against a second writer for the duration; stale
    `.NAME.partial-*` directories of a killed earlier run are removed (the lock says none is live)."""
    out = Path(out)
    check_output_dir(out, inputs, force)
    with output_lock(out):
        for stale in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        old = out.parent / f".{out.name}.partial-old-{os.getpid()}"
        tmp = None
        try:
            with _signals_held():  # a signal between the directory's creation and `tmp` would leave it behind
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
            yield tmp
            with _signals_held():
                if out.exists():  # move the old output aside first: a kill at any point leaves one of the two in place
                    out.rename(old)
                    try:
                        tmp.rename(out)
                    except BaseException:
                        old.rename(out)
                        raise
                else:
                    tmp.rename(out)
                COMMITTED.append(out)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:  # the previous output, once the new one is in place (also when a held signal fires after it)
            shutil.rmtree(old, ignore_errors=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "added_tokens.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "spiece.model")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files a checkpoint has (TOKENIZER_FILES) from `src` into `dst`."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[tuple[str, list[str]]]:
    """Split (tensor name, bytes) pairs, in order, into shards of at most `max_shard_bytes` (a larger tensor gets a
    shard of its own); returns (file name, tensor names) per shard, named as Hugging Face does."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def write_shard_index(out_dir: Path, shards: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """model.safetensors.index.json for more than one shard."""
    if len(shards) > 1:
        weight_map = {n: fname for fname, names in shards for n in names}
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2, sort_keys=True)
        )


def write_checkpoint(
    out_dir: Path, config: dict, state: dict[str, torch.Tensor], max_shard_bytes: int = 5 * 10**9
) -> list[str]:
    """Write config.json and safetensors shards (with an index when more than one) into `out_dir`."""
    shards = plan_shards([(n, state[n].numel() * state[n].element_size()) for n in sorted(state)], max_shard_bytes)
    for fname, names in shards:
        save_file({n: state[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
    write_shard_index(out_dir, shards, sum(t.numel() * t.element_size() for t in state.values()))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [fname for fname, _ in shards]
