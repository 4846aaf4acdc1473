"""vLLM serves a converted model with MSA active: `vllm serve DIR` and `vllm.LLM(DIR)` for a directory that
`m3c convert` (or distill, train, `m3compile.save`) wrote with model_type m3compile_msa.

vLLM calls `register` in each of its processes, through the `vllm.general_plugins` entry point of pyproject.toml.
It registers the converted model's config class with transformers (so no remote code runs), its architecture with
vLLM's model registry, and the check vLLM's configuration step runs before it starts an engine.

    config.py   what is asked of vLLM, checked (one-line errors) and set: the cache's block size is the MSA block
    cache.py    the paged K/V and index-key caches vLLM allocates, their attention backend, and the view of a
                batch that m3compile's model attends through (runtime.paged_cache's prompt and decode views)
    model.py    the model vLLM runs: m3compile's Decoder, its weights, its forward over those caches

How the caches are laid out and why: docs/vllm.md.
"""
from __future__ import annotations

from transformers import AutoConfig
from vllm import ModelRegistry

from m3compile.export.modeling_m3compile import M3CompileConfig
from m3compile.export.remote_code import ARCHITECTURE
from m3compile.io.hf_config import REMOTE_MODEL_TYPE
from m3compile.vllm.config import register_checks
from m3compile.vllm.model import M3CompileForCausalLM

__all__ = ["register"]


def register() -> None:
    """Make vLLM serve model_type m3compile_msa (vLLM may call this more than once in a process)."""
    AutoConfig.register(REMOTE_MODEL_TYPE, M3CompileConfig, exist_ok=True)
    ModelRegistry.register_model(ARCHITECTURE, M3CompileForCausalLM)
    register_checks(ARCHITECTURE)
