"""Index-branch distillation on the shared checkpoint: it learns, only the index branch changes, resume is exact,
data parallelism matches a doubled batch, and bad input leaves the output untouched."""
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from m3compile import (DistillConfig, DistillInterrupted, M3CompileError, TrainConfig, distill,
                       load)
from m3compile.data import load_tokens, windows
from m3compile.graph.pass_manager import PassManager
from m3compile.graph.tracing import trace
from m3compile.passes.kl_distill import KLDistill
from tests.conftest import CALIB_DATA, EVAL_DATA, LLAMA_BYTE
from tests.cli.test_cli import assert_clean_failure, run

ROOT = Path(__file__).resolve().parents[2]




def measure(model_dir: Path, n_windows: int = 4, seq_len: int = 256) -> tuple[float, float]:
    """Mean sparse-support KL and mean dense-teacher recall on fixed held-out windows."""
    model = load(model_dir, dtype="float32")
    gm = trace(model)
    PassManager([KLDistill("sparse")]).run(gm)
    x = windows(load_tokens(EVAL_DATA, 256), seq_len, n_windows)[:, :-1]
    with torch.no_grad():
        _, kl, recall = gm(x)
    return float(kl.mean()), float(recall.mean())


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_distillation_lowers_kl_raises_recall_and_keeps_the_backbone(byte_msa, tmp_path, monkeypatch):
    """What distillation learns, on a CPU as a user without a GPU runs it: the torch references (the kernels it
    would launch are tested against them in tests/kernels and by test_lowering_generate's KL hooks)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "distilled"
    kl_before, recall_before = measure(byte_msa)
    report = distill(byte_msa, CALIB_DATA, out, DistillConfig(steps=14, seq_len=256, batch=4, lr=1e-2, warmup_steps=4,
                                                               holdout_tokens=0))
    kl_after, recall_after = measure(out)
    assert kl_after < 0.7 * kl_before, (kl_before, kl_after)
    assert recall_after > recall_before, (recall_before, recall_after)
    assert [h["mode"] for h in report.history] == ["warmup"] * 4 + ["sparse"] * 10
    before, after = tensors(byte_msa), tensors(out)
    assert before.keys() == after.keys()
    index = [n for n in before if ".index_" in n]
    assert len(index) == 5 * 4  # 5 MSA layers x (q_proj, k_proj, q_norm, k_norm)
    for name in before:
        if name in index:
            assert not torch.equal(before[name], after[name]), f"{name} did not learn"
        else:
            assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name


def test_ctrl_c_saves_and_resume_continues_bit_for_bit(byte_msa, tmp_path):
    """(With a held-out window: the resumed run takes its evaluations from the state and writes the same output; with
    a learning-rate ramp and cosine, the resumed run follows the same curve, and a run grown past the curve's end
    without naming it is refused with the option that keeps it.)"""
    config = DistillConfig(steps=6, seq_len=128, batch=2, lr=1e-2, warmup_steps=2, holdout_tokens=128,
                           lr_schedule="cosine", lr_warmup_steps=2)
    distill(byte_msa, CALIB_DATA, tmp_path / "straight", config)

    def interrupt_at_3(step, total, metrics):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(DistillInterrupted, match="after step 3"):
        distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, progress=interrupt_at_3)
    assert '"step": 3' in (tmp_path / "resumed" / "distill_state" / "state.json").read_text()
    report = distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, resume=True)
    assert report.start_step == 3 and [h["step"] for h in report.history] == [1, 2, 3, 4, 5, 6]
    lrs = [h["lr"] for h in report.history]
    assert lrs[:3] == [5e-3, 1e-2, 1e-2] and lrs[2] > lrs[3] > lrs[4] > lrs[5] == pytest.approx(1e-2 * (0.1 + 0.45 * (1 - 2**-0.5)))
    with pytest.raises(M3CompileError, match="--lr-decay-steps 6"):
        distill(byte_msa, CALIB_DATA, tmp_path / "resumed", DistillConfig(**{**config.__dict__, "steps": 8}),
                resume=True)
    for name in ("distill_state/index.safetensors", "distill_state/optimizer.safetensors", "model.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "resumed" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key}"


def test_a_run_that_makes_the_model_worse_keeps_its_start(byte_msa, tmp_path):
    """A learning rate far too high: the held-out sparse loss rises, so --out holds the start's index branch, bit
    for bit, and says so, while the resume state is the last step's; interrupted and resumed, the same output."""
    args = ["--steps", 2, "--seq-len", 128, "--lr", 10, "--holdout-tokens", 256, "--block-loss", 0]
    code, output = run("distill", byte_msa, "--data", CALIB_DATA, "--out", tmp_path / "worse", *args)
    assert code == 0 and "the output keeps the start" in output, output
    held = json.loads((tmp_path / "worse" / "distill_report.json").read_text())["holdout"]
    assert held["windows"] == 2 and [h["step"] for h in held["evaluations"]] == [0, 2]
    assert held["kept"] == held["start"] and held["final"]["loss"] > held["start"]["loss"]
    assert held["start"]["gap"] == held["start"]["loss"] / held["start"]["dense_loss"] - 1 > 0
    start, out = tensors(byte_msa), tensors(tmp_path / "worse")
    state = load_file(str(tmp_path / "worse" / "distill_state" / "index.safetensors"))
    for name in (n for n in start if ".index_" in n):
        assert torch.equal(start[name], out[name]) and not torch.equal(start[name].float(), state[name]), name

    def interrupt(step, total, metrics):
        raise KeyboardInterrupt

    config = DistillConfig(steps=2, seq_len=128, lr=10.0, holdout_tokens=256, block_loss=0)
    with pytest.raises(DistillInterrupted, match="after step 1"):
        distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, progress=interrupt)
    report = distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, resume=True)
    assert report.holdout == {**held, "seconds": report.holdout["seconds"]}
    for name in ("model.safetensors", "distill_state/index.safetensors"):  # the kept start, then the last state
        assert digest(tmp_path / "resumed")[name] == digest(tmp_path / "worse")[name], name


