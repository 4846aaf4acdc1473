"""The block-stats kernel (kernels/block_stats/) against naive.block_stats on odd shapes, and the block-ranking
loss built on it (value and index-branch gradients) against naive.block_rank_kl. Interpreter: fp32 / fp16 only
(bf16 tl.dot is wrong under Triton 3.6's interpreter; benchmarks/check_kernels.py --only block_loss runs bf16)."""
import math
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m3compile import ops
from m3compile.kernels import block_stats as bs
from m3compile.kernels.block_stats import naive


def inputs(B, Hi, G, T, D, Di, dtype, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(B, T, Hi, Di, generator=g).to(dtype).requires_grad_(grad)  # the graph's layout
    k_idx = torch.randn(B, T, Di, generator=g).to(dtype).requires_grad_(grad)
    q = (2 * torch.randn(B, Hi * G, T, D, generator=g)).to(dtype)
    k = torch.randn(B, Hi, T, D, generator=g).to(dtype)
    return q_idx, k_idx, q, k


STATS = {  # B, Hi, G, T, D, Di, block, rows
    "T203-block16-G3-Di24": (1, 2, 3, 203, 8, 24, 16, [0, 3, 17, *range(40, 203, 9), 202]),
    "G1-batch2-block7-Di8": (2, 1, 1, 61, 16, 8, 7, list(range(21, 61))),  # block < 16 and not a power of two
    "one-row-G2": (1, 3, 2, 50, 8, 16, 16, [49]),
    "rows-at-the-start": (1, 2, 3, 40, 8, 8, 16, [0, 1, 2, 15]),  # one block visible: no candidate anywhere
}


def check_stats(got, want, q_idx, k_idx, rows, block, tol):
    """blse and scores: -inf exactly where the block holds no visible key, the reference's values elsewhere; arg: a
    key of its block, and where the block has visible keys one the row sees whose score is the block's max."""
    (blse, scores, arg), (w_blse, w_scores, _) = got, want
    B, T, Hi, Di = q_idx.shape
    nb = -(-T // block)
    first = torch.arange(nb) * block
    visible = first[None, :] <= rows[:, None]  # [R, nb]
    for g, w in ((blse, w_blse), (scores, w_scores)):
        assert g.dtype == torch.float32 and g.shape[2:] == (rows.numel(), nb)
        assert torch.equal(torch.isfinite(w), visible.expand_as(w))
        assert torch.equal(torch.isfinite(g), visible.expand_as(g)) and bool((g[~torch.isfinite(g)] < 0).all())
        torch.testing.assert_close(g[torch.isfinite(g)], w[torch.isfinite(w)].float(), rtol=tol, atol=tol)
    assert arg.dtype == torch.int32 and arg.shape == scores.shape
    arg = arg.long()
    assert bool(((arg >= first) & (arg < first + block) & (arg < T)).all())
    seen = visible.expand_as(arg)
    assert bool((arg <= rows[:, None])[seen].all())
    i_b = torch.arange(B)[:, None, None, None]
    q_rows = q_idx.float()[:, rows].transpose(1, 2)  # [B, Hi, R, Di]
    at = torch.einsum("bhrd,bhrnd->bhrn", q_rows, k_idx.float()[i_b, arg]) / math.sqrt(Di)
    torch.testing.assert_close(at[seen], w_scores[seen].float(), rtol=tol, atol=tol)


def _cases(table, fp16):
    """Every case in fp32, the `fp16` ones in fp16 too (interpreter time)."""
    out = [pytest.param(*v, torch.float32, id=f"{name}-fp32") for name, v in table.items()]
    return out + [pytest.param(*table[name], torch.float16, id=f"{name}-fp16") for name in fp16]


@pytest.mark.parametrize("B,Hi,G,T,D,Di,block,rows,dtype", _cases(STATS, ["T203-block16-G3-Di24"]))
def test_kernel_matches_the_reference(B, Hi, G, T, D, Di, block, rows, dtype):
    q_idx, k_idx, q, k = inputs(B, Hi, G, T, D, Di, dtype)
    rows = torch.tensor(rows)
    got = bs.block_stats(q_idx, k_idx, q, k, rows, block_size=block, backend="triton")
    want = bs.block_stats_reference(*(t.double() for t in (q_idx, k_idx, q, k)), rows, block_size=block)
    check_stats(got, want, q_idx, k_idx, rows, block, 1e-5 if dtype == torch.float32 else 2e-3)


LOSS = {  # B, Hi, G, T, D, Di, block, topk, init, local, sampled rows
    "T203-block16-G3-init1-local2": (1, 2, 3, 203, 8, 24, 16, 4, 1, 2, None),
    "G1-batch2-block7-sampled": (2, 1, 1, 61, 16, 8, 7, 3, 0, 1, 20),
}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("B,Hi,G,T,D,Di,block,topk,init,local,n,dtype", _cases(LOSS, ["T203-block16-G3-init1-local2"]))
def test_loss_and_gradients_match_the_reference(B, Hi, G, T, D, Di, block, topk, init, local, n, dtype):
    q_idx, k_idx, q, k = inputs(B, Hi, G, T, D, Di, dtype, grad=True)
    rows = naive.choice_rows(T, block, topk, n)
    with mock.patch.object(bs, "block_stats", wraps=bs.block_stats) as kernel:
        got = bs.block_rank_kl(q_idx, k_idx, q, k, block_size=block, rows=rows, init_blocks=init, local_blocks=local)
        grads = torch.autograd.grad(got, (q_idx, k_idx))
    assert kernel.call_count == 1 and got.dtype == torch.float32 and got.shape == ()
    x = [t.detach().double().requires_grad_() for t in (q_idx, k_idx)]
    want = naive.block_rank_kl(x[0].transpose(1, 2), x[1], q.double(), k.double(), block_size=block, rows=rows,
                               init_blocks=init, local_blocks=local)
    assert float(want.detach()) > 0
    want_grads = torch.autograd.grad(want, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert _rel(got.detach(), want.detach()) < tol
    for g, w, t in zip(grads, want_grads, (q_idx, k_idx)):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert _rel(g, w) < (1e-4 if dtype == torch.float32 else 2e-3)


class _HostReads(TorchDispatchMode):
    """The aten ops that read a value back to the host or make a data-dependent shape (a CUDA graph refuses both)."""

    BAD = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.BAD:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_rows_without_a_choice_give_zero_and_nothing_reads_the_host():
    """Rows that see no candidate block (the start of the sequence) count for nothing: loss 0, zero gradients, no
    NaN; an empty row set gives 0; forward and backward read nothing back to the host."""
    q_idx, k_idx, q, k = inputs(1, 2, 3, 40, 8, 8, torch.float32, grad=True)
    with _HostReads() as reads:
        loss = bs.block_rank_kl(q_idx, k_idx, q, k, block_size=16, rows=torch.tensor([0, 1, 2, 15, 31]))
        dq, dk = torch.autograd.grad(loss, (q_idx, k_idx))
    assert reads.seen == []
    assert float(loss.detach()) == 0.0 and not dq.any() and not dk.any()
    empty = bs.block_rank_kl(q_idx, k_idx, q, k, block_size=16, rows=torch.zeros(0, dtype=torch.long))
    assert float(empty) == 0.0


def test_the_lowered_op_runs_the_kernel_and_falls_back_on_cpu(monkeypatch):
    """msa_block_loss_triton: the kernel under the interpreter (as on CUDA), equal to msa_block_loss; on CPU tensors
    without the interpreter exactly the reference op."""
    q_idx, k_idx, q, k = inputs(1, 3, 2, 45, 8, 16, torch.float32)
    args = dict(block_size=8, scale=8**-0.5, topk=2, init_blocks=1, local_blocks=1, rows=7)
    want = ops.msa_block_loss(q, k, q_idx, k_idx, **args)
    with mock.patch.object(bs, "block_stats", wraps=bs.block_stats) as kernel:
        got = ops.msa_block_loss_triton(q, k, q_idx, k_idx, **args)
    assert kernel.call_count == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert ops.LOWERING[ops.msa_block_loss] is ops.msa_block_loss_triton
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with mock.patch.object(bs, "block_stats", wraps=bs.block_stats) as kernel:
        assert torch.equal(ops.msa_block_loss_triton(q, k, q_idx, k_idx, **args), want)
    assert kernel.call_count == 0


def test_bad_inputs_are_refused():
    q_idx, k_idx, q, k = inputs(1, 2, 3, 20, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        bs.block_stats(q_idx, k_idx, q, k, torch.tensor([3, 4], dtype=torch.int32), block_size=4)
    with pytest.raises(ValueError, match="disagree"):
        bs.block_stats(q_idx, k_idx[:, :10], q, k, torch.tensor([3]), block_size=4)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        bs.block_stats(q_idx.double(), k_idx.double(), q, k, torch.tensor([3]), block_size=4, backend="triton")


@pytest.mark.parametrize("G, T, block, topk, init, local", [(7, 117, 16, 4, 1, 1), (1, 61, 7, 3, 0, 2),
                                                              (3, 40, 16, 2, 0, 1)],
                         ids=["G7-T117-block16-init1", "G1-block7-local2", "G3-one-choice"])
def test_block_lse_and_the_oracle_match_the_reference(G, T, block, topk, init, local):
    """block_lse (the kernel with its index half compiled out) gives block_stats' blse; oracle_blocks built on it
    selects what causal_lse.naive.oracle_blocks selects (the same block mass, to fp32 rounding: the selections hold
    the same mass, and are the same sets of blocks but on near ties)."""
    from m3compile.kernels.causal_lse import naive as lse_ref, oracle_blocks

    q_idx, k_idx, q, k = inputs(1, 2, G, T, 8, 8, torch.float32)
    rows = torch.arange(T)
    blse = bs.block_lse(q, k, rows, block_size=block, backend="triton")
    want = naive.block_stats(q_idx.transpose(1, 2), k_idx, q, k, rows, block_size=block)[0]
    assert torch.equal(torch.isfinite(blse), torch.isfinite(want))
    torch.testing.assert_close(blse[torch.isfinite(blse)], want[torch.isfinite(want)], rtol=1e-5, atol=1e-5)
    kw = dict(block_size=block, topk=topk, init_blocks=init, local_blocks=local)
    got = oracle_blocks(q, k, backend="triton", **kw)
    ref = lse_ref.oracle_blocks(q, k, **kw)
    assert got.shape == ref.shape == (1, 2, T, topk) and got.dtype == torch.long
    same = (got.sort(-1).values == ref.sort(-1).values).all(-1)
    held = lse_ref.block_recall(q, k, got, block_size=block)  # the dense mass inside the kernel path's blocks
    torch.testing.assert_close(held, lse_ref.oracle_recall(q, k, **kw), rtol=1e-5, atol=1e-5)  # ties aside, equal
    assert same.float().mean() > 0.98
