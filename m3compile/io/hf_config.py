"""Hugging Face config.json -> ModelArgs (and VisionArgs): read, type-checked, mapped.

model_type llama, mistral, qwen2, qwen3, minimax_m3_vl_text, the text model of minimax_m3_vl, and m3compile_msa (a
converted Llama-family model as transformers remote code, m3compile.export.remote_code); M3 text configs in both
flavours of keys (docs/msa.md section 1): the release's (`sparse_attention_config`, `moe_layer_freq`) and what
`transformers` saves (`layer_types`, `index_n_heads`, ...).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from m3compile.config import (FORMAT_VERSION, FORMAT_VERSION_KEY, INDEX_DTYPES, INDEX_ROPES, check_msa_ranges,
                              check_question_budgets, max_positions)
from m3compile.errors import M3CompileError
from m3compile.models.decoder import ModelArgs, MSALayerArgs
from m3compile.models.vision import VisionArgs

__all__ = ["SUPPORTED_MODEL_TYPES", "read_config", "check_config_types", "args_from_config", "vision_args_from_config",
           "max_positions", "check_positions", "ROPE_SCALINGS", "REMOTE_MODEL_TYPE", "REMOTE_SOURCE_TYPES",
           "source_config"]

# A converted Llama-family model's config.json type, read back as its source's (m3compile.export.remote_code writes it)
REMOTE_MODEL_TYPE = "m3compile_msa"
REMOTE_SOURCE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "minimax_m3_vl_text", "minimax_m3_vl", REMOTE_MODEL_TYPE)
_M3_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")


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
    ("sparse_min_blocks", int, 0), ("sparse_top_p", float, 0), ("use_sparse_attention", bool, None),
    ("sparse_answer_tokens", int, 0),
    (FORMAT_VERSION_KEY, int, 1),
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
    if sparse.get(FORMAT_VERSION_KEY, FORMAT_VERSION) > FORMAT_VERSION:
        raise M3CompileError(f"config.json {where}sparse_attention_config.{FORMAT_VERSION_KEY} is "
                             f"{sparse[FORMAT_VERSION_KEY]}, a newer format than this m3compile reads "
                             f"({FORMAT_VERSION}): update m3compile")
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
        if key.endswith("_freq") and value is not None:  # one 0 or 1 per layer
            bad = [v for v in value if not isinstance(v, (int, float)) or v not in (0, 1)]
            if bad:
                bad = bad[0]
                raise M3CompileError(f"config.json {where}{'sparse_attention_config.' if key.startswith('sparse') else ''}"
                                     f"{key} entries must be 0 or 1 (one per layer), got {json.dumps(bad)}")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise M3CompileError(f"config.json {where}num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv}): each KV head serves a whole group of query heads")


# RoPE frequency scalings the models implement (models/decoder.py _scale_frequencies) and the keys each needs
ROPE_SCALINGS = {"default": (), "linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _check_rope_scaling(scaling: dict | None, where: str) -> None:
    """A RoPE scaling the model implements, with every number it needs finite and positive."""
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise M3CompileError(f"config.json {where}: RoPE scaling {json.dumps(kind)} is not supported (supported: "
                             f"{', '.join(ROPE_SCALINGS)})")
    for key in ROPE_SCALINGS[kind]:
        if key not in scaling:
            raise M3CompileError(f"config.json {where}: {kind} RoPE scaling needs {key}")
        _check_value(f"{where}.", key, scaling[key], float, 0)
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise M3CompileError(f"config.json {where}: high_freq_factor ({scaling['high_freq_factor']}) must exceed "
                             f"low_freq_factor ({scaling['low_freq_factor']})")


def check_positions(length: int, cfg: dict | None, what: str) -> None:
    """`length` tokens in one sequence must fit the model's positions (max_position_embeddings): past them the model
    runs on positions it was never trained on, and whatever is measured there means nothing. `what` names the
    length in the error ("--seq-len 4096")."""
    limit = max_positions(cfg)
    if limit is not None and length > limit:
        raise M3CompileError(f"{what} is past the model's {limit:,} positions (max_position_embeddings in "
                             f"config.json); use at most {limit:,} tokens")


def _rope(cfg: dict) -> tuple[float, float, dict | None]:
    """(theta, partial_rotary_factor, scaling) from either the old keys or transformers 5's rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", "default")
    _check_rope_scaling(scaling, "rope_scaling")
    if kind != "default":
        scaling = params
        _check_rope_scaling(scaling, "rope_parameters")
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
    except ValueError as e:  # the model's own consistency checks (ModelArgs, MSALayerArgs)
        raise M3CompileError(f"config.json: {' '.join(str(e).split())}") from None


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
            top_p=sparse_cfg.get("sparse_top_p", 1.0), min_blocks=sparse_cfg.get("sparse_min_blocks", 0),
            **_question_budgets(sparse_cfg),
        )
        if any(sparse):
            _check_msa(msa, dict(block_size="index_block_size", topk="index_topk_blocks",
                                 init_blocks="sparse_attention_config.sparse_init_block",
                                 local_blocks="index_local_blocks", index_dim="index_head_dim",
                                 index_heads="index_n_heads", top_p="sparse_attention_config.sparse_top_p",
                                 min_blocks="sparse_attention_config.sparse_min_blocks"))
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
        top_p=sparse_cfg.get("sparse_top_p", 1.0), min_blocks=sparse_cfg.get("sparse_min_blocks", 0),
        **_question_budgets(sparse_cfg),
    )
    _check_msa(msa, {name: f"sparse_attention_config.{key}" for name, key in (
        ("block_size", "sparse_block_size"), ("topk", "sparse_topk_blocks"), ("init_blocks", "sparse_init_block"),
        ("local_blocks", "sparse_local_block"), ("index_dim", "sparse_index_dim"),
        ("index_heads", "sparse_num_index_heads"), ("top_p", "sparse_top_p"), ("min_blocks", "sparse_min_blocks"))})
    return {"sparse_layers": tuple(bool(f) for f in freq), "msa": msa}


