"""The kl_distill pass: hooks per MSA layer, warm-up and sparse modes, and an exact undo."""
import pytest
import torch

from m3compile.kernels.block_stats.naive import block_rank_kl
from m3compile.kernels.sparse_kl.naive import index_kl
from m3compile import M3CompileError, MSAConfig, convert, from_preset, load, save
from m3compile.graph.pass_manager import PassManager
from m3compile.graph.tracing import trace
from m3compile.passes.kl_distill import KLDistill, StripKLDistill


@pytest.fixture
def converted():
    model = from_preset("m3-tiny")
    gm, _ = convert(model, MSAConfig(block_size=4, topk=2, dense_layers=(0,)))
    return model, gm


def test_modes_and_exact_undo(converted):
    model, gm = converted
    x = torch.randint(0, 256, (2, 23))
    code, inference = gm.code, gm(x)
    reports = PassManager([KLDistill("warmup")]).run(gm)
    assert reports[0].replaced == 3  # layers 1-3 are MSA
    logits, kl, recall = gm(x)
    assert kl.shape == recall.shape == (3,) and kl.requires_grad and bool((recall < 1).all())
    model.set_selection("dense")
    torch.testing.assert_close(logits, model(x))  # warm-up: the main branch runs dense
    PassManager([KLDistill("sparse")]).run(gm)  # switches the mode
    logits, kl_sparse, _ = gm(x)
    torch.testing.assert_close(logits, inference)  # sparse: the inference computation
    assert not torch.allclose(kl, kl_sparse)
    assert not PassManager([KLDistill("sparse")]).run(gm)[0].modified  # idempotent
    assert PassManager([StripKLDistill()]).run(gm)[0].replaced == 3
    assert gm.code == code
    torch.testing.assert_close(gm(x), inference, rtol=0, atol=0)


def test_hook_on_a_loaded_msa_model_equals_the_loss_on_its_own_tensors(tmp_path):
    gm0, report = convert(from_preset("m3-tiny"), MSAConfig(block_size=4, topk=2, dense_layers=(0,)))
    save(gm0, report, tmp_path / "msa")
    model = load(tmp_path / "msa", dtype="float32")  # natively MSA: the graph comes from tracing, not the rewrite
    gm = trace(model)
    PassManager([KLDistill("sparse")]).run(gm)
    assert gm.meta["m3_kl_distill"].layers == [1, 2, 3]
    x = torch.randint(0, 256, (1, 17))
    seen = {}
    attn = model.model.layers[2].self_attn
    attn.observer = lambda a, q, k, blocks, lse: seen.update(q=q, k=k, blocks=blocks)
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.update(h=args[0], cos=args[1], sin=args[2]))
    model(x)
    hook.remove()
    attn.observer = None
    _, _, _, q_idx, k_idx = attn.project(seen["h"], seen["cos"], seen["sin"])
    want, _ = index_kl(q_idx.transpose(1, 2), k_idx, seen["q"], seen["k"], seen["blocks"], block_size=4,
                       scale=attn.scale)
    _, kl, _ = gm(x)
    torch.testing.assert_close(kl[1], want.mean())
    # with the block-ranking loss: its node sees the same tensors (17 tokens, block 4 / top-2: rows 8..16 choose)
    PassManager([StripKLDistill(), KLDistill("sparse", block_loss=True)]).run(gm)
    _, kl_b, _, block = gm(x)
    torch.testing.assert_close(kl_b, kl, rtol=0, atol=0)
    want = block_rank_kl(q_idx.transpose(1, 2), k_idx, seen["q"], seen["k"], block_size=4, topk=2,
                         scale=attn.scale)
    assert block.shape == (3,) and float(want.detach()) > 0
    torch.testing.assert_close(block[1], want)


