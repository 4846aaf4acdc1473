"""m3c bench model: the whole-model bench's JSON on a small checkpoint (CPU, timings meaningless), its
extrapolation laws, the per-stage attribution (synthetic profiler events and a real CPU run), the decode batch that
fits in memory, and its outputs."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from m3compile import M3CompileError
from m3compile.cli import main
from m3compile.kernels import _common as kernel_common
from m3compile.models.decoder import PRESETS, MSALayerArgs
from m3compile.pipelines import lower
from m3compile.bench.common import Profile, bench_models, module_ranges, profile_run
from m3compile.bench.model import (ENCLOSING, GROUPS, PREFILL_LABELS, STAGES, ModelBenchConfig, cache_bytes,
                                         decode_batch, decode_depths, extrapolate, run_model_bench, shallow,
                                         write_model_outputs)
from m3compile.bench import model as bench_model
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
        "bench", "model", str(LLAMA_BYTE), "--device", "cpu", "--dtype", "float32", "--prefill-lengths",
        "48,80", "--dense-max", "48", "--msa-max", "48", "--decode-lengths", "48", "--batch", "2", "--block", "16",
        "--topk", "2", "--steps", "1", "--decode-steps", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "byte-llama.json").read_text())
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
            assert row["stages"]["unattributed"] == 0
        check = timed["attribution"]  # the profiled split: every op's self time once, within the profiled wall
        assert 0 < check["work_ms"] <= check["profiled_ms"] and check["routes"] == {} and check["unattributed_ms"] == 0
        assert set(check["top"]) >= {"rest", "projections_mlp"}
        want = extrapolate(timed["stages"], 48, 80, keys=32)
        assert all(_close(extra["stages"][s], want[s]) for s in STAGES)
        # the laws themselves: linear, constant, causal pairs, keys a top-2 x 16 selection reaches (32 per query)
        st = timed["stages"]
        assert _close(want["projections_mlp"], st["projections_mlp"] * 80 / 48) and want["host"] == st["host"]
        assert _close(want["attention_dense"], st["attention_dense"] * (80 * 81) / (48 * 49))
        assert _close(want["attention_sparse"], st["attention_sparse"] * (528 + 48 * 32) / (528 + 16 * 32))
    assert rows[48, "dense"]["breakdown"]["indexer"] == 0 and rows[48, "msa"]["breakdown"]["indexer"] > 0
    assert rows[48, "msa"]["stages"]["index_select"] > 0 and rows[48, "msa"]["stages"]["index_projections"] > 0
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
        assert row["attribution"]["work_ms"] <= row["attribution"]["profiled_ms"] and row["stages"]["unattributed"] == 0
    assert dec["msa"]["breakdown"]["indexer"] > 0 and dec["dense"]["breakdown"]["indexer"] == 0
    assert dec["speedup"] is None and dec["speedup_eager"] > 0
    assert "extrapolated" in r.output and "conversion kept device cpu and dtype float32: yes" in r.output


def test_adaptive_budget_conversion(tmp_path, monkeypatch):
    """--top-p / --min-blocks convert with the adaptive budget (--topk its ceiling) and the result records it; a
    floor above the ceiling is one line and no output."""
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)
    out = tmp_path / "bench"
    common = ["bench", "model", str(LLAMA_BYTE), "--device", "cpu", "--dtype", "float32", "--prefill-lengths", "64",
              "--decode-lengths", "", "--block", "16", "--topk", "4", "--top-p", "0.01", "--steps", "1"]
    r = CliRunner().invoke(main, [*common, "--min-blocks", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "byte-llama.json").read_text())
    assert (data["msa"]["topk"], data["msa"]["top_p"], data["msa"]["min_blocks"]) == (4, 0.01, 3)
    assert (data["config"]["top_p"], data["config"]["min_blocks"]) == (0.01, 3)
    r = CliRunner().invoke(main, [*common, "--min-blocks", "5", "--out", str(tmp_path / "bad")])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and errors == [r.output.strip().splitlines()[-1]] and "min_blocks (5)" in errors[0]
    assert not (tmp_path / "bad").exists()


def test_dense_layers_conversion(tmp_path, monkeypatch):
    """--dense-layers keeps those layers dense (the result counts the MSA layers); a layer the model lacks is one
    line and no output."""
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)
    out = tmp_path / "bench"
    common = ["bench", "model", str(LLAMA_BYTE), "--device", "cpu", "--dtype", "float32", "--prefill-lengths", "64",
              "--decode-lengths", "", "--block", "16", "--topk", "2", "--steps", "1"]
    r = CliRunner().invoke(main, [*common, "--dense-layers", "0,1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "byte-llama.json").read_text())
    assert (data["config"]["dense_layers"], data["msa_layers"]) == ([0, 1], data["layers"] - 2)
    r = CliRunner().invoke(main, [*common, "--dense-layers", "0,99", "--out", str(tmp_path / "bad")])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and errors == [r.output.strip().splitlines()[-1]] and "dense layer 99 does not exist" in errors[0]
    assert not (tmp_path / "bad").exists()


def test_decode_batch_is_what_fits():
    """Llama-3-8B shapes at 128K: 8 sequences of bf16 caches need ~146 GB; with ~118 GB free six fit. Qwen2.5-7B
    (4 KV heads) fits 8 at 128K; nothing fits at 8M."""
    llama = PRESETS["llama3-8b"].replace(sparse_layers=(False,) + (True,) * 31, msa=MSALayerArgs(8, 128, 128, 16))
    per_seq = cache_bytes(llama, 131072, 128, torch.bfloat16, torch.bfloat16)
    assert per_seq == 32 * 2 * 131072 * 8 * 128 * 2 + 31 * 131072 * 128 * 2
    fp8 = cache_bytes(llama, 131072, 128, torch.bfloat16, torch.float8_e4m3fn)
    assert fp8 == 32 * 2 * 131072 * 8 * 128 * 2 + 31 * (131072 * (128 + 4) + 128 * 128 * 2)  # + a bf16 tail page
    free, reserve = 122e9, 4e9
    assert decode_batch(llama, 131072, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 6
    assert decode_batch(llama, 32768, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 8
    assert decode_batch(llama, 8 << 20, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 0
    qwen = PRESETS["qwen2.5-7b"].replace(sparse_layers=(False,) + (True,) * 27, msa=MSALayerArgs(4, 128, 128, 16))
    assert decode_batch(qwen, 131072, 8, free, 128, torch.bfloat16, torch.bfloat16, reserve) == 8
    assert cache_bytes(llama, 100, 128, torch.bfloat16, torch.bfloat16) == \
        cache_bytes(llama, 128, 128, torch.bfloat16, torch.bfloat16)  # whole pages


def test_decode_depths_fit_and_skip_layers_of_another_kind():
    """Llama-3-8B at 128K, batch 8 (~146 GB of caches): with 131.6 GB free (a H200 beside the weights) the deepest
    copy that fits has 28 layers, the other half of it; M3's first MoE-free layers (dense MLP) stay below L1."""
    llama = PRESETS["llama3-8b"].replace(sparse_layers=(False,) + (True,) * 31, msa=MSALayerArgs(8, 128, 128, 16))
    assert decode_depths(llama, 131072 + 40, 8, 131.6e9, 128, torch.bfloat16, torch.float8_e4m3fn, 4e9) == (14, 28)
    assert decode_depths(llama, 131072, 8, 20e9, 128, torch.bfloat16, torch.bfloat16, 4e9) is None  # 2 layers fit
    m3 = PRESETS["m3"]
    m3 = m3.replace(sparse_layers=(False,) + (True,) * (m3.n_layers - 1), msa=MSALayerArgs(4, 128, 128, 16))
    first_moe = m3.mlp_layer_types.index("sparse")
    assert first_moe >= 2
    l1, l2 = decode_depths(m3, 4096, 1, 1e12, 128, torch.bfloat16, torch.bfloat16, 0)
    assert l2 == m3.n_layers - 1 and l1 >= first_moe


