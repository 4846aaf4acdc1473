"""Synthetic Llama- and Qwen2-style checkpoints with random weights, written tensor by tensor (memory stays at one
tensor).

For benchmarks and tests of real-size conversion: the shapes are a real model's, the values are random.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from m3compile.outputs import atomic_output_dir
from m3compile.io.shards import SafetensorsWriter, nbytes
from m3compile.io.weights import plan_shards, write_shard_index

__all__ = ["SHAPES", "write_synthetic_checkpoint"]

SHAPES = {
    # 7B Llama-style with GQA: hidden 4096, 32 layers, 32 query / 8 KV heads; 6.4B parameters, 12.9 GB in bf16
    "7b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    # about 300 MB in bf16 (0.17B parameters), 30 MB per layer: the CI test's model
    "300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=10, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=8192),
    # Llama-style, hidden 2048, 12 layers, 16 query / 4 KV heads: 0.61B parameters, 1.2 GB in bf16, 2.4 GB in fp32
    "600m": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=16384),
    # Qwen2-1.5B's layout: q/k/v biases, tied embeddings, 12 query / 2 KV heads of 128; 1.54B parameters, 6.2 GB
    # in fp32
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0),
}


def _tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    qkv_bias = cfg["model_type"] == "qwen2"
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h))]
        if qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (h,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    return out if cfg["tie_word_embeddings"] else out + [("lm_head.weight", (v, h))]


def write_synthetic_checkpoint(out: str | os.PathLike, shape: str | dict = "300m", *, seed: int = 0,
                               max_shard_size: int = 5 * 10**9, dtype: torch.dtype = torch.bfloat16,
                               force: bool = False) -> Path:
    """A Llama (or, for model_type "qwen2", Qwen2) checkpoint directory (config.json, safetensors shards + index) of
    random weights."""
    cfg = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    cfg = {"model_type": "llama", "rope_theta": 500000.0, "tie_word_embeddings": False, **cfg}
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg["model_type"]]
    cfg.update(architectures=[arch], rms_norm_eps=1e-5, max_position_embeddings=131072,
               torch_dtype=str(dtype).split(".")[-1])
    entries = _tensors(cfg)
    shapes = dict(entries)
    shards = plan_shards([(n, nbytes(s, dtype)) for n, s in entries], max_shard_size)
    gen = torch.Generator().manual_seed(seed)
    out = Path(out)
    with atomic_output_dir(out, force) as tmp:
        for fname, names in shards:
            writer = SafetensorsWriter(tmp / fname, [(n, shapes[n], dtype) for n in names])
            for name in names:
                s = shapes[name]
                if name.endswith("norm.weight"):
                    t = 1.0 + 0.1 * torch.randn(s, generator=gen)
                elif name.endswith("bias"):
                    t = 0.1 * torch.randn(s, generator=gen)
                else:
                    t = torch.randn(s, generator=gen) * (1.0 / s[-1] ** 0.5)
                writer.write(name, t.to(dtype))
            writer.close()
        write_shard_index(tmp, shards, sum(nbytes(s, dtype) for _, s in entries))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
