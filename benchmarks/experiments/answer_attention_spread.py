"""How many blocks a dense model's own attention needs where it reads the question and writes the answer.

An adaptive answer budget (top-p P of the index branch's block probabilities) kept 52-61% of the blocks at every
length on the real 32K model (BENCHMARKS.md, "The quality-speed frontier"). This script asks whether the dense
attention itself is that spread there, or only the index's estimate of it: it builds RULER-style samples
(m3compile.evaluation.ruler_tasks, as `m3c eval ruler` does), appends each sample's expected answer (teacher-forced),
runs the dense model through transformers with an attention function that also keeps the probabilities of the last
rows (the prompt's last QUESTION tokens and the answer's tokens), and, per layer from 1 up and KV group, sums the
group's head-mean probability over each BLOCK-token block (the oracle's block mass, kernels/causal_lse/naive.py).
It prints, per task and length, the mean fraction of the visible blocks that holds P of that mass (fewest blocks
first): the oracle's budget at top-p P, on the rows where the answer budget applies. With --plain N it measures
instead the last QUESTION + 32 tokens of N windows of plain text (the data file cut into `length`-token windows):
where the same share of the mass sits in code the model merely continues, as distillation sees it.

    python benchmarks/experiments/answer_attention_spread.py HF_MODEL_DIR data/long_code_eval.txt \
        [--lengths 4096,8192] [--tasks niah_multikey_3,niah_multivalue,niah_multiquery] [--samples 2] \
        [--block 128] [--question 128] [--p 0.9,0.95] [--plain N] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

from m3compile.evaluation.ruler_tasks import TASKS, Haystacks, build_samples
from m3compile.io.tokenizer import PromptCodec
from m3compile.kernels.causal_lse.naive import _block_mass

ROWS: dict[int, torch.Tensor] = {}  # layer -> [KV groups, rows, blocks] the group's head-mean mass per block
STATE = {"rows": 0, "block": 128}


def _spread_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA's output (causal, grouped heads), and the last STATE["rows"] rows' block masses kept in ROWS."""
    T, D = query.shape[2:]
    scale = scaling if scaling is not None else D ** -0.5
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
    ROWS[module.layer_idx] = _block_mass(query, key, T - STATE["rows"], T, STATE["block"], scale)[0]
    return out.transpose(1, 2).contiguous(), None


def blocks_for(mass: torch.Tensor, p: float, visible: torch.Tensor) -> torch.Tensor:
    """mass [..., R, n_blocks] -> [..., R] the fewest blocks that hold a share p of each row's mass, over the blocks
    the row can see (visible [R])."""
    sorted_mass = mass.sort(-1, descending=True).values.cumsum(-1)
    need = (sorted_mass < p * sorted_mass[..., -1:]).sum(-1) + 1
    return torch.minimum(need, visible)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--tasks", default="niah_multikey_3,niah_multivalue,niah_multiquery")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--question", type=int, default=128, help="the prompt's last tokens counted as the question")
    ap.add_argument("--p", default="0.9,0.95")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", type=int, default=0, help="windows of plain text instead of the tasks' samples")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ps = [float(x) for x in a.p.split(",")]
    AttentionInterface.register("spread", _spread_attention)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="spread").eval()
    codec = PromptCodec(a.model, model.config.vocab_size)
    text = open(a.data, encoding="utf-8").read()
    hay = Haystacks(text, a.data)
    render = lambda inst: codec.prompt(inst.question, inst.answer_prefix)  # noqa: E731
    STATE["block"] = a.block
    rows_out = []
    for length in [int(x) for x in a.lengths.split(",")]:
        if a.plain:
            ids_all = codec.tokenizer.encode(text).ids
            runs = [("plain", ids_all[i * length:(i + 1) * length], 32) for i in range(a.plain)]
        else:
            runs = []
            for name in a.tasks.split(","):
                task = TASKS[name]
                for s in build_samples(task, length, a.samples, a.seed, hay, render, codec.encode_batch):
                    answer = codec.encode_batch([" " + ", ".join(s.answers)])[0] if codec.chat else []
                    answer = answer[: task.max_new_tokens]
                    runs.append((name, s.ids + answer, len(answer)))
        for name, ids, n_answer in runs:
            answer = ids[len(ids) - n_answer:]
            STATE["rows"] = a.question + len(answer)
            t0 = time.perf_counter()
            ROWS.clear()
            with torch.no_grad():
                model(torch.tensor([ids]))
            T = len(ids)
            R = STATE["rows"]
            visible = (torch.arange(T - R, T) // a.block) + 1
            row = {"task": name, "length": length, "tokens": T, "answer_tokens": len(answer),
                   "seconds": round(time.perf_counter() - t0, 1)}
            for p in ps:
                frac_q, frac_a, blk_q, blk_a = [], [], [], []
                for layer in sorted(ROWS)[1:]:  # layer 0 stays dense in a conversion
                    need = blocks_for(ROWS[layer], p, visible).float()  # [kv, R]
                    frac = need / visible.float()
                    frac_q.append(frac[:, : a.question].mean())
                    frac_a.append(frac[:, a.question:].mean())
                    blk_q.append(need[:, : a.question].mean())
                    blk_a.append(need[:, a.question:].mean())
                row[f"p{p}"] = {"question_fraction": round(float(torch.stack(frac_q).mean()), 3),
                                "answer_fraction": round(float(torch.stack(frac_a).mean()), 3),
                                "question_blocks": round(float(torch.stack(blk_q).mean()), 1),
                                "answer_blocks": round(float(torch.stack(blk_a).mean()), 1)}
            row["blocks_visible"] = int(visible[-1])
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
