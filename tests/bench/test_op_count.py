"""The host cost of a distillation step, counted on CPU (bench/op_count.py): a regression guard.

A step on the GPU can be bound by its host dispatches (a sparse distillation step of SmolLM2 at batch 2 measured
~10K kernel launches, 131 ms of GPU work against 557-681 ms of CPU time). Under TRITON_INTERPRET=1 the lowered
graph takes the same host path as on CUDA, so the dispatches of one step are countable here. Measured on SmolLM2's
shapes (9 query / 3 KV heads, tied embeddings; 3 layers, layer 0 dense), per MSA layer: 112 (sparse) and 104
(warm-up) dispatches (`m3c bench distill smollm2-135m --count-ops`, BENCHMARKS.md; with per-layer glue ops, 376
and 411).
The bounds below sit a few ops above the measured counts: a change that adds per-layer glue fails here.
"""
import torch

from m3compile.config import MSAConfig
from m3compile.models.decoder import PRESETS, Decoder
from m3compile.conversion.convert import convert
from m3compile.bench.op_count import count_ops
from m3compile.train.distill import DistillConfig, DistillStep

# mode: (dispatches per MSA layer, per step of this 3-layer model), measured 112 / 302 and 104 / 286
BOUNDS = {"sparse": (116, 312), "warmup": (108, 296)}


def smollm2_shaped(layers=3):
    """SmolLM2-135M's attention shapes and wiring (9 / 3 heads, tied embeddings), small widths: the per-layer
    dispatch counts do not depend on the widths."""
    args = PRESETS["smollm2-135m"].replace(vocab_size=256, hidden_size=96, n_layers=layers, head_dim=16,
                                           intermediate_size=128)
    gm, _ = convert(Decoder(args), MSAConfig(block_size=8, topk=2, dense_layers=(0,)))
    model = Decoder(gm.meta["model_args"])
    model.load_state_dict(gm.state_dict(), strict=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def test_distillation_step_dispatches_stay_below_the_measured_bound():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (1, 24))  # 3 blocks of 8 > top-2: the sparse kernels run
    # the KL-only step the bounds were measured on (the block loss's CPU path is the query-chunked torch reference)
    step = DistillStep(smollm2_shaped(), DistillConfig(steps=1, seq_len=24, block_loss=0), "cpu", "warmup",
                       lowered=True)
    counts = {}
    for mode in ("warmup", "sparse"):
        step.set_mode(mode)
        step(x)  # caches (the dense support, the CSR constants) fill on the first step
        counts[mode] = count_ops(lambda: step(x), step.gm)
    for mode, c in counts.items():
        per_layer, total = BOUNDS[mode]
        assert set(c.layers) == {"0", "1", "2", "model"}, c.layers
        assert c.per_layer(1) <= per_layer, (mode, c.per_layer(1), c.layers["1"])
        assert c.total <= total, (mode, c.total, c.stages)
        assert c.syncs == 0, c.top  # no host read inside a step
        assert c.stages["optimizer"]["aten"] <= 2  # fused AdamW: one kernel for every parameter
        assert c.triton > 0 and "index_branch" not in c.layers  # the lowered path ran
    sparse = counts["sparse"].kernels
    assert sparse["sparse_kl_fwd_kernel"] == 2 and sparse["norm_rope_bwd_kernel"] == 2  # one per MSA layer
    assert sparse["csr_keys_kernel"] == 2  # one CSR per layer: the attention's, reused by the KL
