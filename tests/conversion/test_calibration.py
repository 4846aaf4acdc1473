"""The calibrated index init (`m3c convert --calib`): the whitened closed form, its layer-by-layer moments, streaming
and in-memory agreement, and that it beats the weight-only init on the shared (real, trained) checkpoint."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import m3compile
from m3compile import MSAConfig
from m3compile.cli import main
from m3compile.conversion.streaming import convert_streaming
from m3compile.models.decoder import Decoder
from m3compile.conversion.calibration import Calibration
from m3compile.models.index_init import init_index_weights
from tests.conftest import CALIB_DATA, EVAL_DATA, LLAMA_BYTE

SHAPES = dict(n_heads=6, n_kv_heads=2, head_dim=8, rope_dim=8, index_dim=8)


def _bytes(path, n):
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)[:n].astype(np.int64))


def test_isotropic_moment_is_the_weight_only_init():
    """Whitening by c * I changes nothing: the fit is the weight-only one (up to rounding)."""
    wq, wk = torch.randn(6 * 8, 16, dtype=torch.float64), torch.randn(2 * 8, 16, dtype=torch.float64)
    plain = init_index_weights(wq, wk, **SHAPES)
    iso = init_index_weights(wq, wk, **SHAPES, x_moment=3.0 * torch.eye(16, dtype=torch.float64))
    for a, b in zip(plain, iso):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("moment", [False, True], ids=["weight-only", "calibrated"])
def test_wider_index_head_starts_equal_and_can_learn(moment):
    """An index head wider than the dense head (16 > 8) of a partly rotated head (index rope "m3": the extra
    channels do not turn): the slots nothing fits start with zero query rows and non-zero key rows, so the
    projections score as the head-dim fit does, and the query rows of those slots get a gradient. (A fully rotated
    head gets rule "tile" instead: tests/models/test_index_rope_tile.py.)"""
    torch.manual_seed(0)
    wq, wk = torch.randn(6 * 8, 16, dtype=torch.float64), torch.randn(2 * 8, 16, dtype=torch.float64)
    x = torch.randn(64, 16, dtype=torch.float64) * torch.linspace(0.1, 3.0, 16, dtype=torch.float64)
    c = dict(x_moment=x.T @ x / 64) if moment else {}
    partial = {**SHAPES, "rope_dim": 4}
    q8, k8 = init_index_weights(wq, wk, **partial, **c)
    q16, k16 = init_index_weights(wq, wk, **{**partial, "index_dim": 16}, **c)
    q16 = q16.view(2, 16, 16)
    torch.testing.assert_close(q16[:, :8].reshape(16, 16), q8)
    torch.testing.assert_close(k16[:8], k8)
    assert torch.count_nonzero(q16[:, 8:]) == 0 and bool((k16[8:].norm(dim=-1) > 0).all())
    assert torch.equal(k16, init_index_weights(wq, wk, **{**partial, "index_dim": 16}, **c)[1])  # seeded
    wq_idx = q16.clone().requires_grad_(True)
    scores = torch.einsum("thd,sd->ths", torch.einsum("hdc,tc->thd", wq_idx, x), x @ k16.T)
    scores.pow(2).sum().backward()
    assert wq_idx.grad[:, 8:].abs().max() > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moment_fits_the_data_directions(seed):
    """Hidden states concentrated in a few directions: the calibrated init's logits on such data match the
    group-mean dense logits better than the weight-only init's (the error E|x_i^T (A - M) x_j|^2 it targets)."""
    torch.manual_seed(seed)
    assert _error_ratio() < 0.8


def _error_ratio() -> float:
    hidden, n = 32, 4096
    basis = torch.linalg.qr(torch.randn(hidden, hidden, dtype=torch.float64))[0]
    x = torch.randn(n, hidden, dtype=torch.float64) * torch.logspace(1, -2, hidden, dtype=torch.float64) @ basis.T
    wq, wk = torch.randn(6 * 8, hidden, dtype=torch.float64), torch.randn(2 * 8, hidden, dtype=torch.float64)
    shapes = dict(SHAPES, rope_dim=0)  # no rotary channels: logits are plain dot products, position-free

    def error(wq_idx, wk_idx):
        q = (x @ wq.T).view(n, 2, 3, 8).mean(2)  # group-mean dense queries [n, Hkv, D]
        k = (x @ wk.T).view(n, 2, 8)
        dense = torch.einsum("ngd,mgd->gnm", q, k)
        index = torch.einsum("ngd,md->gnm", (x @ wq_idx.T).view(n, 2, 8), x @ wk_idx.T)
        return ((dense - index) ** 2).mean().item()

    moment = x.T @ x / n
    return error(*init_index_weights(wq, wk, **shapes, x_moment=moment)) / error(*init_index_weights(wq, wk, **shapes))


