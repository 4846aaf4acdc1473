"""What the plain-PyTorch references of kernels/<op>/naive.py share: the fp32 upcast, the query chunking, the
input checks and the fp8 e4m3 quantisation of index keys and queries.

The references are the ground truth every kernel is tested against. Shapes (head-major, the layout
`scaled_dot_product_attention` takes):
    q        [B, Hq, T, D]     query heads of the main branch, RoPE applied
    k, v     [B, Hkv, T, D]    key/value heads; query head h belongs to KV group h // (Hq // Hkv)
    q_idx    [B, Hi, T, Di]    index queries, one head per KV group (Hi == Hkv)
    k_idx    [B, T, Di]        the single shared index key head
    blocks   [B, Hi, T, K]     selected key-block ids per (group, query); -1 marks an empty slot;
                               slot order carries no meaning
A chunk of a prompt whose earlier keys are cached (chunked prefill) passes fewer queries than keys: its Tq queries
are the last Tq of the Tk key positions (`cached_prefix` of the checks; the selection and the sparse attention).

Everything is computed in fp32 (fp64 for fp64 inputs, so gradcheck can run on it) and cast back to the input dtype.
fp8 index scoring is stated here too: `quantize_index_keys` (one e4m3 scale per row or key block) and `fp8_round`
(indexer.naive.select_blocks(fp8=True) scores with them). The query axis is processed in chunks sized so that no
[T, T] tensor is ever allocated (`query_chunk`): memory is O(chunk * T) for scoring and O(chunk * K * block) for the
sparse attention itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "compute_dtype",
    "query_chunk",
    "check_index_inputs",
    "check_attention_inputs",
    "quantize_index_keys",
    "dequantize_index_keys",
    "expand_block_scale",
    "fp8_round",
    "FP8_MAX",
]

# Elements of fp32 scratch one chunk may allocate (128 MiB): bounds memory at any T.
_CHUNK_ELEMENTS = 1 << 25


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when the input is fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def query_chunk(rows_per_query: int, length: int, budget: int = _CHUNK_ELEMENTS) -> int:
    """Queries per chunk so that `chunk * rows_per_query * length` elements stay within `budget`."""
    return max(1, min(length, budget // max(1, rows_per_query * length)))


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_keys(x: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Di] -> (fp8 e4m3 [..., Di], fp32 scale [...]) with x ~= fp8 * scale: one scale per row (each
    token's index key; for index queries, each (token, head)), the row's largest magnitude mapped to 448, rounded to
    nearest even. The fp8 index kernels quantise queries exactly so, inside the kernel.

    block_size (keys x [..., T, Di] only): one scale per aligned block of `block_size` keys instead, the block's
    largest magnitude mapped to 448 -> scale [..., ceil(T / block_size)]. e4m3 is a floating format, so a key
    smaller than its block's largest keeps the same relative precision unless it falls 2^15 below it (e4m3's
    subnormals); the prefill indexer then applies the scale once per block score, after the block max
    (a positive scale commutes with the max), instead of once per token score."""
    if block_size is None:
        scale = _over_fp8_max(x.float().abs().amax(-1).clamp(min=1e-12))
        per_row = scale
    else:
        T = x.shape[-2]
        n_blocks = -(-T // block_size)
        pad = F.pad(x.float().abs(), (0, 0, 0, n_blocks * block_size - T))
        scale = _over_fp8_max(pad.reshape(*x.shape[:-2], n_blocks, block_size * x.shape[-1]).amax(-1).clamp(min=1e-12))
        per_row = expand_block_scale(scale, block_size, T)
    return (x.float() / per_row[..., None]).to(torch.float8_e4m3fn), scale


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as an IEEE quotient on every device, as the kernels compute it (_tl_common.e4m3_scale): on CUDA
    torch divides by a Python number as a product with its rounded reciprocal, a last bit off for some values."""
    return amax / amax.new_full((), FP8_MAX)


def expand_block_scale(scale: torch.Tensor, block_size: int, T: int) -> torch.Tensor:
    """A per-key-block scale [..., ceil(T / block_size)] as one scale per key [..., T]."""
    return scale.repeat_interleave(block_size, -1)[..., :T]


def dequantize_index_keys(x_fp8: torch.Tensor, scale: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """fp8 keys [..., T, Di] times their scales: per key [..., T], or per key block [..., ceil(T / block_size)]."""
    if block_size is not None and scale.shape[-1] != x_fp8.shape[-2]:
        scale = expand_block_scale(scale, block_size, x_fp8.shape[-2])
    return x_fp8.float() * scale[..., None]


def fp8_round(x: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """x [..., Di] as fp8 index scoring sees it: quantised (quantize_index_keys: per row, or per key block),
    dequantised, fp32."""
    return dequantize_index_keys(*quantize_index_keys(x, block_size), block_size)


def _lengths_agree(Tq: int, Tk: int, cached_prefix: bool) -> bool:
    """Queries Tq against keys Tk: the same positions, or (cached_prefix) the last Tq of the Tk positions."""
    return Tq == Tk or (cached_prefix and Tq <= Tk)


def check_index_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor, cached_prefix: bool = False) -> torch.Tensor:
    """k_idx as [B, T, Di]. cached_prefix: the queries may be the last Tq <= Tk key positions (a prompt chunk)."""
    if k_idx.dim() == 4:  # [B, 1, T, Di] accepted too
        if k_idx.shape[1] != 1:
            raise ValueError(f"k_idx must have a single index key head, got shape {tuple(k_idx.shape)}")
        k_idx = k_idx[:, 0]
    if q_idx.dim() != 4 or k_idx.dim() != 3:
        raise ValueError(f"q_idx must be [B, Hi, T, Di] and k_idx [B, T, Di]; got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}")
    if q_idx.shape[0] != k_idx.shape[0] or not _lengths_agree(q_idx.shape[2], k_idx.shape[1], cached_prefix) \
            or q_idx.shape[3] != k_idx.shape[2]:
        raise ValueError(f"q_idx {tuple(q_idx.shape)} and k_idx {tuple(k_idx.shape)} disagree on B, T or Di")
    return k_idx


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_prefix: bool = False) -> int:
    """Group size G = Hq // Hkv. cached_prefix: the queries may be the last Tq <= Tk key positions."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or not _lengths_agree(T, k.shape[2], cached_prefix) or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} are not a GQA pair")
    return Hq // k.shape[1]
