"""Full-size correctness of the Triton kernels on a GPU (CI runs the small shapes under the interpreter).

    python benchmarks/check_kernels.py [--only indexer|sparse|backward|kl|fused|block_loss|oracle|varlen|decode|
                                               generate|cache]
                                       [--json OUT.json]

Each check prints one line: the shapes, the measured error against the torch reference (fp32 on upcast inputs)
and PASS/FAIL against the issue's tolerances (fp32 1e-5, bf16 2e-2 relative). Selections are compared as sets;
rows that differ must be near-ties of the reference scores. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from m3compile.kernels import block_stats as bst
from m3compile.kernels import decode as dk
from m3compile.kernels import indexer
from m3compile.kernels.block_stats.naive import block_rank_kl, block_stats
from m3compile.kernels.causal_lse.naive import causal_lse
from m3compile.kernels.indexer.naive import block_scores, select_blocks
from m3compile.kernels.naive_common import fp8_round
from m3compile.kernels.norm_rope.naive import index_norm_rope, rms_norm, rope
from m3compile.kernels.sparse_attention.naive import sparse_attention
from m3compile.kernels.sparse_kl.naive import index_kl
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels import sparse_kl
from m3compile.kernels import varlen_attention as va
from m3compile.bench.common import median_ms

results = []


def report(name: str, ok: bool, **figures):
    results.append(dict(check=name, ok=ok, **figures))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  " + "  ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def rel_err(out, want):
    """Relative error; the absolute one where the reference is exactly zero (e.g. dq, dk of a single token, whose
    softmax over one key has no gradient) rather than an infinite ratio."""
    if out.isnan().any():
        return float("nan")
    diff, norm = (out.float() - want.float()).norm().item(), want.float().norm().item()
    return diff / norm if norm > 0 else diff


def selection_agreement(got, want, scores, tol):
    """(share of rows with identical sets, worst score shortfall of a swapped block in the differing rows)."""
    g, w = got.long().sort(-1).values, want.long().sort(-1).values
    same = (g == w).all(-1)
    worst = 0.0
    for row in (~same).nonzero()[:2000]:
        a, b = set(g[tuple(row)].tolist()), set(w[tuple(row)].tolist())
        if -1 in a ^ b:
            return same.float().mean().item(), float("inf")
        s = scores[tuple(row)]
        worst = max(worst, max(s[j].item() for j in b - a) - min(s[j].item() for j in a - b))
    return same.float().mean().item(), worst


def check_indexer(T, H, Di, bs, k, dtype, fp8=False, block_scale=False):
    q_idx = torch.randn(1, T, H, Di, device="cuda", dtype=dtype)
    k_idx = torch.randn(1, T, Di, device="cuda", dtype=dtype)
    if fp8:  # fp8 x fp8 scoring: against quantise (keys per token or per key block, query rows per head),
        # dequantise, fp32 scores
        k8, scale = indexer.quantize_index_keys(k_idx, bs if block_scale else None)
        got = indexer.select_blocks(q_idx, k8, block_size=bs, topk=k, k_scale=scale)
        q_ref, k_ref = fp8_round(q_idx), indexer.dequantize_index_keys(k8, scale, bs)
    else:
        got = indexer.select_blocks(q_idx, k_idx, block_size=bs, topk=k)
        q_ref, k_ref = q_idx, k_idx
    want = select_blocks(q_ref.transpose(1, 2), k_ref, block_size=bs, topk=k)
    scores = block_scores(q_ref.transpose(1, 2), k_ref, bs)
    same, worst = selection_agreement(got, want, scores, 0)
    # score units (after 1/sqrt(Di)): bf16 rounding of the sums; fp8 wgmma accumulates with less than fp32 precision
    tol = 1e-4 if dtype == torch.float32 and not fp8 else 5e-2
    kind = (" fp8 block scale" if block_scale else " fp8") if fp8 else ""
    report(f"indexer T={T} Hi={H} Di={Di} bs={bs} topk={k} {str(dtype)[6:]}{kind}",
           worst <= tol, identical_rows=round(same, 5), worst_swap_gap=round(worst, 6))


def _selection(B, Hkv, T, bs, k):
    blocks = select_blocks(torch.randn(B, Hkv, T, 32, device="cuda"), torch.randn(B, T, 32, device="cuda"),
                           block_size=bs, topk=k)
    return blocks[..., torch.randperm(k, device="cuda")].int()


def check_sparse(B, Hq, Hkv, T, D, bs, k, dtype, ahead=False):
    """ahead: one slot of each token holds a block past its own (no key it may see), which must add nothing."""
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    blocks = _selection(B, Hkv, T, bs, k)
    if ahead:
        nb, own = -(-T // bs), torch.arange(T, device="cuda") // bs
        other = (blocks[..., 1:] >= 0).any(-1)  # rows that keep a visible block elsewhere (else no key: NaN)
        blocks[..., 0] = torch.where(other & (own + 2 < nb), own + 2, blocks[..., 0]).int()
    got = sa.sparse_attention(q, kk, v, blocks, block_size=bs)
    want = sparse_attention(q.float(), kk.float(), v.float(), blocks, block_size=bs)
    err = rel_err(got, want)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    report(f"sparse prefill B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} bs={bs} topk={k} {str(dtype)[6:]}"
           + (", a block past the token in slot 0" if ahead else ""), err < tol, rel_err=f"{err:.2e}")


def check_backward(B, Hq, Hkv, T, D, bs, k, dtype):
    """dq, dk, dv of the Triton backward against autograd through the torch reference (fp32 on upcast inputs)."""
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype, requires_grad=True)
    blocks = _selection(B, Hkv, T, bs, k)
    d_out = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    got = torch.autograd.grad(sa.sparse_attention(q, kk, v, blocks, block_size=bs), (q, kk, v), d_out)
    x32 = [t.detach().float().requires_grad_() for t in (q, kk, v)]
    want = torch.autograd.grad(sparse_attention(*x32, blocks, block_size=bs), x32, d_out.float())
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    report(f"sparse backward B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} bs={bs} topk={k} {str(dtype)[6:]}",
           max(errs) < tol, **{f"rel_err_d{n}": f"{e:.2e}" for n, e in zip("qkv", errs)})


def check_kl(B, Hq, Hkv, T, D, Di, bs, k, dtype):
    """Fused sparse KL and its index-branch gradients against the chunked torch reference."""
    q_idx = torch.randn(B, T, Hkv, Di, device="cuda", dtype=dtype, requires_grad=True)
    k_idx = torch.randn(B, T, Di, device="cuda", dtype=dtype, requires_grad=True)
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    blocks = _selection(B, Hkv, T, bs, k)
    w = torch.rand(B, Hkv, T, device="cuda")
    kl = sparse_kl.sparse_index_kl(q_idx, k_idx, q, kk, blocks, block_size=bs)
    got = torch.autograd.grad((kl * w).sum(), (q_idx, k_idx))
    x32 = [t.detach().float().requires_grad_() for t in (q_idx, k_idx)]
    want_kl = index_kl(x32[0].transpose(1, 2), x32[1], q.float(), kk.float(), blocks, block_size=bs,
                       sparse=True)[0]
    want = torch.autograd.grad((want_kl * w).sum(), x32)
    errs = [rel_err(kl, want_kl)] + [rel_err(g, w_) for g, w_ in zip(got, want)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    report(f"sparse KL B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} Di={Di} bs={bs} topk={k} {str(dtype)[6:]}",
           max(errs) < tol, **{f"rel_err_{n}": f"{e:.2e}" for n, e in zip(("kl", "dq_idx", "dk_idx"), errs)})


def check_kl_warmup(B, Hq, Hkv, T, D, Di, bs, k, dtype):
    """The lowered hook's dense-support (warm-up) KL, recall and index-branch gradients against the torch reference:
    the fused KL over every visible block with the teacher LSE from the fused causal log-sum-exp and recall from
    the KL kernel's per-block teacher mass (m3compile.ops)."""
    from m3compile.ops import LOWERING, msa_index_kl

    msa_index_kl_triton = LOWERING[msa_index_kl]

    q_idx = torch.randn(B, T, Hkv, Di, device="cuda", dtype=dtype, requires_grad=True)
    k_idx = torch.randn(B, T, Di, device="cuda", dtype=dtype, requires_grad=True)
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    blocks = _selection(B, Hkv, T, bs, k)
    kl, recall = msa_index_kl_triton(q, kk, q_idx, k_idx, blocks, bs, D**-0.5, False)
    got = torch.autograd.grad(kl, (q_idx, k_idx))
    x32 = [t.detach().float().requires_grad_() for t in (q_idx, k_idx)]
    want_kl, want_recall = index_kl(x32[0].transpose(1, 2), x32[1], q.float(), kk.float(), blocks, block_size=bs,
                                    sparse=False)
    want = torch.autograd.grad(want_kl.mean(), x32)
    errs = [rel_err(kl, want_kl.mean()), rel_err(recall, want_recall.mean())] + [rel_err(g, w_) for g, w_ in zip(got, want)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    report(f"warm-up KL B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} Di={Di} bs={bs} topk={k} {str(dtype)[6:]}",
           max(errs) < tol, **{f"rel_err_{n}": f"{e:.2e}" for n, e in zip(("kl", "recall", "dq_idx", "dk_idx"), errs)})


def check_csr(B, Hkv, T, bs, k, chunk):
    """The CSR from the Triton kernels equals the torch build, tensor for tensor."""
    blocks = _selection(B, Hkv, T, bs, k).int()
    nb = -(-T // bs)
    got, want = sa._build_csr_triton(blocks, nb, 0, T, chunk), sa._build_csr_torch(blocks, nb, 0, T, chunk)
    same = [torch.equal(a, b) for a, b in zip(got, want)]
    report(f"CSR kernels B={B} Hkv={Hkv} T={T} bs={bs} topk={k} chunk={chunk}", all(same), identical=same)


def check_causal_lse(B, Hq, Hkv, T, D, dtype):
    """Fused causal log-sum-exp (the warm-up teacher's normaliser) on every row and dense recall on sampled rows."""
    from m3compile.kernels import causal_lse as cl
    from m3compile.ops import recall_rows

    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    want = causal_lse(q.float(), kk.float())
    err = (cl.causal_lse(q, kk) - want).abs().max().item()
    rows = recall_rows(T, q.device)
    sel = want - torch.rand_like(want)
    got = cl.dense_recall(q, kk, sel, rows=rows)
    manual = torch.exp2(sel[:, rows] - want[:, rows]).unflatten(2, (Hkv, Hq // Hkv)).mean(-1)
    r_err = (got - manual).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # base-2 log-sum-exp, absolute
    report(f"causal LSE + recall, B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} {str(dtype)[6:]}", err < tol and r_err < tol,
           max_abs_err_lse=f"{err:.2e}", max_abs_err_recall=f"{r_err:.2e}")


def check_oracle(B, Hq, Hkv, T, D, bs, k, dtype):
    """The oracle selection from block_lse (the block-stats kernel without its index half) against the torch
    oracle: the same blocks but on near ties of the block mass, and the same recalled mass."""
    from m3compile.kernels.causal_lse import naive as lse_ref, oracle_blocks

    q = (2 * torch.randn(B, Hq, T, D, device="cuda")).to(dtype)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    got = oracle_blocks(q, kk, block_size=bs, topk=k, init_blocks=1)
    want = lse_ref.oracle_blocks(q, kk, block_size=bs, topk=k, init_blocks=1)
    same = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()
    gap = (lse_ref.block_recall(q, kk, got, block_size=bs)
           - lse_ref.oracle_recall(q, kk, block_size=bs, topk=k, init_blocks=1)).abs().max().item()
    report(f"oracle blocks, B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} block {bs} top-{k} {str(dtype)[6:]}",
           same > 0.99 and gap < 1e-4, same_sets=f"{same:.5f}", max_recall_gap=f"{gap:.1e}")


def check_norm_rope(B, T, H, D, R, dtype):
    """Fused RoPE (expected bit-identical to the reference's bf16 ops), index norm + RoPE with its gradients, and
    the RMSNorm forward, against the references (fp32 on upcast inputs for the last two)."""
    from m3compile.kernels import norm_rope as nr

    pos = torch.arange(T, device="cuda")[None, :, None].float()
    cos, sin = (pos * torch.rand(R, device="cuda")).cos(), (pos * torch.rand(R, device="cuda")).sin()
    x = torch.randn(B, T, H, D, device="cuda", dtype=dtype, requires_grad=True)
    got, want = nr.rope(x, cos, sin), rope(x, cos, sin)
    g = torch.randn_like(got)
    dx_got, dx_want = torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0]
    rope_err = max(rel_err(got, want), rel_err(dx_got, dx_want))
    identical = torch.equal(got, want) and torch.equal(dx_got, dx_want)
    y = torch.randn(B, T, (H + 1) * D, device="cuda", dtype=dtype, requires_grad=True)
    wq = (0.1 * torch.randn(D, device="cuda")).requires_grad_()
    wk = (0.1 * torch.randn(D, device="cuda")).requires_grad_()
    out = nr.index_norm_rope(y, wq, wk, cos, sin, eps=1e-6)
    y32 = y.detach().float().requires_grad_()
    w32 = [t.detach().clone().requires_grad_() for t in (wq, wk)]
    out32 = index_norm_rope(y32, *w32, cos, sin, eps=1e-6)
    gq, gk = torch.randn_like(out32[0]), torch.randn_like(out32[1])
    grads = torch.autograd.grad(out, (y, wq, wk), (gq.to(dtype), gk.to(dtype)))
    grads32 = torch.autograd.grad(out32, (y32, *w32), (gq, gk))
    idx_err = max([rel_err(a, b) for a, b in zip(out, out32)] + [rel_err(a, b) for a, b in zip(grads, grads32)])
    hidden = torch.randn(B, T, 576, device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(576, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm_err = rel_err(nr.rms_norm(hidden, w, eps=1e-5), rms_norm(hidden.float(), w.float(), 1e-5))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    report(f"RoPE / index norm+RoPE / RMSNorm B={B} T={T} H={H} D={D} R={R} {str(dtype)[6:]}",
           max(rope_err, idx_err, norm_err) < tol, rope_bit_identical=identical, rel_err_rope=f"{rope_err:.2e}",
           rel_err_index_branch=f"{idx_err:.2e}", rel_err_rms_norm=f"{norm_err:.2e}")


def _cuda_ms(fn, steps=5):
    """Median CUDA-event milliseconds of fn() after one untimed call."""
    return median_ms(fn, steps=steps, warmup=1, device="cuda")[0]


def check_block_loss(B, Hq, Hkv, T, D, Di, bs, k, dtype, n_rows=1024):
    """The block-stats kernel (per-block teacher log-sum-exp, student block max and its key, on the sampled rows of
    ops.block_loss_rows) against reference.block_stats on fp32-upcast inputs, then the block-ranking loss built on it
    and its index-branch gradients against reference.block_rank_kl; and the time of each (loss forward + backward).
    blse / scores errors are absolute (logit units) over the visible blocks; -inf must match exactly; arg_gap is the
    worst shortfall of the score at the kernel's key below the reference's block max."""
    from m3compile.ops import block_loss_rows

    q_idx = torch.randn(B, T, Hkv, Di, device="cuda", dtype=dtype, requires_grad=True)
    k_idx = torch.randn(B, T, Di, device="cuda", dtype=dtype, requires_grad=True)
    q = 2 * torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    kk = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
    rows = block_loss_rows(T, bs, k, n_rows, q.device)
    with torch.no_grad():
        blse, scores, arg = bst.block_stats(q_idx, k_idx, q, kk, rows, block_size=bs)
        w_blse, w_scores, w_arg = block_stats(q_idx.float().transpose(1, 2), k_idx.float(), q.float(), kk.float(),
                                              rows, block_size=bs)
    same_inf = all(torch.equal(torch.isinf(a), torch.isinf(b)) for a, b in ((blse, w_blse), (scores, w_scores)))
    fin = torch.isfinite(w_scores)
    err_lse = (blse - w_blse)[torch.isfinite(w_blse)].abs().max().item()
    err_s = (scores - w_scores)[fin].abs().max().item()
    i_b = torch.arange(B, device="cuda")[:, None, None, None]
    at = torch.einsum("bhrd,bhrnd->bhrn", q_idx.detach().float()[:, rows].transpose(1, 2),
                      k_idx.detach().float()[i_b, arg.long()]) * Di**-0.5
    gap = (w_scores - at)[fin].max().item()
    same_arg = (arg.long() == w_arg)[fin].float().mean().item()
    del at, w_blse, w_scores, w_arg

    def lowered():
        return bst.block_rank_kl(q_idx, k_idx, q, kk, block_size=bs, rows=rows)

    x32 = [t.detach().float().requires_grad_() for t in (q_idx, k_idx)]

    def reference():
        return block_rank_kl(x32[0].transpose(1, 2), x32[1], q.float(), kk.float(), block_size=bs, rows=rows)

    loss = lowered()
    got = torch.autograd.grad(loss, (q_idx, k_idx))
    want_loss = reference()
    want = torch.autograd.grad(want_loss, x32)
    errs = [rel_err(loss, want_loss)] + [rel_err(g, w) for g, w in zip(got, want)]
    ms = _cuda_ms(lambda: torch.autograd.grad(lowered(), (q_idx, k_idx)))
    ms_ref = _cuda_ms(lambda: torch.autograd.grad(reference(), x32), steps=3)
    tol_abs = 1e-4 if dtype == torch.float32 else 2e-3  # logits: both accumulate the same products in fp32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    report(f"block loss B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} Di={Di} bs={bs} topk={k} rows={rows.numel()} "
           f"{str(dtype)[6:]}", same_inf and err_lse < tol_abs and err_s < tol_abs and gap < tol_abs and max(errs) < tol,
           same_inf=same_inf, max_abs_err_blse=f"{err_lse:.2e}", max_abs_err_scores=f"{err_s:.2e}",
           arg_gap=f"{gap:.2e}", identical_arg=round(same_arg, 5),
           **{f"rel_err_{n}": f"{e:.2e}" for n, e in zip(("loss", "dq_idx", "dk_idx"), errs)},
           ms_fwd_bwd=round(ms, 3), ms_reference=round(ms_ref, 2))


def check_lowered_distill(T, mode, block_loss=False):
    """The lowered distillation graph (fused index branch, norms, RoPE, KL with the attention's CSR, with
    `block_loss` the block-stats kernel's loss) against the reference graph on SmolLM2's shapes (4 layers, random
    weights, fp32): per-layer KL, recall, index gradients (of KL + block loss)."""
    import copy

    import m3compile
    from m3compile.io.load import from_preset
    from m3compile.pipelines import run_pipeline
    from m3compile.train.distill import index_parameters

    with torch.device("cuda"):
        base, _ = m3compile.convert(from_preset("smollm2-135m", n_layers=4),
                                    m3compile.MSAConfig(block_size=64, topk=8, dense_layers=(0,)))
    for name, p in base.named_parameters():
        p.requires_grad_(".index_" in name)
    ids = torch.randint(0, 49152, (1, T), device="cuda")
    out = []
    for lowered in (False, True):
        gm = copy.deepcopy(base)
        run_pipeline("distill", gm, mode=mode, lowered=lowered, block_loss=block_loss)
        params = index_parameters(gm)
        _, kl, recall, *block = gm(ids)
        total = kl.sum() + (block[0].sum() if block else 0.0)
        out.append((kl.detach(), recall.detach(), [b.detach() for b in block],
                    torch.autograd.grad(total, list(params.values()))))
    (kl0, r0, b0, g0), (kl1, r1, b1, g1) = out
    errs = [rel_err(kl1, kl0), rel_err(r1, r0), max(rel_err(a, b) for a, b in zip(g1, g0))]
    names = ["kl", "recall", "index_grads"]
    if block_loss:
        errs.append(rel_err(b1[0], b0[0]))
        names.append("block_loss")
    report(f"lowered distillation graph vs reference, smollm2 shapes 4 layers T={T} {mode}"
           f"{' + block loss' if block_loss else ''} fp32", max(errs) < 1e-3,
           **{f"rel_err_{n}": f"{e:.2e}" for n, e in zip(names, errs)})


def check_distill_autocast():
    """`m3c distill` as users run it on a GPU: an fp32 backbone under bf16 autocast through the lowered kernels (the
    fused residual add + norm then meets an fp32 residual and a bf16 branch output). Its first step's KL against
    the same step with autocast off (fp32 throughout), and every step finite."""
    import math
    import tempfile

    import m3compile

    src = Path(__file__).resolve().parents[1] / "checkpoints" / "byte-llama"
    tmp = Path(tempfile.mkdtemp())
    m3compile.convert_checkpoint(src, tmp / "msa", m3compile.MSAConfig(block_size=64, topk=4, dense_layers=(0,)))
    data = tmp / "code.bin"
    data.write_bytes(Path(os.__file__).read_bytes()[:200_000])
    kl = {}
    for autocast in ("auto", "none"):
        report_ = m3compile.distill(tmp / "msa", data, tmp / f"d-{autocast}",
                                    m3compile.DistillConfig(steps=2, seq_len=2048, autocast=autocast, holdout_tokens=0),
                                    device="cuda")
        kl[autocast] = [h["kl"] for h in report_.history]
    finite = all(math.isfinite(x) for xs in kl.values() for x in xs)
    err = abs(kl["auto"][0] - kl["none"][0]) / max(abs(kl["none"][0]), 1e-12)
    report("distillation byte-llama (block 64, top-4), 2 steps of 2,048: bf16 autocast vs fp32, first step's KL",
           finite and err < 2e-2, kl_autocast=[f"{x:.4f}" for x in kl["auto"]], kl_fp32=[f"{x:.4f}" for x in kl["none"]],
           rel_err=f"{err:.2e}")


def check_varlen(steps, grid, window, H, D, dtype):
    cu = va.window_segments([[t, grid, grid] for t in steps], window, device="cuda")
    N = int(cu[-1])
    q, kk, v = (torch.randn(N, H, D, device="cuda", dtype=dtype) for _ in range(3))
    err = rel_err(va.varlen_attention(q, kk, v, cu), va.varlen_attention_reference(q.float(), kk.float(), v.float(), cu))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    report(f"varlen steps={steps} grid={grid} window={window} H={H} D={D} {str(dtype)[6:]}", err < tol,
           rel_err=f"{err:.2e}")


def check_decode(lens, Hq, Hkv, D, Di, bs, k, dtype, fp8=False):
    B = len(lens)
    per_seq = max(-(-L // bs) for L in lens)
    P = B * per_seq + 5
    table = torch.randperm(P, device="cuda")[: B * per_seq].view(B, per_seq).int()
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    k_cache = torch.randn(P, bs, Hkv, D, device="cuda", dtype=dtype)
    v_cache = torch.randn(P, bs, Hkv, D, device="cuda", dtype=dtype)
    idx_cache = torch.randn(P, bs, Di, device="cuda", dtype=dtype)
    scale = None
    if fp8:
        idx_cache, scale = indexer.quantize_index_keys(idx_cache)
    q_idx, q = torch.randn(B, Hkv, Di, device="cuda", dtype=dtype), torch.randn(B, Hq, D, device="cuda", dtype=dtype)
    got = dk.paged_select(q_idx, idx_cache, table, seq_lens, topk=k, init_blocks=1, idx_scale=scale)
    want = dk.paged_select_reference(q_idx, idx_cache, table, seq_lens, topk=k, init_blocks=1, idx_scale=scale)
    scores = dk.paged_block_scores_reference(q_idx, idx_cache, table, seq_lens, scale)
    same, worst = selection_agreement(got, want, scores, 0)
    out = dk.paged_attention(q, k_cache, v_cache, want, table, seq_lens)
    err = rel_err(out, dk.paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), want, table, seq_lens))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    name = f"decode lens={lens} Hq={Hq} Hkv={Hkv} D={D} topk={k} {str(dtype)[6:]}{' fp8-index' if fp8 else ''}"
    gap_tol = 1e-4 if dtype == torch.float32 else 5e-2
    report(name, err < tol and worst <= gap_tol, identical_rows=round(same, 4), worst_swap_gap=round(worst, 6),
           rel_err=f"{err:.2e}")


def check_prompt_chunk(Hq, Hkv, T, t0, D, Di, bs, k, dtype):
    """A prefill chunk over its cached prefix: the last T - t0 queries against all T keys (selection with fp8 keys
    of one scale per block, sparse attention) equal those rows of the whole prompt's."""
    q_idx = torch.randn(1, T, Hkv, Di, device="cuda", dtype=dtype)
    k8, k_scale = indexer.quantize_index_keys(torch.randn(1, T, Di, device="cuda", dtype=dtype), bs)
    whole = indexer.select_blocks(q_idx, k8, block_size=bs, topk=k, k_scale=k_scale)
    got = indexer.select_blocks(q_idx[:, t0:].contiguous(), k8, block_size=bs, topk=k, k_scale=k_scale)
    same = (got.sort(-1).values == whole[:, :, t0:].sort(-1).values).all(-1).float().mean().item()
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
    kk, v = torch.randn(1, Hkv, T, D, device="cuda", dtype=dtype), torch.randn(1, Hkv, T, D, device="cuda", dtype=dtype)
    out = sa.sparse_attention(q[:, :, t0:], kk, v, whole[:, :, t0:], block_size=bs)
    want = sparse_attention(q.float(), kk.float(), v.float(), whole, block_size=bs)[:, :, t0:]
    err = rel_err(out, want)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    report(f"prompt chunk T={T} from {t0} Hq={Hq} Hkv={Hkv} D={D} Di={Di} bs={bs} topk={k} {str(dtype)[6:]}",
           same == 1.0 and err < tol, identical_rows=round(same, 4), rel_err=f"{err:.2e}")


def check_decode_fp8_kv(lens, Hq, Hkv, D, bs, k, dtype, cache=torch.float8_e4m3fn):
    """An fp8 (or int8) K/V cache (one scale per token and head): paged_kv_write's bytes against the reference's,
    and the attention over the quantised pages against the reference over the dequantised cache."""
    B = len(lens)
    per_seq = max(-(-L // bs) for L in lens)
    P = B * per_seq + 5
    table = torch.randperm(P, device="cuda")[: B * per_seq].view(B, per_seq).int()
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    k_bf, v_bf = (torch.randn(P, bs, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    caches = [[torch.zeros(P, bs, Hkv, D, device="cuda", dtype=cache) for _ in range(2)]
              + [torch.ones(P, bs, Hkv, device="cuda") for _ in range(2)] for _ in range(2)]
    page = torch.arange(P, device="cuda").repeat_interleave(bs)
    off = torch.arange(bs, device="cuda").repeat(P)
    kr, vr = k_bf.flatten(0, 1), v_bf.flatten(0, 1)
    rot = None
    if cache == torch.int8:  # int8 rows are stored rotated (runtime.key_shift.rotation): the kernel undoes it
        from m3compile.runtime.key_shift import rotation
        rot = rotation(D).cuda()
        kr, vr = (kr.float() @ rot).to(dtype), (vr.float() @ rot).to(dtype)
    dk.paged_kv_write(caches[0][0], caches[0][1], kr, vr, page, off, k_scale=caches[0][2], v_scale=caches[0][3])
    dk.paged_kv_write_reference(caches[1][0], caches[1][1], kr, vr, page, off, caches[1][2], caches[1][3])
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == cache else torch.equal(a, b)
               for a, b in zip(*caches))
    extra = {}
    hadamard = rot is not None and D & (D - 1) == 0
    if rot is not None:  # the write that shifts and rotates in its kernel (the Hadamard made in registers), as
        # PagedCache writes: the codes equal the reference's but where fp32 sums in another order cross a boundary
        shift = torch.randn(Hkv, D, device="cuda")
        fused = [[torch.zeros_like(t) for t in caches[0]] for _ in range(2)]
        kw = dict(k_shift=shift, rotation=rot)
        dk.paged_kv_write(*fused[0][:2], k_bf.flatten(0, 1), v_bf.flatten(0, 1), page, off, k_scale=fused[0][2],
                          v_scale=fused[0][3], hadamard=hadamard, **kw)
        dk.paged_kv_write_reference(*fused[1][:2], k_bf.flatten(0, 1), v_bf.flatten(0, 1), page, off, fused[1][2],
                                    fused[1][3], **kw)
        diff = torch.stack([(a.float() - b.float()).abs() for a, b in zip(fused[0][:2], fused[1][:2])])
        extra = dict(fused_write_codes_off=f"{(diff > 0).float().mean().item():.1e}",
                     fused_write_max_step=int(diff.max().item()), hadamard=hadamard)
        same = same and diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.02
    k8, v8, ks, vs = caches[0]
    blocks = dk.paged_select_reference(torch.randn(B, Hkv, 64, device="cuda"), torch.randn(P, bs, 64, device="cuda"),
                                       table, seq_lens, topk=k)
    q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
    out = dk.paged_attention(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, rotation=rot,
                             hadamard=hadamard)
    want = dk.paged_attention_reference(q.float(), k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs,
                                        rotation=rot)
    err = rel_err(out, want)
    exact = rel_err(want, dk.paged_attention_reference(q.float(), k_bf.float(), v_bf.float(), blocks, table, seq_lens))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    name = "fp8" if cache == torch.float8_e4m3fn else "int8"
    report(f"decode {name} KV lens={lens} Hq={Hq} Hkv={Hkv} D={D} topk={k} {str(dtype)[6:]}", same and err < tol,
           write_bytes_equal=same, rel_err=f"{err:.2e}", vs_unquantised=f"{exact:.2e}", **extra)


def check_generate_long():
    """An fp8 KV cache and chunked prefill end to end on the GPU: the Triton path against the torch references
    (m3-tiny with fp8 index scoring, a 300-token prompt in chunks of 77, 20 steps), and the chunked prefill's
    logits against one pass."""
    import tempfile

    import m3compile

    out = Path(tempfile.mkdtemp()) / "msa"
    cfg = m3compile.MSAConfig(block_size=16, topk=2, dense_layers=(0,), index_dtype="fp8")
    m3compile.convert_checkpoint(None, out, cfg, preset="m3-tiny", dtype="float32")
    model = m3compile.load(out, device="cuda", dtype="float32")
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    kw = dict(kv_cache_dtype="fp8", prefill_chunk=77)
    fast = m3compile.generate(model, [prompt], 20, **kw)
    slow = m3compile.generate(model, [prompt], 20, kernels=False, **kw)
    whole = m3compile.generate(model, [prompt], 1, kv_cache_dtype="fp8")
    same = fast.tokens == slow.tokens
    err = (fast.step_logits - slow.step_logits).abs().max().item()
    err_chunk = (fast.prefill_logits[0] - whole.prefill_logits[0]).abs().max().item()
    report("generate m3-tiny fp8 KV + fp8 index, prompt 300 in chunks of 77, Triton vs torch and vs one pass",
           same and err < 1e-3 and err_chunk < 1e-3, tokens_equal=same, max_logit_diff=f"{err:.2e}",
           chunked_vs_whole=f"{err_chunk:.2e}")


def check_generate():
    import tempfile

    import m3compile

    src = Path(__file__).resolve().parents[1] / "checkpoints" / "byte-llama"
    out = Path(tempfile.mkdtemp()) / "msa"
    m3compile.convert_checkpoint(src, out, m3compile.MSAConfig(block_size=64, topk=4, dense_layers=(0,)))
    model = m3compile.load(out, device="cuda", dtype="float32")
    data = torch.frombuffer(bytearray(Path(os.__file__).read_bytes()[:4096]), dtype=torch.uint8).long()  # code
    prompts = [data[:1000].tolist(), data[1000:1700].tolist(), data[2000:2300].tolist()]
    fast = m3compile.generate(model, prompts, 16)
    slow = m3compile.generate(model, prompts, 16, kernels=False)
    same = fast.tokens == slow.tokens
    err = (fast.step_logits - slow.step_logits).abs().max().item()
    report("generate byte-llama (block 64, top-4) fp32, Triton vs torch reference", same and err < 1e-3,
           tokens_equal=same, max_logit_diff=f"{err:.2e}")


def check_generate_fp8():
    """fp8 index scoring end to end on the GPU: the Triton decode (paged_index_write requantising each page as it
    fills, fp8 paged scores) against the torch references, and against the model's forward of the grown sequence."""
    import tempfile

    import m3compile

    out = Path(tempfile.mkdtemp()) / "msa"
    cfg = m3compile.MSAConfig(block_size=8, topk=2, dense_layers=(0, 1), index_dtype="fp8")
    m3compile.convert_checkpoint(None, out, cfg, preset="m3-tiny", dtype="float32")
    model = m3compile.load(out, device="cuda", dtype="float32")
    prompt = torch.randint(0, 256, (22,), generator=torch.Generator().manual_seed(1)).tolist()
    fast = m3compile.generate(model, [prompt], 26)
    slow = m3compile.generate(model, [prompt], 26, kernels=False)
    with torch.no_grad():
        want = model(torch.tensor([prompt + fast.tokens[0][:-1]], device="cuda"))[0, len(prompt):].float().cpu()
    same = fast.tokens == slow.tokens
    err = (fast.step_logits - slow.step_logits).abs().max().item()
    err_fwd = (fast.step_logits[:, 0].cpu() - want).abs().max().item()
    report("generate m3-tiny fp8 index scoring (block 8, top-2, 26 steps over 4 page fills) fp32, Triton vs torch "
           "and vs the forward", same and err < 1e-3 and err_fwd < 1e-3, tokens_equal=same,
           max_logit_diff=f"{err:.2e}", vs_forward=f"{err_fwd:.2e}")


def check_kernel_cache():
    """Kernels compiled ahead are loaded, not compiled: byte-llama converted, its kernel cache built (m3c compile),
    the model folder then moved (the cache's file groups must follow it), and m3c generate run in a fresh process
    with an empty Triton cache on a prompt length the build never ran: --timings must say the cache was used and
    name no kernel compiled anew."""
    import shutil
    import subprocess
    import tempfile

    import m3compile
    from m3compile.runtime.compile_ahead import build

    root = Path(tempfile.mkdtemp())
    src = Path(__file__).resolve().parents[1] / "checkpoints" / "byte-llama"
    m3compile.convert_checkpoint(src, root / "msa", m3compile.MSAConfig(block_size=64, topk=4, dense_layers=(0,)))
    built = build(root / "msa")
    shutil.move(root / "msa", root / "moved")
    env = dict(os.environ, TRITON_CACHE_DIR=str(root / "empty-triton-cache"))
    prompt = Path(os.__file__).read_text()[:777]
    done = subprocess.run([sys.executable, "-m", "m3compile.entry", "generate", str(root / "moved"), "--prompt", prompt,
                           "--max-new-tokens", "24", "--timings", "--device", "cuda"], capture_output=True, text=True,
                          env=env, cwd=root)
    try:
        timings = json.loads(done.stderr.strip().splitlines()[-1])
    except (ValueError, IndexError):
        timings = {}
    anew = timings.get("compiled_anew")
    report(f"kernel cache ({built.kernels} kernels, {built.variants} variants, {built.seconds:.1f} s), model folder "
           f"moved, a 777-byte prompt in a fresh process", done.returncode == 0 and timings.get("kernel_cache") ==
           "used" and anew == [], kernel_cache=timings.get("kernel_cache"), compiled_anew=anew,
           compile_s=timings.get("compile"), error=None if done.returncode == 0 else done.stderr.strip()[-300:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", choices=["indexer", "sparse", "backward", "kl", "fused", "block_loss", "oracle", "varlen",
                                       "decode", "generate", "cache"],
                    help="run one family of checks")
    args = ap.parse_args()
    run = lambda family: args.only in (None, family)  # noqa: E731
    torch.manual_seed(0)
    bf16, fp32 = torch.bfloat16, torch.float32
    if run("indexer"):
        check_indexer(8192, 4, 128, 128, 16, bf16)
        check_indexer(8000, 4, 128, 128, 16, bf16)
        check_indexer(8000, 4, 128, 128, 16, bf16, fp8=True)
        check_indexer(8000, 8, 128, 128, 16, bf16, fp8=True)  # Llama-3-8B: 8 index heads
        check_indexer(3000, 3, 48, 64, 8, fp32, fp8=True)  # 3 heads, Di 48 (padded to 64), fp32 queries
        check_indexer(1, 4, 128, 128, 16, bf16, fp8=True)
        check_indexer(8000, 8, 64, 128, 16, bf16, fp8=True, block_scale=True)  # the graph's prefill, index dim 64
        check_indexer(3000, 3, 48, 64, 8, fp32, fp8=True, block_scale=True)
        check_indexer(1, 4, 128, 128, 16, bf16, fp8=True, block_scale=True)
        check_indexer(3000, 3, 96, 64, 32, fp32)
        check_indexer(1, 4, 128, 128, 16, bf16)
    if run("sparse"):
        check_sparse(1, 64, 4, 8192, 128, 128, 16, bf16)
        check_sparse(1, 64, 4, 8000, 128, 128, 16, bf16)
        check_sparse(2, 16, 4, 2100, 128, 128, 16, fp32)
        for G in (1, 3, 4, 8, 16):
            check_sparse(1, 2 * G, 2, 1500, 64, 64, 4 if G % 2 else 32, fp32)
        check_sparse(1, 8, 2, 1, 128, 128, 16, bf16)
        check_sparse(1, 32, 8, 4000, 128, 128, 16, bf16, ahead=True)
        check_prompt_chunk(32, 8, 20000, 12345, 128, 64, 128, 16, bf16)  # Llama-3-8B shapes, a chunk mid-block
        check_prompt_chunk(14, 2, 3000, 2999, 64, 48, 64, 4, fp32)  # G 7, one query
    if run("backward"):
        check_backward(1, 64, 4, 8192, 128, 128, 16, bf16)
        check_backward(1, 64, 4, 8000, 128, 128, 16, bf16)
        for G in (1, 3, 4, 16):
            check_backward(1, 2 * G, 2, 1500, 64, 64, 4 if G % 2 else 32, fp32)
        check_backward(1, 8, 2, 1, 128, 128, 16, bf16)
    if run("kl"):
        check_kl(1, 64, 4, 8192, 128, 128, 128, 16, bf16)
        check_kl(1, 64, 4, 8000, 128, 128, 128, 16, bf16)
        for G in (1, 3, 16):
            check_kl(1, 2 * G, 2, 1500, 64, 48, 64, 4 if G % 2 else 32, fp32)
        check_kl(1, 8, 2, 1, 128, 128, 128, 16, bf16)
        check_kl_warmup(2, 9, 3, 8192, 64, 64, 64, 8, bf16)
        check_kl_warmup(1, 8, 2, 3000, 48, 48, 64, 8, fp32)
        check_kl_warmup(1, 8, 2, 1, 64, 64, 64, 8, bf16)
    if run("fused"):  # the kernels that cut the distillation step's host dispatches
        check_csr(2, 3, 8192, 64, 8, 256)
        check_csr(1, 4, 8000, 128, 16, 64)
        check_causal_lse(2, 9, 3, 8192, 64, bf16)
        check_causal_lse(1, 6, 2, 3001, 48, fp32)
        check_norm_rope(2, 8192, 9, 64, 64, bf16)
        check_norm_rope(1, 1000, 4, 128, 64, fp32)
        for mode in ("sparse", "warmup"):
            check_lowered_distill(2048, mode)
        check_distill_autocast()
    if run("oracle"):  # the oracle selection of m3c eval and of the runtime's prefill: Qwen2.5-Coder's group 7 first
        check_oracle(1, 14, 2, 32768, 64, 128, 16, bf16)
        check_oracle(1, 14, 2, 5000, 64, 128, 16, bf16)
        check_oracle(2, 9, 3, 3001, 48, 64, 8, fp32)
    if run("block_loss"):  # the block-ranking loss's kernel, at SmolLM2's distillation shapes first
        check_block_loss(2, 9, 3, 8192, 64, 64, 64, 8, bf16)
        check_block_loss(1, 8, 2, 3001, 48, 40, 64, 8, fp32, n_rows=700)  # G 4, D and Di not powers of two
        check_block_loss(1, 6, 6, 2000, 64, 64, 48, 4, fp32, n_rows=1)  # G 1, block 48, one row
        check_block_loss(1, 64, 4, 8192, 128, 128, 128, 16, bf16)  # M3: G 16
        check_lowered_distill(2048, "sparse", block_loss=True)
    if run("varlen"):
        check_varlen([8, 13, 21], 32, 4, 16, 80, bf16)
        check_varlen([1, 3, 5, 2], 9, 4, 16, 80, fp32)
        check_varlen([2, 1], 7, 4, 3, 72, fp32)
        check_varlen([4], 16, 4, 16, 64, bf16)
    if run("decode"):
        lens = [32768, 100, 20000, 1, 4097, 128, 129, 30000]
        check_decode(lens, 64, 4, 128, 128, 128, 16, bf16)
        check_decode(lens, 64, 4, 128, 128, 128, 16, bf16, fp8=True)
        check_decode([5000, 77, 1], 24, 8, 128, 96, 128, 32, fp32)
        check_decode([3000, 2000], 48, 3, 128, 128, 128, 1, fp32)
        check_decode_fp8_kv(lens, 32, 8, 128, 128, 16, bf16)  # Llama-3-8B shapes
        check_decode_fp8_kv([5000, 77, 1], 56, 8, 128, 128, 16, bf16)  # G 7
        check_decode_fp8_kv([300, 1], 8, 8, 64, 64, 4, fp32)  # G 1
        check_decode_fp8_kv([32768, 100, 1, 4097], 14, 2, 64, 128, 16, bf16, torch.int8)  # int8, Qwen2.5-0.5B (G 7)
        check_decode_fp8_kv([32768, 100, 1, 4097], 32, 8, 128, 128, 16, bf16, torch.int8)  # int8, Llama-3-8B (G 4)
    if run("generate"):
        check_generate_fp8()
        check_generate()
        check_generate_long()
    if run("cache"):
        check_kernel_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
