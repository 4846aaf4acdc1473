"""Triton kernels against the torch reference (TRITON_INTERPRET=1 on CPU; full sizes: benchmarks/check_kernels.py).

Shape families: lengths that are not a multiple of the block, T smaller than one block, T = 1, group sizes
1, 3, 4, 8, 16, index-head counts and head dims that are not powers of two, top-k 1, 4, 16, 32 (more slots than
visible blocks, hence -1 slots), shuffled slot order, batches of mixed lengths for decode, fp8 index keys.
"""
import pytest
import torch
import triton
import triton.language as tl

from m3compile.kernels import decode as dk
from m3compile.kernels import indexer
from m3compile.kernels.indexer import naive
from m3compile.kernels.naive_common import fp8_round, quantize_index_keys
from m3compile.kernels.sparse_attention.naive import sparse_attention
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels._tl_common import quantize_rows_e4m3
from m3compile.runtime.timings import kernel_census


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in kernel output"
    return ((out.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)).item()


def assert_same_selection(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor | None = None, tol=1e-4):
    """Equal as sets per row (slot order carries no meaning). Where rounding may flip a near-tie, `scores` (the
    reference block scores, same layout + [NB]) must show the swapped blocks within `tol`."""
    g, w = got.long().sort(-1).values, want.long().sort(-1).values
    if torch.equal(g, w):
        return
    assert scores is not None, f"selections differ in {(g != w).any(-1).sum().item()} rows"
    diff = (g != w).any(-1)
    for row in diff.nonzero():
        s = scores[tuple(row)]
        a, b = set(g[tuple(row)].tolist()), set(w[tuple(row)].tolist())
        only_g, only_w = a - b, b - a
        assert -1 not in only_g and -1 not in only_w, f"row {row.tolist()}: {sorted(a)} vs {sorted(b)}"
        assert min(s[j] for j in only_g) >= max(s[j] for j in only_w) - tol, f"row {row.tolist()}: {a} vs {b}"


def _scores(q_idx, k_idx, bs):
    s = naive.block_scores(q_idx.transpose(1, 2), k_idx, bs)
    return s.transpose(1, 2)  # [B, Hi, T, NB] -> as selected rows [B, Hi, T, NB]


INDEX_CASES = [  # B, T, Hi, Di, block, topk, init, local
    (1, 1, 4, 16, 16, 4, 0, 1),
    (2, 5, 3, 16, 16, 4, 0, 1),  # T < one block
    (2, 37, 3, 24, 8, 4, 1, 1),
    (1, 100, 4, 32, 16, 1, 0, 1),
    (1, 100, 1, 16, 8, 16, 0, 2),
    (2, 53, 5, 16, 8, 32, 1, 1),  # more slots than blocks: -1 slots
    (1, 300, 2, 16, 4, 40, 1, 1),  # past 32 slots (index_topk_kernel_wide: 64 slots, 40 used)
]


@pytest.mark.parametrize("case", INDEX_CASES, ids=lambda c: "B{}-T{}-Hi{}-Di{}-bs{}-k{}-init{}-local{}".format(*c))
def test_indexer_matches_reference(case):
    B, T, H, D, bs, k, init, local = case
    q_idx, k_idx = torch.randn(B, T, H, D), torch.randn(B, T, D)
    got = indexer.select_blocks(q_idx, k_idx, block_size=bs, topk=k, init_blocks=init, local_blocks=local,
                                backend="triton")
    want = naive.select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=k, init_blocks=init, local_blocks=local)
    assert got.shape == (B, H, T, k) and got.dtype == torch.int32
    assert_same_selection(got, want, naive.block_scores(q_idx.transpose(1, 2), k_idx, bs))
    n_visible = torch.arange(T) // bs + 1
    assert torch.equal((got >= 0).sum(-1), n_visible.clamp(max=k).expand(B, H, T).int())


def assert_same_adaptive(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, top_p: float, tol=1e-4):
    """Adaptive selections equal as sets per row, except where the reference's kept mass sits within `tol` of
    top_p (rounding may then keep one block more or fewer). logits [..., NB]: the reference's block logits of the
    rows' candidates and forced blocks alike."""
    g, w = got.long().sort(-1).values, want.long().sort(-1).values
    for row in (g != w).any(-1).nonzero():
        r = tuple(row)
        a, b = {x for x in g[r].tolist() if x >= 0}, {x for x in w[r].tolist() if x >= 0}
        assert abs(len(a) - len(b)) == 1 and (a < b or b < a), f"row {row.tolist()}: {sorted(a)} vs {sorted(b)}"
        z = torch.logsumexp(logits[r][[x for x in range(logits.shape[-1]) if logits[r][x] > float("-inf")]], 0)
        mass = sum(torch.exp(logits[r][x] - z).item() for x in b)
        assert abs(mass - top_p) < tol or mass < top_p + tol, f"row {row.tolist()}: {sorted(a)} vs {sorted(b)}"


ADAPTIVE_CASES = [  # B, T, Hi, Di, block, topk (ceiling), init, local, top_p, min_blocks
    (1, 1, 2, 16, 16, 4, 0, 1, 0.5, 2),  # one token
    (2, 70, 3, 24, 8, 6, 1, 1, 0.6, 0),  # ragged tail, Di not a power of two, an init block
    (1, 129, 2, 16, 8, 12, 0, 2, 0.9, 4),  # a floor, two local blocks
    (2, 53, 1, 16, 4, 32, 0, 1, 0.3, 0),  # a ceiling above the block count: -1 slots
    (1, 150, 2, 16, 4, 36, 0, 1, 0.9, 4),  # a ceiling past 32 slots (the wide kernel: 64 slots)
]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("case", ADAPTIVE_CASES,
                         ids=lambda c: "B{}-T{}-Hi{}-Di{}-bs{}-k{}-init{}-local{}-p{}-min{}".format(*c))
def test_indexer_adaptive_budget_matches_reference(case, fp8):
    """The kernel's slot logits and candidate log-sum-exp (fp8: the query row's own scale applied) cut the
    selection where the reference's adaptive budget does."""
    B, T, H, D, bs, k, init, local, p, floor = case
    q_idx, k_idx = torch.randn(B, T, H, D) * 2, torch.randn(B, T, D)
    scale = None
    if fp8:
        k_idx, scale = indexer.quantize_index_keys(k_idx, bs)
    kw = dict(block_size=bs, topk=k, init_blocks=init, local_blocks=local, k_scale=scale, top_p=p, min_blocks=floor)
    got = indexer.select_blocks(q_idx, k_idx, backend="triton", **kw)
    want = indexer.select_blocks_reference(q_idx, k_idx, **kw)
    keys = indexer.dequantize_index_keys(k_idx, scale, bs) if fp8 else k_idx
    logits = naive.block_scores((fp8_round(q_idx) if fp8 else q_idx).transpose(1, 2), keys, bs)
    assert got.shape == (B, H, T, k) and got.dtype == torch.int32
    assert_same_adaptive(got, want, logits, p)
    fixed = indexer.select_blocks_reference(q_idx, k_idx, block_size=bs, topk=k, init_blocks=init,
                                            local_blocks=local, k_scale=scale)
    assert (got >= 0).sum() <= (fixed >= 0).sum()
    if T > 8 * bs:
        assert (got >= 0).sum() < (fixed >= 0).sum()


