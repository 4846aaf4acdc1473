"""How much consecutive queries share their blocks.

A query-tile sparse-attention design keeps its partial outputs on chip by giving one program a tile of R consecutive
query tokens x the G heads of a KV group and looping over the union of the blocks those tokens selected, masking
each row to its own selection. Its cost against the gather-Q kernel's ideal is the union's size over top-k. This
script measures that ratio on a converted model's real selections: one sparse forward per window (the model's own
index branch, layer by layer), and for each MSA layer and tile size R the mean over tiles and KV groups of
|union of the tile's selected blocks| / top-k, on the tiles whose tokens all have a choice to make
(t >= topk * block). A random selection (the kernel bench's `independent` regime) is printed beside it: what the
bench's figures assume.

    PYTHONPATH=. python benchmarks/experiments/selection_locality.py CKPT DATA SEQ_LEN WINDOWS [--tiles 8,16,32,64]
"""
from __future__ import annotations

import argparse
import json

import torch

import m3compile
from m3compile.data import load_tokens, windows


def union_ratio(blocks: torch.Tensor, tile: int, topk: int, n_blocks: int) -> float:
    """blocks [Hkv, T, topk] (-1 = empty) -> mean |union over each tile of `tile` tokens| / topk."""
    H, T, _ = blocks.shape
    T = T // tile * tile
    b = blocks[:, :T].reshape(H, T // tile, tile * topk).long()
    hit = torch.zeros(H, T // tile, n_blocks + 1, dtype=torch.bool)
    hit.scatter_(2, torch.where(b < 0, n_blocks, b), True)
    return float(hit[..., :n_blocks].sum(-1).float().mean()) / topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("data")
    ap.add_argument("seq_len", type=int)
    ap.add_argument("windows", type=int)
    ap.add_argument("--tiles", default="8,16,32,64")
    a = ap.parse_args()
    tiles = [int(t) for t in a.tiles.split(",")]
    model = m3compile.load(a.ckpt, dtype="float32")
    m = model.args.msa
    start = m.topk * m.block_size  # queries with a choice to make
    n_blocks = -(-a.seq_len // m.block_size)
    got: dict[int, list[torch.Tensor]] = {}

    def probe(i):
        def f(attn, q, k, blocks, lse):
            got.setdefault(i, []).append(blocks[0, :, start:].clone())  # [Hkv, T - start, topk]
        return f

    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.msa is not None:
            layer.self_attn.observer = probe(i)
    with torch.no_grad():
        for window in windows(load_tokens(a.data, model.args.vocab_size), a.seq_len, a.windows):
            model(window[None, :-1])
    g = torch.Generator().manual_seed(0)
    out = {"ckpt": a.ckpt, "seq_len": a.seq_len, "windows": a.windows, "block": m.block_size, "topk": m.topk,
           "tiles": tiles, "layers": {}}
    for i, chunks in sorted(got.items()):
        out["layers"][i] = {t: round(sum(union_ratio(c, t, m.topk, n_blocks) for c in chunks) / len(chunks), 3)
                            for t in tiles}
    for t in tiles:
        out.setdefault("mean", {})[t] = round(sum(v[t] for v in out["layers"].values()) / len(out["layers"]), 3)
    # the bench's `independent` regime: per token, topk distinct blocks drawn uniformly from those it can see
    T = a.seq_len - 1 - start
    pos = torch.arange(start, a.seq_len - 1)
    visible = pos // m.block_size + 1
    keys = torch.rand(1, T, n_blocks, generator=g).masked_fill(torch.arange(n_blocks) >= visible[:, None], 2.0)
    rand = keys.topk(m.topk, dim=-1, largest=False).indices
    out["random_selection"] = {t: round(union_ratio(rand, t, m.topk, n_blocks), 3) for t in tiles}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
