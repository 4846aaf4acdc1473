"""The recompute_mlp pass: each dense MLP runs under torch.utils.checkpoint with the same outputs, gradients and
parameter names, and keeps no [tokens, intermediate] tensor for the backward; MoE blocks stay as they are."""
import pytest
import torch

from m3compile import M3CompileError, TrainConfig, from_preset, load, train
from m3compile.graph.tracing import trace
from m3compile.passes.recompute_mlp import RecomputedMLP, recompute_mlps
from tests.conftest import CALIB_DATA, LLAMA_BYTE
from tests.train.test_distill import tensors


def saved_widths(fn) -> list[int]:
    """The last dimension of every tensor autograd saved while fn ran."""
    widths = []

    def pack(t):
        widths.append(t.shape[-1] if t.dim() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, widths


@pytest.mark.parametrize("source", ["byte-llama", "m3-tiny"])
def test_recomputed_mlps_match_and_keep_no_intermediate(source):
    model = load(LLAMA_BYTE, dtype="float32") if source == "byte-llama" else from_preset("m3-tiny")
    inter = model.args.intermediate_size
    graphs = [trace(model), trace(model)]
    names = list(dict(graphs[1].named_parameters()))
    layers = recompute_mlps(graphs[1], model)
    dense = [i for i in range(model.args.n_layers) if not model.args.is_moe(i)]
    assert layers == dense and len(dense) >= 1
    assert sum(isinstance(m, RecomputedMLP) for m in graphs[1].modules()) == len(dense)
    assert list(dict(graphs[1].named_parameters())) == names  # a checkpoint's tensor names do not change
    x = torch.randint(0, model.args.vocab_size, (2, 37))
    grads = []
    for gm in graphs:
        gm.zero_grad()
        out, widths = saved_widths(lambda: gm(x))
        out.float().logsumexp(-1).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None},
                      widths.count(inter)))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    assert grads[1][1].keys() == grads[0][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=0, atol=0, msg=name)
    assert grads[0][2] >= 3 * len(dense) and grads[1][2] == 0, (grads[0][2], grads[1][2])
    with torch.no_grad():  # without a gradient the module runs plainly
        torch.testing.assert_close(graphs[1](x), graphs[0](x), rtol=0, atol=0)


def test_training_with_recomputed_mlps_is_the_same_training(byte_msa, tmp_path):
    common = dict(steps=2, seq_len=128, batch=1, lr=1e-4, holdout_tokens=0)
    train(byte_msa, CALIB_DATA, tmp_path / "plain", TrainConfig(**common))
    train(byte_msa, CALIB_DATA, tmp_path / "recomputed", TrainConfig(**common, recompute_mlp=True))
    a, b = tensors(tmp_path / "plain"), tensors(tmp_path / "recomputed")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)
    from m3compile.train.distill import DistillStep
    with pytest.raises(M3CompileError, match="--recompute-mlp"):
        DistillStep(load(byte_msa, dtype="float32"), TrainConfig(steps=1, recompute_mlp=True), "cpu", "sparse",
                    shard=True)