FP8_CASES = [  # B, T, Hi, Di, block, topk, init, local, query dtype
    (1, 1, 1, 16, 16, 4, 0, 1, torch.float32),  # one token, one index head
    (2, 5, 3, 16, 16, 4, 0, 1, torch.float32),  # T < one block, 3 heads
    (2, 70, 3, 24, 8, 4, 1, 1, torch.float32),  # ragged tail, Di not a power of two, init block
    (1, 100, 1, 48, 16, 4, 0, 2, torch.bfloat16),  # bf16 queries (the GPU's dtype), two local blocks
    (2, 53, 5, 16, 8, 32, 1, 1, torch.float16),  # more slots than blocks: -1 slots
]


@pytest.mark.parametrize("per_block", [False, True], ids=["token-scale", "block-scale"])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "B{}-T{}-Hi{}-Di{}-bs{}-k{}-init{}-local{}-{}".format(
    *c[:-1], str(c[-1]).split(".")[-1]))
def test_indexer_fp8_matches_reference(case, per_block):
    """fp8 scoring: the kernel (query rows quantised inside it, fp8 keys with one scale per key or per key block)
    against quantise-dequantise-score."""
    B, T, H, D, bs, k, init, local, dtype = case
    q_idx, k_idx = torch.randn(B, T, H, D).to(dtype), torch.randn(B, T, D).to(dtype)
    k8, scale = indexer.quantize_index_keys(k_idx, bs if per_block else None)
    assert k8.dtype == torch.float8_e4m3fn and scale.shape == (B, -(-T // bs) if per_block else T)
    keys = indexer.dequantize_index_keys(k8, scale, bs)
    assert rel_err(keys, k_idx) < 0.05  # e4m3 keeps ~3 significant bits
    got = indexer.select_blocks(q_idx, k8, block_size=bs, topk=k, init_blocks=init, local_blocks=local, k_scale=scale,
                                backend="triton")
    want = indexer.select_blocks_reference(q_idx, k8, block_size=bs, topk=k, init_blocks=init, local_blocks=local,
                                           k_scale=scale)
    assert got.shape == (B, H, T, k) and got.dtype == torch.int32
    scores = naive.block_scores(fp8_round(q_idx).transpose(1, 2), keys, bs)
    assert_same_selection(got, want, scores)
    n_visible = torch.arange(T) // bs + 1
    assert torch.equal((got >= 0).sum(-1), n_visible.clamp(max=k).expand(B, H, T).int())
    if per_block:  # the reference is what MSA's own reference selects in fp8 mode, from the unquantised keys
        assert torch.equal(want, naive.select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=k,
                                                   init_blocks=init, local_blocks=local, fp8=True).int())


def test_block_scale_quantises_each_key_block_to_448():
    """One scale per aligned key block (the ragged last block too): the block's largest magnitude becomes 448,
    and a key 1000x smaller than its block's largest keeps e4m3's relative precision."""
    k_idx = torch.randn(2, 21, 8)
    k_idx[0, 3] *= 1e-3
    k8, scale = indexer.quantize_index_keys(k_idx, 8)
    assert scale.shape == (2, 3)
    blocks = torch.nn.functional.pad(k_idx.abs(), (0, 0, 0, 3)).view(2, 3, 64).amax(-1)
    torch.testing.assert_close(scale, blocks / 448.0)
    assert torch.equal(k8.float().abs().view(2, -1).max(-1).values, torch.full((2,), 448.0))
    back = indexer.dequantize_index_keys(k8, scale, 8)
    assert rel_err(back[0, 3], k_idx[0, 3]) < 0.05
    with pytest.raises(ValueError, match="k_scale"):
        indexer.select_blocks(torch.randn(2, 21, 1, 8), k8, block_size=8, topk=2, k_scale=scale[:, :2])


@triton.jit
def _quantize_rows_kernel(x, out, M: tl.constexpr, D: tl.constexpr, FP8_DOT: tl.constexpr):
    o = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out + o, quantize_rows_e4m3(tl.load(x + o), FP8_DOT).to(tl.float32))


@pytest.mark.parametrize("fp8_dot", [True, False], ids=["fp8", "widened-fp16"])
def test_kernel_quantises_query_rows_as_torch_does(fp8_dot):
    """The in-kernel row quantisation gives torch's e4m3 values exactly: round-ups that carry into the exponent
    (7.8 -> 8, which Triton's interpreter cast gets wrong), ties to even, e4m3 subnormals, the 448 edge, zero rows."""
    M, D = 8, 32
    x = torch.randn(M, D) * torch.logspace(-6, 3, M)[:, None]
    x[0] = 0.0
    # amax 448: scale 1, so these values are rounded as they are; 7.25, 7.75 and the last three are halfway cases
    x[1, :9] = torch.tensor([448.0, 7.8, -7.8, 7.25, 7.75, -1.9463, 0.5 * 2**-9, 1.5 * 2**-9, 2.5 * 2**-9])
    x[2] = torch.randn(D) ** 7  # wide range in one row: many subnormals after scaling
    out = torch.empty(M, D)
    _quantize_rows_kernel[(1,)](x, out, M=M, D=D, FP8_DOT=fp8_dot)
    assert torch.equal(out, quantize_index_keys(x)[0].float())


def test_indexer_half_precision():
    B, T, H, D, bs, k = 1, 90, 4, 32, 16, 3
    q_idx, k_idx = torch.randn(B, T, H, D).half(), torch.randn(B, T, D).half()
    got = indexer.select_blocks(q_idx, k_idx, block_size=bs, topk=k, backend="triton")
    want = naive.select_blocks(q_idx.transpose(1, 2), k_idx, block_size=bs, topk=k)
    assert_same_selection(got, want, naive.block_scores(q_idx.transpose(1, 2), k_idx, bs), tol=2e-2)


SPARSE_CASES = [  # B, Hkv, G, T, D, block, topk
    (1, 1, 1, 1, 16, 16, 4),  # one token
    (2, 2, 3, 5, 16, 16, 1),  # T < one block, topk 1
    (1, 2, 4, 37, 24, 8, 4),  # D not a power of two, ragged tail
    (2, 1, 8, 45, 16, 8, 16),  # more slots than blocks
    (1, 1, 16, 50, 32, 16, 32),  # G 16, more slots than blocks, ragged tail
    (1, 4, 1, 64, 16, 16, 2),  # T a multiple of the block
    (1, 2, 3, 97, 16, 16, 4),  # padded head rows (G 3 of 4) in tiles past their block (the unmasked path)
    (1, 1, 4, 70, 16, 16, 4),  # several unmasked tiles per segment (the path needs blocks of >= 16)
    (1, 1, 3, 40, 16, 2, 19),  # 19 slots: the combine takes them in two groups, the second partial
]


