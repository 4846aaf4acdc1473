"""How often fp8 index scoring selects the same blocks as full-precision scoring on a real
model's own index queries and keys. CPU run in BENCHMARKS.md, 2026-12-01.

Runs the converted model densely (so every layer sees the dense model's hidden states, whatever it selects), takes
each MSA layer's index queries and keys from its input, and selects with the plain-torch reference three ways:
fp32 scores, bf16-rounded q/k (what bf16 scoring sees), and fp8 (quantise, dequantise, fp32 scores). Prints, per
layer, over the queries that have a choice to make (t >= topk * block) and their scored slots only (forced blocks
left out: they agree by construction), the share of the fp32 selection's blocks each other one also selects and
the share of rows selected identically.

    PYTHONPATH=. python benchmarks/experiments/fp8_index_agreement.py CKPT DATA.bin SEQ_LEN WINDOWS
"""
import json
import sys

import torch

import m3compile
from m3compile.data import load_tokens, windows
from m3compile.kernels.indexer import naive as ref
from m3compile.bench.kernels import selection_agreement

ckpt, data, seq_len, n_windows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = m3compile.load(ckpt, dtype="float32")
m = model.args.msa
inputs = {}
for i, layer in enumerate(model.model.layers):
    if layer.self_attn.msa is not None:
        layer.self_attn.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args))
model.set_sparse(False)
stats = {}
with torch.no_grad():
    for window in windows(load_tokens(data, model.args.vocab_size), seq_len, n_windows):
        model(window[None, :-1])
        for i, (x, cos, sin) in inputs.items():
            q_idx, k_idx = model.model.layers[i].self_attn.index_branch(x, cos, sin)
            q_idx = q_idx.transpose(1, 2)

            T = q_idx.shape[2]
            t = torch.arange(m.topk * m.block_size, T)
            own = (t // m.block_size)[:, None]

            def select(q, k, fp8=False):
                sel = ref.select_blocks(q, k, block_size=m.block_size, topk=m.topk, init_blocks=m.init_blocks,
                                        local_blocks=m.local_blocks, fp8=fp8)[:, :, t]
                return sel.masked_fill((sel > own - m.local_blocks) | (sel < m.init_blocks), -1)  # scored slots

            base = select(q_idx, k_idx)
            for name, sel in (("bf16", select(q_idx.bfloat16(), k_idx.bfloat16())),
                              ("fp8", select(q_idx, k_idx, fp8=True))):
                blocks, rows = selection_agreement(sel, base)
                s = stats.setdefault(i, {}).setdefault(name, [0.0, 0.0, 0])
                s[0] += blocks
                s[1] += rows
                s[2] += 1
out = {str(i): {name: {"same_blocks": b / n, "same_rows": r / n} for name, (b, r, n) in per.items()}
       for i, per in sorted(stats.items())}
print(json.dumps(out, indent=1))
