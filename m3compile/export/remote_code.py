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
"""
from __future__ import annotations

import shutil
from pathlib import Path

from m3compile.io.hf_config import REMOTE_MODEL_TYPE, REMOTE_SOURCE_TYPES

__all__ = ["MODELING_FILE", "ARCHITECTURE", "remote_config", "write_modeling_file"]

MODELING_FILE = "modeling_m3compile.py"
ARCHITECTURE = "M3CompileForCausalLM"
_AUTO_MAP = {"AutoConfig": "modeling_m3compile.M3CompileConfig",
             "AutoModelForCausalLM": "modeling_m3compile.M3CompileForCausalLM"}


def _has_msa_layers(config: dict) -> bool:
    sparse = config.get("sparse_attention_config")
    return isinstance(sparse, dict) and sparse.get("use_sparse_attention", True) is not False \
        and any(sparse.get("sparse_attention_freq") or [])


def remote_config(config: dict) -> dict:
    """config.json of an output directory: a Llama-family model with MSA layers as model_type m3compile_msa (with
    auto_map); a dense model, an M3 model or one already converted this way as given."""
    kind = config.get("model_type")
    if kind not in REMOTE_SOURCE_TYPES or not _has_msa_layers(config):
        return dict(config)
    out = dict(config, model_type=REMOTE_MODEL_TYPE, source_model_type=kind, architectures=[ARCHITECTURE],
               auto_map=dict(_AUTO_MAP))
    return out


def write_modeling_file(folder: str | Path, config: dict) -> bool:
    """Copy modeling_m3compile.py into `folder` when `config` (as written there) names it; returns whether it did."""
    if config.get("model_type") != REMOTE_MODEL_TYPE:
        return False
    shutil.copyfile(Path(__file__).with_name(MODELING_FILE), Path(folder) / MODELING_FILE)
    return True
