"""Whether the answer's blocks can come from the question's own attention: an answer at a small index budget plus
the N key blocks (per KV group and layer) that the question's tokens attended to most, against the same number of
blocks from the index alone.

The spread RULER tasks need the question and the answer at every block (BENCHMARKS.md, "The quality-speed
frontier"): an answer at top-4 or top-64 of the index loses the points an answer at every block keeps, and a decode
step that reads every block cannot run much faster than dense. The question (the prompt's last `--answer-tokens`
tokens, prefilled at `--answer-budget`) sees every block; this script records, for each MSA layer, each KV group's
attention mass per key block summed over the question's tokens and the group's heads (the softmax over every cached
key, causal), keeps the `--guide` blocks of most mass (`--beyond`: of the blocks after the first and before the
question's own, which the index's init and local blocks cover and where every query's mass lands), and adds them to
every decode step's index selection (duplicates dropped). Everything else is `m3c eval ruler`, whose options follow
`--`. Runs the torch paths (CPU).

    python benchmarks/experiments/guided_answer.py --guide 4 -- MODEL --data data/long_code_eval.txt --lengths 4K \\
        --samples 10 --tasks niah_single_2,niah_multikey_1,niah_multivalue --topk 4 --answer-budget k64 \\
        --decode-budget k4 --selections index --json

The JSON is `m3c eval ruler`'s, with "guided_blocks": N, "guided_selections" (the decode selections extended: one
per MSA layer and step) and "guided_blocks_added" (the blocks they gained beyond the index's) added.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

import torch
import torch.nn.functional as F

import m3compile.runtime.paged_cache as pc

# (id of the paged cache, layer) -> [batch, KV groups, N] guided block ids (-1: none), from the latest prompt pass
# of at most QUESTION_MAX tokens (a question pass; a longer body pass records nothing)
GUIDED: dict[tuple[int, int], torch.Tensor] = {}
QUESTION_MAX = 256
_STEP = {"cache": None, "layer": None, "extended": 0, "added": 0}


def block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q [1, Hq, C, D] of the last C of T positions, k [1, Hkv, T, D] -> [Hkv, ceil(T / block_size)]: each key
    block's softmax attention mass, summed over the C queries and each group's heads (causal)."""
    Hq, C, D = q.shape[1:]
    Hkv, T = k.shape[1], k.shape[2]
    s = torch.einsum("hgcd,htd->hgct", q[0].float().view(Hkv, Hq // Hkv, C, D), k[0].float()) * scale
    future = torch.arange(T, device=q.device)[None, :] > torch.arange(T - C, T, device=q.device)[:, None]
    p = s.masked_fill(future, float("-inf")).softmax(-1).sum((1, 2))  # [Hkv, T]
    nb = -(-T // block_size)
    return F.pad(p, (0, nb * block_size - T)).view(Hkv, nb, block_size).sum(-1)


def install(n: int, beyond: bool) -> None:
    """Patch the paged prefill (record the question's blocks) and the decode selection (add them). beyond: rank only
    the blocks after the first (the attention sink) and before the question's own (the index's local blocks)."""
    prompt_attend, step_attend, select = pc.PromptView.attend, pc.StepView.attend, pc.paged.paged_select

    def recording_attend(self, attn, q, k, v, q_idx, k_idx):
        out = prompt_attend(self, attn, q, k, v, q_idx, k_idx)
        m = attn.msa
        if m is not None and self.end - self.start <= QUESTION_MAX:
            keys, _ = self.cache.keys_values(attn.layer, self.b, self.end)
            mass = block_mass(q, keys, attn.scale, m.block_size)
            if beyond:
                j = torch.arange(mass.shape[-1], device=mass.device)
                mass = mass.masked_fill((j == 0) | (j >= self.start // m.block_size), float("-inf"))
            top = mass.topk(min(n, mass.shape[-1]), -1)
            top = torch.where(top.values > float("-inf"), top.indices, -1)
            key = (id(self.cache), attn.layer)
            if key not in GUIDED:
                GUIDED[key] = torch.full((self.cache.seq_lens.shape[0], mass.shape[0], n), -1, dtype=torch.long)
            GUIDED[key][self.b] = -1
            GUIDED[key][self.b, :, : top.shape[-1]] = top
        return out

    def step_attend_noting_layer(self, attn, q, k, v, q_idx, k_idx):
        _STEP["cache"], _STEP["layer"] = id(self.cache), attn.layer
        return step_attend(self, attn, q, k, v, q_idx, k_idx)

    def guided_select(*args, **kwargs):
        blocks = select(*args, **kwargs)  # [B, Hkv, K]
        g = GUIDED.get((_STEP["cache"], _STEP["layer"]))
        if g is None:
            return blocks
        g = g[: blocks.shape[0]].to(blocks)
        g = torch.where((g[..., :, None] == blocks[..., None, :]).any(-1), -1, g)
        _STEP["extended"] += 1
        _STEP["added"] += int((g >= 0).sum())
        return torch.cat([blocks, g], -1)

    pc.PromptView.attend = recording_attend
    pc.StepView.attend = step_attend_noting_layer
    pc.paged.paged_select = guided_select


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guide", type=int, required=True,
                    help="blocks per KV group and layer from the question (0: none)")
    ap.add_argument("--beyond", action="store_true",
                    help="rank only blocks after the first and before the question's own")
    ap.add_argument("ruler_args", nargs=argparse.REMAINDER, help="-- then `m3c eval ruler`'s arguments")
    a = ap.parse_args()
    args = a.ruler_args[1:] if a.ruler_args[:1] == ["--"] else a.ruler_args
    if a.guide < 0:
        sys.exit(f"error: --guide must be >= 0, got {a.guide}")
    if "--json" not in args:
        sys.exit("error: pass --json among the ruler's arguments (this script adds to its JSON)")
    if a.guide:
        install(a.guide, a.beyond)
    from m3compile import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(["eval", "ruler", *args], standalone_mode=False)
    report = json.loads(buf.getvalue())
    report["guided_blocks"], report["guided_beyond"] = a.guide, a.beyond
    # decode selections (one per MSA layer and step) extended, and the blocks they gained beyond the index's
    report["guided_selections"], report["guided_blocks_added"] = _STEP["extended"], _STEP["added"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