def test_decode_batch_that_does_not_fit_is_extrapolated_from_two_depths(monkeypatch):
    """Where the asked batch's caches do not fit, the bench runs the batch that fits and then the asked one on the
    first L1 and L2 layers of both models (the same modules), extrapolated linearly in the depth and marked."""
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)  # torch references on CPU
    args = bench_models(str(LLAMA_BYTE), device="cpu", dtype="float32", block=16, topk=2)[1].args
    assert args.n_layers == 6
    max_len = 48 + 1 + 8  # T + decode steps + the bench's room
    four = args.replace(n_layers=4, sparse_layers=args.sparse_layers[:4])
    # batch 2 fits at 4 layers, not at 5; at the full 6 layers batch 1 fits
    free = 4e9 + 2 * cache_bytes(four, max_len, 16, torch.float32, torch.float32) + 1
    monkeypatch.setattr(bench_model, "_free_bytes", lambda cfg: free)
    cfg = ModelBenchConfig(str(LLAMA_BYTE), prefill_lengths=(), decode_lengths=(48,), batch=2, block=16, topk=2,
                           dtype="float32", decode_steps=1, device="cpu")
    lowered, asked = run_model_bench(cfg, log=lambda m: None)["decode"]
    assert lowered["batch"] == 1 and not lowered["extrapolated"] and "ran batch 1" in lowered["note"]
    assert asked["batch"] == asked["batch_requested"] == 2 and asked["extrapolated"]
    assert "first 2 and 4 layers" in asked["note"]
    for name in ("dense", "msa"):
        row = asked[name]
        assert row["extrapolated_from_depths"] == [2, 4] and set(row["measured"]) == {"2", "4"}
        m2, m4 = row["measured"]["2"], row["measured"]["4"]
        assert m2["batch"] == m4["batch"] == 2
        assert _close(row["eager_ms"], m4["eager_ms"] + (m4["eager_ms"] - m2["eager_ms"]), rel=1e-3)
        for st in STAGES:
            assert _close(row["stages"][st], max(0.0, 2 * m4["stages"][st] - m2["stages"][st]), rel=1e-3)
    assert asked["speedup_eager"] == round(asked["dense"]["eager_ms"] / asked["msa"]["eager_ms"], 3)
    dense = bench_models(str(LLAMA_BYTE), device="cpu", dtype="float32", block=16, topk=2)[0]
    part = shallow(dense, 3)  # shares the modules: no copy
    assert part.args.n_layers == 3 and len(part.model.layers) == 3
    assert part.model.layers[2] is dense.model.layers[2] and part.lm_head is dense.lm_head


