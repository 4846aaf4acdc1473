"""A picture of selection: the dense attention of one KV group with the blocks its index branch selected outlined,
beside the block recall of every MSA layer. What to look at when a sparse model misbehaves."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from m3compile.kernels.causal_lse.naive import block_recall
from m3compile.kernels.sparse_kl.naive import selected_blocks_mask
from m3compile.errors import M3CompileError
from m3compile.io.hf_config import check_positions
from m3compile.outputs import atomic_save_figure, check_output_file
from m3compile.models.decoder import Decoder

__all__ = ["AttentionMap", "attention_map", "draw_attention_map", "check_map_output", "MAX_MAP_TOKENS"]

MAX_MAP_TOKENS = 8192  # the map is a [T, T] image


@dataclass
class AttentionMap:
    layer: int
    group: int
    offset: int
    block_size: int
    attention: torch.Tensor  # [T, T] mean over the group's query heads of the dense causal softmax
    selected: torch.Tensor  # [T, n_blocks] bool: blocks the index branch selected for each query
    recall: dict[int, float] = field(default_factory=dict)  # MSA layer -> mean block recall on this window

    @property
    def group_recall(self) -> float:
        """Share of this group's dense attention mass inside its selected blocks (mean over queries)."""
        T = self.attention.shape[0]
        mask = self.selected.repeat_interleave(self.block_size, dim=1)[:, :T]
        return float((self.attention * mask).sum(1).mean())

    def to_dict(self) -> dict:
        return {"layer": self.layer, "group": self.group, "offset": self.offset, "seq_len": self.attention.shape[0],
                "block_size": self.block_size, "group_recall": self.group_recall,
                "recall": {str(k): v for k, v in self.recall.items()}}


@torch.no_grad()
def attention_map(model: Decoder, tokens: torch.Tensor, layer: int, group: int, seq_len: int = 1024,
                  offset: int = 0) -> AttentionMap:
    """Run `tokens[offset:offset + seq_len]` through `model` with MSA active and capture layer `layer`, group `group`."""
    args = model.args
    msa_layers = [i for i in range(args.n_layers) if args.is_sparse(i)]
    if not msa_layers:
        raise M3CompileError("the model has no MSA layers: it was never converted (run m3c convert first)")
    if layer not in msa_layers:
        raise M3CompileError(f"layer {layer} is not an MSA layer (MSA layers: {', '.join(map(str, msa_layers))})")
    if not 0 <= group < args.n_kv_heads:
        raise M3CompileError(f"group {group} does not exist (the model has {args.n_kv_heads} KV groups)")
    if not 1 <= seq_len <= MAX_MAP_TOKENS:
        raise M3CompileError(f"--seq-len must be in [1, {MAX_MAP_TOKENS}] for a map, got {seq_len}")
    check_positions(seq_len, getattr(model, "source_config", None), f"--seq-len {seq_len}")
    if offset < 0 or offset + seq_len > tokens.numel():
        raise M3CompileError(f"the data has {tokens.numel()} tokens; offset {offset} + seq-len {seq_len} runs past it")
    x = tokens[None, offset:offset + seq_len].to(next(model.parameters()).device)
    sums: dict[int, float] = {}
    captured = {}

    def probe(i, attn, q, k, blocks, lse):
        sums[i] = float(block_recall(q, k, blocks, block_size=attn.msa.block_size, scale=attn.scale).mean())
        if i == layer:
            G = q.shape[1] // k.shape[1]
            captured.update(q=q[0, group * G:(group + 1) * G], k=k[0, group], blocks=blocks[0, group], scale=attn.scale)

    for i in msa_layers:
        model.model.layers[i].self_attn.observer = lambda *a, _i=i: probe(_i, *a)
    try:
        model.set_selection("index")
        model(x)
    finally:
        for i in msa_layers:
            model.model.layers[i].self_attn.observer = None
    T, bs = seq_len, args.msa.block_size
    s = torch.einsum("htd,hjd->htj", captured["q"].float(), captured["k"].float()[None].expand(captured["q"].shape[0], -1, -1))
    s = s * captured["scale"]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    attention = torch.softmax(s, -1).mean(0).cpu()
    selected = selected_blocks_mask(captured["blocks"].cpu(), -(-T // bs))
    return AttentionMap(layer, group, offset, bs, attention, selected, sums)


def check_map_output(out: str | os.PathLike, inputs=()) -> None:
    """The map's output file, before any work: a *.png name, and the output guard (not an input, nor inside one; not
    a directory; its name and lock free)."""
    check_output_file(out, inputs, suffix=".png")


def draw_attention_map(amap: AttentionMap, out: str | os.PathLike, inputs=()) -> Path:
    """Write a PNG: the attention (log colour scale) with selected blocks outlined, and recall per MSA layer.
    `inputs`: the paths the map was made from, which the output may not overwrite (check_map_output)."""
    out = Path(out)
    check_map_output(out, inputs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    T = amap.attention.shape[0]
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(13, 6.5), gridspec_kw={"width_ratios": [3, 1]})
    image = amap.attention.clamp(min=1e-6).numpy()
    shown = ax.imshow(image, cmap="magma", norm=LogNorm(vmin=1e-6, vmax=1.0), interpolation="nearest",
                      extent=(amap.offset - 0.5, amap.offset + T - 0.5, amap.offset + T - 0.5, amap.offset - 0.5))
    mask = amap.selected.repeat_interleave(amap.block_size, dim=1)[:, :T]
    mask &= torch.ones(T, T, dtype=torch.bool).tril()
    dropped = torch.zeros(T, T, 4)
    dropped[..., 3] = (~mask & torch.ones(T, T, dtype=torch.bool).tril()).float() * 0.6  # dim what MSA drops
    ax.imshow(dropped.numpy(), interpolation="nearest", extent=shown.get_extent())
    grid = torch.arange(T) + amap.offset
    ax.contour(grid.numpy(), grid.numpy(), mask.float().numpy(), levels=[0.5], colors="#39d0ff", linewidths=0.6)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"layer {amap.layer}, KV group {amap.group}: dense attention (mean of the group's heads)\n"
                 f"selected {amap.block_size}-token blocks outlined, dropped keys dimmed; recall "
                 f"{amap.group_recall:.3f}", fontsize=9)
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02, label="attention probability")
    layers = list(amap.recall)
    bar.barh([str(i) for i in layers], [amap.recall[i] for i in layers],
             color=["#e4572e" if i == amap.layer else "#4c72b0" for i in layers])
    bar.set_xlim(0, 1)
    bar.invert_yaxis()
    bar.set_xlabel("block recall (all groups)")
    bar.set_ylabel("MSA layer")
    for i, layer in enumerate(layers):
        bar.text(min(amap.recall[layer], 0.98), i, f"{amap.recall[layer]:.3f}", va="center", ha="right", color="white",
                 fontsize=8)
    fig.tight_layout()
    try:
        atomic_save_figure(fig, out, inputs, dpi=130)
    finally:
        plt.close(fig)
    return out