def test_block_loss_nodes_switch_modes_lower_and_strip_exactly(converted):
    """block_loss adds one msa_block_loss node per layer and a fourth output; mode switches keep it, lowering runs
    its lowering (the block-stats kernel, here under the interpreter; counted) with the same loss and index
    gradients, a hooked graph refuses another block_loss setting, and strip_kl_distill restores the inference
    graph's code."""
    from m3compile import lower
    from m3compile.ops import LOWERING, msa_block_loss
    from m3compile.pipelines import run_pipeline

    _, gm = converted
    x = torch.randint(0, 256, (2, 23))
    code, inference = gm.code, gm(x)
    run_pipeline("distill", gm, mode="warmup", block_loss=True)
    assert len([n for n in gm.graph.nodes if n.target is msa_block_loss]) == 3
    logits, kl, recall, block = gm(x)
    assert block.shape == (3,) and block.requires_grad and bool((block > 0).all())
    index = [p for n, p in gm.named_parameters() if ".index_" in n]
    grads = torch.autograd.grad(block.sum(), index, allow_unused=True)
    assert all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
    run_pipeline("distill", gm, mode="sparse", block_loss=True)
    _, _, _, block_sparse = gm(x)
    grads_sparse = torch.autograd.grad(block_sparse.sum(), index)
    # the loss itself is the same in both modes (dense teacher, block-max scores): the first MSA layer, whose input
    # does not depend on the mode, agrees; later layers see the sparse main branch's hidden states
    torch.testing.assert_close(block_sparse[0], block[0])
    assert not torch.allclose(block_sparse, block)
    with pytest.raises(M3CompileError, match="block_loss=True"):
        run_pipeline("distill", gm, mode="sparse")
    PassManager([StripKLDistill()]).run(gm)
    assert gm.code == code
    torch.testing.assert_close(gm(x), inference, rtol=0, atol=0)
    run_pipeline("distill", gm, mode="sparse", block_loss=True)
    calls = []
    kernel = LOWERING[msa_block_loss]
    LOWERING[msa_block_loss] = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        _, _, _, block_lowered = lower(gm)(x)
    finally:
        LOWERING[msa_block_loss] = kernel
    assert len(calls) == 3
    torch.testing.assert_close(block_lowered, block_sparse, rtol=1e-5, atol=1e-7)
    index = [p for n, p in gm.named_parameters() if ".index_" in n]
    for got, want in zip(torch.autograd.grad(block_lowered.sum(), index), grads_sparse):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_needs_msa_layers():
    gm = trace(from_preset("m3-tiny"))  # a dense model
    with pytest.raises(M3CompileError, match="no MSA layers"):
        PassManager([KLDistill()]).run(gm)
    with pytest.raises(M3CompileError, match="unknown distillation mode"):
        KLDistill("dense")


def test_mode_switch_on_a_hooked_training_graph(converted):
    """Switching warm-up -> sparse is the distill pipeline again (kl_distill revisits): it finds the hooks by their
    records and sets both supports; the lowered graph then runs the switched mode."""
    from m3compile import lower
    from m3compile.ops import msa_attention_lse, msa_index_kl, op_args
    from m3compile.pipelines import run_pipeline

    _, gm = converted
    run_pipeline("distill", gm, mode="warmup")
    run_pipeline("distill", gm, mode="sparse")
    kls = [n for n in gm.graph.nodes if n.target is msa_index_kl]
    assert len(kls) == 3 and all(op_args(n)["sparse"] for n in kls)
    assert all(op_args(n)["sparse"] for n in gm.graph.nodes if n.target is msa_attention_lse)
    x = torch.randint(0, 256, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(lower(gm)(x)[1], gm(x)[1], rtol=1e-5, atol=1e-6)


def test_drop_logits_keeps_the_hooks_outputs_and_gradients_and_removes_the_head(converted):
    """Distillation reads only the hooks' outputs: drop_logits returns None for the logits and removes the lm head,
    the final norm and the last layer's MLP, with KL, recall, block loss and the index gradients unchanged in both
    modes; the pruned graph cannot be stripped back."""
    import copy

    from m3compile.passes.kl_distill import drop_logits
    from m3compile.pipelines import run_pipeline

    _, full = converted
    pruned = torch.fx.GraphModule(full, copy.deepcopy(full.graph))  # the same parameters, a graph of its own
    pruned.meta = copy.deepcopy(full.meta)
    for gm in (full, pruned):
        run_pipeline("distill", gm, mode="warmup", block_loss=True)
    assert drop_logits(pruned) > 0 and drop_logits(pruned) == 0  # idempotent
    used = {n.target for n in pruned.graph.nodes if n.op in ("call_module", "get_attr")}
    assert not {"lm_head", "model.norm", "model.layers.3.mlp", "model.layers.3.self_attn.o_proj"} & used
    assert "model.layers.2.mlp" in used  # earlier layers' MLPs feed later layers' attention
    x = torch.randint(0, 256, (2, 23))
    for mode in ("warmup", "sparse"):
        run_pipeline("distill", full, mode=mode, block_loss=True)
        run_pipeline("distill", pruned, mode=mode, block_loss=True)
        want, got = full(x), pruned(x)
        assert got[0] is None and want[0].shape == (2, 23, 256)
        for a, b in zip(got[1:], want[1:]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        grads = [torch.autograd.grad(out[1].sum() + out[3].sum(), [p for n, p in gm.named_parameters()
                                                                   if ".index_" in n])
                 for gm, out in ((full, want), (pruned, got))]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(M3CompileError, match="logits were dropped"):
        PassManager([StripKLDistill()]).run(pruned)
