"""M3-style vision tower, projector and the multimodal wrapper (docs/msa.md section 6), read top-down.

    frames [F, C, H, W] --patchify--> pixel_values [N, C * tp * p * p], grid_thw [videos, 3]
    VisionTower: Conv3d patch embedding (temporal 2 x 14 x 14) -> LayerNorm -> layers of
                 (LayerNorm, bidirectional attention with 3D RoPE over t/h/w, LayerNorm, GELU MLP)
    Projector:   per patch GELU MLP to the text width, then each 2 x 2 block of patches merged into one token
    MultimodalDecoder: visual tokens replace the image / video placeholder tokens, then the text decoder runs.

Attention inside the tower is block-diagonal over segments given by `cu_seqlens`. As built, the segments are single
frames (`frame_segments`: the per-frame ViT, frames never meet); the `vit_3d_window` pass rewrites them into 3D
windows of at most W temporal steps (`window_segments`; both are graph ops of m3compile.ops). Tensor names follow
`transformers`' minimax_m3_vl (`vision_tower.embeddings.proj`, `vision_tower.layers.{i}`, `multi_modal_projector`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from m3compile.kernels import varlen_attention as varlen
from m3compile.models.decoder import FP32Frequencies
from m3compile.ops import frame_segments, segment_attention, window_segments

__all__ = ["VisionArgs", "VisionTower", "Projector", "MultimodalDecoder", "patchify", "segment_ids",
           "vision_positions", "apply_window", "VisionRotary", "VisionExport", "onnx_vision_inputs"]


@dataclass(frozen=True)
class VisionArgs:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    n_layers: int = 32
    n_heads: int = 16
    n_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    projector_hidden_size: int = 6144
    text_hidden_size: int = 6144
    image_token_id: int = 200025
    video_token_id: int = 200026

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def axis_dim(self) -> int:
        """Rotated channels per axis (t, h, w): 26 of M3's 80-dim heads; 3 x 26 = 78 rotated, 2 pass through."""
        return 2 * ((self.head_dim // 3) // 2)


# ---------------------------------------------------------------------------------------------------------------
# Inputs and segments


def _grid(grid_thw) -> torch.Tensor:
    return torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).cpu()


def patchify(frames: torch.Tensor, args: VisionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """frames [F, C, H, W] (an image is F = 1, repeated to one temporal patch) -> (pixel_values [t*h*w, C*tp*p*p],
    grid_thw [1, 3]); patches ordered t-major, then 2 x 2 merge blocks, as the projector expects."""
    if frames.dim() != 4 or frames.shape[1] != args.n_channels:
        raise ValueError(f"frames must be [F, {args.n_channels}, H, W], got {tuple(frames.shape)}")
    F_, C, H, W = frames.shape
    tp, p, m = args.temporal_patch_size, args.patch_size, args.spatial_merge_size
    if F_ == 0:
        raise ValueError("empty video: no frames")
    if F_ == 1:
        frames = frames.repeat(tp, 1, 1, 1)
        F_ = tp
    if F_ % tp:
        raise ValueError(f"video of {F_} frames is not divisible by the temporal patch ({tp})")
    if H % (p * m) or W % (p * m):
        raise ValueError(f"frame size {H}x{W} is not divisible by patch x merge ({p} x {m} = {p * m})")
    t, h, w = F_ // tp, H // p, W // p
    x = frames.reshape(t, tp, C, h // m, m, p, w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h-blocks, w-blocks, m, m, C, tp, p, p
    return x.reshape(t * h * w, C * tp * p * p), torch.tensor([[t, h, w]])


def segment_ids(grid_thw, window: int | None) -> torch.Tensor:
    """[N] int64: the attention segment of every patch (3D windows of <= `window` steps; None: one per frame)."""
    cu = varlen.window_segments(_grid(grid_thw), window or 1)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())


@torch.fx.wrap
def vision_positions(grid_thw, merge: int) -> torch.Tensor:
    """(t, h, w) of every patch [N, 3], h/w laid out block-major over merge x merge blocks (the patch order)."""
    out = []
    for t, h, w in _grid(grid_thw).tolist():
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh, ww = hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([torch.arange(t).repeat_interleave(h * w), hh.repeat(t), ww.repeat(t)], -1))
    return torch.cat(out)


def check_grid(pixel_values: torch.Tensor, grid_thw, args: VisionArgs) -> None:
    grid = _grid(grid_thw)
    if grid.numel() == 0:
        raise ValueError("no image or video (grid_thw is empty)")
    bad = [(i, g) for i, g in enumerate(grid.tolist()) if min(g) < 1]
    if bad:
        raise ValueError(f"video {bad[0][0]} is empty: grid (t, h, w) = {tuple(bad[0][1])}")
    m = args.spatial_merge_size
    odd = [(i, g) for i, g in enumerate(grid.tolist()) if g[1] % m or g[2] % m]
    if odd:
        raise ValueError(f"video {odd[0][0]}: patch grid {odd[0][1][1]}x{odd[0][1][2]} is not divisible by the "
                         f"{m}x{m} patch merge")
    n = int(grid.prod(-1).sum())
    per_patch = args.n_channels * args.temporal_patch_size * args.patch_size**2
    if pixel_values.dim() != 2 or pixel_values.shape != (n, per_patch):
        raise ValueError(f"pixel_values must be [{n}, {per_patch}] for grids {grid.tolist()}, got "
                         f"{tuple(pixel_values.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# Modules


class VisionRotary(FP32Frequencies):
    """3D RoPE: axis_dim channels each for t, h and w (equal frequency bands); the remaining channels pass."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.register_buffer("inv_freq", self.frequencies(args).to(torch.empty(0).device), persistent=False)

    @staticmethod
    def frequencies(args: VisionArgs) -> torch.Tensor:
        d = args.axis_dim  # computed on the CPU, also under a meta-device context
        return 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = (positions[..., None].float() * self.inv_freq.float()).flatten(1)  # [N, 3 * d / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, 3 * d]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; rotate-half RoPE on the first cos.shape[-1] channels."""
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated = torch.cat((-x_rot[..., r // 2:], x_rot[..., : r // 2]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.k_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.v_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x, cu_seqlens, cos, sin):
        N = x.shape[0]
        q = _rope(self.q_proj(x).view(N, self.n_heads, self.head_dim), cos, sin)  # [N, H, D]
        k = _rope(self.k_proj(x).view(N, self.n_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(N, self.n_heads, self.head_dim)
        o = segment_attention(q, k, v, cu_seqlens, self.scale)
        return self.out_proj(o.reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        k = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.n_channels, args.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixel_values):
        a = self.args
        x = pixel_values.view(-1, a.n_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, a.hidden_size)


class VisionTower(nn.Module):
    """pixel_values [N, C*tp*p*p], grid_thw [videos, 3] -> patch features [N, hidden]."""

    def __init__(self, args: VisionArgs, window: int | None = None):
        super().__init__()
        self.args = args
        self.window = window  # None: per-frame segments (the 2D baseline); W: 3D windows of <= W temporal steps
        self.embeddings = VisionEmbeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)  # (sic: M3's name)
        self.layers = nn.ModuleList(VisionLayer(args) for _ in range(args.n_layers))
        self.rotary_emb = VisionRotary(args)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.window is None:
            cu_seqlens = frame_segments(grid_thw)  # per frame: the baseline the vit_3d_window pass rewrites
        else:
            cu_seqlens = window_segments(grid_thw, self.window)
        return self.encode(pixel_values, vision_positions(grid_thw, self.args.spatial_merge_size), cu_seqlens)

    def encode(self, pixel_values: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """The tower on precomputed patch positions [N, 3] and segments (cu_seqlens or a [N, N] bool mask)."""
        x = self.embeddings(pixel_values)  # [N, hidden]
        cos, sin = self.rotary_emb(positions, x.dtype)
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x, segments, cos, sin)
        return x


class Projector(nn.Module):
    """[N, vision hidden] -> [N / merge^2, text hidden]: a GELU MLP per patch, then each merge x merge block of
    patches (consecutive in the patch order) concatenated and fused by a second GELU MLP."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.merge = args.spatial_merge_size
        self.linear_1 = nn.Linear(args.hidden_size, args.projector_hidden_size)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size)
        self.merge_linear_1 = nn.Linear(args.text_hidden_size * self.merge**2, args.projector_hidden_size)
        self.merge_linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size)

    def forward(self, x):
        x = self.linear_2(F.gelu(self.linear_1(x)))
        x = x.reshape(x.shape[0] // self.merge**2, -1)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))


class MultimodalDecoder(nn.Module):
    """The text Decoder with a vision tower: visual tokens replace the placeholder tokens, then the LLM runs.

    forward(input_ids [B, T], pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw) -> logits.
    """

    def __init__(self, text: nn.Module, args: VisionArgs):
        super().__init__()
        self.vision_args = args
        self.language = text  # models.decoder.Decoder (its own names under `language.`)
        self.vision_tower = VisionTower(args)
        self.multi_modal_projector = Projector(args)

    @property
    def args(self):
        return self.language.args

    def visual_tokens(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        check_grid(pixel_values, grid_thw, self.vision_args)
        return self.multi_modal_projector(self.vision_tower(pixel_values, grid_thw))

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None):
        """Text embeddings with the visual tokens scattered into the placeholder positions. [B, T, hidden]."""
        x = self.language.model.embed_tokens(input_ids)
        for kind, pixels, grid, token in (("image", pixel_values, image_grid_thw, self.vision_args.image_token_id),
                                          ("video", pixel_values_videos, video_grid_thw,
                                           self.vision_args.video_token_id)):
            slots = input_ids == token
            n_slots = int(slots.sum())
            if pixels is None:
                if n_slots:
                    raise ValueError(f"{n_slots} {kind} placeholder tokens but no {kind} input")
                continue
            feats = self.visual_tokens(pixels, grid)
            if feats.shape[0] != n_slots:
                raise ValueError(f"{kind} placeholders ({n_slots}) do not match the {kind} tokens the vision tower "
                                 f"produced ({feats.shape[0]} = patches / {self.vision_args.spatial_merge_size ** 2})")
            x = x.masked_scatter(slots[..., None], feats.to(x.dtype))
        return x

    def forward(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None):
        x = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return self.language.lm_head(self.language.model.forward_embeds(x))


def apply_window(model: nn.Module, window: int | None) -> None:
    """Run every VisionTower of `model` natively with 3D windows of <= `window` steps (None: per frame)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 temporal step, got {window}")
    for m in model.modules():
        if isinstance(m, VisionTower):
            m.window = window


class VisionExport(nn.Module):
    """What vision.onnx computes: pixel_values [N, C*tp*p*p], positions [N, 3] (t, h, w of each patch, int64) and
    segment_ids [N] (int64, the 3D window of each patch) -> visual tokens [N / merge^2, text hidden], the ViT with
    windowed attention as one masked SDPA per layer, then the projector. `onnx_vision_inputs` builds positions and
    segment ids from grid_thw on the host, the part that depends on the data."""

    def __init__(self, model: MultimodalDecoder):
        super().__init__()
        self.vision_tower, self.multi_modal_projector = model.vision_tower, model.multi_modal_projector

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        same = segment_ids[:, None] == segment_ids[None, :]
        return self.multi_modal_projector(self.vision_tower.encode(pixel_values, positions, same))


def onnx_vision_inputs(grid_thw, args: VisionArgs, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [N, 3] int64, segment_ids [N] int64) for vision.onnx from grid_thw [videos, 3]."""
    return vision_positions(grid_thw, args.spatial_merge_size).long(), segment_ids(grid_thw, window)