"""Tensor names: every supported checkpoint layout <-> ours, and ours -> M3's release naming.

Read: both M3 layouts (docs/msa.md section 1), the release naming (`language_model.model.`, `block_sparse_moe.`,
per-expert w1/w2/w3, `index_q_proj`) and what `transformers` saves (`indexer.q_proj`, fused `gate_up_proj`, packed
experts), and the Llama family's. Write (checkpoint_names): the release naming (to_release_names,
vision_release_names), except for a text-only M3 checkpoint (minimax_m3_vl_text), which gets what transformers'
own class for that type loads (to_transformers_names): transformers maps the release naming only for the
multimodal type, so release names there load as unexpected tensors beside freshly initialised ones.
"""
from __future__ import annotations

import re

import torch

from m3compile.errors import M3CompileError
from m3compile.models.decoder import ModelArgs

__all__ = ["VISION_TENSOR", "vision_names", "vision_release_names", "strip_prefix", "internal_names",
           "to_release_names", "to_transformers_names", "checkpoint_names", "written_together"]

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


_FUSED = re.compile(r"(.*\.(?:mlp|shared_experts))\.(gate|up)_proj\.weight$")  # a dense or shared MLP's gate / up


def to_transformers_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> what transformers' MiniMaxM3VLForCausalLM (model type minimax_m3_vl_text) loads: the index branch
    under `indexer.`, the experts packed (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), a dense
    or shared MLP's gate and up rows in one `gate_up_proj` (gate first: both must be in `state`), the router's bias
    under `gate.`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        fused = _FUSED.match(name)
        if fused:
            if fused[2] == "gate":
                out[f"{fused[1]}.gate_up_proj.weight"] = torch.cat([t, state[f"{fused[1]}.up_proj.weight"]], dim=0)
            continue
        name = re.sub(r"\.self_attn\.index_(q|k)_(proj|norm)\.", r".self_attn.indexer.\1_\2.", name)
        name = re.sub(r"\.mlp\.w13$", ".mlp.experts.gate_up_proj", name)
        name = re.sub(r"\.mlp\.w2$", ".mlp.experts.down_proj", name)
        out[name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")] = t
    return {k: v.contiguous() for k, v in out.items()}


def _transformers_naming(config: dict) -> bool:
    return config.get("model_type") == "minimax_m3_vl_text"


def checkpoint_names(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Our names -> those a checkpoint whose config.json is `config` is written with (module doc)."""
    return to_transformers_names(state) if _transformers_naming(config) else to_release_names(state)


def written_together(names: list[str], config: dict) -> list[list[str]]:
    """`names` (ours) in groups that checkpoint_names turns into output tensors together (a gate and its up rows,
    where they are fused), in their order; each other name alone."""
    if not _transformers_naming(config):
        return [[n] for n in names]
    groups, of = [], {}
    for n in names:
        fused = _FUSED.match(n)
        if fused and fused[1] in of:
            of[fused[1]].append(n)
            continue
        groups.append([n])
        if fused:
            of[fused[1]] = groups[-1]
    return groups
