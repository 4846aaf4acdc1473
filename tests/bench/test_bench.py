"""m3c bench: its FLOP model, the FlexAttention baseline's mask, its subcommands' options, and CPU smoke runs of
them."""
import json
import re

import pytest
import torch
from click.testing import CliRunner
from torch.nn.attention.flex_attention import flex_attention

from m3compile.cli import main
from m3compile.kernels.indexer.naive import select_blocks
from m3compile.kernels.sparse_attention.naive import sparse_attention
from m3compile import M3CompileError
from m3compile.models.decoder import Attention
from m3compile.bench import distill as bench_distill
from m3compile.bench.kernels import BenchConfig, flex_block_mask, prefill_flops, selection_agreement, visible_keys
from m3compile.bench.common import bench_models


# each subcommand's options, and no other's (BENCHMARKS.md's commands use these names)
OPTIONS = {
    "kernels": {"--prefill-lengths", "--decode-lengths", "--batch", "--heads", "--kv-heads", "--head-dim",
                "--index-dim", "--block", "--topk", "--selection", "--dense-max", "--flex-max", "--no-flex",
                "--query-chunk-sweep", "--rep-ms", "--device", "--out"},
    "model": {"--prefill-lengths", "--decode-lengths", "--batch", "--block", "--topk", "--index-dim", "--dense-max",
              "--msa-max", "--dtype", "--index-cache", "--index-dtype", "--sparse-kernel", "--steps", "--decode-steps",
              "--figure-seconds", "--device", "--out", "--kv-cache", "--prefill-chunk", "--bandwidth", "--profile-max",
              "--separate-projections", "--top-p", "--min-blocks", "--dense-layers"},
    "distill": {"--seq-len", "--batch", "--dtype", "--autocast", "--block-loss", "--no-train", "--no-eval", "--shard",
                "--layers", "--count-ops", "--cuda-graph", "--steps", "--block", "--topk", "--device", "--out"},
    "backward": {"--heads", "--kv-heads", "--head-dim", "--index-dim", "--block", "--topk", "--lengths", "--dense-max",
                 "--rep-ms", "--device", "--out"},
    "vision": {"--steps", "--grid", "--window", "--heads", "--head-dim", "--rep-ms", "--device", "--out"},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_bench_subcommand_lists_only_its_own_options(name):
    r = CliRunner().invoke(main, ["bench", name, "--help"])
    assert r.exit_code == 0, r.output
    listed = set(re.findall(r"^  (--[\w-]+)", r.output.split("\nOptions:\n")[1], re.M)) - {"--help"}
    assert listed == OPTIONS[name]
    if name == "model":
        assert "--vision-grid" not in r.output and "--heads" not in r.output
    if name == "vision":
        assert "--index-cache" not in r.output
    assert "Instead:" not in r.output and not re.search(r"--(model|distill|vision|backward):", r.output)
    writes = {"kernels": "OUT/bench.json", "model": "OUT/<model>.json"}.get(name, f"OUT/{name}.json")
    assert writes in " ".join(r.output.split())  # it says what it writes


def test_bench_alone_lists_its_subcommands():
    r = CliRunner().invoke(main, ["bench"])
    assert "Traceback" not in r.output
    assert set(re.findall(r"^  (\w+)", r.output.split("\nCommands:\n")[1], re.M)) == set(OPTIONS)


@pytest.mark.parametrize("argv, message", [
    (["--model", "m3-tiny", "--device", "cpu"], "No such option '--model'"),
    (["--device", "cpu", "--distill", "m3-tiny"], "No such option '--device'"),
    (["--backward"], "No such option '--backward'"),
    (["--vision-grid", "4"], "No such option '--vision-grid'"),
], ids=["model", "distill", "backward", "vision-option"])
def test_options_without_a_subcommand_are_a_usage_error(tmp_path, argv, message):
    """`m3c bench` takes its options after a subcommand: one before it is a usage error, one line, exit 2, nothing
    written."""
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["bench", *argv, "--out", str(out)])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    assert r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "" and not out.exists()


def test_visible_keys_counts_causal_keys_of_valid_slots():
    T, bs = 37, 8
    blocks = select_blocks(torch.randn(1, 2, T, 16), torch.randn(1, T, 16), block_size=bs, topk=3)
    got = visible_keys(blocks, bs)
    for h in range(2):
        for t in range(T):
            want = sum(min(bs, t - j * bs + 1) for j in blocks[0, h, t].tolist() if j >= 0)
            assert got[0, h, t].item() == want
    assert prefill_flops(T, 4, 16) == 4 * 4 * 16 * T * (T + 1) / 2
    all_blocks = torch.arange(5).expand(1, 2, T, 5)  # every block selected: the sparse FLOPs are the dense ones
    assert prefill_flops(T, 4, 16, visible_keys(all_blocks.masked_fill(all_blocks * bs > torch.arange(T)[:, None], -1), bs)) \
        == prefill_flops(T, 4, 16)


