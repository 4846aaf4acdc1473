"""Continued training (m3c train): every parameter learns with sparse attention active, the KL reaches only the
index branch, resume is exact, data parallelism matches a doubled batch, bad input leaves the output untouched."""

import pytest
import torch
from safetensors.torch import load_file

from m3compile import DistillInterrupted, M3CompileError, TrainConfig, load, train
from m3compile.data import load_tokens, windows
from tests.conftest import CALIB_DATA
from tests.cli.test_cli import run
from tests.train.test_distill import digest, tensors, two_processes_and_one


@pytest.mark.parametrize("bias", [False, True])
def test_lm_loss_in_chunks_matches_the_whole_logits(bias):
    """The loss and its gradients (hidden state, head weight and bias) from chunks of 5 rows equal those of the whole
    logits, on 2 x 11 tokens (chunks that do not divide them, the last of 2 rows) and on one token."""
    import torch.nn.functional as F
    from m3compile.train.lm_loss import lm_loss

    torch.manual_seed(0)
    for shape in ((2, 11), (1, 1)):
        head = torch.nn.Linear(8, 37, bias=bias)
        h = torch.randn(*shape, 8, requires_grad=True)
        y = torch.randint(0, 37, shape)
        grads = []
        for loss in (F.cross_entropy(head(h).flatten(0, 1), y.flatten()), lm_loss(h, head, y, rows=5)):
            params = [h, *head.parameters()]
            grads.append((loss.detach(), *torch.autograd.grad(loss, params)))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(lm_loss(h, head, y, reduction="sum", rows=3),
                                       F.cross_entropy(head(h).flatten(0, 1), y.flatten(), reduction="sum"))


def test_training_step_makes_the_whole_logits_loss_in_chunks(byte_msa):
    """The training step's graph returns the final hidden state (hidden_output) and its LM loss, made a chunk of
    tokens at a time, equals the cross-entropy of the untouched graph's whole logits, gradients included."""
    from m3compile.graph.tracing import trace
    from m3compile.passes.kl_distill import KLDistill, hidden_output
    from m3compile.graph.pass_manager import PassManager
    from m3compile.train.lm_loss import lm_loss

    x = windows(load_tokens(CALIB_DATA, 256), 96, 1)
    graphs = []
    for _ in range(2):
        gm = trace(load(byte_msa, dtype="float32"))
        PassManager([KLDistill("sparse")]).run(gm)
        graphs.append(gm)
    head = hidden_output(graphs[1])
    assert head is graphs[1].lm_head and not any(n.target == "lm_head" for n in graphs[1].graph.nodes)
    logits, kl, _ = graphs[0](x[:, :-1])
    hidden, kl2, _ = graphs[1](x[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    got = lm_loss(hidden, head, x[:, 1:], rows=40)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl2, kl, rtol=0, atol=0)
    (want + kl.sum()).backward()
    (got + kl2.sum()).backward()
    a, b = dict(graphs[0].named_parameters()), dict(graphs[1].named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name].grad, a[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_lm_kl_in_chunks_matches_the_whole_distributions():
    """The KL from a teacher's next-token distributions to the model's, from chunks of 5 rows, equals the whole
    logits' (value, and the gradients of the hidden state and the head); the teacher gets no gradient."""
    import torch.nn.functional as F
    from m3compile.train.lm_loss import lm_kl

    torch.manual_seed(1)
    head, teacher_head = torch.nn.Linear(8, 37), torch.nn.Linear(8, 37)
    h = torch.randn(2, 11, 8, requires_grad=True)
    t = torch.randn(2, 11, 8)
    want = F.kl_div(F.log_softmax(head(h), -1).flatten(0, 1), F.log_softmax(teacher_head(t), -1).flatten(0, 1),
                    reduction="batchmean", log_target=True)
    got = lm_kl(h, head, t, teacher_head, rows=5)
    params = [h, *head.parameters()]
    for a, b in zip(torch.autograd.grad(want, params), torch.autograd.grad(got, params)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in teacher_head.parameters())
    assert lm_kl(h, head, h.detach(), head).item() == pytest.approx(0.0, abs=1e-6)


def test_training_on_the_dense_copy_fits_the_models_own_dense_output(byte_msa, tmp_path):
    """--lm-target dense: the first step's LM loss is the KL from the model's dense next-token distributions to its
    sparse ones, computed here independently; zero where top-4 of 16-token blocks hold every key (64 tokens); it falls
    as the model trains on one window; a data run does not resume as one on the dense copy."""
    import torch.nn.functional as F

    data = tmp_path / "one_window.bin"
    data.write_bytes(CALIB_DATA.read_bytes()[:257])
    x = windows(load_tokens(data, 256), 256, 1)[:, :-1]
    model = load(byte_msa, dtype="float32")
    with torch.no_grad():
        model.set_selection("dense")
        p = F.log_softmax(model(x).float(), -1).flatten(0, 1)
        model.set_selection("index")
        q = F.log_softmax(model(x).float(), -1).flatten(0, 1)
    want = F.kl_div(q, p, reduction="batchmean", log_target=True).item()
    report = train(byte_msa, data, tmp_path / "dense", TrainConfig(steps=6, seq_len=256, lr=1e-4, lm_target="dense",
                                                                   holdout_tokens=0))
    lm = [h["lm"] for h in report.history]
    assert want > 1e-3 and lm[0] == pytest.approx(want, rel=1e-4), (lm[0], want)
    assert lm[-1] < 0.8 * lm[0], lm
    short = train(byte_msa, CALIB_DATA, tmp_path / "short", TrainConfig(steps=1, seq_len=64, lr=1e-5, lm_target="dense",
                                                                        holdout_tokens=0))
    assert short.history[0]["lm"] == pytest.approx(0.0, abs=1e-6)
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", tmp_path / "short", "--steps", "2",
                       "--seq-len", "64", "--holdout-tokens", "0", "--resume")
    assert code == 2 and "lm_target" in output, output
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", tmp_path / "cli", "--steps", "1",
                       "--seq-len", "64", "--holdout-tokens", "0", "--lm-target", "dense")
    assert code == 0 and "LM (KL to the dense copy) 0.0000" in output, output
    with pytest.raises(M3CompileError, match="lm_target"):
        TrainConfig(steps=1, lm_target="text")
    from m3compile.train.distill import DistillStep
    with pytest.raises(M3CompileError, match="not with --shard"):
        DistillStep(load(byte_msa, dtype="float32"), TrainConfig(steps=1, lm_target="dense"), "cpu", "sparse",
                    shard=True)


