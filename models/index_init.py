"""Initialising the index branch from the dense weights, so that selection is useful before any training.

Target: for KV group g, the group-mean dense logit  mean_h q_h . k_g  (the teacher's logits, docs/msa.md section 4).
Constraint: one shared index key head, and the index branch uses the main branch's own RoPE.

RoPE rotates each channel pair (p, p + R/2) as one complex number, so any map from dense to index channels that
commutes with RoPE must act on each pair by a complex scalar. Per pair p, with complex weight rows
alpha_g (group-mean query, q_norm scale folded in) and beta_g (group g's key), the dense bilinear form of group g is
alpha_g beta_g^H. We approximate every group's form by mu_g nu^H with one shared key row nu:

    nu   = top eigenvector of  sum_g |alpha_g|^2 beta_g beta_g^H      (Hermitian, rank <= Hkv: solved in the span)
    mu_g = alpha_g (beta_g^H nu)                                         (the optimal query row for that nu)

which minimises sum_g || alpha_g beta_g^H - mu_g nu^H ||_F. With one KV head this is exact. Channels RoPE does not
rotate (partial RoPE) get the same treatment with real numbers, one channel at a time; when the index head has fewer
such channels than the dense head, the channels with the largest sum_g |alpha_g|^2 |beta_g|^2 are kept. Biases are
dropped (M3's index projections have none) and the index norms start as identity (Gemma-style weight 0).
`m3c eval` reports the block recall this reaches.

Calibrated: the weight-space fit above treats every direction of the hidden state alike, but real hidden states are
far from isotropic (a few directions carry most of their energy), and the fit spends its one shared key on
directions the data never visits. Given the second moment C = E[x x^T] of the layer's attention input on calibration
tokens, the error that matters is the expected one over the data, E |x_i^T (A_g - M_g) x_j|^2 for independent
tokens i, j, which is || C^1/2 (A_g - M_g) C^1/2 ||_F^2: the same problem in whitened coordinates. So the rows are
mapped by C^1/2, fitted as above, and mapped back by C^-1/2 (C regularised by 1e-3 of its mean diagonal). On
SmolLM2-135M at 4K tokens this lifts layer 3's block recall from 0.53 to 0.80 (oracle 0.83), as much as 100 steps of
KL fitting on the same data; 256 calibration tokens already give it (m3compile/conversion/calibration.py collects C).

An index dim below the rotary width R (a cheaper indexer: its cost is linear in Di): M3's rule would give the
index head the main table cut to its width (rule "m3", kernels/norm_rope/index_rope.py), whose channel pairs (p, p + Di/2) mix two
frequencies, so no per-pair map commutes with it. The converter then gives the index head the rule "low"
(kernels/norm_rope/index_rope.py): its Di/2 pairs turn at the model's Di/2 lowest frequencies, pair p + R/2 - Di/2 of the main
table in index channels (p, p + Di/2), and the fit above runs on exactly those pairs; the higher-frequency pairs
(which mostly tell nearby positions apart, inside the always-kept local block) and any non-rotated channels are
dropped. An odd index dim below R is refused with an M3CompileError.

An index dim above the head dim of a fully rotated head (index rope "tile", index_rope_rule): every index pair
turns at one of the model's R/2 frequencies, each at least once and the lowest ones again (tile_pairs), so a
dense pair p with r_p index pairs is fitted with r_p shared key rows instead of one: nu_1 .. nu_r the top r
eigenvectors of the same form, mu_g,j = alpha_g (beta_g^H nu_j), which minimises the same error over a rank-r
shared key (exact once r_p >= Hkv). Twice the head dim gives two ranks. SmolLM2-135M (3 KV heads, head dim 64),
calibrated, block 64 / top-8: at 4K on CPU +3.35% at index dim 128 against +4.13% at 64 (+3.30% at 192, rank 3,
exact); at 8K on the GPU +6.68% against +9.00%. A 9.5M-parameter byte-level Llama (2 KV heads, head dim 48) at 8K: +1.47% at 96 and
128 against +2.07%. Distilled, the gain is gone (SmolLM2 +1.54% against +1.51% with non-rotated slots; byte +0.83%
against +0.81%): BENCHMARKS.md. Ranks past Hkv have nothing to fit and start as unfitted slots.

An index dim above what the dense channels fill otherwise (above the head dim of a partly rotated head, or more
non-rotated channels than the dense head has; or "tile" ranks past Hkv) leaves slots with nothing to fit: their query rows start at zero and their key rows at random (seeded,
UNFITTED_KEY_NORM = 0.01 times the fitted rows' mean norm), so the projections score as the fitted slots alone do
and distillation can still grow the rest (two zero rows would keep each other's gradient at zero; AdamW's steps do
not depend on the gradient's scale). The index key norm, an RMS over all Di channels, sees the random rows: at the
fitted rows' full norm the init is worse than the narrower head's (that byte-level Llama at index dim 128:
+2.42% against +2.07% at 8K on the GPU), at 0.01 it is the narrower head's (+6.53% against +6.60% at 512 tokens,
block 16 / top-4, CPU), and both distil past it (GPU at 8K with 1.0: +0.82% against +1.12%; CPU at 512 tokens,
205K tokens: 0.01 +4.71%, 1.0 +4.90%, head dim +5.19%). BENCHMARKS.md.
"""
from __future__ import annotations

