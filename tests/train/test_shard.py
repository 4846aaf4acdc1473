"""Sharded training (FSDP2, m3compile/train/shard.py): 2 gloo processes with --shard match one process with the
doubled batch (gradients, distillation, training), each keeps half the parameters, a sharded run resumes bit for
bit, and its state resumes without sharding too. One torchrun launch (tests/train/shard_worker.py) makes every sharded
run; the references run here, in this process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m3compile import DistillConfig, TrainConfig, distill, load, train
from m3compile.data import load_tokens, windows
from m3compile.train.distill import DistillStep
from tests.conftest import CALIB_DATA
from tests.train.test_distill import tensors

ROOT = Path(__file__).resolve().parents[2]
STATE_FILES = ("distill_state/index.safetensors", "distill_state/optimizer.safetensors", "model.safetensors")

# the module fixtures are built once: xdist sends this file's tests to one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("shard")




@pytest.fixture(scope="module")
def sharded(byte_msa, tmp_path_factory):
    """The worker's outputs (see tests/train/shard_worker.py) of one launch of 2 gloo processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def launch():
        out = tmp_path_factory.mktemp("sharded")  # a fresh folder: the worker refuses to write over a run's outputs
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "train" / "shard_worker.py"), str(byte_msa), str(CALIB_DATA), str(out)]
        return out, subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    out, done = launch()
    if done.returncode != 0 and "terminate called without an active exception" in done.stderr:
        out, done = launch()  # see test_distill
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind", ["distill", "train"])
def test_gradients_equal_the_one_process_gradients_of_the_doubled_batch(byte_msa, sharded, kind):
    config = DistillConfig(steps=1, seq_len=128) if kind == "distill" else TrainConfig(steps=1, seq_len=64, lr=1e-4)
    step = DistillStep(load(byte_msa, dtype="float32"), config, "cpu", "sparse")
    wins = windows(load_tokens(CALIB_DATA, 256), config.seq_len, 2)
    step.backward(wins[:, :-1], wins[:, 1:])
    got = load_file(str(sharded / f"grads_{kind}.safetensors"))
    assert got.keys() == step.params.keys()
    for name, p in step.params.items():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_two_sharded_processes_match_one_process_and_keep_half_the_parameters_each(byte_msa, sharded, tmp_path):
    single = distill(byte_msa, CALIB_DATA, tmp_path / "single",
                     DistillConfig(steps=3, seq_len=128, batch=2, lr=1e-2, warmup_steps=1, holdout_tokens=128))
    a = load_file(str(sharded / "distill" / STATE_FILES[0]))
    b = load_file(str(tmp_path / "single" / STATE_FILES[0]))
    start = load_file(str(byte_msa / "model.safetensors"))
    for key in a:
        assert not torch.equal(a[key], start[key].float())
        # as the DDP test (test_distill.py), on its data: with the default 512 held-out tokens the training windows
        # start elsewhere and one layer's trajectory parts from the one-process run's by up to 4e-4 after 3 steps at
        # lr 1e-2, as the unsharded two-process run's does, bit for bit (reduction-order noise in a gradient near
        # AdamW's eps, grown by the later steps)
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4)
        assert ((a[key] - b[key]).abs() > 1e-6).float().mean() < 1e-3
    before, after = tensors(byte_msa), tensors(sharded / "distill")
    assert before.keys() == after.keys()
    for name in before:  # the backbone, gathered from the shards, is written back bit for bit
        if ".index_" not in name:
            assert torch.equal(before[name], after[name]), name
    report = json.loads((sharded / "distill" / "distill_report.json").read_text())
    assert report["sharded"] and report["world_size"] == 2
    whole = single.param_bytes_per_rank[0]
    assert whole == sum(p.numel() * p.element_size() for p in load(byte_msa, dtype="float32").parameters())
    assert sum(report["param_bytes_per_rank"]) == whole  # the local shards partition the model
    for held in report["param_bytes_per_rank"]:
        assert abs(held - whole / 2) < 0.01 * whole, (held, whole)


def test_sharded_training_matches_one_process(byte_msa, sharded, tmp_path):
    train(byte_msa, CALIB_DATA, tmp_path / "single", TrainConfig(steps=2, seq_len=64, batch=2, lr=1e-4))
    a = load_file(str(sharded / "train" / "train_state" / "params.safetensors"))
    b = load_file(str(tmp_path / "single" / "train_state" / "params.safetensors"))
    start = {k: v.float() for k, v in load(byte_msa, dtype="float32").state_dict().items()}
    assert a.keys() == b.keys()
    for key in a:
        assert not torch.equal(a[key], start[key]), key
        # AdamW's first steps move a weight by ~lr whatever its gradient's size, so fp32 reduction-order noise in a
        # near-zero gradient can flip one (seen: 5e-6 on 1 of 147,456); the gradients themselves agree (test above)
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=2 * 1e-4 * 2)
        assert ((a[key] - b[key]).abs() > 2e-6).float().mean() < 1e-3, key
    assert json.loads((sharded / "train" / "train_report.json").read_text())["sharded"]


def test_a_sharded_run_resumes_bit_for_bit_sharded_or_not(byte_msa, sharded):
    for name in STATE_FILES[:2]:
        a, b = load_file(str(sharded / "distill" / name)), load_file(str(sharded / "resumed" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key}"
    # the output holds the best held-out state: the stopped run evaluated its last step (2), which the straight run
    # never did, so the resumed output holds the state of whichever of steps 2 and 3 its report keeps
    kept = json.loads((sharded / "resumed" / "distill_report.json").read_text())["holdout"]["kept"]["step"]
    state = load_file(str(sharded / {2: "two_steps", 3: "resumed"}[kept] / STATE_FILES[0]))
    model, straight = load_file(str(sharded / "resumed" / STATE_FILES[2])), tensors(sharded / "distill")
    assert model.keys() == straight.keys()
    for key in model:
        want = state[key].to(model[key].dtype) if key in state else straight[key]
        assert torch.equal(model[key], want), key
    # the 2-step state of the 2-process sharded run, continued by one unsharded process (the same global batch)
    report = distill(byte_msa, CALIB_DATA, sharded / "two_steps",
                     DistillConfig(steps=3, seq_len=128, batch=2, lr=1e-2, warmup_steps=1, holdout_tokens=128), resume=True)
    assert report.start_step == 2 and not report.sharded
    a = load_file(str(sharded / "distill" / STATE_FILES[0]))
    b = load_file(str(sharded / "two_steps" / STATE_FILES[0]))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4)


def test_the_distillation_graph_keeps_every_layer_group(byte_msa):
    """The distillation graph calls each layer's backbone leaves as modules (where FSDP2 all-gathers a shard): every
    layer keeps its group. The index branch's weights, which its one index_branch op reads by get_attr, belong to
    no layer group: the root holds them (they are small), gathered for the whole step."""
    from m3compile.graph.tracing import trace
    from m3compile.pipelines import run_pipeline
    from m3compile.train.shard import shard_groups

    model = load(byte_msa, dtype="float32")
    gm = trace(model)
    run_pipeline("distill", gm, mode="sparse")
    groups = dict(shard_groups(gm))
    assert set(groups) == {f"layer {i}" for i in range(model.args.n_layers)}
    assert not any(".index_" in name for names in groups.values() for name in names)
