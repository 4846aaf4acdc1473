"""lower_triton (graph ops swapped for the Triton kernels) and paged-cache generation.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so these tests execute the same kernel
code the GPU runs, at small shapes.
"""
import operator

import pytest
import torch

import m3compile
from m3compile import M3CompileError, MSAConfig
from m3compile.graph.pass_manager import PassManager
from m3compile.passes.lower_triton import LowerTriton
from m3compile.ops import msa_attention_triton, msa_select_triton, op_args
from m3compile.ops import msa_attention, msa_select
from tests.conftest import LLAMA_BYTE

TINY = MSAConfig(block_size=8, topk=2, dense_layers=(0,))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "msa"
    m3compile.convert_checkpoint(None, out, TINY, preset="m3-tiny", dtype="float32")
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama") / "msa"
    m3compile.convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=2, dense_layers=(0,)))
    return out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_lowered_graph_matches_reference_graph():
    gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    ids = torch.randint(0, 256, (2, 43))  # 6 blocks of 8 > top-2: the sparse kernels run
    with torch.no_grad():
        want = gm(ids)
    lowered = m3compile.lower(gm)
    targets = _targets(lowered)
    assert msa_select not in targets and msa_attention not in targets
    assert targets.count(msa_select_triton) == 3 and targets.count(msa_attention_triton) == 3
    with torch.no_grad():
        got = lowered(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert lowered.meta["lowering"].replaced == 6


def test_lowering_is_idempotent_and_needs_msa():
    gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    m3compile.lower(gm)
    report = PassManager([LowerTriton()]).run(gm)[0]
    assert report.replaced == 0 and not report.modified
    with pytest.raises(M3CompileError, match="no MSA layer"):
        m3compile.lower(m3compile.from_preset("m3-tiny"))


def test_lowering_a_loaded_decoder(tiny_dir):
    model = m3compile.load(tiny_dir)
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        want = model(ids)
        got = m3compile.lower(model)(ids)
    assert (got - want).abs().max().item() < 1e-4


def test_generate_equals_greedy_recompute(llama_dir):
    """Paged prefill + decode (torch references) == argmax of a full forward over the growing sequence."""
    model = m3compile.load(llama_dir, dtype="float32")
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (23,)).tolist()]
    res = m3compile.generate(model, prompts, 5, backend="torch")
    for b, prompt in enumerate(prompts):
        seq = list(prompt)
        for step in range(5):
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0, -1]
            if step:
                assert (logits - res.step_logits[step - 1, b]).abs().max().item() < 1e-4
            seq.append(int(logits.argmax()))
        assert res.tokens[b] == seq[len(prompt):]


def test_generate_with_an_index_head_narrower_than_rope(tmp_path):
    """Index dim 24 below the rotary width 32: the decode path's index keys get the same cut-table RoPE
    as the prefill, so paged generation (torch references and Triton kernels) follows transformers' greedy logits."""
    from tests.models.test_hf_parity import m3_index_rope_model

    hf = m3_index_rope_model(24)
    hf.save_pretrained(tmp_path / "m3")
    model = m3compile.load(tmp_path / "m3", dtype="float32")
    prompts = [torch.randint(0, 64, (45,)).tolist(), torch.randint(0, 64, (20,)).tolist()]  # 45 + 6 > 3 blocks of 16
    slow = m3compile.generate(model, prompts, 6, backend="torch")
    fast = m3compile.generate(model, prompts, 6)
    assert fast.tokens == slow.tokens
    for b, prompt in enumerate(prompts):
        seq = prompt + slow.tokens[b]
        with torch.no_grad():
            want = hf(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:]
        for res in (slow, fast):
            assert (res.prefill_logits[b] - want[0]).abs().max().item() < 1e-4
            assert (res.step_logits[:, b] - want[1:]).abs().max().item() < 1e-4


def test_generate_with_triton_kernels_matches_reference(tiny_dir):
    model = m3compile.load(tiny_dir)
    prompts = [torch.randint(0, 256, (29,)).tolist(), torch.randint(0, 256, (9,)).tolist(), [5]]
    fast = m3compile.generate(model, prompts, 4)  # interpreter: the Triton kernels
    slow = m3compile.generate(model, prompts, 4, backend="torch")
    assert fast.tokens == slow.tokens
    assert (fast.step_logits - slow.step_logits).abs().max().item() < 1e-4
    fp8 = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8")
    fp8_ref = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8", backend="torch")
    assert fp8.tokens == fp8_ref.tokens


