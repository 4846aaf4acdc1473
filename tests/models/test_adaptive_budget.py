"""The adaptive budget (docs/msa.md 2.8) end to end: the model's forward, its lowering, the paged prefill and decode,
the oracle, and a converted checkpoint's config.json, all keeping the same blocks."""
import json

import pytest
import torch

import m3compile
from m3compile import MSAConfig
from m3compile.models.decoder import Decoder, ModelArgs, MSALayerArgs
from m3compile.ops import lowering
from m3compile.runtime import PagedCache, decode_step, prefill
from tests.conftest import LLAMA_BYTE

TOP_P, FLOOR = 0.6, 2


def _model(top_p: float = TOP_P, index_dtype: str = "auto") -> Decoder:
    """Dense layer 0, then MSA layers with 4-token blocks and a ceiling of 6: at 45 tokens (12 blocks) the budget
    decides how many blocks each query keeps."""
    args = ModelArgs(vocab_size=64, hidden_size=32, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
                     intermediate_size=48, sparse_layers=(False, True, True),
                     msa=MSALayerArgs(index_heads=2, index_dim=8, block_size=4, topk=6, index_dtype=index_dtype,
                                      top_p=top_p, min_blocks=FLOOR))
    torch.manual_seed(0)
    model = Decoder(args).eval()
    with torch.no_grad():  # sharper index scores than the random init's, so the budget bites
        for layer in model.model.layers[1:]:
            layer.self_attn.index_q_proj.weight.mul_(8)
    return model


def _kept(model: Decoder, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The blocks each MSA layer keeps per (group, query) in the model's own forward."""
    seen = []
    for layer in model.model.layers:
        if layer.self_attn.msa is not None:
            layer.self_attn.observer = lambda attn, q, k, blocks, lse: seen.append((blocks >= 0).sum(-1))
    with torch.no_grad():
        model(tokens)
    for layer in model.model.layers:
        layer.self_attn.observer = None
    return seen


@pytest.mark.parametrize("index_dtype", ["auto", "fp8"])
def test_every_path_keeps_the_same_adaptive_blocks(index_dtype):
    """The reference forward, the lowered forward (Triton under the interpreter), a paged prefill in one pass and in
    chunks, and paged decode steps give the same logits; the budget keeps fewer blocks than the fixed top-k. (fp8
    scoring: the forwards only. The paged paths compute layer 1's output another way, and e4m3 rounding turns such
    1e-7 differences into other codes, so later layers may rank a near-tie otherwise.)"""
    model, fixed = _model(index_dtype=index_dtype), _model(1.0, index_dtype)
    tokens = torch.randint(0, 64, (1, 45))
    kept, full = _kept(model, tokens), _kept(fixed, tokens)
    floor = (torch.arange(45) // 4 + 1).clamp(max=FLOOR)  # the floor, where that many blocks are visible
    assert all((k >= floor).all() for k in kept)
    assert sum(k.sum() for k in kept) < 0.8 * sum(k.sum() for k in full)
    with torch.no_grad():
        want = model(tokens)[0]
        with lowering():
            assert (model(tokens)[0] - want).abs().max().item() < 1e-4
        assert (fixed(tokens)[0] - want).abs().max().item() > 1e-3  # the budget changes the output
    for kernels in (False, True) if index_dtype == "auto" else ():
        with lowering(kernels):
            for chunk in (None, 7):
                cache = PagedCache(model, 1, 48, 4, "cpu", torch.float32, torch.float32)
                last = prefill(model, cache, 0, tokens[0, :41], chunk)
                assert (last - want[40]).abs().max().item() < 1e-4, (kernels, chunk)
            cache.seq_lens[0] = 41  # what generate records after a prefill
            for t in range(41, 45):  # decode steps over the cache the one-pass prefill left
                step = decode_step(model, cache, tokens[:, t])
                assert (step[0] - want[t]).abs().max().item() < 1e-4, (kernels, t)


def test_the_oracle_keeps_the_fewest_blocks_of_mass_top_p():
    """The oracle under the budget keeps fewer blocks than its fixed top-k, and at p = 0.99 about as many blocks
    as the index does at its own budget's ceiling (every candidate has some mass)."""
    tokens = torch.randint(0, 64, (1, 45))
    counts = {}
    for p in (0.5, 0.99, 1.0):
        model = _model(p)
        for layer in model.model.layers:
            layer.self_attn.selection = "oracle"
        counts[p] = sum(k.float().mean() for k in _kept(model, tokens)).item()
    assert counts[0.5] < counts[0.99] <= counts[1.0]


def test_a_converted_checkpoint_keeps_its_budget(tmp_path):
    """config.json carries sparse_top_p and sparse_min_blocks (not M3 keys: only below p = 1), load reads them,
    the converted graph and the loaded model agree, and a re-conversion sets a new budget on every MSA layer."""
    config = MSAConfig(block_size=16, topk=8, dense_layers=(0,), top_p=0.8, min_blocks=3)
    m3compile.convert_checkpoint(LLAMA_BYTE, tmp_path / "a", config)
    sparse = json.loads((tmp_path / "a" / "config.json").read_text())["sparse_attention_config"]
    assert sparse["sparse_top_p"] == 0.8 and sparse["sparse_min_blocks"] == 3 and sparse["sparse_topk_blocks"] == 8
    model = m3compile.load(tmp_path / "a", dtype="float32")
    assert model.args.msa.top_p == 0.8 and model.args.msa.min_blocks == 3
    tokens = torch.randint(0, 256, (1, 300))
    gm, _ = m3compile.convert(model, config)  # traced: the MSA layers' selection nodes carry the budget
    with torch.no_grad():
        want = model(tokens)
        assert (gm(tokens) - want).abs().max().item() < 1e-5
    m3compile.convert_checkpoint(tmp_path / "a", tmp_path / "b", MSAConfig(block_size=16, topk=8, top_p=0.5))
    again = m3compile.load(tmp_path / "b", dtype="float32")
    assert again.args.msa.top_p == 0.5 and again.args.msa.min_blocks == 0
    gm, _ = m3compile.convert(model, MSAConfig(block_size=16, topk=8, top_p=0.5))  # a new budget in memory too
    with torch.no_grad():
        assert (gm(tokens) - again(tokens)).abs().max().item() < 1e-5
        assert (gm(tokens) - want).abs().max().item() > 1e-3
    m3compile.convert_checkpoint(tmp_path / "a", tmp_path / "d")  # no config: the source's own settings
    assert m3compile.load(tmp_path / "d").args.msa == model.args.msa
    m3compile.convert_checkpoint(tmp_path / "a", tmp_path / "c", MSAConfig(block_size=16, topk=8))
    sparse = json.loads((tmp_path / "c" / "config.json").read_text())["sparse_attention_config"]
    assert "sparse_top_p" not in sparse and "sparse_min_blocks" not in sparse
