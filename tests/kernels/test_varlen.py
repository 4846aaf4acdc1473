"""Variable-length block-diagonal (3D window) attention: Triton (interpreter on CPU) against the torch reference."""
import pytest
import torch

from m3compile.kernels.varlen_attention import varlen_attention, varlen_attention_reference, window_segments


def rel_err(out, want):
    assert not out.isnan().any()
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def test_window_segments_cut_videos_into_windows():
    # video of 7 steps of 2x3 patches, window 4 -> 4 + 3 steps; an image (t = 1); a video of 4 steps -> one window
    cu = window_segments([[7, 2, 3], [1, 4, 4], [4, 1, 2]], window=4)
    assert cu.tolist() == [0, 24, 42, 58, 66]
    assert window_segments([[3, 2, 2]], window=1).tolist() == [0, 4, 8, 12]  # per-frame baseline
    assert window_segments([[3, 2, 2]], window=8).tolist() == [0, 12]  # whole clip


@pytest.mark.parametrize("bad, match", [
    ([[0, 2, 2]], "video 0 is empty"),
    ([[2, 2, 2], [3, 0, 4]], "video 1 is empty"),
    ([], "no image or video"),
])
def test_window_segments_reject_bad_grids(bad, match):
    with pytest.raises(ValueError, match=match):
        window_segments(bad, window=4)


CASES = [  # grids, window, heads, head dim
    ([[1, 1, 1]], 4, 2, 16),  # one token
    ([[7, 3, 5], [1, 4, 4], [2, 2, 3]], 4, 3, 24),  # mixed videos + image, ragged windows, D not a power of two
    ([[9, 4, 4]], 1, 2, 16),  # per-frame segments of 16 tokens
    ([[5, 6, 7], [12, 2, 2]], 4, 1, 80),  # M3's ViT head dim
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"grids{len(c[0])}-W{c[1]}-H{c[2]}-D{c[3]}")
def test_varlen_matches_reference(case):
    grids, window, H, D = case
    cu = window_segments(grids, window)
    N = int(cu[-1])
    q, k, v = torch.randn(N, H, D), torch.randn(N, H, D), torch.randn(N, H, D)
    got = varlen_attention(q, k, v, cu, backend="triton")
    assert rel_err(got, varlen_attention_reference(q, k, v, cu)) < 1e-5


def test_varlen_half_precision():
    cu = window_segments([[6, 4, 5]], 4)
    N = int(cu[-1])
    q, k, v = (torch.randn(N, 2, 32).half() for _ in range(3))
    got = varlen_attention(q, k, v, cu, backend="triton")
    assert got.dtype == torch.float16
    assert rel_err(got, varlen_attention_reference(q.float(), k.float(), v.float(), cu)) < 2e-2


def test_segments_do_not_influence_each_other():
    """Changing one frame changes its own window's outputs and leaves every other window bit-identical."""
    grids, window = [[10, 3, 3], [3, 2, 2]], 4
    cu = window_segments(grids, window)
    N = int(cu[-1])
    q, k, v = torch.randn(N, 2, 16), torch.randn(N, 2, 16), torch.randn(N, 2, 16)
    before = varlen_attention(q, k, v, cu, backend="triton")
    frame = slice(5 * 9, 6 * 9)  # step 5 of video 0: inside its second window [36, 72)
    k2, v2 = k.clone(), v.clone()
    k2[frame] += 1.0
    v2[frame] -= 2.0
    after = varlen_attention(q, k2, v2, cu, backend="triton")
    changed = (after != before).any(-1).any(-1)
    window_of = torch.bucketize(torch.arange(N), cu[1:].long(), right=True)
    assert changed[window_of == 1].all()
    assert torch.equal(after[window_of != 1], before[window_of != 1])


def test_varlen_rejects_bad_input():
    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="token count 10"):
        varlen_attention(q, q, q, torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="strictly increasing"):
        varlen_attention(q, q, q, torch.tensor([0, 4, 4, 10], dtype=torch.int32))