def test_calibration_checks_its_order_and_input():
    model = m3compile.load(LLAMA_BYTE, dtype="float32")
    cal = Calibration(model.args, _bytes(CALIB_DATA, 100), seq_len=64)
    assert (cal.info.tokens, cal.info.windows, cal.info.seq_len) == (64, 1, 64)
    with pytest.raises(AssertionError, match="expected layer 0"):
        cal.moment(0, model.model.layers[0])  # before embed()
    cal.embed(model.model.embed_tokens.weight)
    with pytest.raises(AssertionError, match="got layer 1"):
        cal.moment(1, model.model.layers[1])
    moment = cal.moment(0, model.model.layers[0])
    assert moment.shape == (192, 192) and moment.dtype == torch.float64
    torch.testing.assert_close(moment, moment.T)
    with pytest.raises(m3compile.M3CompileError, match="at least 2 tokens"):
        Calibration(model.args, torch.zeros(1, dtype=torch.long))


def test_streaming_and_in_memory_calibration_agree(tmp_path):
    """Streaming runs the calibration forward from each layer's tensors as it writes them; its index branch is
    bit-identical to the in-memory conversion's (both run the same fp32 copies)."""
    cfg = MSAConfig(block_size=64, topk=4, dense_layers=(0,))
    ids = _bytes(CALIB_DATA, 1024)
    report = convert_streaming(LLAMA_BYTE, tmp_path / "out", cfg, calib=ids, calib_seq_len=512, calib_source="x")
    assert report.index_init.to_dict() == {"method": "calibrated", "tokens": 1024, "windows": 2, "seq_len": 512,
                                           "source": "x"}
    gm, mem_report = m3compile.convert(m3compile.load(LLAMA_BYTE), cfg, calib=ids, calib_seq_len=512)
    assert mem_report.index_init.method == "calibrated"
    streamed = m3compile.load(tmp_path / "out").state_dict()
    names = [n for n in streamed if ".index_" in n]
    assert len(names) == 5 * 4
    for n in names:
        assert torch.equal(streamed[n], gm.state_dict()[n]), n
    plain, _ = m3compile.convert(m3compile.load(LLAMA_BYTE), cfg)
    assert not torch.equal(plain.state_dict()[names[0]], streamed[names[0]])


def test_calibrated_init_beats_weight_only_on_real_checkpoint():
    """On the trained byte model (1,024 held-out bytes, block 64, top-4, index dim 8): lower sparse loss and higher
    block recall than the weight-only init, calibrated on 2,048 training bytes. The gain shows where the index is
    narrower than a head (24 here), so the weight-only init has to drop directions the calibration can choose."""
    model = m3compile.load(LLAMA_BYTE, dtype="float32")
    cfg = MSAConfig(block_size=64, topk=4, dense_layers=(0,), index_dim=8)
    tokens = _bytes(EVAL_DATA, 1025)
    results = {}
    for name, calib in (("weight-only", None), ("calibrated", _bytes(CALIB_DATA, 2048))):
        gm, _ = m3compile.convert(model, cfg, calib=calib, calib_seq_len=1024)
        native = Decoder(gm.meta["model_args"]).eval()
        native.load_state_dict({k: v for k, v in gm.state_dict().items() if k in native.state_dict()})
        results[name] = m3compile.evaluate(native, tokens, seq_len=1024, oracle=False)
    w, c = results["weight-only"], results["calibrated"]
    assert c.sparse_loss < w.sparse_loss - 0.002, (c.sparse_loss, w.sparse_loss)
    assert c.mean_recall > w.mean_recall, (c.mean_recall, w.mean_recall)


def test_cli_reports_the_init(tmp_path):
    runner = CliRunner()
    out = tmp_path / "c"
    res = runner.invoke(main, ["convert", str(LLAMA_BYTE), str(out), "--calib", str(CALIB_DATA), "--calib-tokens",
                               "512", "--calib-seq-len", "256", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["index_init"] == {"method": "calibrated", "tokens": 512, "windows": 2,
                                                    "seq_len": 256, "source": str(CALIB_DATA)}
    assert json.loads((out / "conversion_report.json").read_text())["index_init"]["method"] == "calibrated"
    res = runner.invoke(main, ["convert", str(LLAMA_BYTE), str(tmp_path / "d")])
    assert res.exit_code == 0 and "index init: weight-only (no --calib)" in res.output, res.output
    for bad, msg in ((["--calib-tokens", "1"], "at least 2"), (["--calib-device", "cuda:7"], "cuda")):
        res = runner.invoke(main, ["convert", str(LLAMA_BYTE), str(tmp_path / "e"), "--calib", str(CALIB_DATA), *bad])
        assert res.exit_code == 2 and msg in res.output and not (tmp_path / "e").exists(), res.output
    res = runner.invoke(main, ["convert", str(LLAMA_BYTE), str(tmp_path / "e"), "--calib-tokens", "64"])
    assert res.exit_code == 2 and "--calib-tokens applies only with --calib" in res.output
    assert not (tmp_path / "e").exists()