def test_decode_graph_capture_needs_cuda_and_cpu_stays_eager(tiny_dir):
    """The captured decode step (CUDA graph) cannot run on a CPU: asked for, it is a one-line error; by default a CPU
    runs the eager step (the GPU check, graph logits == eager logits, is in `m3c bench model`)."""
    from m3compile.runtime import DecodeStep, PagedCache, graph_unavailable

    model = m3compile.load(tiny_dir)
    assert "CUDA" in graph_unavailable(model, "cpu")
    with pytest.raises(M3CompileError, match="cannot capture the decode step"):
        m3compile.generate(model, [[1, 2, 3]], 3, cuda_graph=True)
    cache = PagedCache(model, 1, 16, 8, "cpu", torch.float32, torch.float32)
    assert DecodeStep(model, cache, 1).graph is None
    res = m3compile.generate(model, [[1, 2, 3]], 12, backend="torch")  # > 8 steps: still eager on a CPU
    assert len(res.tokens[0]) == 12


def test_generate_rejects_bad_input(tiny_dir):
    model = m3compile.load(tiny_dir)
    with pytest.raises(M3CompileError, match="at least one token"):
        m3compile.generate(model, [[1, 2], []], 2)
    with pytest.raises(M3CompileError, match="outside the vocabulary"):
        m3compile.generate(model, [[1, 999]], 2)
    with pytest.raises(M3CompileError, match="must equal the MSA block size"):
        m3compile.generate(model, [[1, 2]], 2, page_size=16)
    with pytest.raises(M3CompileError, match="index_cache_dtype"):
        m3compile.generate(model, [[1, 2]], 2, index_cache_dtype="int4")


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_lowered_kl_hooks_match_the_reference_graph(monkeypatch, mode):
    """Training's graph lowered: the fused KL and the streamed recall give the reference's per-layer KL and recall,
    and the same gradients on the index parameters. Sparse support: the teacher LSE and the CSR are taken from the
    same layer's sparse attention (no LSE pass of its own). Warm-up (dense support): the same kernel over every
    visible block, its teacher LSE from the fused causal log-sum-exp (no LSE-only gather pass either)."""
    from m3compile.kernels import sparse_attention as sa
    from m3compile.ops import msa_attention_lse_triton, msa_index_kl_triton
    from m3compile.train.distill import index_parameters
    from m3compile.passes.kl_distill import KLDistill

    stages = []
    forward = sa._forward_csr
    monkeypatch.setattr(sa, "_forward_csr", lambda *a: stages.append(a[8]) or forward(*a))
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 43))  # 6 blocks of 8 > top-2: sparse support
    results = []
    for lower in (False, True):
        gm, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
        report = PassManager([KLDistill(mode)] + ([LowerTriton()] if lower else [])).run(gm)
        if lower and mode == "sparse":
            assert _targets(gm).count(msa_index_kl_triton) == 3
            for kl_node in (n for n in gm.graph.nodes if n.target is msa_index_kl_triton):
                lse, csr = kl_node.kwargs["teacher_lse"], kl_node.kwargs["csr"]
                assert lse.target is operator.getitem and lse.args[0].target is msa_attention_lse_triton
                assert csr.target is operator.getitem and csr.args == (lse.args[0], 2)
                att, kl_args = op_args(lse.args[0]), op_args(kl_node)
                assert (att["q"], att["k"]) == (kl_args["q"], kl_args["k"])  # the same layer's q and k
            assert sum("KL teacher log-sum-exp and CSR from the attention" in d for d in report[-1].details) == 3
        params = index_parameters(gm)
        _, kl, recall = gm(ids)
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


