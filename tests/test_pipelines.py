"""Lowering (m3compile.lower, the ops' switch m3compile.ops.lowering): a converted graph, a loaded Decoder and a
distillation graph run the Triton kernels (interpreted here) with the reference's results, and the graphs keep their
reference ops.
"""
import copy
import operator

import pytest
import torch

import m3compile
from m3compile import M3CompileError, MSAConfig
from m3compile.ops import LOWERING, index_branch, msa_attention, msa_attention_lse, msa_index_kl, msa_select, \
    op_args
from m3compile.pipelines import Lowered, run_pipeline
from m3compile.train.distill import index_parameters

TINY = MSAConfig(block_size=8, topk=2, dense_layers=(0,))




def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_lowered_graph_matches_reference_graph(monkeypatch):
    """The lowered graph runs each MSA op's lowering (counted) with the reference's logits; its nodes stay the
    reference ops."""
    gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    ids = torch.randint(0, 256, (2, 43))  # 6 blocks of 8 > top-2: the sparse kernels run
    with torch.no_grad():
        want = gm(ids)
    calls = []
    for op in (msa_select, msa_attention):
        lowered_op = LOWERING[op]
        monkeypatch.setitem(LOWERING, op, lambda *a, _f=lowered_op, **k: calls.append(_f) or _f(*a, **k))
    lowered = m3compile.lower(gm)
    assert isinstance(lowered, Lowered) and lowered.model is gm
    targets = _targets(gm)
    assert targets.count(msa_select) == 3 and targets.count(msa_attention) == 3
    with torch.no_grad():
        got = lowered(ids)
    assert len(calls) == 6
    assert (got - want).abs().max().item() < 1e-4


def test_lowering_is_idempotent_and_needs_msa():
    gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    once = m3compile.lower(gm)
    assert m3compile.lower(once) is once
    with pytest.raises(M3CompileError, match="no MSA layer"):
        m3compile.lower(m3compile.from_preset("m3-tiny"))
    m3compile.lower(m3compile.from_preset("m3-tiny"), require_msa=False)  # a dense model's norms and RoPE


def test_lowering_a_loaded_decoder(tiny_msa):
    model = m3compile.load(tiny_msa)
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        want = model(ids)
        got = m3compile.lower(model)(ids)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_lowered_kl_hooks_match_the_reference_graph(monkeypatch, mode):
    """Training's graph lowered: the fused KL and the streamed recall give the reference's per-layer KL and recall,
    and the same gradients on the index parameters. Sparse support: the teacher LSE and the CSR are taken from the
    same layer's sparse attention (no LSE pass of its own). Warm-up (dense support): the same kernel over every
    visible block, its teacher LSE from the fused causal log-sum-exp (no LSE-only gather pass either)."""
    from m3compile.kernels import sparse_attention as sa

    stages = []
    forward = sa._forward_csr
    monkeypatch.setattr(sa, "_forward_csr", lambda *a: stages.append(a[8]) or forward(*a))
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 43))  # 6 blocks of 8 > top-2: sparse support
    gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    report = run_pipeline("distill", gm, mode=mode)
    assert _targets(gm).count(msa_index_kl) == 3
    for kl_node in (n for n in gm.graph.nodes if n.target is msa_index_kl):
        lse, csr = kl_node.kwargs["teacher_lse"], kl_node.kwargs["csr"]
        assert lse.target is operator.getitem and lse.args[0].target is msa_attention_lse
        assert csr.target is operator.getitem and csr.args == (lse.args[0], 2)
        att, kl_args = op_args(lse.args[0]), op_args(kl_node)
        assert (att["q"], att["k"]) == (kl_args["q"], kl_args["k"])  # the same layer's q and k
    assert report[0].replaced == 3
    params = index_parameters(gm)
    results = []
    for lowered in (False, True):
        _, kl, recall = m3compile.lower(gm)(ids) if lowered else gm(ids)
        grads = torch.autograd.grad(kl.sum(), list(params.values()))
        results.append((kl.detach(), recall.detach(), grads))
    (kl0, r0, g0), (kl1, r1, g1) = results
    if mode == "sparse":
        assert stages and "lse" not in stages, stages  # the three layers' attentions ran; no LSE-only pass
    else:  # the dense main branch is SDPA; the KL's teacher LSE and recall need no gather pass
        assert "lse" not in stages, stages
    assert (kl1 - kl0).abs().max().item() < 1e-5 and (r1 - r0).abs().max().item() < 1e-5
    assert 0.0 < r1.min().item() and r1.max().item() < 1.0  # some teacher mass outside the selected blocks
    for a, b in zip(g1, g0):
        assert (a - b).norm().item() <= 1e-4 * max(1.0, b.norm().item())


def test_lowered_distillation_graph_fuses_the_index_branch_and_the_norms(monkeypatch):
    """The distillation graph on a frozen backbone: one index_branch op per MSA layer (its two projections as one
    matmul, the norms and RoPEs of the index heads in one kernel), the backbone's norms as modules, each run lowered
    inside the switch (the index branch's kernel and every RMSNorm's, counted); per-layer KL and recall, and the
    index parameters' gradients, as the reference's. m3-tiny's index RoPE is the table cut to 8 of 16 channels."""
    from m3compile import ops

    torch.manual_seed(0)
    base, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    for name, p in base.named_parameters():
        p.requires_grad_(".index_" in name)
    ids = torch.randint(0, 256, (1, 43))  # 6 blocks of 8 > top-2
    calls = []
    for op in (ops.index_branch, ops.rms_norm, ops.add_rms_norm):
        lowered_op = LOWERING[op]
        monkeypatch.setitem(LOWERING, op, lambda *a, _n=op.__name__, _f=lowered_op, **k: calls.append(_n) or _f(*a, **k))
    results = []
    for lowered in (False, True):
        gm = copy.deepcopy(base)
        run_pipeline("distill", gm, mode="sparse")
        assert _targets(gm).count(index_branch) == 3
        params = index_parameters(gm)
        _, kl, recall = m3compile.lower(gm)(ids) if lowered else gm(ids)
        results.append((kl.detach(), recall.detach(), torch.autograd.grad(kl.sum(), list(params.values()))))
    assert calls.count("index_branch") == 3
    assert calls.count("rms_norm") + calls.count("add_rms_norm") == 4 * 4 + 1  # per layer its two norms and q/k
    (kl0, r0, g0), (kl1, r1, g1) = results  # norms; the final norm
    assert (kl1 - kl0).abs().max().item() < 1e-5 and (r1 - r0).abs().max().item() < 1e-5
    for a, b in zip(g1, g0):
        assert (a - b).norm().item() <= 1e-4 * max(1.0, b.norm().item())