def test_training_updates_the_backbone_and_fits_its_data(byte_msa, tmp_path):
    """One 128-token window seen every step: the LM loss through the sparse attention must fall."""
    data = tmp_path / "one_window.bin"
    data.write_bytes(CALIB_DATA.read_bytes()[:129])
    out = tmp_path / "trained"
    report = train(byte_msa, data, out, TrainConfig(steps=6, seq_len=128, batch=1, lr=1e-4, loss_coeff=1.0))
    lm = [h["lm"] for h in report.history]
    assert len(lm) == 6 and lm[-1] < lm[0] - 0.05, lm
    a, b = tensors(byte_msa), tensors(out)
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert any(".self_attn.q_proj." in k for k in changed) and any(".mlp." in k for k in changed)
    assert any(".index_q_proj." in k for k in changed)  # through the KL
    assert (out / "train_state" / "params.safetensors").is_file() and (out / "train_report.json").is_file()


def test_kl_alone_reaches_only_the_index_branch(byte_msa):
    """With the LM loss's gradient removed (coefficient on the KL only), backbone gradients are exactly zero."""
    from m3compile.graph.pass_manager import PassManager
    from m3compile.graph.tracing import trace
    from m3compile.passes.kl_distill import KLDistill

    model = load(byte_msa, dtype="float32")
    gm = trace(model)
    PassManager([KLDistill("sparse")]).run(gm)
    x = windows(load_tokens(CALIB_DATA, 256), 128, 1)[:, :-1]
    _, kl, _ = gm(x)
    kl.sum().backward()
    for name, p in gm.named_parameters():
        if ".index_" in name:
            continue
        assert p.grad is None or p.grad.abs().max() == 0, name


def test_ctrl_c_saves_and_resume_continues_bit_for_bit(byte_msa, tmp_path):
    config = TrainConfig(steps=4, seq_len=64, batch=1, lr=1e-4, holdout_tokens=64)
    train(byte_msa, CALIB_DATA, tmp_path / "straight", config)

    def interrupt_at_2(step, total, metrics):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(DistillInterrupted, match="after step 2"):
        train(byte_msa, CALIB_DATA, tmp_path / "resumed", config, progress=interrupt_at_2)
    report = train(byte_msa, CALIB_DATA, tmp_path / "resumed", config, resume=True)
    assert report.start_step == 2 and [h["step"] for h in report.history] == [1, 2, 3, 4]
    for name in ("train_state/params.safetensors", "train_state/optimizer.safetensors", "model.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "resumed" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key}"


def test_two_gloo_processes_match_one_process_with_the_doubled_batch(byte_msa, tmp_path):
    ddp, single = two_processes_and_one(["train", str(byte_msa), "--data", str(CALIB_DATA), "--steps", "2",
                                         "--seq-len", "64", "--lr", "1e-4", "--holdout-tokens", "64", "--json"],
                                        tmp_path)
    a = load_file(str(ddp / "train_state" / "params.safetensors"))
    b = load_file(str(single / "train_state" / "params.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=2e-6)


def test_bad_input_leaves_output_untouched(byte_msa, tmp_path):
    out = tmp_path / "out"
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", out, "--steps", "1", "--seq-len", "64",
                       "--holdout-tokens", "0")
    assert code == 0, output
    before = digest(out)
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", out, "--steps", "2", "--seq-len", "64")
    assert code == 2 and "already exists" in output
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", out, "--steps", "2", "--seq-len", "64",
                       "--loss-coeff", "0.5", "--resume", "--holdout-tokens", "0")
    assert code == 2 and "loss_coeff" in output
    code, output = run("train", byte_msa, "--data", CALIB_DATA, "--out", tmp_path / "x", "--steps", "1",
                       "--loss-coeff", "-1")
    assert code == 2 and "loss_coeff must be >= 0" in output and not (tmp_path / "x").exists()
    assert digest(out) == before
