"""m3c bench --model: the whole-model bench's JSON on a small checkpoint (CPU, timings meaningless), its
extrapolation laws, the decode batch that fits in memory, and its outputs."""
import json

import torch
from click.testing import CliRunner

from m3compile.cli import main
from m3compile.kernels import _common as kernel_common
from m3compile.models.decoder import PRESETS, MSALayerArgs
from m3compile.tools.bench_model import GROUPS, STAGES, cache_bytes, decode_batch, extrapolate, write_model_outputs
from tests.conftest import LLAMA_BYTE


def _close(a, b, rel=2e-3, abs_=2e-3):
    return abs(a - b) <= max(abs_, rel * abs(b))


def test_model_bench_json_on_a_small_checkpoint(tmp_path, monkeypatch):
    """A dense checkpoint directory, converted in memory: prefill rows timed up to --dense-max / --msa-max and
    extrapolated (marked) beyond; each breakdown sums to its total; extrapolated stages follow their laws from the
    longest timed row; decode rows with their batch, eager timings (no CUDA graph on a CPU) and breakdown; the
    conversion kept the model's device and dtype."""
    # torch references on CPU (the interpreted kernels are tested elsewhere); not through the environment: Triton
    # reads TRITON_INTERPRET once, and a kernel module imported meanwhile would stay compiled-mode for the session
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, [
        "bench", "--model", str(LLAMA_BYTE), "--device", "cpu", "--dtype", "float32", "--prefill-lengths",
        "48,80", "--dense-max", "48", "--msa-max", "48", "--decode-lengths", "48", "--batch", "2", "--block", "16",
        "--topk", "2", "--steps", "1", "--decode-steps", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "dense-llama-byte.json").read_text())
    assert (out / "model_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["bench"] == "model" and data["msa"]["block_size"] == 16 and data["msa_layers"] == 5
    assert data["conversion_check"] == {"device": "cpu", "dtype": "float32", "tensors_added": 20, "mismatched": [],
                                        "ok": True}
    rows = {(row["T"], row["model"]): row for row in data["prefill"]}
    assert set(rows) == {(48, "dense"), (48, "msa"), (80, "dense"), (80, "msa")}
    for name in ("dense", "msa"):
        timed, extra = rows[48, name], rows[80, name]
        assert timed["measured"] == "timed" and timed["runs"] >= 1 and timed["from_T"] is None
        assert extra["measured"] == "extrapolated" and extra["from_T"] == 48 and extra["runs"] == 0
        for row in (timed, extra):
            assert set(row["stages"]) == set(STAGES) and set(row["breakdown"]) == set(GROUPS)
            assert all(v >= 0 for v in row["stages"].values())
            assert _close(sum(row["breakdown"].values()), row["ms"]), row
            assert row["breakdown"]["attention"] > 0 and row["breakdown"]["projections_mlp"] > 0
        want = extrapolate(timed["stages"], 48, 80, keys=32)
        assert all(_close(extra["stages"][s], want[s]) for s in STAGES)
        # the laws themselves: linear, constant, causal pairs, keys a top-2 x 16 selection reaches (32 per query)
        st = timed["stages"]
        assert _close(want["projections_mlp"], st["projections_mlp"] * 80 / 48) and want["host"] == st["host"]
        assert _close(want["attention_dense"], st["attention_dense"] * (80 * 81) / (48 * 49))
        assert _close(want["attention_sparse"], st["attention_sparse"] * (528 + 48 * 32) / (528 + 16 * 32))
    assert rows[48, "dense"]["breakdown"]["indexer"] == 0 and rows[48, "msa"]["breakdown"]["indexer"] > 0
    assert rows[48, "msa"]["stages"]["attention_sparse"] > 0 and rows[48, "dense"]["stages"]["attention_sparse"] == 0
    for s in data["prefill_summary"]:
        d = rows[s["T"], "dense"]
        assert _close(s["speedup"], d["ms"] / rows[s["T"], "msa"]["ms"], rel=1e-2)
        assert _close(s["ceiling"], d["ms"] / (d["ms"] - d["breakdown"]["attention"]), rel=1e-2)
    assert [s["dense"] for s in data["prefill_summary"]] == ["timed", "extrapolated"]
    (dec,) = data["decode"]
    assert dec["T"] == 48 and dec["batch"] == dec["batch_requested"] == 2 and dec["note"] is None
    for name in ("dense", "msa"):
        row = dec[name]
        assert row["eager_ms"] > 0 and row["eager_tokens_per_s"] > 0 and row["graph_ms"] is None
        assert "CUDA" in row["graph_unavailable"]
        assert _close(sum(row["breakdown"].values()), row["eager_ms"]), row
    assert dec["msa"]["breakdown"]["indexer"] > 0 and dec["dense"]["breakdown"]["indexer"] == 0
    assert dec["speedup"] is None and dec["speedup_eager"] > 0
    assert "extrapolated" in r.output and "conversion kept device cpu and dtype float32: yes" in r.output


def test_decode_batch_is_what_fits():
    """Llama-3-8B shapes at 128K: 8 sequences of bf16 caches need ~146 GB; with ~118 GB free six fit. Qwen2.5-7B
    (4 KV heads) fits 8 at 128K; nothing fits at 8M."""
    llama = PRESETS["llama3-8b"].replace(sparse_layers=(False,) + (True,) * 31, msa=MSALayerArgs(8, 128, 128, 16))
    per_seq = cache_bytes(llama, 131072, 128, torch.bfloat16, torch.bfloat16)
    assert per_seq == 32 * 2 * 131072 * 8 * 128 * 2 + 31 * 131072 * 128 * 2
    fp8 = cache_bytes(llama, 131072, 128, torch.bfloat16, torch.float8_e4m3fn)
    assert fp8 == 32 * 2 * 131072 * 8 * 128 * 2 + 31 * 131072 * (128 + 4)
    free, reserve = 122e9, 4e9
    assert decode_batch(llama, 131072, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 6
    assert decode_batch(llama, 32768, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 8
    assert decode_batch(llama, 8 << 20, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 0
    qwen = PRESETS["qwen2.5-7b"].replace(sparse_layers=(False,) + (True,) * 27, msa=MSALayerArgs(4, 128, 128, 16))
    assert decode_batch(qwen, 131072, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 8
    assert cache_bytes(llama, 100, 128, torch.bfloat16, torch.bfloat16) == \
        cache_bytes(llama, 128, 128, torch.bfloat16, torch.bfloat16)  # whole pages


def test_extrapolation_below_the_selection_reach_is_quadratic():
    stages = dict.fromkeys(STAGES, 1.0)
    got = extrapolate(stages, 8, 16, keys=64)  # both lengths within top-k x block: every key is reached
    assert got["attention_sparse"] == got["attention_dense"] == got["index_select"] == (16 * 17) / (8 * 9)
    assert got["rest"] == 2.0 and got["host"] == 1.0


def test_model_bench_refuses_bad_input(tmp_path):
    r = CliRunner().invoke(main, ["bench", "--model", "no-such-model", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "neither a checkpoint directory nor a preset" in r.output
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--device", "cpu", "--out", str(model_dir / "b")])
    assert r.exit_code == 2 and "inside the model directory" in r.output
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
    r = CliRunner().invoke(main, ["bench", "--model", "m3-tiny", "--device", "cpu", "--steps", "0",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "steps must be >= 1" in r.output
    assert not (tmp_path / "o").exists()
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["bench", "--model", "m3-tiny", "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and "needs a CUDA GPU" in r.output
        assert not (tmp_path / "o").exists()


def test_a_decode_only_run_keeps_the_earlier_prefill(tmp_path):
    """Prefill and decode can run as two commands into one OUT: the second keeps the first's other part (same model
    and MSA settings only); the plot draws every model bench JSON of OUT."""
    def result(model, prefill, decode, msa=None):
        return {"bench": "model", "model": model, "name": model, "msa": msa or {"block_size": 128, "topk": 16},
                "env": {"device": "cpu", "torch": "x", "triton": None},
                "config": {"prefill_lengths": [8192] if prefill else [], "decode_lengths": [32768] if decode else []},
                "prefill": [{"T": 8192}] if prefill else [],
                "prefill_summary": [{"T": 8192, "speedup": 1.5, "ceiling": 3.0, "dense": "timed", "msa": "timed"}]
                if prefill else [],
                "decode": [{"T": 32768, "batch": 8, "speedup": 2.0, "speedup_eager": 1.2}] if decode else []}

    write_model_outputs(result("a", True, False), tmp_path)
    path, png = write_model_outputs(result("a", False, True), tmp_path)
    data = json.loads(path.read_text())
    assert data["prefill"] == [{"T": 8192}] and data["decode"][0]["T"] == 32768
    assert [k["part"] for k in data["kept_from_earlier_run"]] == ["prefill"]
    write_model_outputs(result("a", False, True, msa={"block_size": 64, "topk": 8}), tmp_path)  # other settings
    assert json.loads(path.read_text())["prefill"] == []
    write_model_outputs(result("b", True, True), tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.glob("*.json")) == \
        ["a.json", "b.json"]