def test_extrapolation_below_the_selection_reach_is_quadratic():
    stages = dict.fromkeys(STAGES, 1.0)
    got = extrapolate(stages, 8, 16, keys=64)  # both lengths within top-k x block: every key is reached
    assert got["attention_sparse"] == got["attention_dense"] == got["index_select"] == (16 * 17) / (8 * 9)
    assert got["rest"] == got["projections_mlp"] == got["index_projections"] == got["unattributed"] == 2.0
    assert got["host"] == 1.0


def test_model_bench_refuses_bad_input(tmp_path):
    r = CliRunner().invoke(main, ["bench", "model", "no-such-model", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "neither a checkpoint directory nor a preset" in r.output
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["bench", "model", str(model_dir), "--device", "cpu", "--out", str(model_dir / "b")])
    assert r.exit_code == 2 and "is inside the input" in r.output
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
    r = CliRunner().invoke(main, ["bench", "model", "m3-tiny", "--device", "cpu", "--steps", "0",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "steps must be >= 1" in r.output
    assert not (tmp_path / "o").exists()
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["bench", "model", "m3-tiny", "--out", str(tmp_path / "o")])
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


# ---------------------------------------------------------------------------------------------------------------
# attribution: synthetic profiler events (the fields torch.profiler's FunctionEvent gives) and a real CPU run


class _Span:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


def _ev(name, start, end, id=0, kind="cpu_op", device="CPU", linked=0, children=(), kernels=()):
    e = SimpleNamespace(name=name, time_range=_Span(start, end), id=id, activity_type=kind, linked_correlation_id=linked,
                        device_type=SimpleNamespace(name=device), is_async=False, cpu_parent=None,
                        cpu_children=list(children), kernels=list(kernels), is_user_annotation=kind.endswith("annotation"))
    for c in e.cpu_children:
        c.cpu_parent = e
    e.cpu_time_total = end - start
    e.self_cpu_time_total = e.cpu_time_total - sum(c.cpu_time_total for c in e.cpu_children)
    return e


def _flat(roots):
    out = []
    for r in roots:
        out += [r] + _flat(r.cpu_children)
    return out


def _launch(cid, t, name="cudaLaunchKernel"):
    return _ev(name, t, t + 1, id=cid, kind="cuda_runtime" if name.startswith("cuda") else "cuda_driver", linked=cid + 1000)


def _kernel(name, cid, start, us, linked=0):
    return _ev(name, start, start + us, id=cid, kind="kernel", device="CUDA", linked=linked)


def _gpu_trace():
    """One layer's host ranges and the kernels they launched (times in us), with the profiler's quirks: GPU
    annotations mirroring each range on the device, a Triton kernel launched directly inside a range (no aten op to
    link it to), a kernel the profiler linked only to its op, one with no launch at all, and an op whose id equals a
    kernel's CUPTI correlation id. Each kernel's expected stage is in its name."""
    sdpa = _ev("aten::scaled_dot_product_attention", 11, 19, id=5, children=[
        _ev("aten::_flash_attention_forward", 12, 18, id=6, children=[_launch(101, 13)])])
    msa = _ev("m3c.msa_attention", 10, 30, id=4, children=[sdpa, _launch(102, 20, "cuLaunchKernelEx")])
    select = _ev("m3c.msa_select", 42, 48, id=8, children=[_launch(104, 44, "cuLaunchKernelEx")])
    branch = _ev("m3c.index_branch", 35, 50, id=7, children=[
        _ev("aten::mm", 36, 40, id=9, children=[_launch(103, 37)]), select, _launch(105, 49, "cuLaunchKernelEx")])
    mm = _ev("aten::mm", 55, 60, id=106)  # its id collides with a CUPTI correlation id: kernel 106 is not its
    proj = _ev("m3c.proj_mlp", 52, 62, id=11, children=[mm])
    roots = [_ev("aten::layer_norm", 0, 5, id=1, children=[_launch(100, 2)]), msa, branch, proj,
             _ev("aten::add", 63, 66, id=12, children=[_launch(106, 64)])]
    kernels = [
        _kernel("rest: norm", 100, 100, 10),
        _kernel("attention_sparse: flash (SDPA inside msa_attention)", 101, 110, 40),
        _kernel("attention_sparse: sparse_attention_kernel", 102, 150, 30),
        _kernel("index_projections: gemm", 103, 180, 20),
        _kernel("index_select: index_topk_kernel", 104, 200, 25),
        _kernel("index_projections: norm_rope_kernel", 105, 225, 5),
        _kernel("projections_mlp: gemm (linked to its op only)", 900, 230, 50, linked=mm.id),
        _kernel("rest: add (CUPTI id 106 = the mm op's id)", 106, 280, 7),
        _kernel("unattributed: lost_kernel", 901, 290, 3),
    ]
    annotations = [_ev(r.name, a, b, id=r.id, kind="gpu_user_annotation", device="CUDA", linked=r.id)
                   for r, (a, b) in ((msa, (110, 180)), (branch, (180, 230)), (select, (200, 225)), (proj, (230, 280)))]
    for r, ann in zip((msa, branch, select, proj), annotations):
        r.kernels = [SimpleNamespace(duration=ann.time_range.elapsed_us())]  # what the profiler lists for a range
    return roots, kernels, annotations


def test_attribution_books_each_kernel_once_to_the_innermost_range():
    """Synthetic GPU trace: stage sums equal the kernels' total (every kernel once, none dropped), the innermost
    labelled range wins (m3c.msa_select inside m3c.index_branch) except the enclosing m3c.msa_attention (its SDPA
    stays sparse attention), annotations are not work, a kernel with no launch record is booked through its linked
    op or reported as unattributed by name; the profiler's own per-range lists would count ranges twice."""
    roots, kernels, annotations = _gpu_trace()
    events = _flat(roots)
    prof = Profile(events, True, 400.0, 0.0, device_events=annotations + kernels)
    a = prof.attribute(PREFILL_LABELS, ENCLOSING)
    want = {}
    for k in kernels:
        stage = k.name.split(":")[0]
        want[stage] = want.get(stage, 0.0) + k.time_range.elapsed_us() / 1e3
    assert {s: round(v, 6) for s, v in a.stages.items() if v} == {s: round(v, 6) for s, v in want.items()}
    assert abs(a.work_ms - sum(k.time_range.elapsed_us() for k in kernels) / 1e3) < 1e-9
    assert abs(a.busy_ms - a.work_ms) < 1e-9  # one stream, no overlap
    assert a.routes == {"launch": 7, "op": 1, "none": 1}
    assert a.top["unattributed"] == [["unattributed: lost_kernel", 0.003]]
    assert a.stages["attention_dense"] == 0.0  # enclosing
    stages = prof.stages(PREFILL_LABELS, ENCLOSING)
    assert abs(sum(stages.values()) - 400.0) < 1e-9 and abs(stages["host"] - (400.0 - a.work_ms)) < 1e-9
    # innermost: without the enclosing rule the SDPA inside msa_attention is dense attention
    assert abs(prof.attribute(PREFILL_LABELS).stages["attention_dense"] - 0.040) < 1e-9
    # the same trace from a torch without activity types: launches by name, annotations by their range's name
    for e in events + annotations + kernels:
        e.activity_type = ""
        e.is_user_annotation = False
    assert Profile(events, True, 400.0, 0.0, device_events=annotations + kernels).attribute(
        PREFILL_LABELS, ENCLOSING).stages == a.stages
    # what the profiler's per-range lists give: annotation + children's kernels, the Triton kernels nowhere
    from m3compile.bench.common import kernel_us
    assert kernel_us(roots[2]) == 50 + 25  # index_branch: its annotation + select's annotation, no real kernel


def test_attribution_overlapping_streams_and_cpu_trees():
    """Busy time is the union of the device intervals (two streams overlapping), work their sum; on a CPU each op's
    self time goes to the innermost labelled range among it and its ancestors (enclosing ranges keep theirs), so the
    stages sum to the roots' total time."""
    roots, kernels, _ = _gpu_trace()
    kernels[1].time_range = _Span(140, 180)  # another stream: overlaps kernel 102 (150-180)
    a = Profile(_flat(roots), True, 400.0, 0.0, device_events=kernels).attribute(PREFILL_LABELS, ENCLOSING)
    assert abs(a.work_ms - 0.190) < 1e-9 and abs(a.busy_ms - (0.190 - 0.030)) < 1e-9
    cpu_roots = [
        _ev("m3c.msa_attention", 0, 100, children=[_ev("aten::scaled_dot_product_attention", 10, 50, children=[
            _ev("aten::_flash", 20, 40)])]),
        _ev("m3c.index_branch", 100, 160, children=[_ev("aten::mm", 105, 120), _ev("m3c.msa_select", 120, 150, children=[
            _ev("aten::topk", 125, 145)])]),
        _ev("aten::add", 160, 170),
        _ev("aten::scaled_dot_product_attention", 170, 200),
    ]
    cpu = Profile(_flat(cpu_roots), False, 250.0, 0.0).attribute(PREFILL_LABELS, ENCLOSING)
    assert {s: round(v * 1e3, 6) for s, v in cpu.stages.items() if v} == {
        "attention_sparse": 100, "index_projections": 30, "index_select": 30, "rest": 10, "attention_dense": 30}
    assert abs(cpu.work_ms - 0.200) < 1e-12 and cpu.routes == {}


def test_attribution_of_a_real_cpu_run(monkeypatch):
    """The converted and lowered m3-tiny on CPU, profiled: the stages sum to the profiled ops' total time, each
    labelled range's time is in its stage once (the index branch, the selection and the sparse attention apart),
    and the bench's split closes to the timed total."""
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)
    torch.manual_seed(0)
    _, sparse, _, _ = bench_models("m3-tiny", device="cpu", dtype="float32", block=16, topk=2)
    low = lower(sparse.model)
    ids = torch.randint(0, sparse.args.vocab_size, (1, 80))
    with torch.no_grad(), module_ranges(low, bench_model._classify):
        prof = profile_run(lambda: low(ids), "cpu")
    a = prof.attribute(PREFILL_LABELS, ENCLOSING)
    roots_ms = sum(e.cpu_time_total for e in prof.events if e.cpu_parent is None) / 1e3
    assert abs(a.work_ms - roots_ms) < 1e-6 * max(1.0, roots_ms) and abs(sum(a.stages.values()) - a.work_ms) < 1e-9
    assert a.work_ms <= prof.wall_ms and a.stages["unattributed"] == 0.0

    def inside_label(e):
        p = e.cpu_parent
        while p is not None and p.name not in PREFILL_LABELS:
            p = p.cpu_parent
        return p is not None

    def ranges_ms(name):  # the outermost labelled ranges (an MoE block's expert projections nest in its range)
        return sum(e.cpu_time_total for e in prof.events if e.name == name and not inside_label(e)) / 1e3

    for name, stage in (("m3c.msa_select", "index_select"), ("m3c.index_branch", "index_projections"),
                        ("m3c.msa_attention", "attention_sparse"), ("m3c.proj_mlp", "projections_mlp")):
        assert ranges_ms(name) > 0 and abs(a.stages[stage] - ranges_ms(name)) < 1e-6, (name, a.stages)
    sdpa = [e for e in prof.events if e.name == "aten::scaled_dot_product_attention"]  # layer 0 (dense)
    assert sdpa and abs(a.stages["attention_dense"] - sum(e.cpu_time_total for e in sdpa) / 1e3) < 1e-6
    stages, check = bench_model._split(prof, PREFILL_LABELS, 123.0)
    assert abs(sum(stages.values()) - 123.0) < 1e-6 and check["routes"] == {} and check["unattributed_ms"] == 0


def test_fp8_index_option_and_a_lowered_dense_twin(monkeypatch):
    """--index-dtype fp8 converts with e4m3 index scoring (a converted model's setting replaced too), and the dense
    baseline's backbone lowers like the MSA one (the same RMSNorm / RoPE kernels run; same output)."""
    import pytest

    from m3compile import ops
    from m3compile.errors import M3CompileError
    from m3compile.bench.model import ModelBenchConfig

    dense, sparse, _, _ = bench_models("m3-tiny", device="cpu", dtype="float32", block=16, topk=2, index_dtype="fp8")
    assert sparse.args.msa.index_dtype == "fp8"
    dense_lowered = lower(dense.model, require_msa=False)
    ran = set()
    for op in (ops.rms_norm, ops.add_rms_norm, ops.apply_rope):
        kernel = ops.LOWERING[op]
        monkeypatch.setitem(ops.LOWERING, op, lambda *a, _n=op.__name__, _f=kernel, **k: ran.add(_n) or _f(*a, **k))
    ids = torch.randint(0, dense.args.vocab_size, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(dense_lowered(ids), dense.model(ids))
    assert ran == {"rms_norm", "add_rms_norm", "apply_rope"}
    with pytest.raises(M3CompileError, match="index_dtype must be"):
        ModelBenchConfig(model="m3-tiny", device="cpu", index_dtype="int8")
    # --index-dim below the rotary width (m3-tiny: 8 of 16): the lowest-frequency index rope
    _, narrow, _, _ = bench_models("m3-tiny", device="cpu", dtype="float32", block=16, topk=2, index_dim=4)
    assert (narrow.args.msa.index_dim, narrow.args.msa.index_rope) == (4, "low")


def test_decode_byte_floor_by_hand():
    """A decode step's bytes on the Llama-3-8B shape (meta device, bf16), counted by hand: 8 sequences at 128K.
    Dense, bf16 KV: every weight but the embedding table (8 rows of it) + every layer's K and V. MSA at index dim
    64 with fp8 K/V and index keys: layer 0 reads every K/V row, the 31 MSA layers 16 blocks of 128, each K/V row
    with its fp32 scale, and every index key with its fp32 scale. At 4.8 TB/s (the H200 by name)."""
    from m3compile.bench.byte_floor import bandwidth_tbs, step_bytes
    from m3compile.models.decoder import Decoder

    args = PRESETS["llama3-8b"]
    with torch.device("meta"):
        dense = Decoder(args).to(torch.bfloat16)
        msa = Decoder(args.replace(sparse_layers=(False,) + (True,) * 31,
                                   msa=MSALayerArgs(8, 64, 128, 16))).to(torch.bfloat16)
    B, T, table = 8, 131072, 128256 * 4096
    weights = 2 * (8_030_261_248 - table) + B * 4096 * 2  # Llama-3-8B has 8.03B parameters
    got = step_bytes(dense, B, T, torch.bfloat16, torch.bfloat16)
    assert (got.weights, got.kv, got.index) == (weights, 32 * B * 8 * T * 2 * 128 * 2, 0)
    index_weights = 31 * 2 * (4096 * 8 * 64 + 4096 * 64 + 2 * 64)  # index q/k projections and their norms
    fp8 = torch.float8_e4m3fn
    got = step_bytes(msa, B, T, fp8, fp8)
    assert got.weights == weights + index_weights
    assert got.kv == B * 8 * 2 * (128 + 4) * (T + 31 * 16 * 128)
    assert got.index == 31 * B * T * (64 + 4)
    assert bandwidth_tbs("NVIDIA H200") == 4.8 and bandwidth_tbs("NVIDIA H100 80GB HBM3") == 3.35
    assert bandwidth_tbs("NVIDIA GH200 480GB") == 4.9 and bandwidth_tbs("some GPU") is None
    assert abs(got.floor_ms(4.8) - got.total / 4.8e9) < 1e-9  # ms = bytes / (TB/s * 1e12) * 1e3
    # 15.2 GB of weights, 3.3 GB of K/V (2.2 of them the dense layer 0's), 2.2 GB of index keys: 4.3 ms
    assert round(got.floor_ms(4.8), 2) == 4.30


def test_model_bench_chunked_prefill_fp8_cache_and_byte_floor(tmp_path, monkeypatch):
    """--kv-cache fp8 --prefill-chunk 24: time to first token through the runtime's chunked prefill into an fp8
    paged cache (the MSA layers select from the second chunk on: 40 tokens are 3 blocks of 16 > top-2; the dense
    model's prefill is left out, --dense-max 16), decode on the fp8 cache, each decode row with its byte floor and
    share at --bandwidth."""
    from m3compile.bench.byte_floor import step_bytes

    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)  # torch references on CPU
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, [
        "bench", "model", str(LLAMA_BYTE), "--device", "cpu", "--dtype", "float32", "--prefill-lengths", "40",
        "--decode-lengths", "40", "--batch", "1", "--block", "16", "--topk", "2", "--steps", "1", "--decode-steps",
        "1", "--kv-cache", "fp8", "--index-cache", "fp8", "--prefill-chunk", "24", "--bandwidth", "2", "--dense-max",
        "16", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "byte-llama.json").read_text())
    assert data["config"]["kv_cache"] == "fp8" and data["bandwidth_tbs"] == 2.0
    rows = {row["model"]: row for row in data["prefill"]}
    assert rows["dense"]["measured"] == "not run"
    row = rows["msa"]
    assert row["prefill"] == "chunked" and row["chunk"] == 24 and row["measured"] == "timed", row
    assert row["memory"]["kv_cache"] == "float8_e4m3fn" and row["memory"]["prefill_chunk"] == 24
    assert row["stages"]["index_select"] > 0 and row["stages"]["attention_sparse"] > 0
    assert row["stages"]["attention_dense"] > 0  # layer 0, and the MSA layers' first chunk (2 blocks <= top-2)
    (dec,) = data["decode"]
    dense, sparse = bench_models(str(LLAMA_BYTE), device="cpu", dtype="float32", block=16, topk=2)[:2]
    for name, model in (("dense", dense), ("msa", sparse)):
        floor = dec[name]["floor"]
        want = step_bytes(model, 1, 40, torch.float8_e4m3fn, torch.float8_e4m3fn)
        assert floor["bytes"] == want.to_dict() and floor["tbs"] == 2.0
        assert floor["ms"] == round(want.total / 2e9, 4)
        assert floor["share"] == round(want.total / 2e9 / dec[name]["eager_ms"], 3)
    assert "byte floor" in r.output and "in chunks of 24 tokens" in r.output


def test_a_converted_model_records_the_block_it_ran(byte_msa, monkeypatch):
    """A converted model runs at its own block size and top-k, and the result's config says so (not the defaults for
    a dense model's conversion); another --block or --topk cannot apply and is refused before anything is built."""
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)  # torch references on CPU
    cfg = ModelBenchConfig(str(byte_msa), prefill_lengths=(), decode_lengths=(32,), batch=1, dtype="float32",
                           decode_steps=1, device="cpu")
    result = run_model_bench(cfg, log=lambda m: None)
    assert (result["config"]["block"], result["config"]["topk"]) == (16, 4) == (result["msa"]["block_size"],
                                                                                result["msa"]["topk"])
    for asked in (dict(block=32), dict(topk=2)):
        with pytest.raises(M3CompileError, match="cannot apply to it"):
            run_model_bench(dataclasses.replace(cfg, **asked), log=lambda m: None)
