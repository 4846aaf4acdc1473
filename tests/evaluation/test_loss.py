"""m3c eval loss: the oracle-selection loss against an independent masked-dense path, the all-blocks identity, the oracle
beating the untrained index branch on the shared byte model, the tail figures, and the CLI's JSON and table."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from m3compile import evaluate, load
from m3compile.data import load_tokens
from m3compile.kernels.causal_lse import naive as ref
from m3compile.models.decoder import Attention, Decoder, ModelArgs, MSALayerArgs
from m3compile.ops import lowering_enabled
from tests.conftest import EVAL_DATA
from tests.cli.test_cli import assert_clean_failure, run, small_ckpt  # noqa: F401 (fixture)


def _tiny(block=8, topk=3, init=1, local=1, layers=3):
    args = ModelArgs(vocab_size=64, hidden_size=32, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=48, qk_norm="rms", sparse_layers=(False,) + (True,) * (layers - 1),
                     msa=MSALayerArgs(index_heads=2, index_dim=8, block_size=block, topk=topk, init_blocks=init,
                                      local_blocks=local))
    model = Decoder(args).eval()
    with torch.no_grad():  # sharper attention than the default init, so the selection matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def _naive_oracle_mask(q, k, block, topk, init):
    """[B, Hkv, T, T] bool, built with plain sorting on the full T x T matrix (small T): per (group, query) the local
    block, the first `init` blocks, then the earlier blocks of most group-mean dense attention mass."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    s = torch.einsum("bhgtd,bhjd->bhgtj", q.float().view(B, Hkv, Hq // Hkv, T, D), k.float()) * D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1).mean(2)  # [B, Hkv, T, T]
    n_blocks = -(-T // block)
    mass = F.pad(p, (0, n_blocks * block - T)).view(B, Hkv, T, n_blocks, block).sum(-1)
    chosen = torch.zeros(B, Hkv, T, n_blocks, dtype=torch.bool)
    for t in range(T):
        own = t // block
        forced = {own} | set(range(min(init, own + 1)))
        free = [b for b in range(own) if b not in forced]
        for b_, h in np.ndindex(B, Hkv):
            order = sorted(free, key=lambda b: -float(mass[b_, h, t, b]))
            for b in list(forced) + order[: max(0, topk - len(forced))]:
                chosen[b_, h, t, b] = True
    keys = chosen.repeat_interleave(block, -1)[..., :T]
    return keys & causal


def test_oracle_loss_equals_masked_dense_attention(monkeypatch):
    model = _tiny()
    tokens = torch.randint(0, 64, (65,))
    report = evaluate(model, tokens, seq_len=64)
    assert report.oracle_loss is not None and report.sparse_loss is not None

    def masked_dense(self, q, k, v, q_idx, k_idx):  # the independent path: SDPA with an explicit boolean mask
        m = self.msa
        mask = _naive_oracle_mask(q, k, m.block_size, m.topk, m.init_blocks)
        G = self.n_heads // self.n_kv_heads
        mask = mask.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                              attn_mask=mask, scale=self.scale)

    monkeypatch.setattr(Attention, "_msa", masked_dense)
    with torch.no_grad():
        logits = model(tokens[None, :-1])
    expected = float(F.cross_entropy(logits.flatten(0, 1), tokens[1:]))
    assert report.oracle_loss == pytest.approx(expected, abs=1e-5)
    assert report.oracle_loss != pytest.approx(report.sparse_loss, abs=1e-4)  # the oracle did select differently


def test_all_blocks_selected_oracle_equals_sparse_equals_dense():
    model = _tiny(block=8, topk=8, init=0)  # 8 x 8 = 64 >= every prefix
    report = evaluate(model, torch.randint(0, 64, (129,)), seq_len=64)
    assert report.sparse_loss == pytest.approx(report.dense_loss, abs=1e-5)
    assert report.oracle_loss == pytest.approx(report.dense_loss, abs=1e-5)
    assert report.tail_share == 0 and report.oracle_tail_share == 0
    assert all(r == pytest.approx(1.0) for r in report.recall_p10.values())
    assert json.loads(json.dumps(report.to_dict(), allow_nan=False))["oracle_loss_increase"] == pytest.approx(0, abs=1e-5)


def test_tail_figures_and_no_oracle():
    model = _tiny(block=4, topk=2, init=0)
    report = evaluate(model, torch.randint(0, 64, (129,)), seq_len=64, oracle=False)
    assert report.oracle_loss is None and report.oracle_tail_share is None
    d = report.to_dict()
    assert d["oracle_loss"] is None and d["oracle_loss_increase"] is None
    assert d["oracle_recall"] is None and d["mean_oracle_recall"] is None and report.oracle_recall == {}
    assert 0 <= d["tail_share"] <= 1 and set(d["recall_p10"]) == {"1", "2"}
    assert all(0 <= d["recall_p10"][k] <= d["recall"][k] + 1e-4 for k in d["recall_p10"])  # p10 below the mean
    assert d["min_recall_p10"] == min(d["recall_p10"].values())


