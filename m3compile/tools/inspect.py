"""Inspect a checkpoint (or preset) without loading its weights: config.json and safetensors headers on the meta
device, the graph before and after the passes, and the cost of attention at a given context.

Graph analysis uses networkx: the fx graph as a DiGraph, nodes grouped by decoder layer (module path), the
shortest path from the input to every attention op, and each MSA layer's index branch as the subgraph between
its input and its block selection.
"""
from __future__ import annotations

import collections
import operator
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx
import torch
import torch.fx
import torch.nn.functional as F
from rich.table import Table
from rich.tree import Tree

from m3compile.config import MAX_TOPK, MSAConfig, check_size, max_positions, parse_budget
from m3compile.errors import M3CompileError
from m3compile.graph.matching import msa_layer, msa_nodes
from m3compile.graph.tracing import trace
from m3compile.io.hf_config import args_from_config, check_positions, read_config, vision_args_from_config
from m3compile.io.shards import SourceTensors
from m3compile.io.tensor_names import VISION_TENSOR
from m3compile.models.decoder import PRESETS, Decoder, ModelArgs
from m3compile.models.vision import Projector, VisionTower
from m3compile.ops import is_op, op_args, segment_attention
from m3compile.conversion.convert import convert
from m3compile.pipelines import run_pipeline

__all__ = ["InspectReport", "inspect", "attention_cost", "to_dot", "to_svg", "to_mermaid", "layer_subgraph", "render",
           "DEFAULT_CONTEXT"]

DEFAULT_CONTEXT = 131072  # the context of the cost figures, unless the model has fewer positions or one is asked


def attention_cost(args: ModelArgs, context: int, bytes_per_value: int = 2, blocks: float | None = None) -> dict:
    """Attention FLOPs and cache bytes per token at `context`, MSA layers against the same layers dense.

    the FLOP model of docs/msa.md for a prefill of N tokens: dense 2*Hq*d*N^2, MSA H_kv*d_idx*N^2 + 4*Hq*d*N*k*block;
    per token = divided by N. Decode of one token at context N: dense 4*Hq*d*N, MSA 2*H_kv*d_idx*N +
    4*Hq*d*min(k*block, N). Dense layers cost the same in both columns. k = `blocks`, the blocks each (KV group,
    query) keeps: under an adaptive budget (docs/msa.md 2.8) what `m3c eval loss` measured (its mean_blocks);
    default the top-k (the adaptive budget's ceiling: an upper bound of its cost). A model converted with an answer
    budget (m3c convert --answer-budget / --decode-budget) decodes at that budget's top-k (the decode budget's where
    one is stored; "off": the model's): its decode column counts those blocks unless `blocks` is given; the
    prefill's question tokens (a few hundred of a long prompt) are left out.
    """
    N, hq, hkv, d = context, args.n_heads, args.n_kv_heads, args.head_dim
    dense_prefill, dense_decode = 2 * hq * d * N, 4 * hq * d * N
    out = {"context": N, "layers": args.n_layers, "msa_layers": 0, "dense_prefill_flops_per_token": 0,
           "msa_prefill_flops_per_token": 0, "dense_decode_flops": 0, "msa_decode_flops": 0,
           "kv_cache_bytes_per_token": 0, "index_k_cache_bytes_per_token": 0, "index_params": 0,
           "blocks_per_query": None, "adaptive": bool(args.msa and args.msa.top_p < 1),
           "answer_budget": args.msa.answer_budget if args.msa else None,
           "answer_tokens": args.msa.answer_tokens if args.msa and args.msa.answer_budget else None,
           "decode_budget": args.msa.decode_budget if args.msa else None, "decode_blocks_per_query": None}
    decode_spec = None if args.msa is None else args.msa.decode_budget or args.msa.answer_budget
    per_layer = None
    for i in range(args.n_layers):
        out["dense_prefill_flops_per_token"] += dense_prefill
        out["dense_decode_flops"] += dense_decode
        out["kv_cache_bytes_per_token"] += 2 * hkv * d * bytes_per_value
        if args.is_sparse(i):
            m = args.msa
            k = m.topk if blocks is None else blocks
            out["blocks_per_query"] = k
            prefill = m.index_heads * m.index_dim * N + 4 * hq * d * k * m.block_size
            out["msa_prefill_flops_per_token"] += prefill
            k_decode = k if blocks is not None or decode_spec in (None, "off") else parse_budget(decode_spec)["topk"]
            out["decode_blocks_per_query"] = k_decode
            out["msa_decode_flops"] += 2 * m.index_heads * m.index_dim * N + \
                4 * hq * d * min(k_decode * m.block_size, N)
            # fp8 index scoring keeps e4m3 keys and an fp32 scale per token slot (its page's scale, repeated)
            out["index_k_cache_bytes_per_token"] += m.index_dim + 4 if m.index_dtype == "fp8" else \
                m.index_dim * bytes_per_value
            out["index_params"] += (m.index_heads + 1) * m.index_dim * args.hidden_size + 2 * m.index_dim
            out["msa_layers"] += 1
            per_layer = dense_prefill / prefill
        else:
            out["msa_prefill_flops_per_token"] += dense_prefill
            out["msa_decode_flops"] += dense_decode
    out["prefill_ratio"] = out["dense_prefill_flops_per_token"] / out["msa_prefill_flops_per_token"]
    out["decode_ratio"] = out["dense_decode_flops"] / out["msa_decode_flops"]
    out["prefill_ratio_per_msa_layer"] = per_layer
    return out