import torch

from m3compile.errors import M3CompileError
from m3compile.kernels.norm_rope.index_rope import index_rope_rule, tile_pairs

__all__ = ["init_index_weights", "index_branch_weights"]


def _shared_key(alpha: torch.Tensor, beta: torch.Tensor, rank: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha, beta [P, G, H] (complex or real): rows mu [P, G, r, H] and nu [P, r, H] as in the module docstring,
    r = min(rank, G) shared key rows per pair, largest first (orthogonal: the top eigenvectors; with r = G exact)."""
    w = alpha.abs().pow(2).sum(-1)  # [P, G]
    basis = beta * w.sqrt()[..., None]  # [P, G, H]
    gram = basis.conj() @ basis.transpose(1, 2)  # [P, G, G] = basis^H basis in the row convention
    _, vecs = torch.linalg.eigh(gram)
    top = vecs[..., -min(rank, gram.shape[-1]):].flip(-1)  # [P, G, r]
    nu = (top.transpose(1, 2)[..., None] * basis[:, None]).sum(2)  # [P, r, H]: eigenvectors of basis basis^H
    nu = nu / nu.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    proj = (beta.conj()[:, :, None] * nu[:, None]).sum(-1)  # beta_g^H nu_j  [P, G, r]
    # Balance magnitudes: the key row carries the group-averaged key norm along nu, the query rows the rest.
    scale = ((w[..., None] * proj.abs().pow(2)).sum(1) / w.sum(-1, keepdim=True).clamp_min(1e-30)).sqrt()
    scale = scale.clamp_min(1e-12)  # [P, r]
    mu = alpha[:, :, None] * (proj / scale[:, None])[..., None]
    return mu, nu * scale[..., None]


WHITENING_RIDGE = 1e-3  # the calibration moment is regularised by this share of its mean diagonal
# the norm of an unfitted slot's random key row, as a share of the fitted rows' mean norm: small, so that the index
# key norm (an RMS over all Di channels) barely sees it (module docstring)
UNFITTED_KEY_NORM = 0.01


def _whitening(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C^1/2, C^-1/2) of the symmetric second moment C (float64), ridge-regularised so C^-1/2 stays bounded."""
    moment = (moment + moment.T) / 2
    ridge = WHITENING_RIDGE * moment.diagonal().mean().clamp_min(1e-30)
    vals, vecs = torch.linalg.eigh(moment + ridge * torch.eye(moment.shape[0], dtype=moment.dtype, device=moment.device))
    vals = vals.clamp_min(ridge)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def init_index_weights(
    wq: torch.Tensor,
    wk: torch.Tensor,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rope_dim: int,
    index_dim: int,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    x_moment: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_q_proj.weight [Hkv * Di, hidden], index_k_proj.weight [Di, hidden]) from q_proj/k_proj weights.

    wq [Hq * D, hidden], wk [Hkv * D, hidden]; q_scale/k_scale [D]: the effective per-channel scale of a QK norm;
    x_moment [hidden, hidden]: the second moment of the attention input on calibration data (the calibrated fit of
    the module docstring), None for the weight-only fit.
    """
    if index_dim < rope_dim and index_dim % 2:
        raise M3CompileError(f"index_dim ({index_dim}) is below the model's rotary width ({rope_dim}) and odd: "
                             "a narrower index head turns in channel pairs (use an even index_dim)")
    hidden, dtype = wq.shape[1], wq.dtype
    if wq.is_meta:
        return (torch.empty(n_kv_heads * index_dim, hidden, device="meta", dtype=dtype),
                torch.empty(index_dim, hidden, device="meta", dtype=dtype))
    G = n_heads // n_kv_heads
    a = wq.double().view(n_kv_heads, G, head_dim, hidden).mean(1)  # [Hkv, D, hidden]
    b = wk.double().view(n_kv_heads, head_dim, hidden)
    unwhiten = None
    if x_moment is not None:
        if x_moment.shape != (hidden, hidden):
            raise M3CompileError(f"calibration moment {tuple(x_moment.shape)} does not match hidden size {hidden}")
        root, unwhiten = _whitening(x_moment.to(device=wq.device, dtype=torch.float64))
        a, b = a @ root, b @ root
    if q_scale is not None:
        a = a * q_scale.double()[None, :, None]
    if k_scale is not None:
        b = b * k_scale.double()[None, :, None]
    half = rope_dim // 2
    wq_idx = torch.zeros(n_kv_heads, index_dim, hidden, dtype=torch.float64, device=wq.device)
    wk_idx = torch.zeros(index_dim, hidden, dtype=torch.float64, device=wq.device)
    fitted = torch.zeros(index_dim, dtype=torch.bool)  # index channels the fit fills
    if index_rope_rule(head_dim, rope_dim, index_dim) == "tile":
        # every index pair turns at one dense pair's frequency (tile_pairs); a dense pair with r index pairs is
        # fitted with r shared-key ranks (at most G: beyond that nothing is left to fit)
        n = index_dim // 2
        alpha = torch.complex(a[:, :half], a[:, half:rope_dim]).transpose(0, 1)  # [half, G, hidden]
        beta = torch.complex(b[:, :half], b[:, half:rope_dim]).transpose(0, 1)
        pairs = tile_pairs(rope_dim, index_dim)
        mu, nu = _shared_key(alpha, beta, rank=-(-n // half))  # [half, G, r, hidden], [half, r, hidden]
        taken = [0] * half  # ranks of each dense pair given out so far
        for c, p in enumerate(pairs.tolist()):  # the j-th index pair of dense pair p takes its rank j
            j, taken[p] = taken[p], taken[p] + 1
            if j < nu.shape[1]:
                wq_idx[:, c], wq_idx[:, n + c] = mu[p, :, j].real, mu[p, :, j].imag
                wk_idx[c], wk_idx[n + c] = nu[p, j].real, nu[p, j].imag
                fitted[c] = fitted[n + c] = True
    else:
        n = min(half, index_dim // 2)  # pairs the index head keeps: all, or (index rope "low") the n lowest
        if n:
            lo = half - n
            alpha = torch.complex(a[:, lo:half], a[:, half + lo:rope_dim]).transpose(0, 1)  # [n, G, hidden]
            beta = torch.complex(b[:, lo:half], b[:, half + lo:rope_dim]).transpose(0, 1)
            mu, nu = _shared_key(alpha, beta)
            mu, nu = mu[:, :, 0], nu[:, 0]
            wq_idx[:, :n], wq_idx[:, n:2 * n] = mu.real.transpose(0, 1), mu.imag.transpose(0, 1)
            wk_idx[:n], wk_idx[n:2 * n] = nu.real, nu.imag
            fitted[:2 * n] = True
        n_pass, slots = head_dim - rope_dim, max(0, index_dim - rope_dim)
        if n_pass and slots:
            alpha = a[:, rope_dim:].transpose(0, 1)  # [n_pass, G, hidden]
            beta = b[:, rope_dim:].transpose(0, 1)
            energy = (alpha.pow(2).sum(-1) * beta.pow(2).sum(-1)).sum(-1)
            keep = energy.argsort(descending=True)[:slots].sort().values
            mu, nu = _shared_key(alpha[keep], beta[keep])
            wq_idx[:, rope_dim:rope_dim + len(keep)] = mu[:, :, 0].transpose(0, 1)
            wk_idx[rope_dim:rope_dim + len(keep)] = nu[:, 0]
            fitted[rope_dim:rope_dim + len(keep)] = True
    if not fitted.all():  # slots no dense channel fills (an index head wider than the dense one's channels)
        # a zero query row and a zero key row would keep each other's gradient at zero for ever; a random key row
        # (seeded, isotropic in the whitened coordinates) under a zero query row adds nothing to the projections'
        # scores and lets distillation grow the query side (as LoRA starts one factor at zero). The index key norm
        # (RMS over all Di channels) still sees the random rows: module docstring
        g = torch.Generator(device="cpu").manual_seed(0)
        free = (~fitted).nonzero().flatten().to(wq.device)
        extra = torch.randn(len(free), hidden, generator=g, dtype=torch.float64).to(wq.device)
        norm = (wk_idx[fitted.to(wq.device)].norm(dim=-1).mean() if fitted.any()
                else torch.tensor(1.0, dtype=torch.float64))
        wk_idx[free] = extra / extra.norm(dim=-1, keepdim=True) * norm * UNFITTED_KEY_NORM
    if unwhiten is not None:
        wq_idx, wk_idx = wq_idx @ unwhiten, wk_idx @ unwhiten
    out = dict(device=wq.device, dtype=dtype)  # the model's device and dtype, not the scratch's
    return wq_idx.reshape(n_kv_heads * index_dim, hidden).to(**out), wk_idx.to(**out)


def index_branch_weights(wq: torch.Tensor, wk: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int,
                         rope_dim: int, index_dim: int, q_norm: torch.Tensor | None = None,
                         k_norm: torch.Tensor | None = None, norm_style: str = "rms",
                         x_moment: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The four index-branch tensors of one layer, by their names under the attention block (M3's names):
    index_q_proj / index_k_proj from `init_index_weights` (calibrated when `x_moment` is given), and
    index_q_norm / index_k_norm zero (Gemma-style norms start as identity). q_norm / k_norm: the layer's QK-norm
    weights, if any, in `norm_style` ("rms": w * x, "gemma": x * (1 + w)). gqa_to_msa and the streaming converter
    both take their index branch from here."""

    def scale(w):
        if w is None:
            return None
        return (1.0 + w.float()) if norm_style == "gemma" else w.float()

    with torch.no_grad():
        wq_idx, wk_idx = init_index_weights(
            wq.detach(), wk.detach(), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, rope_dim=rope_dim,
            index_dim=index_dim, q_scale=scale(q_norm), k_scale=scale(k_norm), x_moment=x_moment,
        )
    zeros = torch.zeros(index_dim, dtype=wq.dtype, device=wq.device)
    return {"index_q_proj.weight": wq_idx, "index_k_proj.weight": wk_idx, "index_q_norm.weight": zeros,
            "index_k_norm.weight": zeros.clone()}