@pytest.mark.parametrize("tokens", [1, 16], ids=["combine-1-token", "combine-16-tokens"])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: "B{}-Hkv{}-G{}-T{}-D{}-bs{}-k{}".format(*c))
def test_sparse_prefill_matches_reference(case, tokens, monkeypatch):
    """Output against the reference, and the combine's log-sum-exp against the LSE-only gather pass's, with one
    token a combine program (a GPU's) and 16 (the interpreter's default: the rest of the suite)."""
    monkeypatch.setattr(sa, "COMBINE_TOKENS_INTERPRETED", tokens)
    B, Hkv, G, T, D, bs, k = case
    q = torch.randn(B, T, Hkv * G, D).transpose(1, 2)  # head-major view of token-major memory, as in the graph
    kk, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=k)
    blocks = blocks[..., torch.randperm(k)].int()  # no slot order may be assumed
    got, lse = sa.sparse_attention_lse(q, kk, v, blocks, block_size=bs, backend="triton")
    want = sparse_attention(q, kk, v, blocks, block_size=bs)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5
    torch.testing.assert_close(lse, sa.selected_lse(q, kk, blocks, block_size=bs), rtol=1e-5, atol=1e-5)


def test_sparse_prefill_tiles_mixing_a_blocks_own_tokens_with_later_ones():
    """Blocks chosen at random among the visible ones, the token's own block not forced: a segment's first tile then
    holds some of the block's own tokens (masked causally) and later ones (which see the whole block)."""
    B, Hkv, G, T, D, bs, k = 1, 2, 4, 75, 16, 16, 2
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    nb = -(-T // bs)
    scores = torch.rand(B, Hkv, T, nb).masked_fill(torch.arange(nb) > (torch.arange(T) // bs)[:, None], -1.0)
    top = scores.topk(k, -1)
    blocks = torch.where(top.values >= 0, top.indices, -1).int()
    assert ((blocks == (torch.arange(T) // bs)[:, None]).any(-1)).float().mean() < 0.9  # own blocks often left out
    got = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert rel_err(got, sparse_attention(q, kk, v, blocks, block_size=bs)) < 1e-5


def test_sparse_prefill_open_tiles_decided_two_tiles_ahead():
    """The forward loads each tile's payload and first token two tiles ahead; a tile goes unmasked only where its
    own first token lies past the block. Block 1's segment here: 12 of its own tokens (20..31), then 32 later ones,
    so its second 8-token tile (interpreter tiles) straddles the block's end and its third does not; a first token
    taken from the wrong tile would unmask the straddling one and let tokens 28..31 see keys past them."""
    B, Hkv, G, T, D, bs = 1, 1, 4, 64, 16, 16
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    t = torch.arange(T)
    own = torch.where((t >= bs) & (t % bs >= 4), t // bs, -1)  # a token's own block, from block 1 on, not all
    blocks = torch.stack([torch.zeros_like(t), own, torch.where(t >= 2 * bs, 1, -1)], -1).int().view(B, Hkv, T, 3)
    got = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert rel_err(got, sparse_attention(q, kk, v, blocks, block_size=bs)) < 1e-5


def test_sparse_prefill_ignores_minus_one_slots_and_unsorted_ids():
    B, Hkv, G, T, D, bs = 1, 2, 3, 50, 16, 8
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    full = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=4)
    holes = full.clone()
    holes[..., 1:][torch.rand(holes[..., 1:].shape) < 0.4] = -1  # keep slot 0 (some block) in every row
    holes = holes.flip(-1).contiguous()
    got = sa.sparse_attention(q, kk, v, holes, block_size=bs, backend="triton")
    want = sparse_attention(q, kk, v, holes, block_size=bs)
    assert rel_err(got, want) < 1e-5


def test_sparse_prefill_ignores_blocks_past_the_token():
    """A block past a token's own holds no key the token may see: like a -1 slot it adds nothing (its partial's
    log-sum-exp is -inf), to the output, to the log-sum-exp kept for the backward, in the LSE-only pass and in the
    gradients, as in the reference. Merged with weight 1 instead, such a block puts the outputs 16-30% off."""
    B, Hkv, G, T, D, bs = 1, 2, 3, 45, 16, 8
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    nb, t = -(-T // bs), torch.arange(T)
    own = (t // bs).view(1, 1, T).expand(B, Hkv, T)
    ahead = torch.where(own + 2 < nb, own + 2, -1)  # a block past the token's own where there is one
    earlier = (torch.rand(B, Hkv, T) * (own + 1)).long()  # any visible block
    blocks = torch.stack([ahead, own, earlier], -1).int().contiguous()
    holes = torch.where(blocks > own.unsqueeze(-1), -1, blocks).contiguous()
    want = sparse_attention(q, kk, v, blocks, block_size=bs)
    assert rel_err(want, sparse_attention(q, kk, v, holes, block_size=bs)) < 1e-6
    got = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert rel_err(got, want) < 1e-5
    scale = D**-0.5
    lse = sa._forward(q, kk, v, blocks, bs, scale, sa.PARTIAL_BYTES, None, "all", True)[1]
    lse_holes = sa._forward(q, kk, v, holes, bs, scale, sa.PARTIAL_BYTES, None, "all", True)[1]
    lse_only = sa._forward(q, kk, kk, blocks, bs, scale, sa.PARTIAL_BYTES, None, "lse", True)[1]
    assert (lse - lse_holes).abs().max().item() < 1e-5 and (lse_only - lse_holes).abs().max().item() < 1e-5
    x = [t.clone().requires_grad_() for t in (q, kk, v)]
    grads = torch.autograd.grad(sa.sparse_attention(*x, blocks, block_size=bs, backend="triton").square().sum(), x)
    x_ref = [t.clone().requires_grad_() for t in (q, kk, v)]
    want_grads = torch.autograd.grad(sparse_attention(*x_ref, blocks, block_size=bs).square().sum(), x_ref)
    for g, w in zip(grads, want_grads):
        assert rel_err(g, w) < 1e-4


def test_sparse_prefill_query_chunks_agree():
    """A tiny partial-buffer budget forces many query chunks; the result must not change."""
    B, Hkv, G, T, D, bs = 1, 2, 4, 40, 16, 8
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=3)
    one = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    many = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton", max_partial_bytes=1)
    assert rel_err(many, one) < 1e-6


def test_sparse_prefill_takes_longer_programs_for_long_query_chunks(monkeypatch):
    """A query chunk of at least LONG_ROWS gathered rows runs FORWARD_CHUNK_ROWS_LONG rows per program (here scaled
    down so one segment spans several programs either way); the output is the same, and the CSR handed on (to
    the KL) carries the chunk that was used."""
    B, Hkv, G, T, D, bs = 1, 2, 3, 70, 16, 8
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=3)
    entries = B * Hkv * T * 3
    monkeypatch.setattr(sa, "FORWARD_CHUNK_ROWS", 32)
    monkeypatch.setattr(sa, "FORWARD_CHUNK_ROWS_LONG", 64)
    monkeypatch.setattr(sa, "LONG_ROWS", entries * 4 + 1)  # GP = 4: one row short of long
    assert sa.attention_chunk(G, entries) == 8
    short = sa._forward_csr(q, kk, v, blocks, bs, D**-0.5, sa.PARTIAL_BYTES, None, "all", True)
    monkeypatch.setattr(sa, "LONG_ROWS", entries * 4)
    assert sa.attention_chunk(G, entries) == 16
    long = sa._forward_csr(q, kk, v, blocks, bs, D**-0.5, sa.PARTIAL_BYTES, None, "all", True)
    assert (short[2].chunk, long[2].chunk) == (8, 16)
    assert rel_err(long[0], short[0]) < 1e-6 and (long[1] - short[1]).abs().max().item() < 1e-5
    assert rel_err(long[0].transpose(1, 2), sparse_attention(q, kk, v, blocks, block_size=bs)) < 1e-5


def test_sparse_prefill_tma_and_masked_stores_agree(monkeypatch):
    """The forward stores a segment's whole tiles of partials by TMA and its last, partial tile by masked stores
    (fp32 under the interpreter, as on Hopper); with TMA off every tile takes the masked stores: the same output."""
    B, Hkv, G, T, D, bs = 1, 2, 4, 150, 16, 16  # 8-token tiles under the interpreter: whole ones and a last one
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=3)
    boxes = []
    descriptor = sa._descriptor
    monkeypatch.setattr(sa, "_descriptor", lambda *a: boxes.append(a) or descriptor(*a))
    tma = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert boxes, "the TMA path did not run"
    monkeypatch.setattr(sa, "_tma_store", lambda *a: False)
    masked = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert torch.equal(tma, masked)
    assert rel_err(tma, sparse_attention(q, kk, v, blocks, block_size=bs)) < 1e-5


def test_sparse_prefill_half_precision():
    B, Hkv, G, T, D, bs = 1, 2, 4, 60, 32, 16
    q, kk, v = (torch.randn(B, h, T, D).half() for h in (Hkv * G, Hkv, Hkv))
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=2)
    got = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    assert got.dtype == torch.float16
    assert rel_err(got, sparse_attention(q.float(), kk.float(), v.float(), blocks, block_size=bs)) < 2e-2


def test_csr_lists_every_valid_entry_once():
    B, Hkv, T, K, bs = 2, 3, 40, 4, 8
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=K)
    n_blocks = -(-T // bs)
    payload, seg_off, tile_seg, tile_start, entry = sa.build_csr(blocks, n_blocks, 0, T, chunk=8)
    assert seg_off[-1].item() == (blocks >= 0).sum().item()
    # entry inverts the sort: each (batch, head, token, slot) finds its own payload there; -1 slots sort last
    assert torch.equal(entry.sort().values, torch.arange(entry.numel(), dtype=torch.int32))
    live = blocks.reshape(-1) >= 0
    flat = torch.arange(live.numel())
    assert torch.equal(payload[entry[live].long()], (flat[live] % (T * K)).int())
    assert entry[~live].min() >= seg_off[-1]
    for seg in range(B * Hkv * n_blocks):
        b, h, j = seg // (Hkv * n_blocks), (seg // n_blocks) % Hkv, seg % n_blocks
        got = sorted(payload[seg_off[seg]:seg_off[seg + 1]].tolist())
        want = sorted((blocks[b, h] == j).nonzero().mul(torch.tensor([K, 1])).sum(-1).tolist())
        assert got == want
    busy = tile_seg < B * Hkv * n_blocks  # tiles cover each segment's entries exactly once
    covered = torch.zeros(seg_off[-1].item(), dtype=torch.int32)
    for s, st in zip(tile_seg[busy].tolist(), tile_start[busy].tolist()):
        covered[st:min(st + 8, seg_off[s + 1].item())] += 1
    assert torch.equal(covered, torch.ones_like(covered))


@pytest.mark.parametrize("B,Hkv,T,K,bs,chunk,t0,t1", [(2, 3, 40, 4, 8, 8, 0, 40), (1, 1, 1, 2, 16, 8, 0, 1),
                                                     (2, 2, 70, 3, 8, 16, 20, 55), (1, 4, 33, 16, 4, 256, 0, 33)])
def test_csr_kernels_build_the_torch_csr(B, Hkv, T, K, bs, chunk, t0, t1):
    """The CSR built by the Triton kernels (keys, one sort, segments, tiles) is the torch build's, tensor for
    tensor: one query range, a middle range, more slots than blocks (-1 slots), a chunk wider than any segment."""
    blocks = naive.select_blocks(torch.randn(B, Hkv, T, 8), torch.randn(B, T, 8), block_size=bs, topk=K).int()
    n_blocks = -(-T // bs)
    want = sa._build_csr_torch(blocks, n_blocks, t0, t1, chunk)
    got = sa._build_csr_triton(blocks, n_blocks, t0, t1, chunk)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)


def _paged(lens, bs, Hkv, D, Di, dtype=torch.float32):
    """Caches with pages in shuffled physical order and a few unused pages."""
    B = len(lens)
    per_seq = max(-(-L // bs) for L in lens) + 1
    P = B * per_seq + 3
    table = torch.randperm(P)[: B * per_seq].view(B, per_seq).int()
    k_cache, v_cache = torch.randn(P, bs, Hkv, D, dtype=dtype), torch.randn(P, bs, Hkv, D, dtype=dtype)
    idx_cache = torch.randn(P, bs, Di, dtype=dtype)
    return k_cache, v_cache, idx_cache, table, torch.tensor(lens, dtype=torch.int32)


DECODE_CASES = [  # lens, block, Hkv, G, D, Di, topk
    ([1], 16, 1, 1, 16, 16, 4),
    ([37, 5, 64], 8, 2, 3, 16, 24, 4),  # mixed lengths, D and Di not powers of two
    ([100, 17], 16, 1, 16, 32, 16, 16),
    ([64, 9, 33, 1], 16, 2, 4, 16, 16, 1),
    ([120], 8, 1, 8, 16, 16, 32),
    ([70, 3], 16, 1, 16, 128, 16, 4),  # M3's group of 16 at D 128: the merge folds one partial a load
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "lens{}-bs{}-Hkv{}-G{}-D{}-Di{}-k{}".format(
    "_".join(map(str, c[0])), *c[1:]))
def test_paged_decode_matches_reference(case):
    lens, bs, Hkv, G, D, Di, k = case
    k_cache, v_cache, idx_cache, table, seq_lens = _paged(lens, bs, Hkv, D, Di)
    B = len(lens)
    q_idx, q = torch.randn(B, Hkv, Di), torch.randn(B, Hkv * G, D)
    got = dk.paged_select(q_idx, idx_cache, table, seq_lens, topk=k, init_blocks=1, backend="triton")
    want = dk.paged_select_reference(q_idx, idx_cache, table, seq_lens, topk=k, init_blocks=1)
    assert_same_selection(got, want)
    out = dk.paged_attention(q, k_cache, v_cache, want, table, seq_lens, backend="triton")
    assert rel_err(out, dk.paged_attention_reference(q, k_cache, v_cache, want, table, seq_lens)) < 1e-5


@pytest.mark.parametrize("D", [16, 128])
def test_paged_attention_over_every_page_splits_the_pages(D):
    """A dense layer's decode: every page as the blocks, more than 64 of them, so each split walks several slots
    (the slot count and slots per split are run-time arguments: one binary for every context); at D 128 the merge
    folds its 34 partials 8 at a time, the last load part empty."""
    lens, bs = [266, 29], 4
    k_cache, v_cache, _, table, seq_lens = _paged(lens, bs, 1, D, 16)
    n_pages = (seq_lens + bs - 1) // bs
    ids = torch.arange(table.shape[1], dtype=torch.int32)
    every = torch.where(ids[None] < n_pages[:, None], ids[None], -1)[:, None]
    assert every.shape[-1] > 64
    q = torch.randn(2, 3, D)
    out = dk.paged_attention(q, k_cache, v_cache, every, table, seq_lens, backend="triton")
    assert rel_err(out, dk.paged_attention_reference(q, k_cache, v_cache, every, table, seq_lens)) < 1e-5


def test_paged_attention_any_pages_per_split():
    """slots_per_split: programs of 1, 2, 3 or all 7 selected pages (a -1 slot among them, the last split short) give
    the reference's output; fewer than one page is refused."""
    lens, bs = [61, 40], 4
    k_cache, v_cache, _, table, seq_lens = _paged(lens, bs, 2, 16, 16)
    blocks = torch.tensor([[[0, 5, 9, 15, 2, -1, 11], [15, 1, 3, 4, 7, 8, 12]],
                           [[9, 0, 2, 4, 6, -1, 1], [3, 8, 5, 0, 1, 2, 9]]], dtype=torch.int32)
    q = torch.randn(2, 6, 16)
    want = dk.paged_attention_reference(q, k_cache, v_cache, blocks, table, seq_lens)
    for pps in (1, 2, 3, 7):
        out = dk.paged_attention(q, k_cache, v_cache, blocks, table, seq_lens, slots_per_split=pps, backend="triton")
        assert rel_err(out, want) < 1e-5, pps
    with pytest.raises(ValueError, match="slots_per_split must be >= 1"):
        dk.paged_attention(q, k_cache, v_cache, blocks, table, seq_lens, slots_per_split=0, backend="triton")


def test_paged_decode_fp8_index_cache():
    lens, bs, Di = [70, 33], 8, 32
    _, _, idx_cache, table, seq_lens = _paged(lens, bs, 1, 16, Di)
    idx8, scale = indexer.quantize_index_keys(idx_cache)
    q_idx = torch.randn(2, 4, Di)
    got = dk.paged_select(q_idx, idx8, table, seq_lens, topk=4, idx_scale=scale, backend="triton")
    want = dk.paged_select_reference(q_idx, idx8, table, seq_lens, topk=4, idx_scale=scale)
    assert_same_selection(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
def test_paged_select_adaptive_budget(fp8):
    """Decode's adaptive budget: the kernels' block scores turned into the index logits (1/sqrt(Di); fp8: the query
    row's scale) cut the selection where the reference's budget does, sequences of 1 token to 15 pages."""
    lens, bs, Di, k, p, floor = [1, 57, 30], 4, 16, 8, 0.7, 3
    _, _, idx_cache, table, seq_lens = _paged(lens, bs, 1, 16, Di, dtype=torch.float16)
    scale = None
    if fp8:
        idx_cache, scale = dk.quantize_pages(idx_cache)
    q_idx = torch.randn(3, 2, Di, dtype=torch.float16) * 2
    kw = dict(topk=k, init_blocks=1, local_blocks=1, idx_scale=scale, top_p=p, min_blocks=floor)
    got = dk.paged_select(q_idx, idx_cache, table, seq_lens, backend="triton", **kw)
    want = dk.paged_select_reference(q_idx, idx_cache, table, seq_lens, **kw)
    logits = dk.paged_block_scores_reference(q_idx, idx_cache, table, seq_lens, scale)  # fp8: the e4m3 query rows
    logits = logits * dk.index_logit_scale(q_idx, fp8) * Di**0.5
    assert_same_adaptive(got, want, logits, p, tol=1e-2)
    fixed = dk.paged_select_reference(q_idx, idx_cache, table, seq_lens, topk=k, init_blocks=1, idx_scale=scale)
    kept = (got >= 0).sum(-1)
    assert (kept[0] == 1).all() and (kept[1:] >= floor).all() and kept.sum() < (fixed >= 0).sum()


TOP_BLOCKS_CASES = [  # chunk, lens, block, index heads, topk, init, local, scores
    (4, [1, 13, 70, 30], 4, 3, 5, 1, 1, "randn"),  # one token, -1 slots, topk > chunk, > 16 candidates: tiled merge
    (4, [49], 4, 1, 3, 3, 2, "randn"),  # 5 forced blocks for 3 slots, the local ones across two chunks
    (4, [61, 22], 4, 2, 4, 0, 1, "one-chunk"),  # the best blocks all in one chunk
    (4, [37, 9], 4, 3, 6, 1, 1, "ties"),  # equal scores across and inside chunks: the lower page first
    (256, [30, 7], 4, 3, 4, 2, 1, "ties"),  # one chunk: the single pass
    (4, [1100, 3], 4, 2, 7, 1, 1, "ties"),  # 276 chunks: the ranked merge's 1,104 candidates span 5 row tiles
    (4, [9, 2], 4, 2, 6, 0, 1, "randn"),  # one chunk of 4 pages for 6 slots: the single pass writes -1 past them
]


@pytest.mark.parametrize("how", ["serial", "ranks"])
@pytest.mark.parametrize("case", TOP_BLOCKS_CASES, ids=lambda c: "chunk{}-lens{}-bs{}-Hi{}-k{}-init{}-local{}-{}".format(
    c[0], "_".join(map(str, c[1])), *c[2:]))
def test_top_blocks_two_stages_match_reference(case, how, monkeypatch):
    """The top-k over chunks then a merge equals the reference slot for slot (best first, equal scores to the lower
    page), with small chunks so that rows span several, and the page past the sequences' last one never read; with
    each stage's maxima taken in turn, and with every key's rank counted (TOPK_RANK_FROM, TOPK_RANK_MERGE)."""
    chunk, lens, bs, H, k, init, local, kind = case
    monkeypatch.setattr(dk, "TOPK_CHUNK", chunk)
    monkeypatch.setattr(dk, "TOPK_RANK_FROM", 1 if how == "ranks" else 10**9)
    monkeypatch.setattr(dk, "TOPK_RANK_MERGE", 10**9 if how == "ranks" else 0)
    max_pages = max(-(-L // bs) for L in lens) + 1
    scores = torch.randn(len(lens), H, max_pages)
    if kind == "ties":
        scores = torch.randint(0, 3, scores.shape).float()
    elif kind == "one-chunk":
        scores[:, :, 8:12] += 10.0
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    seq_ends = (seq_lens + bs - 1) // bs
    scores = scores.masked_fill(torch.arange(max_pages) >= seq_ends[:, None, None], float("nan"))  # never read
    got = dk.top_blocks(scores, seq_lens, block_size=bs, topk=k, init_blocks=init, local_blocks=local,
                        backend="triton")
    want = dk.top_blocks_reference(scores, seq_lens, block_size=bs, topk=k, init_blocks=init, local_blocks=local)
    assert torch.equal(got, want), (got, want)
    assert ((got == -1).sum(-1) == (k - seq_ends.clamp(max=k))[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_paged_select_two_stages(dtype, monkeypatch):
    """paged_select with 4-page chunks on 16-bit and fp8 index caches, 3 index heads, sequences of 1 token to 14
    pages (one shorter than topk), matches the reference; and a longer block table (more chunks) launches the same
    kernel specialisations. (fp16 stands for bf16 here: the interpreter's tl.dot multiplies bf16 operands' raw bits;
    bf16 caches are checked on a GPU by benchmarks/check_kernels.py.)"""
    monkeypatch.setattr(dk, "TOPK_CHUNK", 4)
    lens, bs, Di, k = [1, 54, 19], 4, 16, 6
    _, _, idx_cache, table, seq_lens = _paged(lens, bs, 1, 16, Di, dtype=torch.float16)
    scale = None
    if dtype == torch.float8_e4m3fn:
        idx_cache, scale = dk.quantize_pages(idx_cache)
    q_idx = torch.randn(3, 3, Di, dtype=torch.float16 if scale is None else torch.bfloat16)
    runs = []
    for pages in (table.shape[1], table.shape[1] + 9):
        wide = torch.cat([table, table[:, :1].expand(-1, pages - table.shape[1])], 1)
        with kernel_census() as census:
            got = dk.paged_select(q_idx, idx_cache, wide, seq_lens, topk=k, init_blocks=1, local_blocks=2,
                                  idx_scale=scale, backend="triton")
        runs.append(dict(census.variants))
        want = dk.paged_select_reference(q_idx, idx_cache, wide, seq_lens, topk=k, init_blocks=1, local_blocks=2,
                                         idx_scale=scale)
        scores = dk.paged_block_scores_reference(q_idx, idx_cache, wide, seq_lens, scale)
        assert_same_selection(got, want, scores, tol=1e-2)
        assert (got[0, :, 1:] == -1).all() and (got[2, :, 5:] == -1).all() and (got[1] >= 0).all()
    assert runs[0] == runs[1] and {"topk_chunk_kernel", "topk_merge_kernel"} <= set(runs[0])


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_index_write_fills_pages_as_the_prefill_quantises(backend, key_dtype):
    """Index keys appended one token at a time (sequences at different positions, shuffled pages, Di not a power of
    two) leave each full page holding exactly the prefill's per-block quantisation of its keys, and the newest
    page that of the keys it has so far; the kernel and the reference write the same bytes."""
    B, bs, Di, steps = 3, 8, 24, 20
    table = torch.randperm(B * 4).view(B, 4).int()
    start = torch.tensor([0, 3, 8])  # sequence b's first position
    # magnitudes that rise, fall and rise again: steps whose key raises its page's scale (the page quantised again)
    # and steps whose key does not (the new row alone)
    size = torch.cat([torch.logspace(-2, 1, 10), torch.logspace(1, -2, 9), torch.logspace(-1, 2, steps - 11)])
    keys = (torch.randn(B, steps + 8, Di) * size[None, :, None]).to(key_dtype)
    # (each sequence's key at position t: keys[b, t])
    cache = torch.full((B * 4, bs, Di), 7.0).to(torch.float8_e4m3fn)  # rows past a sequence are never written
    scale = torch.zeros(B * 4, bs)  # as PagedCache starts them
    tail = torch.zeros(B, bs, Di, dtype=key_dtype)
    rows = torch.arange(B)
    for t in range(steps):
        pos = start + t
        dk.paged_index_write(cache, scale, tail, keys[rows, pos], rows, pos, table, backend=backend)
    for b in range(B):
        L = int(start[b]) + steps
        for p in range(-(-L // bs)):
            lo, hi = max(p * bs, int(start[b])), min((p + 1) * bs, L)
            if lo >= hi:
                continue
            page = torch.zeros(bs, Di, dtype=key_dtype)
            page[lo - p * bs: hi - p * bs] = keys[b, lo:hi]  # keys are indexed by position
            want8, want_s = indexer.quantize_index_keys(page[None], bs)
            got8 = cache[table[b, p]].float()
            assert torch.equal(got8[: hi - p * bs], want8[0].float()[: hi - p * bs]), (b, p)
            assert torch.equal(scale[table[b, p], : hi - p * bs], want_s[0].expand(hi - p * bs)), (b, p)
    if backend == "triton":  # the same bytes as the reference over the whole cache
        cache2, scale2 = torch.full_like(cache.float(), 7.0).to(cache.dtype), torch.zeros_like(scale)
        tail2 = torch.zeros_like(tail)
        for t in range(steps):
            pos = start + t
            dk.paged_index_write_reference(cache2, scale2, tail2, keys[rows, pos], rows, pos, table)
        assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8))
        assert torch.equal(scale, scale2) and torch.equal(tail, tail2)
    with pytest.raises(ValueError, match="paged_index_write"):
        dk.paged_index_write(cache.float(), scale, tail, keys[rows, 0], rows, start, table)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-keys", "fp8"])
def test_paged_decode_equals_prefill_last_token(fp8):
    """The decode path and the prefill path agree on the newest token: same blocks, same output (fp8: both quantise
    the query row in the kernel and read the same fp8 keys and scales)."""
    B, T, Hkv, G, D, bs, k = 1, 77, 2, 4, 16, 8, 3
    q, kk, v = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    q_idx, k_idx = torch.randn(B, T, Hkv, 16), torch.randn(B, T, 16)
    k_scale = None
    if fp8:
        k_idx, k_scale = indexer.quantize_index_keys(k_idx)
    blocks = indexer.select_blocks(q_idx, k_idx, block_size=bs, topk=k, k_scale=k_scale, backend="triton")
    full = sa.sparse_attention(q, kk, v, blocks, block_size=bs, backend="triton")
    pages = -(-T // bs)
    pad = pages * bs - T
    as_pages = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).view(pages, bs, *x.shape[1:])  # noqa: E731
    table = torch.arange(pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([T], dtype=torch.int32)
    idx_cache = as_pages(k_idx[0].view(torch.uint8)[:, None])[:, :, 0].view(k_idx.dtype)  # (fp8 has no pad kernel)
    idx_scale = None if k_scale is None else torch.nn.functional.pad(k_scale[0], (0, pad)).view(pages, bs)
    sel = dk.paged_select(q_idx[:, -1], idx_cache, table, seq_lens, topk=k, idx_scale=idx_scale, backend="triton")
    assert_same_selection(sel, blocks[:, :, -1])
    out = dk.paged_attention(q[:, :, -1], as_pages(kk[0].transpose(0, 1)), as_pages(v[0].transpose(0, 1)), sel, table,
                             seq_lens, backend="triton")
    assert rel_err(out, full[:, :, -1]) < 1e-5


PREFIX_CASES = [  # B, Hkv, G, T, bs, k, first query row: the queries of the last T - first positions
    (1, 1, 1, 37, 8, 3, 36),  # one query, group 1
    (1, 2, 7, 45, 8, 2, 19),  # group 7, queries from mid-block
    (1, 1, 3, 40, 4, 1, 17),  # top-1: the reference gathers (its reach is below T)
]


@pytest.mark.parametrize("case", PREFIX_CASES, ids=lambda c: "B{}-Hkv{}-G{}-T{}-bs{}-k{}-from{}".format(*c))
def test_prompt_chunk_over_a_cached_prefix(case):
    """Fewer queries than keys (a prefill chunk over the keys cached before it): the selection (bf16 and fp8
    keys with one scale per block) and the sparse attention of the last queries, kernel and reference, equal those
    rows of the whole prompt's."""
    B, Hkv, G, T, bs, k, t0 = case
    q_idx, k_idx = torch.randn(B, T, Hkv, 16), torch.randn(B, T, 16)
    k8, k_scale = indexer.quantize_index_keys(k_idx, bs)
    for keys, scale in ((k_idx, None), (k8, k_scale)):
        blocks = indexer.select_blocks_reference(q_idx, keys, block_size=bs, topk=k, init_blocks=1, k_scale=scale)
        for backend in ("triton", "torch"):
            got = indexer.select_blocks(q_idx[:, t0:], keys, block_size=bs, topk=k, init_blocks=1, k_scale=scale,
                                        backend=backend)
            assert got.shape == (B, Hkv, T - t0, k)
            assert_same_selection(got, blocks[:, :, t0:])
    q, kk, v = torch.randn(B, Hkv * G, T, 16), torch.randn(B, Hkv, T, 16), torch.randn(B, Hkv, T, 16)
    whole = sparse_attention(q, kk, v, blocks, block_size=bs)
    for backend in ("triton", "torch"):
        got = sa.sparse_attention(q[:, :, t0:], kk, v, blocks[:, :, t0:], block_size=bs, backend=backend)
        assert rel_err(got, whole[:, :, t0:]) < 1e-5


QUANTISED_KV_CASES = [  # lens, block, Hkv, G, D, topk, cache dtype
    ([1], 16, 1, 1, 16, 4, torch.float8_e4m3fn),  # one token, group 1
    ([37, 5, 64], 8, 2, 7, 24, 4, torch.float8_e4m3fn),  # group 7, lengths off the page, D not a power of two
    ([37, 1, 64], 8, 2, 3, 24, 3, torch.int8),  # int8 rows: group 3, one token, lengths off the page
]


@pytest.mark.parametrize("case", QUANTISED_KV_CASES, ids=lambda c: "lens{}-bs{}-Hkv{}-G{}-D{}-k{}-{}".format(
    "_".join(map(str, c[0])), *c[1:-1], str(c[-1])[6:]))
def test_paged_attention_quantised_kv_cache(case):
    """An fp8 or int8 K/V cache (one scale per token and head) dequantised in the kernel: the same as the reference
    over the dequantised cache, with -1 slots among the blocks, and within the format's precision of the unquantised
    cache (e4m3: 3 mantissa bits, ~2-3% a value; int8: 1/254 of a row's largest value a step)."""
    lens, bs, Hkv, G, D, k, dtype = case
    k_cache, v_cache, idx_cache, table, seq_lens = _paged(lens, bs, Hkv, D, 16)
    k_cache = k_cache * torch.logspace(-1, 1, bs)[None, :, None, None]  # rows of different magnitudes
    (k8, ks), (v8, vs) = dk.quantize_kv(k_cache, dtype), dk.quantize_kv(v_cache, dtype)
    assert k8.dtype == dtype and ks.shape == k_cache.shape[:3]
    B = len(lens)
    q = torch.randn(B, Hkv * G, D)
    blocks = dk.paged_select_reference(torch.randn(B, Hkv, 16), idx_cache, table, seq_lens, topk=k)
    assert (blocks == -1).any() and (blocks >= 0).any()
    got = dk.paged_attention(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, backend="triton")
    want = dk.paged_attention_reference(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < 1e-5
    exact = dk.paged_attention_reference(q, k_cache, v_cache, blocks, table, seq_lens)
    assert rel_err(want, exact) < (0.06 if dtype == torch.float8_e4m3fn else 0.02)
    if dtype == torch.int8:  # rows stored rotated (D 24: an orthogonal matrix, not Hadamard): the kernel rotates the
        # queries in and the output back, as the reference does, and lands near the unrotated attention
        from m3compile.runtime.key_shift import rotation
        r = rotation(D)
        (k8, ks), (v8, vs) = dk.quantize_kv(k_cache @ r, dtype), dk.quantize_kv(v_cache @ r, dtype)
        got = dk.paged_attention(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, rotation=r,
                                 backend="triton")
        want = dk.paged_attention_reference(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, rotation=r)
        assert rel_err(got, want) < 1e-5 and rel_err(want, exact) < 0.02
        with pytest.raises(ValueError, match=r"rotation must be \[D, D\] = \[24, 24\] fp32"):
            dk.paged_attention(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, rotation=r[:16, :16])
        with pytest.raises(ValueError, match="quantised K and V caches must have one dtype"):
            dk.paged_attention(q, k8, v8.view(torch.float8_e4m3fn), blocks, table, seq_lens, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_int8_kernels_make_the_hadamard_rotation_in_registers(q_dtype):
    """hadamard=True (a power-of-two head dim: the rotation is the Walsh-Hadamard matrix, whose signs the kernels
    make instead of loading it): the K/V write and the attention (the queries rotated in every split, the output back
    in the merge) as the reference computes them with the matrix, group 5, one token and -1 slots among the blocks;
    the write's codes equal but where fp32 sums in another order cross a rounding boundary."""
    from m3compile.runtime.key_shift import rotation

    lens, bs, Hkv, G, D = [21, 1, 40], 8, 2, 5, 32
    k_cache, v_cache, idx_cache, table, seq_lens = _paged(lens, bs, Hkv, D, 16)
    r = rotation(D)
    assert torch.equal(r.abs(), torch.full((D, D), D**-0.5))  # (a Walsh-Hadamard matrix)
    (k8, ks), (v8, vs) = dk.quantize_kv(k_cache @ r, torch.int8), dk.quantize_kv(v_cache @ r, torch.int8)
    B = len(lens)
    q = torch.randn(B, Hkv * G, D).to(q_dtype)
    blocks = dk.paged_select_reference(torch.randn(B, Hkv, 16), idx_cache, table, seq_lens, topk=3)
    assert (blocks == -1).any()
    got = dk.paged_attention(q, k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs, rotation=r, hadamard=True,
                             backend="triton")
    want = dk.paged_attention_reference(q.float(), k8, v8, blocks, table, seq_lens, k_scale=ks, v_scale=vs,
                                        rotation=r)
    assert got.dtype == q_dtype and rel_err(got, want) < (1e-5 if q_dtype == torch.float32 else 2e-3)
    N, P = 7, table.numel()
    k, v = torch.randn(N, Hkv, D).to(q_dtype), torch.randn(N, Hkv, D).to(q_dtype)
    shift = torch.randn(Hkv, D)
    slots = torch.randperm(P * bs)[:N]
    caches = [(torch.zeros(P, bs, Hkv, D, dtype=torch.int8), torch.zeros(P, bs, Hkv, D, dtype=torch.int8),
               torch.ones(P, bs, Hkv), torch.ones(P, bs, Hkv)) for _ in range(2)]
    dk.paged_kv_write(*caches[0][:2], k, v, slots // bs, slots % bs, k_scale=caches[0][2], v_scale=caches[0][3],
                      k_shift=shift, rotation=r, hadamard=True, backend="triton")
    dk.paged_kv_write_reference(*caches[1][:2], k, v, slots // bs, slots % bs, caches[1][2], caches[1][3], shift, r)
    for i in (0, 1):
        got8, want8 = caches[0][i].float(), caches[1][i].float()
        assert ((got8 - want8).abs() <= 1).all() and (got8 != want8).float().mean() < 0.02
        assert torch.allclose(caches[0][i + 2], caches[1][i + 2], rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="power-of-two head dim, got 24"):
        dk.paged_attention(torch.randn(1, 2, 24), torch.zeros(2, 8, 1, 24, dtype=torch.int8),
                           torch.zeros(2, 8, 1, 24, dtype=torch.int8), torch.zeros(1, 1, 1, dtype=torch.int32),
                           torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                           k_scale=torch.ones(2, 8, 1), v_scale=torch.ones(2, 8, 1), rotation=rotation(24),
                           hadamard=True)
    with pytest.raises(ValueError, match="hadamard=True needs the rotation matrix"):
        dk.paged_kv_write(*caches[0][:2], k, v, slots // bs, slots % bs, k_scale=caches[0][2], v_scale=caches[0][3],
                          hadamard=True)


def test_paged_attention_fp8_kv_cache_fp16_queries_over_every_page():
    """fp16 queries over an fp8 K/V cache, a dense call (every page, several per split, -1 past the shorter
    sequence), group 3: the kernel casts the fp8 tiles to fp16 as they are and applies the scales to the scores
    and probabilities; with value rows down to 1e-4 in magnitude (p * v_scale near fp16's subnormals) the output
    stays within twice its own fp16 rounding of the fp32 reference over the dequantised cache."""
    lens, bs, Hkv, G, D = [266, 29], 4, 1, 3, 16
    k_cache, v_cache, _, table, seq_lens = _paged(lens, bs, Hkv, D, 16)
    k_cache = k_cache * torch.logspace(-1, 1, bs)[None, :, None, None]
    v_cache = v_cache * torch.logspace(-4, 0, bs)[None, :, None, None]
    (k8, ks), (v8, vs) = dk.quantize_kv(k_cache), dk.quantize_kv(v_cache)
    ids = torch.arange(table.shape[1], dtype=torch.int32)
    every = torch.where(ids[None] < ((seq_lens + bs - 1) // bs)[:, None], ids[None], -1)[:, None].expand(-1, Hkv, -1)
    assert every.shape[-1] > 64 and (every == -1).any()
    q = (torch.randn(len(lens), Hkv * G, D) * 2).half()
    got = dk.paged_attention(q, k8, v8, every, table, seq_lens, k_scale=ks, v_scale=vs, backend="triton")
    want = dk.paged_attention_reference(q.float(), k8, v8, every, table, seq_lens, k_scale=ks, v_scale=vs)
    assert got.dtype == torch.float16
    assert rel_err(got, want) < 2 * rel_err(want.half(), want)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_paged_kv_write_quantises_each_token_and_head(dtype):
    """fp8 or int8 K/V rows written for scattered slots: the kernel writes the reference's bytes and scales, each row
    quantised against its own largest magnitude (-> 448 for e4m3, 127 for int8), values at rounding ties and tiny
    negative values (e4m3: -0) included; other slots keep their contents; a bf16 cache takes the values."""
    P, bs, H, D, N = 6, 8, 3, 24, 13
    k = torch.randn(N, H, D) * torch.logspace(-3, 2, N)[:, None, None]
    v = torch.randn(N, H, D)
    v[:, :, 1] = v.abs().amax(-1) * torch.tensor([0.5, 1.5, 2.5, -3.5])[torch.arange(N * H) % 4].view(N, H) / 127
    v[:, :, 2] = -1e-7 * v.abs().amax(-1)  # rounds to zero: the sign byte of -0 as torch's cast writes it
    slots = torch.randperm(P * bs)[:N]
    page, off = slots // bs, slots % bs
    caches = [(torch.zeros(P, bs, H, D, dtype=dtype), torch.zeros(P, bs, H, D, dtype=dtype),
               torch.ones(P, bs, H), torch.ones(P, bs, H)) for _ in range(2)]
    dk.paged_kv_write(caches[0][0], caches[0][1], k, v, page, off, k_scale=caches[0][2], v_scale=caches[0][3],
                      backend="triton")
    dk.paged_kv_write_reference(caches[1][0], caches[1][1], k, v, page, off, caches[1][2], caches[1][3])
    for got, want in zip(*caches):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    k8, ks = caches[0][0][page, off].float(), caches[0][2][page, off]
    top = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    assert torch.equal(k8.abs().amax(-1), torch.full((N, H), top))
    assert rel_err(k8 * ks[..., None], k) < (0.05 if dtype == torch.float8_e4m3fn else 0.01)
    if dtype == torch.int8:  # the planted ties (x.5 steps of the row's scale) round half to even
        v8, vs = caches[0][1][page, off].float(), caches[0][3][page, off]
        ties = (v[:, :, 1] / vs - (v[:, :, 1] / vs).floor() == 0.5)
        assert ties.any() and (v8[:, :, 1][ties] % 2 == 0).all()
    untouched = torch.ones(P * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[0][2].view(-1, H)[untouched] == 1).all()
    bf16 = torch.zeros(P, bs, H, D, dtype=torch.bfloat16)
    dk.paged_kv_write(bf16, bf16.clone(), k, v, page, off)
    assert torch.equal(bf16[page, off], k.bfloat16())
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        dk.paged_kv_write(caches[0][0], caches[0][1], k, v, page, off)
    # the key shift (keys less it) and the rotation (keys and values times it) inside the same kernel, as the
    # reference computes them first: the same codes but where fp32 products summed in another order cross a rounding
    # boundary (at most one step)
    from m3compile.runtime.key_shift import rotation

    shift, rot = torch.randn(H, D), rotation(D)
    caches = [(torch.zeros(P, bs, H, D, dtype=dtype), torch.zeros(P, bs, H, D, dtype=dtype),
               torch.ones(P, bs, H), torch.ones(P, bs, H)) for _ in range(2)]
    dk.paged_kv_write(caches[0][0], caches[0][1], k, v, page, off, k_scale=caches[0][2], v_scale=caches[0][3],
                      k_shift=shift, rotation=rot, backend="triton")
    dk.paged_kv_write_reference(caches[1][0], caches[1][1], k, v, page, off, caches[1][2], caches[1][3], shift, rot)
    for i, want_rows in ((0, (k - shift) @ rot), (1, v @ rot)):
        got8, want8 = caches[0][i][page, off].float(), caches[1][i][page, off].float()
        step = 1.0 if dtype == torch.int8 else (want8.abs().clamp(min=2**-6) * 2**-3)  # an int8 code; an e4m3 ulp
        assert ((got8 - want8).abs() <= step).all() and ((got8 != want8).float().mean() < 0.02)
        assert torch.allclose(caches[0][i + 2], caches[1][i + 2], rtol=1e-5, atol=0)
        assert rel_err(got8 * caches[0][i + 2][page, off][..., None], want_rows) < (
            0.05 if dtype == torch.float8_e4m3fn else 0.01)
    with pytest.raises(ValueError, match="rotation must be"):
        dk.paged_kv_write(caches[0][0], caches[0][1], k, v, page, off, k_scale=caches[0][2], v_scale=caches[0][3],
                          rotation=rot[:-1])


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="q_idx must be"):
        indexer.select_blocks(torch.randn(1, 4, 16), torch.randn(1, 4, 16), block_size=8, topk=2)
    with pytest.raises(ValueError, match="k_scale"):
        indexer.select_blocks(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 16).to(torch.float8_e4m3fn), block_size=8,
                              topk=2)
    with pytest.raises(ValueError, match="blocks must be"):
        sa.sparse_attention(torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16),
                            torch.zeros(1, 2, 8, 2, dtype=torch.int32), block_size=8)
    with pytest.raises(ValueError, match="scores must be fp32"):
        dk.top_blocks(torch.randn(1, 2, 4).half(), torch.tensor([5], dtype=torch.int32), block_size=4, topk=2)
    with pytest.raises(ValueError, match="idx_scale"):
        dk.paged_select(torch.randn(1, 2, 16), torch.randn(3, 8, 16).to(torch.float8_e4m3fn),
                        torch.zeros(1, 3, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), topk=2)
