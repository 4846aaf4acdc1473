"""Converted checkpoints that `transformers` runs with MSA active: the Hugging Face remote-code convention.

A converted Llama / Mistral / Qwen2 / Qwen3 with MSA layers is written with

    "model_type": "m3compile_msa", "source_model_type": "llama",      (the dense model's type, kept)
    "architectures": ["M3CompileForCausalLM"],
    "auto_map": {"AutoConfig": "modeling_m3compile.M3CompileConfig",
                 "AutoModelForCausalLM": "modeling_m3compile.M3CompileForCausalLM"}

and modeling_m3compile.py (this package's file of that name, plain torch) beside the weights, so
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` builds the MSA model. A model_type of its own,
not the source's: transformers resolves a known model_type to its registered class unless remote code is trusted,
so "llama" plus auto_map would load a dense Llama without a word (only a warning about unused index tensors);
"m3compile_msa" is known to no transformers, so a load without trust_remote_code stops with transformers' error
asking for it. M3's own types (minimax_m3_vl, minimax_m3_vl_text) are left as they are: transformers ships their
MSA model. Readers (`source_config`) see the source's type again, so checkpoints written before this (model_type
llama + sparse_attention_config) and after it load the same way.

What a config says about code is never trusted: every config.json the product writes (convert, distill, train,
save) gets its model_type, architectures and auto_map from remote_config, whatever the source's said; a source's
auto_map (and custom_pipelines) is dropped, never carried into an output beside code that it does not name.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from m3compile.io.hf_config import REMOTE_MODEL_TYPE, REMOTE_SOURCE_TYPES, source_config

__all__ = ["MODELING_FILE", "ARCHITECTURE", "remote_config", "write_modeling_file"]

MODELING_FILE = "modeling_m3compile.py"
ARCHITECTURE = "M3CompileForCausalLM"
_AUTO_MAP = {"AutoConfig": "modeling_m3compile.M3CompileConfig",
             "AutoModelForCausalLM": "modeling_m3compile.M3CompileForCausalLM"}
# transformers' own class of each source type, for a dense output
_DENSE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM"}
_CODE_KEYS = ("auto_map", "custom_pipelines")  # config keys that name code for transformers to import


def _has_msa_layers(config: dict) -> bool:
    sparse = config.get("sparse_attention_config")
    return isinstance(sparse, dict) and sparse.get("use_sparse_attention", True) is not False \
        and any(sparse.get("sparse_attention_freq") or [])


def remote_config(config: dict) -> dict:
    """config.json of an output directory, its fields that name code written here: a Llama-family model with MSA
    layers as model_type m3compile_msa with our architectures and auto_map (one converted before included), a dense
    one as its source type with transformers' class; an M3 model keeps its type. No auto_map of the source stays."""
    out = {k: v for k, v in source_config(config).items() if k not in _CODE_KEYS}
    out.pop("source_model_type", None)
    kind = out.get("model_type")
    if kind not in REMOTE_SOURCE_TYPES:
        return out
    if not _has_msa_layers(out):
        return dict(out, model_type=kind, architectures=[_DENSE_ARCHITECTURES[kind]])
    return dict(out, model_type=REMOTE_MODEL_TYPE, source_model_type=kind, architectures=[ARCHITECTURE],
                auto_map=dict(_AUTO_MAP))


def write_modeling_file(folder: str | Path, config: dict) -> bool:
    """Copy modeling_m3compile.py into `folder` when `config` (as written there) names it; returns whether it did."""
    if config.get("model_type") != REMOTE_MODEL_TYPE:
        return False
    shutil.copyfile(Path(__file__).with_name(MODELING_FILE), Path(folder) / MODELING_FILE)
    return True