@dataclass
class InspectReport:
    source: str
    model_type: str
    params: int
    tensors_checked: int  # tensors whose names and shapes were checked against config.json (0 for presets)
    layers: list[dict]
    passes: list[dict]
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    nodes_before: int
    nodes_after: int
    cost: dict
    seconds: float = 0.0
    vision: dict | None = None  # multimodal checkpoints: the ViT and its attention windows before / after
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)  # after the passes, meta device
    added_nodes: set = field(default_factory=set, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("graph"), d.pop("added_nodes")
        return d


def _op_name(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str | None:
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    if n.op == "call_method":
        return f".{n.target}"
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    return None


def _histogram(gm: torch.fx.GraphModule) -> dict[str, int]:
    c = collections.Counter(name for n in gm.graph.nodes if (name := _op_name(gm, n)))
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def _digraph(gm: torch.fx.GraphModule) -> nx.DiGraph:
    """The fx graph as a DiGraph; each node knows its op label, its decoder layer and its depth (longest path from
    an input, i.e. how far down the residual stream it sits)."""
    g = nx.DiGraph()
    layers: dict[str, int] = {}
    for n in gm.graph.nodes:  # topological order
        layer = _node_layer(n)
        if layer < 0 and n.op in ("call_function", "call_method") and (
                "nn_module_stack" not in n.meta or n.target is operator.getitem):
            # a node a pass added, or a part of a value (a norm's (sum, normed)): the layer of its inputs
            layer = max((layers[a.name] for a in n.all_input_nodes), default=-1)
        layers[n.name] = layer
        g.add_node(n.name, op=n.op, label=_op_name(gm, n) or n.op, layer=layer)
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
    for name in nx.topological_sort(g):
        g.nodes[name]["depth"] = max((g.nodes[p]["depth"] + 1 for p in g.predecessors(name)), default=0)
    return g


def _node_layer(n: torch.fx.Node) -> int:
    """Decoder layer of a node from the module path it was traced in (nn_module_stack), -1 outside the layers."""
    if n.op in ("call_module", "get_attr"):
        m = re.search(r"layers\.(\d+)\.", str(n.target))
        return int(m[1]) if m else -1
    for path in (n.meta.get("nn_module_stack") or {}).values():
        m = re.search(r"layers\.(\d+)", str(path[0]) if isinstance(path, tuple) else str(path))
        if m:
            return int(m[1])
    return -1


def layer_subgraph(gm: torch.fx.GraphModule, layer: int) -> nx.DiGraph:
    """The nodes of one decoder layer (by module path and by name) as a networkx subgraph."""
    g = _digraph(gm)
    keep = [n.name for n in gm.graph.nodes if g.nodes[n.name]["layer"] == layer]  # in graph order
    if not keep:
        raise M3CompileError(f"layer {layer} has no nodes in the graph")
    sub = nx.DiGraph()
    sub.add_nodes_from((n, g.nodes[n]) for n in keep)
    sub.add_edges_from((a, b) for a, b in g.edges(keep) if b in sub)
    return sub


def _layer_rows(gm: torch.fx.GraphModule, args: ModelArgs, converted: set[int]) -> list[dict]:
    g = _digraph(gm)
    by_layer = collections.Counter(d["layer"] for _, d in g.nodes(data=True))
    attn: dict[int, torch.fx.Node] = {msa_layer(n): n for n in msa_nodes(gm)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            attn.setdefault(_node_layer(n), n)
    rows = []
    for i in range(args.n_layers):
        row = {"layer": i, "attention": "msa" if args.is_sparse(i) else "dense", "converted_now": i in converted,
               "nodes": by_layer.get(i, 0)}
        n = attn.get(i)
        if n is not None:
            row["attention_depth"] = g.nodes[n.name]["depth"]
        if args.is_sparse(i):
            row.update(asdict(args.msa))
            if n is not None:  # the index branch: what feeds msa_select but not the layer's own input
                select = op_args(n)["blocks"]
                branch_op = op_args(select)["q_idx"].args[0]  # q_idx, k_idx = index_branch(x.detach(), ...)
                x = op_args(branch_op)["x"].args[0]
                branch = nx.ancestors(g, select.name) - nx.ancestors(g, x.name) - {x.name}
                row["index_branch_nodes"] = len(branch) + 1
        rows.append(row)
    return rows


def _vision_section(vargs, window_now: int | None, window_new: int) -> dict:
    """The ViT on the meta device: its attention ops, and the 3D windows before and after vit_3d_window."""
    with torch.device("meta"):
        tower = VisionTower(vargs, window=window_now)
        projector = Projector(vargs)
    gm = trace(tower)
    attention = sum(1 for n in gm.graph.nodes if is_op(n, segment_attention))
    report = None
    if window_now is None:
        report = run_pipeline("vision", gm, window=window_new)[0].to_dict()
    return {
        "layers": vargs.n_layers, "heads": vargs.n_heads, "head_dim": vargs.head_dim, "hidden": vargs.hidden_size,
        "attention_ops": attention, "window_before": window_now or 1, "window_after": window_now or window_new,
        "params": sum(p.numel() for p in tower.parameters()) + sum(p.numel() for p in projector.parameters()),
        "pass": report,
    }


def inspect(source: str | os.PathLike | None = None, *, preset: str | None = None, config: MSAConfig | None = None,
            context: int | None = None, blocks: float | None = None) -> InspectReport:
    """Inspect a checkpoint directory (from config.json and tensor headers only) or a preset, on the meta device.

    An unconverted model is shown before and after `convert` with `config`; a converted one (or the m3 preset,
    natively MSA) as it is. The cost is given at `context` tokens: None, DEFAULT_CONTEXT or the model's positions if
    fewer; a context past them is refused, as eval refuses it. blocks: the blocks per (KV group, query) the cost
    counts (attention_cost).
    """
    start = time.perf_counter()
    if context is not None:
        check_size(context, "--context")
    if blocks is not None and not (isinstance(blocks, (int, float)) and 0 < blocks <= MAX_TOPK):
        raise M3CompileError(f"--blocks must be a number of blocks in (0, {MAX_TOPK:,}], got {blocks!r}")
    checked, positions = 0, None
    if source is not None:
        path = Path(source)
        cfg = read_config(path)
        args, _ = args_from_config(cfg)
        src = SourceTensors(path)
        has_vision = any(VISION_TENSOR.match(n) for n in src.where)
        vision_args = vision_args_from_config(cfg) if has_vision else None
        checked, name, model_type = src.check(args, vision_args), str(path), cfg.get("model_type", "?")
        positions = max_positions(cfg)
        if context is not None:
            check_positions(context, cfg, f"--context {context:,}")
    else:
        vision_args = None
        preset = preset or "m3"
        if preset not in PRESETS:
            raise M3CompileError(f"unknown preset {preset!r} (presets: {', '.join(PRESETS)})")
        args, name, model_type = PRESETS[preset], f"preset {preset}", "minimax_m3_vl_text"
        if preset == "m3" and config is None:
            config = MSAConfig(dense_layers=(0, 1, 2))  # M3's own layout: layers 0-2 dense, MSA from layer 3
    with torch.device("meta"):
        model = Decoder(args)
    before = trace(model)
    if args.msa is None:
        gm, report = convert(model, config or MSAConfig())
        passes = [p.to_dict() for p in report.passes]
        out_args = gm.meta["model_args"]
        params = report.params_after
    else:
        gm, passes, out_args = before, [], args
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    vision = None
    if vision_args is not None:
        vision = _vision_section(vision_args, (cfg.get("vision_config") or {}).get("vit_3d_window"),
                                 (config or MSAConfig()).vision_window)
        if vision["pass"] is not None:
            passes.append(vision["pass"])
    names_before = {n.name for n in before.graph.nodes}
    converted = {i for i in range(args.n_layers) if out_args.is_sparse(i) and not args.is_sparse(i)}
    return InspectReport(
        source=name, model_type=model_type, params=params, tensors_checked=checked,
        layers=_layer_rows(gm, out_args, converted), passes=passes, ops_before=_histogram(before),
        ops_after=_histogram(gm), nodes_before=len(before.graph.nodes), nodes_after=len(gm.graph.nodes),
        cost=attention_cost(out_args, context or min(DEFAULT_CONTEXT, positions or DEFAULT_CONTEXT), blocks=blocks),
        seconds=time.perf_counter() - start, graph=gm, vision=vision,
        added_nodes={n.name for n in gm.graph.nodes} - names_before,
    )


def _pick_layer(report: InspectReport, layer: int | None) -> int:
    if layer is not None:
        if not 0 <= layer < len(report.layers):
            raise M3CompileError(f"layer {layer} does not exist (the model has {len(report.layers)} layers)")
        return layer
    return next((r["layer"] for r in report.layers if r["attention"] == "msa"), 0)


def to_dot(report: InspectReport, layer: int | None = None) -> str:
    """Graphviz DOT of one layer's graph after the passes; nodes the passes added are filled."""
    layer = _pick_layer(report, layer)
    g = layer_subgraph(report.graph, layer)
    lines = [f'digraph "layer_{layer}" {{', "  rankdir=TB;", '  node [shape=box, fontname="Helvetica", fontsize=10];']
    for n, d in g.nodes(data=True):
        style = ', style=filled, fillcolor="#ffd7a8"' if n in report.added_nodes else ""
        lines.append(f'  "{n}" [label="{d["label"]}\\n{n}"{style}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in g.edges()]
    return "\n".join(lines + ["}"]) + "\n"


def to_svg(report: InspectReport, layer: int | None = None) -> str:
    """`to_dot`'s graph drawn as SVG by Graphviz's dot program (refused where it is not installed)."""
    dot = shutil.which("dot")
    if dot is None:
        raise M3CompileError("--format svg needs Graphviz's dot program, which is not installed (apt-get install "
                             "graphviz, brew install graphviz or conda install graphviz); --format dot writes the "
                             "source")
    return subprocess.run([dot, "-Tsvg"], input=to_dot(report, layer), capture_output=True, text=True,
                          check=True).stdout


def to_mermaid(report: InspectReport, layer: int | None = None) -> str:
    """Mermaid flowchart of one layer's graph after the passes; nodes the passes added use the class `added`."""
    layer = _pick_layer(report, layer)
    g = layer_subgraph(report.graph, layer)
    lines = ["flowchart TD", "  classDef added fill:#ffd7a8,stroke:#c46b00"]
    for n, d in g.nodes(data=True):
        lines.append(f'  {n}["{d["label"]}<br/>{n}"]' + (":::added" if n in report.added_nodes else ""))
    lines += [f"  {a} --> {b}" for a, b in g.edges()]
    return "\n".join(lines) + "\n"


def render(report: InspectReport) -> list:
    """What `m3c inspect` prints (rich renderables): the summary tree, then the layers, ops and cost tables."""
    out = []
    c = report.cost
    tree = Tree(f"[bold]{report.source}[/] ({report.model_type}), {report.params:,} parameters")
    checked = (f"{report.tensors_checked} tensors checked against config.json" if report.tensors_checked else
               "preset (no tensors)")
    tree.add(f"{checked}; graph {report.nodes_before} -> {report.nodes_after} nodes; {report.seconds:.1f} s")
    passes = tree.add("passes")
    for p in report.passes:
        passes.add(f"{p['name']}: replaced {p['replaced']}, +{p['added']} / -{p['removed']} nodes")
    if not report.passes:
        passes.add("none run: the model already has MSA layers")
    if report.vision:
        v = report.vision
        steps = lambda w: "per frame (2D)" if w == 1 else f"3D windows of <= {w} temporal steps"  # noqa: E731
        tree.add(f"vision tower: {v['layers']} layers, {v['heads']} heads x {v['head_dim']}, {v['params']:,} "
                 f"parameters (with projector); {v['attention_ops']} attention ops: {steps(v['window_before'])} -> "
                 f"{steps(v['window_after'])}")
    out.append(tree)
    layers = Table(title="layers")
    for col in ("layer", "attention", "this run", "nodes", "depth", "index", "block", "top-k", "local"):
        layers.add_column(col, justify="right")
    for r in report.layers:
        msa = r["attention"] == "msa"
        index = f"{r['index_heads']}x{r['index_dim']}" if msa else ""
        if msa and r.get("index_rope", "m3") != "m3":  # a narrow index head's own RoPE rule
            index += f" {r['index_rope']}"
        layers.add_row(str(r["layer"]), r["attention"].upper(), "converted" if r["converted_now"] else "",
                       str(r["nodes"]), str(r.get("attention_depth", "")), index,
                       str(r["block_size"]) if msa else "",
                       str(r["topk"]) if msa else "", str(r["local_blocks"]) if msa else "")
    out.append(layers)
    ops = Table(title="ops before -> after (most frequent)")
    ops.add_column("op")
    ops.add_column("before", justify="right")
    ops.add_column("after", justify="right")
    names = sorted(set(report.ops_before) | set(report.ops_after),
                   key=lambda k: (-report.ops_after.get(k, 0), k))
    for name in names[:16]:
        ops.add_row(name, str(report.ops_before.get(name, 0)), str(report.ops_after.get(name, 0)))
    out.append(ops)
    k = c["blocks_per_query"]
    budget = "" if k is None else (f", {k:g} blocks per query" + (" (the adaptive budget's ceiling; --blocks for "
                                                                   "what eval measured)" if c["adaptive"] else ""))
    if c.get("answer_budget") or c.get("decode_budget"):
        budget += (f"; question: the last {c['answer_tokens']} tokens at {c['answer_budget']}" if c["answer_budget"]
                   else "") + f"; decode: {c['decode_blocks_per_query']:g} blocks"
    cost = Table(title=f"attention cost per token at context {c['context']:,} ({c['msa_layers']} MSA of "
                       f"{c['layers']} layers{budget})")
    cost.add_column("figure")
    cost.add_column("dense", justify="right")
    cost.add_column("MSA", justify="right")
    cost.add_column("dense / MSA", justify="right")
    cost.add_row("prefill FLOPs per token (mean over the context)", f"{c['dense_prefill_flops_per_token']:.3e}",
                 f"{c['msa_prefill_flops_per_token']:.3e}", f"{c['prefill_ratio']:.1f}x")
    if c["prefill_ratio_per_msa_layer"]:
        cost.add_row("  one MSA layer", "", "", f"{c['prefill_ratio_per_msa_layer']:.1f}x")
    cost.add_row("decode FLOPs for one token at the context", f"{c['dense_decode_flops']:.3e}",
                 f"{c['msa_decode_flops']:.3e}", f"{c['decode_ratio']:.1f}x")
    cost.add_row("KV cache bytes per token (bf16)", f"{c['kv_cache_bytes_per_token']:,}",
                 f"{c['kv_cache_bytes_per_token'] + c['index_k_cache_bytes_per_token']:,}", "")
    cost.add_row("index-branch parameters", "", f"{c['index_params']:,}", "")
    out.append(cost)
    return out