def _oracle_pass_recall(model, tokens, seq_len):
    """Per MSA layer, reference.oracle_recall of the q/k each layer sees in the oracle forward, mean over tokens."""
    sums, count = {}, 0
    msa = model.args.msa

    def capture(i, attn, q, k, blocks, lse):
        r = ref.oracle_recall(q, k, block_size=msa.block_size, topk=msa.topk, init_blocks=msa.init_blocks,
                              local_blocks=msa.local_blocks, scale=attn.scale)
        sums[i] = sums.get(i, 0.0) + float(r.sum())

    layers = [i for i in range(model.args.n_layers) if model.args.is_sparse(i)]
    for i in layers:
        model.model.layers[i].self_attn.observer = lambda *a, _i=i: capture(_i, *a)
    model.set_selection("oracle")
    try:
        with torch.no_grad():
            for w in range(tokens.numel() // seq_len):
                model(tokens[None, w * seq_len: (w + 1) * seq_len])
                count += model.args.n_kv_heads * seq_len
    finally:
        model.set_selection("index")
        for i in layers:
            model.model.layers[i].self_attn.observer = None
    return {i: sums[i] / count for i in layers}


@pytest.mark.parametrize("heads, kv, layers, n_windows", [(3, 1, 3, 2), (1, 1, 2, 1)],
                         ids=["group3-two-msa-layers-batch2", "group1"])
def test_lowered_path_equals_the_reference_path(heads, kv, layers, n_windows):
    """kernels=True (Triton selection, sparse attention with its LSE, recall from causal_lse.dense_recall; here
    under the interpreter) against the reference ops: losses, tails, per-layer recall and p10, oracle recall; T = 19
    is not a multiple of the block. The oracle recall is the one of the oracle pass's own q/k."""
    args = ModelArgs(vocab_size=64, hidden_size=24, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=8,
                     intermediate_size=32, sparse_layers=(False,) + (True,) * (layers - 1),
                     msa=MSALayerArgs(index_heads=kv, index_dim=8, block_size=4, topk=3, init_blocks=1))
    model = Decoder(args).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    T = 19
    tokens = torch.randint(0, 64, (n_windows * T + 1,))
    slow = evaluate(model, tokens, seq_len=T)  # on CPU the default is the reference ops
    fast = evaluate(model, tokens, seq_len=T, kernels=True, batch=n_windows)
    assert not lowering_enabled() and not any(a.observer for a in (layer.self_attn for layer in model.model.layers))
    for name in ("dense_loss", "sparse_loss", "oracle_loss"):
        assert getattr(fast, name) == pytest.approx(getattr(slow, name), abs=1e-5), name
    assert slow.sparse_loss != pytest.approx(slow.dense_loss, abs=1e-4)  # the selection does matter here
    assert (fast.tail_share, fast.oracle_tail_share) == (slow.tail_share, slow.oracle_tail_share)
    assert set(fast.recall) == set(fast.oracle_recall) == set(range(1, layers))
    for i in fast.recall:
        assert fast.recall[i] == pytest.approx(slow.recall[i], abs=1e-5)
        assert fast.recall_p10[i] == pytest.approx(slow.recall_p10[i], abs=1e-4)
        assert fast.oracle_recall[i] == pytest.approx(slow.oracle_recall[i], abs=1e-5)
        assert fast.recall[i] < 1 - 1e-3
    expected = _oracle_pass_recall(model, tokens, T)
    for i in expected:
        assert fast.oracle_recall[i] == pytest.approx(expected[i], abs=1e-5)




def test_oracle_beats_the_untrained_index_branch(byte_msa):
    report = evaluate(load(byte_msa, dtype="float32"), load_tokens(EVAL_DATA, 256), seq_len=512, max_windows=2)
    assert report.dense_loss < report.oracle_loss < report.sparse_loss, report.to_dict()
    assert report.oracle_tail_share <= report.tail_share
    assert all(report.oracle_recall[i] >= report.recall[i] - 1e-6 for i in report.recall)


def test_cli_eval_json_and_table(small_ckpt, tmp_path):
    code, output = run("convert", small_ckpt, tmp_path / "m", "--block-size", 8, "--topk", 2)
    assert code == 0, output
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.randint(0, 256, size=200).astype(np.int32))
    code, output = run("eval", "loss", tmp_path / "m", "--data", data, "--seq-len", 64, "--json")
    assert code == 0, output
    d = json.loads(output)
    for key in ("oracle_loss", "oracle_loss_increase", "tail_share", "oracle_tail_share", "recall_p10",
                "min_recall_p10"):
        assert key in d and d[key] is not None, key
    assert math.isfinite(d["oracle_loss"])
    code, output = run("eval", "loss", tmp_path / "m", "--data", data, "--seq-len", 64, "--json", "--no-oracle", "--batch", 2)
    assert code == 0 and json.loads(output)["oracle_loss"] is None and json.loads(output)["oracle_recall"] is None
    assert json.loads(output)["dense_loss"] == pytest.approx(d["dense_loss"], abs=1e-5)  # batched: the same loss
    code, output = run("eval", "loss", tmp_path / "m", "--data", data, "--seq-len", 64, "--no-oracle")
    assert code == 0 and "oracle loss" not in output and "recall p10" in output, output
    assert_clean_failure(*run("eval", "loss", tmp_path / "m", "--data", data, "--batch", 0), None, "--batch")
    code, output = run("eval", "loss", tmp_path / "m", "--data", data, "--seq-len", 64)
    assert code == 0 and "oracle loss" in output and "recall p10" in output and "tail" in output, output
    assert_clean_failure(*run("eval", tmp_path / "m", "--data", data, "--task", "nope"), None, "unknown --task")


