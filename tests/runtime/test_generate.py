"""Generation over the paged caches (m3compile.generate): greedy tokens and logits against full forwards, the Triton
kernels against the references, and bad input.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so these tests execute the same kernel
code the GPU runs, at small shapes.
"""
import pytest
import torch

import m3compile
from m3compile import M3CompileError, MSAConfig
from tests.conftest import LLAMA_BYTE

TINY = MSAConfig(block_size=8, topk=2, dense_layers=(0,))




@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama") / "msa"
    m3compile.convert_checkpoint(LLAMA_BYTE, out, MSAConfig(block_size=16, topk=2, dense_layers=(0,)))
    return out


def test_generate_equals_greedy_recompute(llama_dir):
    """Paged prefill + decode (torch references) == argmax of a full forward over the growing sequence."""
    model = m3compile.load(llama_dir, dtype="float32")
    prompts = [torch.randint(0, 256, (70,)).tolist(), torch.randint(0, 256, (23,)).tolist()]
    res = m3compile.generate(model, prompts, 5, kernels=False)
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
    slow = m3compile.generate(model, prompts, 6, kernels=False)
    fast = m3compile.generate(model, prompts, 6)
    assert fast.tokens == slow.tokens
    for b, prompt in enumerate(prompts):
        seq = prompt + slow.tokens[b]
        with torch.no_grad():
            want = hf(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:]
        for res in (slow, fast):
            assert (res.prefill_logits[b] - want[0]).abs().max().item() < 1e-4
            assert (res.step_logits[:, b] - want[1:]).abs().max().item() < 1e-4


def test_generate_with_triton_kernels_matches_reference(tiny_msa):
    model = m3compile.load(tiny_msa)
    prompts = [torch.randint(0, 256, (29,)).tolist(), torch.randint(0, 256, (9,)).tolist(), [5]]
    fast = m3compile.generate(model, prompts, 4)  # interpreter: the Triton kernels
    slow = m3compile.generate(model, prompts, 4, kernels=False)
    assert fast.tokens == slow.tokens
    assert (fast.step_logits - slow.step_logits).abs().max().item() < 1e-4
    fp8 = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8")
    fp8_ref = m3compile.generate(model, prompts, 4, index_cache_dtype="fp8", kernels=False)
    assert fp8.tokens == fp8_ref.tokens


def test_decode_graph_capture_needs_cuda_and_cpu_stays_eager(tiny_msa):
    """The captured decode step (CUDA graph) cannot run on a CPU: asked for, it is a one-line error; by default a CPU
    runs the eager step (the GPU check, graph logits == eager logits, is in `m3c bench model`)."""
    from m3compile.runtime import DecodeStep, PagedCache, graph_unavailable

    model = m3compile.load(tiny_msa)
    assert "CUDA" in graph_unavailable(model, "cpu")
    with pytest.raises(M3CompileError, match="cannot capture the decode step"):
        m3compile.generate(model, [[1, 2, 3]], 3, cuda_graph=True)
    cache = PagedCache(model, 1, 16, 8, "cpu", torch.float32, torch.float32)
    assert DecodeStep(model, cache, 1).graph is None
    res = m3compile.generate(model, [[1, 2, 3]], 12, kernels=False)  # > 8 steps: still eager on a CPU
    assert len(res.tokens[0]) == 12


def test_generate_rejects_bad_input(tiny_msa):
    model = m3compile.load(tiny_msa)
    with pytest.raises(M3CompileError, match="at least one token"):
        m3compile.generate(model, [[1, 2], []], 2)
    with pytest.raises(M3CompileError, match="outside the vocabulary"):
        m3compile.generate(model, [[1, 999]], 2)
    with pytest.raises(M3CompileError, match="must equal the MSA block size"):
        m3compile.generate(model, [[1, 2]], 2, page_size=16)
    with pytest.raises(M3CompileError, match="index_cache_dtype"):
        m3compile.generate(model, [[1, 2]], 2, index_cache_dtype="int4")