def test_selection_agreement_ignores_slot_order_and_empty_slots():
    base = torch.tensor([[[[0, 1, 2], [1, 0, -1], [3, 2, 1], [0, -1, -1]]]])
    other = torch.tensor([[[[2, 0, 1], [0, 1, -1], [3, 0, 1], [0, -1, -1]]]])  # row 2 swaps block 2 for block 0
    blocks, rows = selection_agreement(other, base, chunk=3)  # chunks: a row split off
    assert blocks == 8 / 9 and rows == 3 / 4
    assert selection_agreement(base, base) == (1.0, 1.0)


def test_flex_block_mask_computes_the_same_selection():
    """The FlexAttention baseline attends exactly to the selected blocks (else the comparison would be unfair)."""
    B, Hq, Hkv, T, D, bs = 1, 4, 2, 80, 16, 16
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    blocks = select_blocks(torch.randn(B, Hkv, T, 16), torch.randn(B, T, 16), block_size=bs, topk=2)
    out = flex_attention(q, k, v, block_mask=flex_block_mask(blocks, Hq, bs), enable_gqa=True)
    want = sparse_attention(q, k, v, blocks, block_size=bs)
    assert (out - want).abs().max().item() < 1e-5


def test_bench_config_rejects_bad_shapes():
    with pytest.raises(M3CompileError, match="multiple of kv_heads"):
        BenchConfig(heads=6, kv_heads=4)
    with pytest.raises(M3CompileError, match="unknown selection"):
        BenchConfig(selections=("random",))


