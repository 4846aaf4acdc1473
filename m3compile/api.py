"""The public verbs: load a checkpoint or preset, convert it to MSA, save the result, evaluate it."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.fx
import torch.nn.functional as F

from kernels import reference as ref
from m3compile.checkpoint import (
    atomic_output_dir, check_state, load_state_dict, read_checkpoint, to_release_names,
    write_checkpoint,
)
from m3compile.config import MSAConfig
from m3compile.data import windows
from m3compile.errors import M3CompileError
from m3compile.pass_manager import PassManager, PassReport
from m3compile.tracing import trace
from models.decoder import PRESETS, Attention, Decoder, ModelArgs, MSALayerArgs, RMSNorm, RotaryEmbedding

__all__ = [
    "load", "from_preset", "convert", "save", "convert_checkpoint", "evaluate",
    "ConversionReport", "EvalReport", "lower",
]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise M3CompileError(f"unknown dtype {name!r} (use one of {', '.join(_DTYPES)})")
    return _DTYPES[name]


def load(path: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str = "cpu",
         attn_impl: str = "sdpa_gqa") -> Decoder:
    """A checkpoint directory (dense or converted, any supported layout) as a runnable Decoder."""
    ck = read_checkpoint(path, attn_impl)
    with torch.device("meta"):
        model = Decoder(ck.args)
    model = model.to_empty(device=device)
    load_state_dict(model, ck.state_dict, ck.path)
    if ck.args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = RotaryEmbedding.frequencies(ck.args).to(device)  # not in the checkpoint
    model.source_config = ck.config
    model.source_dtype = ck.dtype
    if ck.vision_args is not None:  # minimax_m3_vl with its vision tower: the multimodal wrapper
        from models.vision import MultimodalDecoder, VisionRotary, apply_window

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
    return model.to(parse_dtype(dtype) or ck.dtype).eval()


def from_preset(name: str, seed: int = 0, attn_impl: str = "sdpa_gqa") -> Decoder:
    """A preset model: `m3-tiny` with seeded random weights, `m3` on the meta device (shapes only)."""
    if name not in PRESETS:
        raise M3CompileError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    args = PRESETS[name].replace(attn_impl=attn_impl)
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


@dataclass
class ConversionReport:
    """What `convert` did: per layer, per pass, and the parameter counts."""

    model: str
    config: MSAConfig
    layers: list[dict]  # {"layer", "attention": "msa"|"dense", "form"}
    passes: list[PassReport]
    params_before: int
    params_after: int
    seconds: float = 0.0

    @property
    def index_params(self) -> int:
        return self.params_after - self.params_before

    def to_dict(self) -> dict:
        return {
            "model": self.model, "config": self.config.to_dict(), "layers": self.layers,
            "passes": [p.to_dict() for p in self.passes], "params_before": self.params_before,
            "params_after": self.params_after, "index_params": self.index_params, "seconds": round(self.seconds, 3),
        }


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def convert(model: Decoder | torch.nn.Module, config: MSAConfig | None = None) -> tuple[torch.fx.GraphModule, ConversionReport]:
    """Trace `model`, rewrite its causal GQA attention into MSA; returns (GraphModule, report).

    The model's own weights are shared with the GraphModule, not copied; the index-branch weights are new.
    """
    from passes.gqa_to_msa import GQAToMSA

    config = config or MSAConfig()
    start = time.perf_counter()
    args: ModelArgs | None = getattr(model, "args", None)
    if args is not None:
        bad = [i for i in config.dense_layers if i >= args.n_layers]
        if bad:
            raise M3CompileError(f"dense layer {bad[0]} does not exist (the model has {args.n_layers} layers)")
    params_before = _count(model)
    gm = trace(model)
    gqa = GQAToMSA(config)
    reports = PassManager([gqa]).run(gm)
    if args is not None:
        gm.meta["model_args"] = _converted_args(args, gqa.layer_settings)
    layers = []
    out_args = gm.meta.get("model_args")
    for i in range(out_args.n_layers if out_args else 0):
        layers.append({"layer": i, "attention": "msa" if out_args.is_sparse(i) else "dense",
                       "converted": i in gqa.layer_settings})
    report = ConversionReport(type(model).__name__, config, layers, reports, params_before, _count(gm))
    report.seconds = time.perf_counter() - start
    return gm, report


def lower(model: torch.nn.Module) -> torch.fx.GraphModule:
    """The model (a converted GraphModule, or a Decoder loaded from a converted checkpoint) with its MSA ops lowered
    to the Triton kernels (passes/lower_triton.py). The result runs Triton on CUDA and the torch reference on CPU."""
    from passes.lower_triton import LowerTriton

    gm = model if isinstance(model, torch.fx.GraphModule) else trace(model)
    if isinstance(model, Decoder):
        gm.meta["model_args"] = model.args
    report = PassManager([LowerTriton()]).run(gm)[0]
    if not report.replaced:
        raise M3CompileError("the model has no MSA layer to lower (convert it first)")
    gm.meta["lowering"] = report
    return gm


def _converted_args(args: ModelArgs, settings: dict[int, MSALayerArgs]) -> ModelArgs:
    if not settings:
        return args
    new = next(iter(settings.values()))
    if args.msa is not None and args.msa != new:
        raise M3CompileError(f"the model's MSA layers use {args.msa}; converting more layers with {new} would mix settings")
    sparse = [args.is_sparse(i) or i in settings for i in range(args.n_layers)]
    return args.replace(sparse_layers=tuple(sparse), msa=new)


def _output_config(source: dict, args: ModelArgs, config: MSAConfig) -> dict:
    out = json.loads(json.dumps(source))
    text = out["text_config"] if out.get("model_type") == "minimax_m3_vl" else out
    if args.msa is None:
        return out
    sparse = [args.is_sparse(i) for i in range(args.n_layers)]
    m = args.msa
    text["sparse_attention_config"] = dataclasses.replace(
        config, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks, local_blocks=m.local_blocks
    ).m3_config(args.n_layers, m.index_heads, m.index_dim, sparse)
    if "layer_types" in text or "index_n_heads" in text:  # keep transformers' flavour of keys consistent
        text["layer_types"] = ["minimax_m3_sparse" if s else "full_attention" for s in sparse]
        text.update(index_n_heads=m.index_heads, index_head_dim=m.index_dim, index_block_size=m.block_size,
                    index_topk_blocks=m.topk, index_local_blocks=m.local_blocks)
    return out


def _config_for_preset(args: ModelArgs) -> dict:
    """config.json for a preset: an M3 text model (minimax_m3_vl_text) in the release flavour of keys."""
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
    config = _output_config(source_config or _config_for_preset(args), args, report.config)
    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir, force) as tmp:
        write_checkpoint(tmp, config, to_release_names(state), max_shard_size)
        _write_extras(tmp, gm, report)
    return out_dir


def _write_extras(folder: Path, gm: torch.fx.GraphModule, report: ConversionReport) -> None:
    """graph/module.py + graph/buffers.safetensors (the rewritten graph as a standalone module, see
    m3compile.module_io) and conversion_report.json beside the weights."""
    from m3compile.module_io import write_module

    write_module(gm, folder, report.model)
    (folder / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def convert_checkpoint(src: str | os.PathLike | None, out_dir: str | os.PathLike, config: MSAConfig | None = None,
                       preset: str | None = None, force: bool = False, dtype: str | None = None,
                       max_shard_size: int = 5 * 10**9,
                       progress: Callable[[int, int, str], None] | None = None) -> ConversionReport:
    """Checkpoint directory (or preset) -> converted checkpoint directory. Fails before writing anything.

    A checkpoint directory is converted streaming (m3compile.streaming): memory holds one layer, not the model.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise M3CompileError(f"{out_dir} already exists (use --force to replace it)")
    if src is not None:
        from m3compile.streaming import convert_streaming

        return convert_streaming(src, out_dir, config, force=force, dtype=dtype, max_shard_size=max_shard_size,
                                 progress=progress)
    model = from_preset(preset or "m3-tiny")
    if dtype:
        model = model.to(parse_dtype(dtype))
    gm, report = convert(model, config)
    report.model = f"preset {preset or 'm3-tiny'}"
    save(gm, report, out_dir, None, force, max_shard_size)
    return report


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class EvalReport:
    seq_len: int
    windows: int
    tokens: int
    dense_loss: float
    sparse_loss: float | None
    recall: dict[int, float] = field(default_factory=dict)  # layer -> mean block recall
    seconds: float = 0.0
    oracle_recall: dict[int, float] = field(default_factory=dict)  # layer -> recall of the teacher's own top-k

    @property
    def mean_oracle_recall(self) -> float | None:
        return sum(self.oracle_recall.values()) / len(self.oracle_recall) if self.oracle_recall else None

    @property
    def mean_recall(self) -> float | None:
        return sum(self.recall.values()) / len(self.recall) if self.recall else None

    @property
    def loss_increase(self) -> float | None:
        return None if self.sparse_loss is None else self.sparse_loss / self.dense_loss - 1.0

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len, "windows": self.windows, "tokens": self.tokens, "dense_loss": self.dense_loss,
            "sparse_loss": self.sparse_loss, "loss_increase": self.loss_increase, "mean_recall": self.mean_recall,
            "recall": {str(k): v for k, v in self.recall.items()}, "mean_oracle_recall": self.mean_oracle_recall,
            "oracle_recall": {str(k): v for k, v in self.oracle_recall.items()}, "seconds": round(self.seconds, 2),
        }