def test_causal_lse_matches_a_dense_logsumexp():
    from m3compile.kernels.causal_lse import naive as ref

    q, k = torch.randn(2, 6, 13, 8), torch.randn(2, 3, 13, 8)
    s = torch.einsum("bhtd,bhkd->bhtk", q, k.repeat_interleave(2, 1)) * 0.3
    s = s.masked_fill(torch.ones(13, 13, dtype=torch.bool).triu(1), float("-inf"))
    want = (torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))).transpose(1, 2)
    assert (ref.causal_lse(q, k, 0.3, chunk=5) - want).abs().max().item() < 1e-5
    rows = torch.tensor([0, 4, 5, 12])
    assert (ref.causal_lse(q, k, 0.3, chunk=3, rows=rows) - want[:, rows]).abs().max().item() < 1e-5


def test_lowered_recall_on_evenly_spaced_queries_beyond_recall_rows(monkeypatch):
    """Past RECALL_ROWS tokens the lowered hook measures recall on RECALL_ROWS evenly spaced queries (first and
    last included): the reference's per-token recall averaged over exactly those queries; the KL is unchanged."""
    from m3compile import ops as msa
    from m3compile.kernels.indexer.naive import select_blocks
    from m3compile.kernels.sparse_kl.naive import index_kl

    torch.manual_seed(0)
    B, Hkv, G, T, D, bs, K = 1, 2, 3, 43, 16, 8, 2
    q, k = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D)
    q_idx, k_idx = torch.randn(B, T, Hkv, 8), torch.randn(B, T, 8)
    blocks = select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=K)
    monkeypatch.setattr(msa, "RECALL_ROWS", 10)
    rows = msa.recall_rows(T)
    assert rows.tolist()[0] == 0 and rows.tolist()[-1] == T - 1 and len(set(rows.tolist())) == 10
    kl, recall = msa.msa_index_kl_triton(q, k, q_idx, k_idx, blocks, bs, D**-0.5, True)
    want_kl, want_recall = index_kl(q_idx.transpose(1, 2), k_idx, q, k, blocks, block_size=bs, sparse=True,
                                    scale=D**-0.5)
    assert abs(kl.item() - want_kl.mean().item()) < 1e-5
    assert abs(recall.item() - want_recall[..., rows].mean().item()) < 1e-5
    assert abs(recall.item() - want_recall.mean().item()) > 1e-4  # a subset, not the full mean


def test_distill_pipeline_fuses_the_index_branch_and_the_norms(monkeypatch):
    """The lowered distillation graph (lower_triton, fuse_index_branch, lower_norms) on a frozen backbone: one
    index_branch_triton per MSA layer in place of its projections, Gemma norms and RoPEs, every backbone RMSNorm
    one kernel; per-layer KL and recall, and the index parameters' gradients, as the reference graph's. m3-tiny's
    index RoPE is the table cut to 8 of 16 channels."""
    import copy

    from m3compile.ops import apply_index_rope, apply_index_rope_triton, index_branch_triton, rms_norm_triton
    from m3compile.pipelines import run_pipeline
    from m3compile.train.distill import index_parameters

    torch.manual_seed(0)
    base, _ = m3compile.convert(m3compile.from_preset("m3-tiny"), TINY)
    for name, p in base.named_parameters():
        p.requires_grad_(".index_" in name)
    ids = torch.randint(0, 256, (1, 43))  # 6 blocks of 8 > top-2
    results = []
    for lowered in (False, True):
        gm = copy.deepcopy(base)
        run_pipeline("distill", gm, mode="sparse", lowered=lowered)
        targets = _targets(gm)
        if lowered:
            assert targets.count(index_branch_triton) == 3
            assert apply_index_rope not in targets and apply_index_rope_triton not in targets
            assert not any(n.op == "call_module" and ".index_" in n.target for n in gm.graph.nodes)
            assert targets.count(rms_norm_triton) == 4 * 4 + 1  # per layer its two norms and q/k norms; the final
        params = index_parameters(gm)
        _, kl, recall = gm(ids)
        results.append((kl.detach(), recall.detach(), torch.autograd.grad(kl.sum(), list(params.values()))))
    (kl0, r0, g0), (kl1, r1, g1) = results
    assert (kl1 - kl0).abs().max().item() < 1e-5 and (r1 - r0).abs().max().item() < 1e-5
    for a, b in zip(g1, g0):
        assert (a - b).norm().item() <= 1e-4 * max(1.0, b.norm().item())
