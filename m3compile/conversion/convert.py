"""Conversion of a model in memory: trace it, run the convert pipeline (gqa_to_msa), with the calibrated index
init when given calibration tokens; the report says what changed."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.fx

from m3compile.config import MSAConfig, check_floor_fits, max_positions
from m3compile.conversion.calibration import Calibration, CalibrationInfo
from m3compile.errors import M3CompileError
from m3compile.graph.pass_manager import PassReport
from m3compile.graph.tracing import trace
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs
from m3compile.pipelines import pipeline

__all__ = ["convert", "ConversionReport"]


@dataclass
class ConversionReport:
    """What `convert` did: per layer, per pass, and the parameter counts."""

    model: str
    config: MSAConfig
    layers: list[dict]  # {"layer", "attention": "msa"|"dense", "converted", "change": what this conversion did}
    passes: list[PassReport]
    params_before: int
    params_after: int
    seconds: float = 0.0
    index_init: CalibrationInfo = CalibrationInfo("weight-only")
    layer_costs: dict | None = None  # --dense-costliest: what each layer cost alone sparse (LayerCostReport.to_dict)

    @property
    def index_params(self) -> int:
        return self.params_after - self.params_before

    def to_dict(self) -> dict:
        return {
            "model": self.model, "config": self.config.to_dict(), "layers": self.layers,
            "passes": [p.to_dict() for p in self.passes], "params_before": self.params_before,
            "params_after": self.params_after, "index_params": self.index_params, "seconds": round(self.seconds, 3),
            "index_init": self.index_init.to_dict(), "layer_costs": self.layer_costs,
        }


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def convert(model: Decoder | torch.nn.Module, config: MSAConfig | None = None, *, calib: torch.Tensor | None = None,
            calib_seq_len: int | None = None, calib_device: str | torch.device | None = None,
            ) -> tuple[torch.fx.GraphModule, ConversionReport]:
    """Trace `model`, rewrite its causal GQA attention into MSA; returns (GraphModule, report).

    The model's own weights are shared with the GraphModule, not copied; the index-branch weights are new.
    calib: 1-D token ids of calibration data; the index branch is then fitted to the data's hidden states
    (m3compile/conversion/calibration.py, models/index_init.py) instead of the weights alone. Needs a Decoder (`m3compile.load`).
    calib_seq_len: tokens per calibration window [default: 2048, at most the model's positions].
    calib_device: where the calibration forward runs [default: the model's device].
    """
    start = time.perf_counter()
    args: ModelArgs | None = getattr(model, "args", None)
    if config is None and args is not None and args.msa is not None:  # an MSA source keeps its own settings
        m = args.msa
        config = MSAConfig(block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                           local_blocks=m.local_blocks, index_dtype=m.index_dtype, top_p=m.top_p,
                           min_blocks=m.min_blocks, answer_budget=m.answer_budget, answer_tokens=m.answer_tokens,
                           decode_budget=m.decode_budget)
    config = config or MSAConfig()
    if args is not None:
        bad = [i for i in config.dense_layers if i >= args.n_layers]
        if bad:
            raise M3CompileError(f"dense layer {bad[0]} does not exist (the model has {args.n_layers} layers)")
        check_floor_fits(config.min_blocks, config.block_size, max_positions(getattr(model, "source_config", None)))
        if args.msa is None and set(range(args.n_layers)) <= set(config.dense_layers):
            raise M3CompileError(f"every layer is kept dense (dense_layers {','.join(map(str, config.dense_layers))} of "
                                 f"the model's {args.n_layers} layers): the output would have no MSA layer; leave at "
                                 f"least one layer out")
    moments, info = None, CalibrationInfo("weight-only")
    if calib is not None:
        if not isinstance(model, Decoder):
            raise M3CompileError(f"calibration needs an m3compile Decoder (m3compile.load), got {type(model).__name__}")
        device = calib_device or next(model.parameters()).device
        calibration = Calibration(args, calib, calib_seq_len, device,
                                  max_positions=max_positions(getattr(model, "source_config", None)))
        todo = [i for i in range(args.n_layers) if i not in config.dense_layers and not args.is_sparse(i)]
        moments, info = calibration.model_moments(model.model, todo), calibration.info
    params_before = _count(model)
    gm = trace(model)
    manager = pipeline("convert", config=config, moments=moments)
    reports = manager.run(gm)
    gqa = manager.passes[0]
    if args is not None:
        gm.meta["model_args"] = _converted_args(args, gqa.layer_settings, config)
    layers = []
    out_args = gm.meta.get("model_args")
    for i in range(out_args.n_layers if out_args else 0):
        msa = out_args.is_sparse(i)
        layers.append({"layer": i, "attention": "msa" if msa else "dense", "converted": i in gqa.layer_settings,
                       "change": gqa.layer_changes.get(i, "already MSA" if msa else "")})
    report = ConversionReport(type(model).__name__, config, layers, reports, params_before, _count(gm),
                              index_init=info)
    report.seconds = time.perf_counter() - start
    return gm, report


def _converted_args(args: ModelArgs, settings: dict[int, MSALayerArgs], config: MSAConfig) -> ModelArgs:
    if args.msa is not None:  # the budget is the config's on every MSA layer (passes/gqa_to_msa.py)
        args = args.replace(msa=dataclasses.replace(args.msa, top_p=config.top_p, min_blocks=config.min_blocks,
                                                    answer_budget=config.answer_budget,
                                                    answer_tokens=config.answer_tokens,
                                                    decode_budget=config.decode_budget))
    if not settings:
        return args
    new = next(iter(settings.values()))
    if args.msa is not None and args.msa != new:
        raise M3CompileError(f"the model's MSA layers use {args.msa}; converting more layers with {new} would mix settings")
    sparse = [args.is_sparse(i) or i in settings for i in range(args.n_layers)]
    return args.replace(sparse_layers=tuple(sparse), msa=new)
