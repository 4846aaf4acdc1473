"""One rank of tests/train/test_shard.py's torchrun launch (2 gloo processes): every sharded run the test checks, in one
launch (a launch costs ~10 s of process start-up on the 2-core CI machine). Writes into OUT (argv[3]); asserts
nothing itself: the test compares what it wrote with the one-process references.

    grads_distill / grads_train.safetensors  the trained parameters' gradients (gathered) of one sharded backward,
                                             rank r on sequence r of a 2-sequence batch
    distill/          m3c distill --shard, 3 steps, batch 1 per process
    two_steps/        the same run stopped after 2 steps (kept for the test to resume without sharding)
    resumed/          that run, resumed with --shard to 3 steps
    train/            m3c train --shard, 2 steps, batch 1 per process
"""
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from m3compile import DistillConfig, TrainConfig
from m3compile.cli import main
from m3compile.data import load_tokens, windows
from m3compile.io.load import load_meta, weights_by_layer
from m3compile.train.distill import DistillStep
from m3compile.train.shard import full_tensor

DISTILL = ["--steps", "3", "--seq-len", "128", "--lr", "1e-2", "--warmup-steps", "1", "--batch", "1",
           "--holdout-tokens", "128"]
TRAIN = ["--steps", "2", "--seq-len", "64", "--lr", "1e-4", "--batch", "1"]


def grads(model_dir: str, data: str, config: DistillConfig, rank: int) -> dict[str, torch.Tensor]:
    model = load_meta(model_dir, dtype="float32")
    step = DistillStep(model, config, "cpu", "sparse", shard=True, weights=weights_by_layer(model_dir, model.args))
    wins = windows(load_tokens(data, 256), config.seq_len, 2)
    step.backward(wins[rank:rank + 1, :-1], wins[rank:rank + 1, 1:])
    return {n: full_tensor(p.grad).clone() for n, p in step.params.items()}


def cli(*args) -> None:
    try:
        main([str(a) for a in args], standalone_mode=False)
    except SystemExit as e:
        if e.code:
            raise


if __name__ == "__main__":
    model_dir, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, config in (("distill", DistillConfig(steps=1, seq_len=128)),
                         ("train", TrainConfig(steps=1, seq_len=64, lr=1e-4))):
        g = grads(model_dir, data, config, rank)
        if rank == 0:
            save_file(g, str(out / f"grads_{name}.safetensors"))
    common = [model_dir, "--data", data, "--shard", "--json"]
    cli("distill", *common, *DISTILL, "--out", out / "distill")
    cli("distill", *common, *DISTILL[:1], "2", *DISTILL[2:], "--out", out / "resumed")
    if rank == 0:
        shutil.copytree(out / "resumed", out / "two_steps")
    dist.barrier()
    cli("distill", *common, *DISTILL, "--out", out / "resumed", "--resume")
    cli("train", *common, *TRAIN, "--out", out / "train")
    dist.destroy_process_group()