def test_bench_command_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, [
        "bench", "kernels", "--device", "cpu", "--prefill-lengths", "40", "--decode-lengths", "40", "--batch", "2",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--index-dim", "16", "--block", "16", "--topk", "2",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert {r["selection"] for r in data["prefill"]} == {"independent", "shared"}
    row = data["prefill"][0]
    assert row["T"] == 40 and row["ideal"] > 1 and row["attention_ms"] > 0 and row["flex_ms"] > 0
    assert row["indexer_fp8_ms"] > 0 and 0 < row["fp8_same_blocks"] <= 1 and 0 <= row["fp8_same_rows"] <= 1
    assert data["decode"][0]["batch"] == 2 and data["decode"][0]["msa_fp8_ms"] > 0
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_needs_a_gpu_unless_told_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = CliRunner().invoke(main, ["bench", "kernels", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    assert not (tmp_path / "b").exists()


def test_bench_vision_smoke_on_cpu(tmp_path):
    result = CliRunner().invoke(main, [
        "bench", "vision", "--device", "cpu", "--steps", "3,5,1", "--grid", "4",
        "--heads", "2", "--head-dim", "16", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "vision.json").read_text())
    assert data["windows"] == 1 + 2 + 1 and data["tokens"] == (3 + 5 + 1) * 16
    assert data["rel_err_vs_loop"]["fused"] < 1e-5 and data["rel_err_vs_loop"]["padded"] < 1e-5
    bad = CliRunner().invoke(main, ["bench", "vision", "--device", "cpu", "--steps", "0", "--out",
                                    str(tmp_path / "x")])
    assert bad.exit_code == 2 and "error:" in bad.output


def test_bench_backward_smoke_on_cpu(tmp_path):
    result = CliRunner().invoke(main, [
        "bench", "backward", "--device", "cpu", "--lengths", "24", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--index-dim", "16", "--block", "8", "--topk", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    row = json.loads((tmp_path / "backward.json").read_text())["rows"][0]
    assert row["T"] == 24 and row["ideal"] > 1 and row["sparse_fwd_bwd_ms"] > 0 and row["kl_fwd_bwd_ms"] > 0
    assert row["kl_given_lse_fwd_bwd_ms"] > 0


@pytest.mark.parametrize("shard", [False, True], ids=["replica", "sharded"])
def test_distill_bench_runs_every_stage_on_cpu(tmp_path, monkeypatch, shard):
    """`m3c bench distill` on CPU (timings meaningless there): every stage is run and reported, with the ratios
    against the dense forward (distillation, m3c eval's forwards), the dense training step (MSA training) and eval's
    own forwards (eval); also sharded (FSDP2 in a process group of one), there with --no-eval (no eval rows). The
    converted model's MSA switches are as before after the eval rows (so the training step traced it sparse, with
    the index selection)."""
    built = []

    def keep(*args, **kwargs):
        built.append(bench_models(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(bench_distill, "bench_models", keep)
    r = CliRunner().invoke(main, ["bench", "distill", "m3-tiny", "--device", "cpu", "--seq-len", "48",
                                  "--batch", "1" if shard else "2", "--steps", "1", "--block", "8",
                                  "--topk", "2", "--out", str(tmp_path)] + (["--shard", "--no-eval"]
                                                                            if shard else []))
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "distill.json").read_text())
    assert result["config"]["shard"] == shard and result["world_size"] == 1 and result["config"]["eval"] != shard
    stages = [r["stage"] for r in result["rows"]]
    forwards = ["converted dense forward", "msa forward", "oracle forward"]
    evals = [] if shard else [*forwards, "eval", "eval --no-oracle"]
    assert stages == ["dense forward", "distill warm-up", "distill sparse", *evals, "dense train", "msa train"]
    assert result["msa"]["block_size"] == 8 and result["msa"]["topk"] == 2
    assert [r["ratio_to"] for r in result["rows"]] == (["dense forward"] * (6 if evals else 3)
                                                       + ["its forwards"] * (2 if evals else 0)
                                                       + ["dense forward", "dense train"])
    assert all(r["tokens_per_s"] > 0 and r["ms"] > 0 and r["ratio"] > 0 for r in result["rows"])
    for r in result["rows"][1:3]:  # each distillation step's host dispatches, by layer
        assert r["ops"]["total"] > 0 and set(r["ops"]["layers"]) == {"0", "1", "2", "3", "model"}
    if shard:
        return
    rows = {r["stage"]: r for r in result["rows"]}
    for name, passes in (("eval", 3), ("eval --no-oracle", 2)):
        row = rows[name]
        spent = sum(rows[f]["ms"] for f in forwards[:passes])
        assert row["passes"] == passes and row["forwards_ms"] == pytest.approx(spent, abs=1e-2)
        assert row["ratio"] == pytest.approx(spent / row["ms"], rel=1e-2)
    for name in evals:  # as m3c eval runs: in the weights' dtype, no autocast, the reference ops on a CPU
        assert (rows[name]["dtype"], rows[name]["autocast"], rows[name]["kernels"]) == ("bfloat16", None, False)
    attns = [m for m in built[0][1].modules() if isinstance(m, Attention)]  # the one converted model (unsharded)
    assert len(built) == 1 and {(a.selection, a.observer) for a in attns} == {("index", None)}


def test_distill_bench_counts_ops_of_a_shallow_preset(tmp_path, monkeypatch):
    """--count-ops: one counted step per mode, no timing; --layers 3 of SmolLM2's 30 extrapolates the count
    to its depth at the count of an MSA layer. (The Triton kernels' host path is tests/bench/test_op_count.py's; here the
    lowered ops run their torch reference, which is fast.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = CliRunner().invoke(main, ["bench", "distill", "smollm2-135m", "--device", "cpu", "--count-ops",
                                  "--layers", "3", "--seq-len", "24", "--batch", "1",
                                  "--block", "8", "--topk", "2", "--dtype", "float32", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "distill.json").read_text())
    assert [row["stage"] for row in result["rows"]] == ["distill warm-up", "distill sparse"]
    assert result["layers"] == 3 and result["env"]["triton_kernels"] is False
    for row in result["rows"]:
        ops = row["ops"]
        assert "ms" not in row and ops["msa_layers"] == 2 and ops["per_msa_layer"] == sum(ops["layers"]["1"].values())
        assert ops["ops_at_full_depth"] == ops["total"] + 27 * ops["per_msa_layer"]
    bad = CliRunner().invoke(main, ["bench", "distill", "smollm2-135m", "--device", "cpu", "--count-ops",
                                    "--layers", "1", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "error:" in bad.output and not (tmp_path / "x").exists()
    # --block-loss: the distillation rows run m3c distill --block-loss, 1 by default as there (its op adds
    # dispatches per layer); 0 the KL-only step
    r = CliRunner().invoke(main, ["bench", "distill", "smollm2-135m", "--device", "cpu", "--count-ops",
                                  "--layers", "3", "--seq-len", "24", "--batch", "1",
                                  "--block", "8", "--topk", "2", "--dtype", "float32",
                                  "--block-loss", "0", "--out", str(tmp_path / "kl")])
    assert r.exit_code == 0, r.output
    kl_only = json.loads((tmp_path / "kl" / "distill.json").read_text())
    assert result["config"]["block_loss"] == 1.0 and kl_only["config"]["block_loss"] == 0.0
    for a, b in zip(result["rows"], kl_only["rows"]):
        assert a["ops"]["per_msa_layer"] > b["ops"]["per_msa_layer"]
    bad = CliRunner().invoke(main, ["bench", "distill", "smollm2-135m", "--device", "cpu", "--count-ops",
                                    "--block-loss", "-1", "--out", str(tmp_path / "y")])
    assert bad.exit_code == 2 and "block_loss must be" in bad.output and not (tmp_path / "y").exists()


def test_distill_bench_refuses_an_unknown_model(tmp_path):
    r = CliRunner().invoke(main, ["bench", "distill", "no-such-model", "--device", "cpu", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "neither a checkpoint directory nor a preset" in r.output


def test_distill_breakdown_books_each_kernel_once():
    """The distillation rows' per-stage GPU ms (synthetic trace, the profiler's fields): each kernel once, to the
    innermost labelled range that launched it; backward kernels go to their autograd function (run outside the
    forward's ranges, inside m3c.backward); range annotations on the device are not work; stages sum to the work."""
    from m3compile.bench.common import Profile
    from m3compile.bench.distill import _breakdown
    from tests.bench.test_model import _ev, _flat, _kernel, _launch

    fwd = _ev("m3c.forward", 0, 40, id=1, children=[
        _ev("aten::mm", 1, 4, id=2, children=[_launch(100, 2)]),
        _ev("m3c.msa_select", 5, 10, id=3, children=[_launch(101, 6, "cuLaunchKernelEx")]),
        _ev("m3c.msa_attention", 11, 20, id=4, children=[_launch(102, 12, "cuLaunchKernelEx")]),
        _ev("m3c.msa_index_kl", 21, 30, id=5, children=[_launch(103, 22, "cuLaunchKernelEx")])])
    bwd = _ev("m3c.backward", 41, 80, id=6, children=[_ev("m3c.loss", 42, 44, id=7, children=[_launch(104, 43)])])
    engine = [_ev("autograd::engine::evaluate_function: _SparseKLBackward", 50, 60, id=8,
                  children=[_launch(105, 51, "cuLaunchKernelEx")]),
              _ev("autograd::engine::evaluate_function: _SparseAttentionBackward", 61, 70, id=9,
                  children=[_launch(106, 62, "cuLaunchKernelEx")]),
              _ev("aten::mm", 71, 75, id=10, children=[_launch(107, 72)])]  # an index-projection gradient
    opt = _ev("m3c.optimizer", 81, 90, id=11, children=[_launch(108, 82)])
    kernels = [_kernel(n, cid, 100 + 40 * i, us) for i, (n, cid, us) in enumerate((
        ("gemm", 100, 10), ("index_topk", 101, 5), ("gather_q", 102, 7), ("kl_fwd", 103, 9), ("sum", 104, 1),
        ("kl_bwd", 105, 11), ("attn_bwd", 106, 13), ("gemm_bwd", 107, 3), ("adamw", 108, 2)))]
    annotation = _ev("m3c.forward", 100, 300, id=1, kind="gpu_user_annotation", device="CUDA", linked=1)
    roots = [fwd, bwd, *engine, opt]
    prof = Profile(_flat(roots), True, 0.5, 0.0, 0.0, kernels + [annotation])
    got = _breakdown(prof)
    want = {"select_ms": 0.005, "attention_fwd_ms": 0.007, "kl_fwd_ms": 0.009, "rest_of_forward_ms": 0.01,
            "kl_bwd_ms": 0.011, "attention_bwd_ms": 0.013, "rest_of_backward_ms": 0.004, "optimizer_ms": 0.002,
            "outside_ranges_ms": 0.0, "unattributed_ms": 0.0}
    assert {k: got[k] for k in want} == want
    assert got["gpu_work_ms"] == got["gpu_busy_ms"] == 0.061 and got["host_wait_ms"] == round(0.5 - 0.061, 3)


def test_the_kernel_bench_smoke_test_runs_on_a_cpu_as_is(tmp_path):
    """m3c bench kernels --device cpu, the smoke test its help names, in a fresh process with TRITON_INTERPRET unset
    (as a reader types it): Triton's interpreter is turned on for the CPU, so the tiny shapes run and the results
    are written."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "from m3compile.entry import main; main()", "bench", "kernels",
                           "--device", "cpu", "--prefill-lengths", "64", "--decode-lengths", "", "--heads", "2",
                           "--kv-heads", "1", "--head-dim", "16", "--index-dim", "16", "--block", "16", "--topk", "2",
                           "--rep-ms", "1", "--no-flex", "--selection", "shared", "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["prefill"]
