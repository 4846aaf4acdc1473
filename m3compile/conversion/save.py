"""Saving a converted graph as a checkpoint directory: config.json with M3's keys, safetensors with M3's names,
graph/module.py, conversion_report.json and, for a Llama-family model, modeling_m3compile.py (transformers remote
code, m3compile.export.remote_code), all written into a temporary directory that is renamed at the end."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.fx

from m3compile.config import MSAConfig
from m3compile.errors import M3CompileError
from m3compile.io.module_io import write_module
from m3compile.outputs import atomic_output_dir
from m3compile.export.remote_code import remote_config, write_modeling_file
from m3compile.io.tensor_names import checkpoint_names
from m3compile.io.weights import write_checkpoint
from m3compile.models.decoder import Decoder, ModelArgs
from m3compile.conversion.convert import ConversionReport

__all__ = ["save", "output_config", "config_for_preset", "write_extras"]


def output_config(source: dict, args: ModelArgs, config: MSAConfig) -> dict:
    """config.json of a converted model: the source's, plus M3's sparse_attention_config for its MSA layers; a
    Llama-family model with MSA layers as transformers remote code (model_type m3compile_msa, auto_map)."""
    out = json.loads(json.dumps(source))
    text = out["text_config"] if out.get("model_type") == "minimax_m3_vl" else out
    if args.msa is None:
        return remote_config(out)
    sparse = [args.is_sparse(i) for i in range(args.n_layers)]
    m = args.msa
    text["sparse_attention_config"] = dataclasses.replace(
        config, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks,
        index_dtype=m.index_dtype, top_p=m.top_p, min_blocks=m.min_blocks, answer_budget=m.answer_budget,
        answer_tokens=m.answer_tokens, decode_budget=m.decode_budget,
    ).m3_config(args.n_layers, m.index_heads, m.index_dim, sparse, m.index_rope)
    m3_type = out.get("model_type") in ("minimax_m3_vl", "minimax_m3_vl_text")
    if m3_type and m.index_rope != "m3":  # transformers ships the M3 classes: they would apply M3's own rule
        raise M3CompileError(f"index_dim {m.index_dim} is below the rotary width ({args.rope_dim}): an M3 checkpoint "
                             "keeps its model type, whose transformers classes cut the RoPE table to the index width, "
                             f"so use --index-dim >= {args.rope_dim} for it")
    if m3_type and ("layer_types" in text or "index_n_heads" in text):  # keep transformers' flavour of keys consistent
        text["layer_types"] = ["minimax_m3_sparse" if s else "full_attention" for s in sparse]
        text.update(index_n_heads=m.index_heads, index_head_dim=m.index_dim, index_block_size=m.block_size,
                    index_topk_blocks=m.topk, index_local_blocks=m.local_blocks)
    return remote_config(out)


def config_for_preset(args: ModelArgs) -> dict:
    """config.json for a preset: a Llama (or, with q/k/v biases, Qwen2) config for the plain dense shapes
    (llama3-8b, qwen2.5-7b, smollm2-135m: RMSNorm w * x, SiLU MLP, no QK norm, no MoE), else an M3 text model (minimax_m3_vl_text) in the
    release flavour of keys (M3's own conventions: Gemma-style norms, clamped SwiGLU), with what transformers' M3
    class needs to build the same model: the rotary width as rope_parameters' partial_rotary_factor (it ignores
    rotary_dim) and no token ids of the released model's 200K vocabulary (its defaults)."""
    llama_like = (args.norm_style == "rms" and args.mlp_act == "silu" and args.qk_norm is None and not args.n_experts
                  and not args.o_bias and args.rope_scaling is None and args.rope_dim == args.head_dim)
    if llama_like:  # Qwen2 is Llama with q/k/v biases
        kind, arch = ("qwen2", "Qwen2ForCausalLM") if args.qkv_bias else ("llama", "LlamaForCausalLM")
        return {
            "model_type": kind, "architectures": [arch], "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps,
            "rope_theta": args.rope_theta, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        }
    return {
        "model_type": "minimax_m3_vl_text", "architectures": ["MiniMaxM3VLForCausalLM"],
        "vocab_size": args.vocab_size, "hidden_size": args.hidden_size, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "dense_intermediate_size": args.intermediate_size, "intermediate_size": args.moe_intermediate_size,
        "shared_intermediate_size": args.shared_intermediate_size, "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.experts_per_tok, "routed_scaling_factor": args.routed_scaling_factor,
        "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta, "rotary_dim": args.rope_dim,
        "moe_layer_freq": [int(args.is_moe(i)) for i in range(args.n_layers)], "tie_word_embeddings": args.tie_embeddings,
        "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.rope_dim / args.head_dim},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def save(gm: torch.fx.GraphModule, report: ConversionReport, out_dir: str | os.PathLike, source_config: dict | None = None,
         force: bool = False, max_shard_size: int = 5 * 10**9) -> Path:
    """Write a converted model: config.json, safetensors with M3 names, graph/module.py, conversion_report.json.

    Everything is written into a temporary sibling directory that is renamed to `out_dir` at the end.
    """
    args: ModelArgs = gm.meta["model_args"]
    if any(t.is_meta for t in gm.state_dict().values()):
        raise M3CompileError("the model is on the meta device and has no weights to write (use a checkpoint)")
    with torch.device("meta"):
        expected = Decoder(args).state_dict()
    state = {k: v.detach() for k, v in gm.state_dict().items() if k in expected}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state and not (args.tie_embeddings and k == "lm_head.weight")]
    if missing:
        raise M3CompileError(f"the converted graph lacks tensor {missing[0]}")
    config = output_config(source_config or config_for_preset(args), args, report.config)
    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir, force) as tmp:
        write_checkpoint(tmp, config, checkpoint_names(state, config), max_shard_size)
        write_extras(tmp, gm, report, config)
    return out_dir


def write_extras(folder: Path, gm: torch.fx.GraphModule, report: ConversionReport, config: dict) -> None:
    """graph/module.py + graph/buffers.safetensors (the rewritten graph as a standalone module, see
    m3compile.io.module_io), conversion_report.json and, when `config` (the config.json written) asks for it, the
    transformers modeling file beside the weights."""
    write_module(gm, folder, report.model)
    write_modeling_file(folder, config)
    (folder / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