def test_a_run_that_improves_keeps_the_improvement(byte_msa, tmp_path):
    report = distill(byte_msa, CALIB_DATA, tmp_path / "better",
                     DistillConfig(steps=2, seq_len=128, lr=1e-2, holdout_tokens=256, block_loss=0))
    held = report.holdout
    assert held["kept"] == held["final"] and held["kept"]["step"] == 2
    assert held["final"]["gap"] < held["start"]["gap"], held
    start, out = tensors(byte_msa), tensors(tmp_path / "better")
    assert all(not torch.equal(start[n], out[n]) for n in start if ".index_" in n)


def test_sigterm_twice_mid_run_stops_after_the_step_and_saves(byte_msa, tmp_path):
    """SIGTERM as `timeout` sends it (to the process and again to its group) while a step runs: the step finishes,
    the loop stops there and saves (the second signal changes nothing), the handlers are restored, and the resumed
    run equals an uninterrupted one."""
    config = DistillConfig(steps=3, seq_len=64, batch=1, lr=1e-2, warmup_steps=1, holdout_tokens=0)
    distill(byte_msa, CALIB_DATA, tmp_path / "straight", config)
    previous = signal.getsignal(signal.SIGTERM)

    def term_at_2(step, total, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(DistillInterrupted, match="after step 2"):
        distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, progress=term_at_2)
    assert signal.getsignal(signal.SIGTERM) == previous
    assert '"step": 2' in (tmp_path / "resumed" / "distill_state" / "state.json").read_text()
    distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, resume=True)
    a, b = (load_file(str(tmp_path / d / "distill_state/index.safetensors")) for d in ("straight", "resumed"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_block_loss_zero_adds_nothing_and_a_weighted_run_resumes_exactly(byte_msa, tmp_path):
    """block_loss 0 builds the KL-only graph (no msa_block_loss node, three outputs) and leaves the block loss out of
    the fingerprint; a weighted run (1, the default) logs it, learns differently, resumes bit for bit, and refuses a
    resume with another weight (either way)."""
    from m3compile.ops import msa_block_loss
    from m3compile.passes.kl_distill import drop_logits
    from m3compile.train.distill import DistillStep

    plain = DistillStep(load(byte_msa, dtype="float32"), DistillConfig(steps=1, seq_len=128, block_loss=0), "cpu",
                        "warmup")
    hooked = trace(load(byte_msa, dtype="float32"))
    PassManager([KLDistill("warmup")]).run(hooked)
    drop_logits(hooked)  # as DistillStep does: distillation never reads the logits
    assert plain.gm.code == hooked.code and not any(n.target is msa_block_loss for n in plain.gm.graph.nodes)
    assert "block_loss" not in DistillConfig(steps=1, block_loss=0).fingerprint(1)
    assert DistillConfig(steps=1).block_loss == 1.0 and TrainConfig(steps=1).block_loss == 0.0
    base = dict(steps=4, seq_len=128, batch=2, lr=1e-2, warmup_steps=1, holdout_tokens=0)
    distill(byte_msa, CALIB_DATA, tmp_path / "kl", DistillConfig(**base, block_loss=0))
    config = DistillConfig(**base)
    report = distill(byte_msa, CALIB_DATA, tmp_path / "straight", config)
    assert all(h["block"] > 0 and len(h["block_layers"]) == 5 for h in report.history)
    assert report.history[-1]["block"] < report.history[0]["block"]

    def interrupt_at_2(step, total, metrics):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(DistillInterrupted, match="after step 2"):
        distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, progress=interrupt_at_2)
    code, output = distill_cli(byte_msa, CALIB_DATA, tmp_path / "resumed", "--resume", "--steps", "4", "--batch",
                               "2", "--lr", "1e-2", "--warmup-steps", "1", "--block-loss", "0", "--holdout-tokens", "0")
    assert code == 2 and "block_loss = 1.0" in output, output
    distill(byte_msa, CALIB_DATA, tmp_path / "resumed", config, resume=True)
    a, b = (load_file(str(tmp_path / d / "distill_state/index.safetensors")) for d in ("straight", "resumed"))
    kl_only = load_file(str(tmp_path / "kl" / "distill_state/index.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[key], kl_only[key]) for key in a)
    with pytest.raises(M3CompileError, match="block_loss"):
        distill(byte_msa, CALIB_DATA, tmp_path / "kl", DistillConfig(**{**base, "steps": 6}, block_loss=0.5),
                resume=True)


def test_held_out_evaluation_reads_the_weights_a_fused_step_left(byte_msa):
    """The distillation's fused AdamW changes the index weights in place without bumping their version counters:
    the held-out evaluation after such a step scores the weights as they are now (the model keeps nothing derived
    from them between forwards), the same loss as a model loaded with those weights."""
    from types import SimpleNamespace

    from m3compile.models.decoder import Attention
    from m3compile.train.holdout import HeldOut

    model = load(byte_msa, dtype="float32")
    attn = next(m for m in model.modules() if isinstance(m, Attention) and m.msa is not None)
    wq, wk = attn.index_q_proj.weight, attn.index_k_proj.weight
    data = windows(load_tokens(EVAL_DATA, 256), 256, 1)  # 16 blocks, top-4: the index weights decide the blocks
    held = HeldOut(data, model, DistillConfig(steps=1, seq_len=256), "cpu", trains_backbone=False)
    with torch.no_grad():
        before = held._loss(SimpleNamespace(sharded=False), sparse=True, wins=data)
    opt = torch.optim.AdamW([wq, wk], lr=0.1, fused=True)
    wq.grad, wk.grad = torch.ones_like(wq), torch.ones_like(wk)
    opt.step()
    fresh = load(byte_msa, dtype="float32")
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after = held._loss(SimpleNamespace(sharded=False), sparse=True, wins=data)
        want = HeldOut(data, fresh, DistillConfig(steps=1, seq_len=256), "cpu", trains_backbone=False)._loss(
            SimpleNamespace(sharded=False), sparse=True, wins=data)
    assert after != before and after == want


def test_learning_rate_curves():
    """lr_at: a linear ramp, then constant or a cosine to lr_min x lr at lr_decay_steps (default: steps) and flat
    after; bad settings are refused by name."""
    ramp = DistillConfig(steps=10, lr=1e-3, lr_warmup_steps=4)
    assert [ramp.lr_at(i) for i in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert DistillConfig(steps=10).lr_varies is False and "lr_schedule" not in DistillConfig(steps=10).fingerprint(1)
    cos = DistillConfig(steps=100, lr=1e-3, lr_schedule="cosine", lr_decay_steps=50, lr_min=0.2)
    assert cos.lr_at(0) == 1e-3 and cos.lr_at(25) == pytest.approx(6e-4) and cos.lr_at(50) == pytest.approx(2e-4)
    assert cos.lr_at(99) == pytest.approx(2e-4)
    assert cos.fingerprint(1)["lr_schedule"] == {"schedule": "cosine", "warmup_steps": 0, "decay_steps": 50, "min": 0.2}
    for bad, message in [(dict(lr_schedule="linear"), "lr_schedule must be"),
                         (dict(lr_schedule="cosine", lr_min=1.5), "lr_min"), (dict(lr_warmup_steps=-1), "lr_warmup_steps"),
                         (dict(lr_schedule="cosine", lr_warmup_steps=5, lr_decay_steps=5), "lr_decay_steps must be"),
                         (dict(lr_min=0.2), "lr_min shapes the cosine schedule and cannot apply to the constant one"),
                         (dict(lr_decay_steps=5, lr_min=0.2), "lr_decay_steps and lr_min shape the cosine")]:
        with pytest.raises(M3CompileError, match=message):
            DistillConfig(steps=10, **bad)


def two_processes_and_one(common: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """Run `m3c *common` under torchrun with 2 gloo processes x batch 1, then in one process with batch 2; both must
    succeed. Returns the two output directories (ddp, single)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "m3compile.cli",
                *common, "--batch", "1", "--out", str(tmp_path / "ddp"), "--force"]
    two = subprocess.run(torchrun, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if two.returncode != 0 and "terminate called without an active exception" in two.stderr:
        # a rank aborted in gloo's C++ thread teardown (seen once in ~20 runs on a loaded 2-core machine, never in
        # our code path); one rerun, and the run must then pass every check below
        two = subprocess.run(torchrun, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert '"world_size": 2' in two.stdout
    one = subprocess.run([sys.executable, "-m", "m3compile.cli", *common, "--batch", "2", "--out", str(tmp_path / "single")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    return tmp_path / "ddp", tmp_path / "single"


def test_two_gloo_processes_match_one_process_with_the_doubled_batch(byte_msa, tmp_path):
    ddp, single = two_processes_and_one(["distill", str(byte_msa), "--data", str(CALIB_DATA), "--steps", "3",
                                         "--seq-len", "128", "--lr", "1e-2", "--warmup-steps", "1", "--holdout-tokens",
                                         "128", "--json"], tmp_path)
    a = load_file(str(ddp / "distill_state" / "index.safetensors"))
    b = load_file(str(single / "distill_state" / "index.safetensors"))
    start = load_file(str(byte_msa / "model.safetensors"))
    for key in a:
        assert not torch.equal(a[key], start[key].float())
        # AdamW steps by ~lr * sign(g) where |g| is near its eps, so fp32 reduction-order noise in a near-zero
        # gradient can move one weight by up to ~lr * 1e-2 (seen: 4.6e-5 on 1 of 18,432); the trajectories match
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4)
        assert ((a[key] - b[key]).abs() > 1e-6).float().mean() < 1e-3  # all but a handful agree to 1e-6


# ------------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, existing output untouched


def distill_cli(model_dir, data, out, *extra):
    return run("distill", model_dir, "--data", data, "--out", out, "--steps", "2", "--seq-len", "128", *extra,
               *([] if "--holdout-tokens" in extra else ["--holdout-tokens", "0"]))


def test_a_run_whose_output_is_not_a_terminal_prints_progress_lines(byte_msa, tmp_path):
    """Into a log or a pipe the bar draws only at the end: a plain line every tenth of the run says how far it is."""
    code, output = distill_cli(byte_msa, CALIB_DATA, tmp_path / "out")
    assert code == 0, output
    steps = [line.split("  ")[0] for line in output.splitlines() if line.startswith("distil step ")]
    assert steps == ["distil step 1/2", "distil step 2/2"], output
    assert "tok/s" in next(line for line in output.splitlines() if line.startswith("distil step 2/2"))


def test_data_shorter_than_one_sequence(byte_msa, tmp_path):
    short = tmp_path / "short.bin"
    short.write_bytes(b"def f():\n    pass\n")
    code, output = distill_cli(byte_msa, short, tmp_path / "out")
    assert code == 2 and "fewer than one sequence" in output and not (tmp_path / "out").exists()


def test_token_ids_beyond_the_vocabulary(byte_msa, tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1000, dtype=np.int64) % 300)
    code, output = distill_cli(byte_msa, ids, tmp_path / "out")
    assert code == 2 and "outside the model's vocabulary" in output and not (tmp_path / "out").exists()


def test_cuda_graph_needs_cuda(byte_msa, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the capture itself is checked by m3c bench distill MODEL --cuda-graph")
    code, output = distill_cli(byte_msa, CALIB_DATA, tmp_path / "out", "--cuda-graph")
    assert code == 2 and "--cuda-graph needs a CUDA device" in output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_block_loss_must_be_a_finite_non_negative_weight(byte_msa, tmp_path, value):
    code, output = distill_cli(byte_msa, CALIB_DATA, tmp_path / "out", "--block-loss", value)
    assert_clean_failure(code, output, tmp_path / "out", "block_loss must be")


@pytest.mark.parametrize("args, message", [(("--lr-min", "1.5"), "lr_min is a fraction"),
                                           (("--lr-warmup", "4", "--lr-decay-steps", "3"), "lr_decay_steps must be")])
def test_learning_rate_options_out_of_range(byte_msa, tmp_path, args, message):
    code, output = distill_cli(byte_msa, CALIB_DATA, tmp_path / "out", "--lr-schedule", "cosine", *args)
    assert_clean_failure(code, output, tmp_path / "out", message)


def test_model_that_was_never_converted(tmp_path):
    code, output = distill_cli(LLAMA_BYTE, CALIB_DATA, tmp_path / "out")
    assert code == 2 and "never converted" in output and not (tmp_path / "out").exists()


def test_existing_output_and_mismatched_resume_leave_it_untouched(byte_msa, tmp_path):
    out = tmp_path / "out"
    code, output = distill_cli(byte_msa, CALIB_DATA, out, "--batch", "1")
    assert code == 0, output
    before = digest(out)
    code, output = distill_cli(byte_msa, CALIB_DATA, out)
    assert code == 2 and "already exists" in output
    code, output = distill_cli(byte_msa, CALIB_DATA, out, "--resume", "--steps", "4", "--lr", "0.5")
    assert code == 2 and "lr" in output, output
    code, output = distill_cli(byte_msa, CALIB_DATA, out, "--resume")
    assert code == 2 and "already holds 2 steps" in output, output
    assert digest(out) == before
    plain = tmp_path / "plain"
    plain.mkdir()
    code, output = distill_cli(byte_msa, CALIB_DATA, plain, "--resume")
    assert code == 2 and "no distillation state" in output


def test_distillation_keeps_an_adaptive_budget(tmp_path):
    """A model with an adaptive budget distils on the blocks it keeps (the sparse KL over its support, the block
    loss over every candidate, whose distribution the budget's cut reads), and the output keeps the budget."""
    from m3compile import MSAConfig, convert_checkpoint

    src = tmp_path / "msa"
    convert_checkpoint(LLAMA_BYTE, src, MSAConfig(block_size=16, topk=6, dense_layers=(0,), top_p=0.6, min_blocks=2))
    report = distill(src, CALIB_DATA, tmp_path / "out", DistillConfig(steps=3, seq_len=256, batch=1, lr=1e-2,
                                                                     warmup_steps=1, holdout_tokens=0))
    assert report.steps == 3 and all(np.isfinite(h["kl"]) for h in report.history)
    assert report.history[-1]["mode"] == "sparse" and report.history[-1]["recall"] < 1.0
    sparse = json.loads((tmp_path / "out" / "config.json").read_text())["sparse_attention_config"]
    assert sparse["sparse_top_p"] == 0.6 and sparse["sparse_min_blocks"] == 2


def test_a_state_worse_at_a_longer_length_is_not_kept(byte_msa, tmp_path):
    """The held-out tokens are judged at the training length and at 2x and 4x it (within the model's positions): a
    state better at the training length but worse at 2x it is not kept, and a distillation records every length."""
    from m3compile.train.holdout import HeldOut, summary

    data = windows(load_tokens(EVAL_DATA, 256), 64, 4)
    held = HeldOut(data, None, DistillConfig(steps=1, seq_len=64), "cpu", trains_backbone=False, max_len=200)
    assert held.lengths == [64, 128]  # 256 tokens, but the positions end at 200
    def entry(step, a, b):
        lengths = {str(n): {"loss": x, "dense_loss": 1.0, "gap": x - 1} for n, x in ((64, a), (128, b))}
        return {"step": step, **lengths["64"], "lengths": lengths}

    held.history = [entry(0, 1.10, 1.20), entry(1, 1.05, 1.21),  # step 1: better at 64, worse at 128
                    entry(2, 1.08, 1.19)]
    assert held.best["step"] == 2
    held.history = held.history[:2]
    assert held.best["step"] == 0
    line = summary({**held.to_dict(1), "windows": 4, "tokens": 256})
    assert "judged at 64, 128 tokens" in line and "keeps the start" in line
    report = distill(byte_msa, CALIB_DATA, tmp_path / "out", DistillConfig(steps=1, seq_len=64, lr=1e-2,
                                                                          holdout_tokens=256, block_loss=0))
    assert report.holdout["lengths"] == [64, 128, 256]
    assert all(set(h["lengths"]) == {"64", "128", "256"} for h in report.holdout["evaluations"])