class _RecallProbe:
    """Attached to MSA layers during evaluation: accumulates per-layer block recall and oracle recall."""

    def __init__(self):
        self.sums: dict[int, float] = {}
        self.oracle_sums: dict[int, float] = {}
        self.counts: dict[int, int] = {}

    def __call__(self, layer: int, attn: Attention, q, k, blocks) -> None:
        m = attn.msa
        r = ref.block_recall(q, k, blocks, block_size=m.block_size, scale=attn.scale)
        best = ref.oracle_recall(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                 local_blocks=m.local_blocks, scale=attn.scale)
        self.sums[layer] = self.sums.get(layer, 0.0) + float(r.sum())
        self.oracle_sums[layer] = self.oracle_sums.get(layer, 0.0) + float(best.sum())
        self.counts[layer] = self.counts.get(layer, 0) + r.numel()

    def result(self, oracle: bool = False) -> dict[int, float]:
        sums = self.oracle_sums if oracle else self.sums
        return {layer: sums[layer] / self.counts[layer] for layer in sorted(sums)}


@torch.no_grad()
def evaluate(model: Decoder, tokens: torch.Tensor, seq_len: int, max_windows: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> EvalReport:
    """Next-token loss (nats/token) with dense attention everywhere and with MSA active, plus block recall per layer."""
    start = time.perf_counter()
    data = windows(tokens, seq_len, max_windows)
    device = next(model.parameters()).device
    sparse_layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    probe = _RecallProbe()
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.probe = (lambda *a, _i=i: probe(_i, *a)) if i in sparse_layers else None
    dense_sum = sparse_sum = 0.0
    try:
        for w, window in enumerate(data):
            x, y = window[None, :-1].to(device), window[None, 1:].to(device)
            model.set_sparse(False)
            dense_sum += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            if sparse_layers:
                model.set_sparse(True)
                sparse_sum += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            if progress:
                progress(w + 1, len(data))
    finally:
        model.set_sparse(True)
        for layer in model.model.layers:
            layer.self_attn.probe = None
    n = data.shape[0] * seq_len
    return EvalReport(seq_len, data.shape[0], n, dense_sum / n, sparse_sum / n if sparse_layers else None,
                      probe.result(), time.perf_counter() - start, probe.result(oracle=True))
