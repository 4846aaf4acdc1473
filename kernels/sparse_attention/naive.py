"""Plain-PyTorch reference of the sparse attention (docs/msa.md section 3), and the dense causal attention it must
equal when every block is selected. Shapes and conventions: kernels/naive_common.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from m3compile.kernels.naive_common import check_attention_inputs, compute_dtype, query_chunk

__all__ = ["sparse_attention", "dense_attention", "MASKED_REACH"]

def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention restricted to the selected key blocks (docs/msa.md section 3).

    All G = Hq // Hkv query heads of group g attend over the causally visible tokens of the blocks selected for
    (g, t); -1 slots are ignored; the query's own block is masked per token.

    q [B, Hq, T, D], k/v [B, Hkv, T, D], blocks [B, Hkv, T, K] -> [B, Hq, T, D] in q's dtype. k/v may hold more
    positions (Tk) than q queries: the queries are then the last T of them (a prompt chunk over its cached prefix).
    """
    G = check_attention_inputs(q, k, v, cached_prefix=True)
    B, Hq, T, D = q.shape
    Hkv, K = k.shape[1], blocks.shape[-1]
    if blocks.shape[:3] != (B, Hkv, T):
        raise ValueError(f"blocks must be [B, Hkv, T, K] = [{B}, {Hkv}, {T}, K], got {tuple(blocks.shape)}")
    scale = D**-0.5 if scale is None else scale
    ct = compute_dtype(q)
    out = torch.empty(B, Hkv, G, T, D, dtype=ct, device=q.device)
    # the selection reaches much of the sequence: one masked causal pass; else gather the selected blocks per query
    fill = _sparse_attention_masked if MASKED_REACH * K * block_size >= k.shape[2] else _sparse_attention_gathered
    fill(q.view(B, Hkv, G, T, D), k, v, blocks, block_size, scale, ct, out, chunk)
    return out.view(B, Hq, T, D).to(q.dtype)


def _sparse_attention_gathered(qg, k, v, blocks, block_size, scale, ct, out, chunk):
    """sparse_attention by gathering each query's K selected blocks: qg [B, Hkv, G, T, D] -> out [B, Hkv, G, T, D]."""
    B, Hkv, G, T, D = qg.shape
    K = blocks.shape[-1]
    Tk = k.shape[2]
    off = Tk - T  # position of query row 0
    n_blocks = -(-Tk // block_size)
    pad = (0, 0, 0, n_blocks * block_size - Tk)
    kb = F.pad(k.to(ct), pad).view(B, Hkv, n_blocks, block_size, D)  # keys as whole blocks
    vb = F.pad(v.to(ct), pad).view(B, Hkv, n_blocks, block_size, D)
    i_b = torch.arange(B, device=qg.device)[:, None, None, None]
    i_h = torch.arange(Hkv, device=qg.device)[None, :, None, None]
    offs = torch.arange(block_size, device=qg.device)
    chunk = chunk or query_chunk(B * Hkv * (G + 2 * D), K * block_size)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        idx = blocks[:, :, start:end]  # [B, Hkv, C, K]
        safe = idx.clamp(min=0)  # -1 slots read block 0, then are masked out by `valid`
        pos = (safe[..., None] * block_size + offs).flatten(-2)  # [B, Hkv, C, K*bs] token ids
        t_pos = torch.arange(start + off, end + off, device=qg.device)[:, None]
        valid = (idx >= 0).repeat_interleave(block_size, dim=-1) & (pos <= t_pos)
        C = end - start
        kg = kb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)  # gather whole blocks
        vg = vb[i_b, i_h, safe].view(B, Hkv, C, K * block_size, D)
        s = torch.einsum("bhgcd,bhcsd->bhgcs", qg[:, :, :, start:end].to(ct), kg) * scale
        s = s.masked_fill(~valid[:, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, :, :, start:end] = torch.einsum("bhgcs,bhcsd->bhgcd", p, vg)


# sparse_attention masks a causal pass over all keys instead of gathering K * block keys per query where
# MASKED_REACH * K * block >= T: on a 2-core CPU at 8K tokens (SmolLM2 shapes, block 128 / top-16) the gathers took
# 50 of a 1K window's 61 s of attention
MASKED_REACH = 4
# queries per chunk of the masked pass at most: each chunk scores only the keys up to its last query, so smaller
# chunks skip more of the causally masked half; on a 2-core CPU a 1K-token prompt (the byte model's shapes, block 64
# / top-8) took 40 ms a layer in chunks of 256 against 170 ms in one
MASKED_CHUNK = 256


def _sparse_attention_masked(qg, k, v, blocks, block_size, scale, ct, out, chunk):
    """sparse_attention as causal attention over every key with the unselected blocks masked out, for selections
    that reach much of the sequence (as at CPU eval lengths): matmuls over all T keys instead of gathering K * block
    keys per query, the same softmax. A block in n slots weighs n times (log n added to its scores, block by block),
    as the gathered form and the kernels count it; -1 slots add nothing. qg [B, Hkv, G, T, D] -> out
    [B, Hkv, G, T, D]."""
    B, Hkv, G, T, D = qg.shape
    Tk = k.shape[2]
    off = Tk - T  # position of query row 0
    n_blocks = -(-Tk // block_size)
    pad = (0, 0, 0, n_blocks * block_size - Tk)
    kb, vb = F.pad(k.to(ct), pad), F.pad(v.to(ct), pad)  # keys as whole blocks (the padding is causally masked)
    chunk = chunk or min(MASKED_CHUNK, query_chunk(B * Hkv * G, Tk))
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        nb = -(-(end + off) // block_size)  # blocks up to the chunk's last query
        idx = blocks[:, :, start:end].long()  # [B, Hkv, C, K]
        count = torch.zeros(*idx.shape[:3], nb + 1, dtype=ct, device=qg.device)
        count.scatter_add_(-1, torch.where(idx >= 0, idx, nb), torch.ones_like(idx, dtype=ct))
        s = torch.einsum("bhgcd,bhjd->bhgcj", qg[:, :, :, start:end].to(ct), kb[:, :, :nb * block_size]) * scale
        s.view(*s.shape[:4], nb, block_size).add_(count[:, :, None, :, :nb, None].log())  # log n, -inf unselected
        causal = torch.arange(nb * block_size, device=qg.device) > torch.arange(start + off, end + off,
                                                                                 device=qg.device)[:, None]
        p = torch.softmax(s.masked_fill_(causal, float("-inf")), dim=-1)
        out[:, :, :, start:end] = torch.einsum("bhgcj,bhjd->bhgcd", p, vb[:, :, :nb * block_size])


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, chunk: int | None = None
) -> torch.Tensor:
    """Causal GQA softmax attention, query-chunked; the dense baseline MSA must equal when every block is selected.

    q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D].
    """
    G = check_attention_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, Hkv, G, T, D, dtype=torch.float32, device=q.device)
    qg = q.view(B, Hkv, G, T, D)
    chunk = chunk or query_chunk(B * Hq, T)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        s = torch.einsum("bhgcd,bhjd->bhgcj", qg[:, :, :, start:end].float(), k[:, :, :end].float()) * scale
        t_pos = torch.arange(start, end, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(end, device=q.device) > t_pos, float("-inf"))
        out[:, :, :, start:end] = torch.einsum("bhgcj,bhjd->bhgcd", torch.softmax(s, -1), v[:, :, :end].float())
    return out.view(B, Hq, T, D).to(q.dtype)
