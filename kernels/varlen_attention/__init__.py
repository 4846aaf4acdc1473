"""Variable-length block-diagonal attention: the ViT's 3D windowed attention over a packed batch
(docs/msa.md section 6).

Tokens of all images and videos of a batch are packed along one axis; `cu_seqlens` cuts it into segments (a video
is split into consecutive windows of at most W temporal steps, an image is one step) and every token attends
bidirectionally to the tokens of its own segment only. One launch covers every segment of every video: programs
are (query tile of one segment) x head, mapped through a tile table built on the device (no host synchronisation,
no padding copies, no Python loop over segments).

Shapes: q, k, v [N, H, D] (packed tokens, the ViT's layout), cu_seqlens [S + 1] int32 -> [N, H, D].
"""
from __future__ import annotations

import math

import torch

from m3compile.kernels._common import interpreting, next_pow2, use_triton
from m3compile.kernels.varlen_attention.naive import varlen_attention_reference

__all__ = ["window_segments", "varlen_attention", "varlen_attention_reference"]


def window_segments(grid_thw: torch.Tensor | list, window: int, device=None) -> torch.Tensor:
    """cu_seqlens [S + 1] int32 of the 3D windows of a batch of videos/images.

    grid_thw [N, 3]: per video its temporal steps t and patch grid h x w (an image has t = 1); each video is cut
    into consecutive windows of at most `window` temporal steps, t*h*w tokens in grid order (t-major).
    window=1 is the per-frame (2D) baseline; window >= t attends across the whole clip.
    """
    grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).cpu()
    if window < 1:
        raise ValueError(f"window must be >= 1 temporal step, got {window}")
    if grid.numel() == 0:
        raise ValueError("no image or video in the batch (grid_thw is empty)")
    lengths = []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"video {i} is empty: grid (t, h, w) = ({t}, {h}, {w})")
        for s in range(0, t, window):
            lengths.append(min(window, t - s) * h * w)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device) if device is not None else cu


def _check(q, k, v, cu_seqlens):
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must all be [N, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be [S + 1] with at least one segment")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {q.shape[0]}, got {int(cu_seqlens[0])}.."
                         f"{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be strictly increasing (no empty segment)")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, backend: str = "auto", block_m: int | None = None) -> torch.Tensor:
    """Block-diagonal (per-segment, bidirectional) attention of packed tokens. q/k/v [N, H, D] -> [N, H, D]."""
    _check(q, k, v, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not use_triton(q, k, v, backend=backend):
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last dimension")
    from m3compile.kernels.varlen_attention._tl_varlen import varlen_fwd_kernel

    N, H, D = q.shape
    bm = block_m or (32 if interpreting() else 128)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    n_seg = cu.numel() - 1
    lengths = (cu[1:] - cu[:-1]).long()
    tiles = (lengths + bm - 1) // bm
    tile_end = tiles.cumsum(0)
    n_tiles = -(-N // bm) + n_seg  # static upper bound of sum(tiles)
    pid = torch.arange(n_tiles, device=q.device)
    tile_seg = torch.searchsorted(tile_end, pid, right=True)
    seg = tile_seg.clamp(max=n_seg - 1)
    tile_start = cu[seg].long() + (pid - (tile_end[seg] - tiles[seg])) * bm
    # head dim as a power-of-two part and a small remainder (80 = 64 + 16): no matmul on padding to 128
    da = max(16, 1 << (D.bit_length() - 1))
    db = 0 if D <= da else max(16, next_pow2(D - da))
    if da + db >= next_pow2(D) and db:  # the split would not save work (e.g. 24 -> 16 + 16 vs 32)
        da, db = max(16, next_pow2(D)), 0
    out = torch.empty_like(q)
    varlen_fwd_kernel[(n_tiles, H)](
        q, k, v, out, cu, tile_seg.to(torch.int32), tile_start.to(torch.int32),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        n_seg, scale * math.log2(math.e),
        H=H, D=D, DA=da, DB=db, BLOCK_M=bm, IEEE=q.dtype == torch.float32,
    )
    return out