def test_eval_losses_through_a_kv_cache(byte_msa, monkeypatch):
    """m3c eval loss --kv-cache bf16 / fp8 on the byte model converted at block 16 / top-4 (fp32 weights, one window of
    192 bytes): the dense, MSA and oracle rows come from the paged prefill over a cache of that dtype, the JSON and
    the table name it and recall is not measured. The bf16 cache's rows are within 1% of the model's own forward's,
    the fp8 cache's within 3% of the bf16 cache's and not equal to them. An fp8 cache this torch build cannot hold
    is a one-line error."""
    args = ["eval", "loss", byte_msa, "--data", EVAL_DATA, "--seq-len", 192, "--max-windows", 1]
    rows = ("dense_loss", "sparse_loss", "oracle_loss")
    want = evaluate(load(byte_msa, dtype="float32"), load_tokens(EVAL_DATA, 256), seq_len=192, max_windows=1)
    got = {}
    for kv in ("bf16", "fp8"):
        code, output = run(*args, "--kv-cache", kv, "--json")
        assert code == 0, output
        got[kv] = json.loads(output)
        assert got[kv]["kv_cache"] == kv and got[kv]["recall"] == {} and got[kv]["tokens"] == 192
    for row in rows:
        assert got["bf16"][row] == pytest.approx(getattr(want, row), rel=0.01), row
        assert got["fp8"][row] == pytest.approx(got["bf16"][row], rel=0.03) and got["fp8"][row] != got["bf16"][row]
    assert got["bf16"]["tail_share"] is not None and want.to_dict()["kv_cache"] is None
    code, output = run(*args[:5], "--seq-len", 64, "--max-windows", 1, "--kv-cache", "fp8", "--no-oracle")
    assert code == 0 and "losses through a fp8 K/V cache" in output and "oracle loss" not in output, output
    # retrieval scores the model's own forward: it takes no --kv-cache
    assert_clean_failure(*run("eval", "retrieval", *args[2:5], "--kv-cache", "fp8"), None, "No such option '--kv-cache'")
    to = torch.Tensor.to

    def no_float8(self, *a, **k):  # a build whose CPU tensors cannot be cast to float8
        if torch.float8_e4m3fn in a or k.get("dtype") is torch.float8_e4m3fn:
            raise RuntimeError('"copy_kernel" not implemented for \'Float8_e4m3fn\'')
        return to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", no_float8)
    assert_clean_failure(*run(*args, "--kv-cache", "fp8"), None, "a fp8 K/V cache needs float8_e4m3fn tensors on cpu")


def test_token_losses_are_the_same_in_pieces(monkeypatch):
    """The logits of a window are made a few rows at a time (a 32K window of a large vocabulary would not fit):
    each token's loss is the whole forward's."""
    from m3compile.evaluation import loss as loss_mod

    model = _tiny()
    x = torch.randint(0, 64, (2, 21))
    y = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        whole = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="none")
        monkeypatch.setattr(loss_mod, "LOGIT_ROWS", 5)  # 42 rows: eight pieces of 5 and one of 2
        pieces = loss_mod._token_losses(model, x, y)
    assert pieces.shape == (42,)
    torch.testing.assert_close(pieces, whole)