def _check_msa(msa: MSALayerArgs, keys: dict[str, str]) -> None:
    """A config's MSA settings within the ranges a conversion accepts (config.check_msa_ranges), named by its keys."""
    try:
        check_msa_ranges(block_size=msa.block_size, topk=msa.topk, init_blocks=msa.init_blocks,
                         local_blocks=msa.local_blocks, index_dim=msa.index_dim, index_heads=msa.index_heads,
                         top_p=msa.top_p, min_blocks=msa.min_blocks, names=keys, min_local=0)
        check_question_budgets(msa.answer_budget, msa.answer_tokens, msa.decode_budget, block_size=msa.block_size,
                               init_blocks=msa.init_blocks, local_blocks=msa.local_blocks,
                               names={k: f"sparse_attention_config.sparse_{k}"
                                      for k in ("answer_budget", "answer_tokens", "decode_budget")})
    except M3CompileError as e:
        raise M3CompileError(f"config.json {e}") from None


def _question_budgets(sparse_cfg: dict) -> dict:
    """MSALayerArgs' answer_budget, answer_tokens and decode_budget from sparse_attention_config (not M3 keys)."""
    return {"answer_budget": sparse_cfg.get("sparse_answer_budget"),
            "answer_tokens": sparse_cfg.get("sparse_answer_tokens", 128),
            "decode_budget": sparse_cfg.get("sparse_decode_budget")}


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


def source_config(config: dict) -> dict:
    """The config as the source model's: model_type m3compile_msa read as its `source_model_type`."""
    if config.get("model_type") != REMOTE_MODEL_TYPE:
        return config
    source = config.get("source_model_type")
    if source not in REMOTE_SOURCE_TYPES:
        raise M3CompileError(f"config.json model_type {REMOTE_MODEL_TYPE} needs source_model_type, one of "
                             f"{', '.join(REMOTE_SOURCE_TYPES)}; got {source!r}")
    return dict(config, model_type=source)
