"""Bad input never hurts: every kind of bad input through the CLI -> exit 2, one line `error: ...` on
stderr, no traceback, nothing written, inputs unchanged; Ctrl-C and SIGTERM leave nothing partial."""
import fcntl
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from m3compile import MSAConfig, cli, convert_checkpoint
from m3compile.io import streaming
from m3compile.tools.evaluate import EvalReport
from m3compile.train import distill as distill_mod

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
WORDS = ["def", "return", "x", "(", ")", ":", "y", "if", "else", "for"]


def _tokenizer(path: Path) -> None:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    (path / "chat_template.jinja").write_text("{{ messages }}")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """dense: a small Llama with a tokenizer; msa: it converted; distilled: msa after one distillation step."""
    root = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(root / "dense")
    _tokenizer(root / "dense")
    convert_checkpoint(root / "dense", root / "msa", MSAConfig(block_size=8, topk=2))
    np.save(root / "d.npy", np.random.default_rng(0).integers(0, 256, 400).astype(np.int64))
    (root / "d.txt").write_text(" ".join(WORDS * 20))
    code, out = _invoke("distill", root / "msa", "--data", root / "d.npy", "--out", root / "distilled", "--steps", 1,
                        "--seq-len", 16)[:2]
    assert code == 0, out
    return root


def _invoke(*args):
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    return r.exit_code, r.output, r.stderr, r.exception


def _tree(*roots) -> dict:
    """Every path under the roots (dotfiles included) -> content hash, 'dir' or its link target."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    out[str(p)] = "-> " + os.readlink(p)
                elif p.is_dir():
                    out[str(p)] = "dir"
                else:
                    out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _set_tensor(d: Path, name: str, fn) -> Path:
    state = load_file(d / "model.safetensors")
    state[name] = fn(state[name])
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _two_shards(d: Path) -> tuple[Path, dict]:
    """Split the single shard into two plus an index; returns the dir and its weight map."""
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(state)
    a, b = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: state[n] for n in a}, str(d / "a.safetensors"), metadata={"format": "pt"})
    save_file({n: state[n] for n in b}, str(d / "b.safetensors"), metadata={"format": "pt"})
    wm = {**{n: "a.safetensors" for n in a}, **{n: "b.safetensors" for n in b}}
    return d, wm


def _index(d: Path, weight_map) -> Path:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _index_case(mutate):
    def case(b, t):
        d, wm = _two_shards(_copy(b / "dense", t / "src"))
        return ["convert", _index(d, mutate(d, wm)), t / "out"], t / "out"
    return case


def _first(wm):
    return sorted(wm)[0]


def _dup_tensor(d, wm):
    state = load_file(d / "b.safetensors")
    name = _first(wm)  # in a.safetensors
    state[name] = load_file(d / "a.safetensors")[name]
    save_file(state, str(d / "b.safetensors"), metadata={"format": "pt"})
    return wm


def _lock(b, t):
    out = t / "out"
    fd = os.open(t / ".out.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return ["convert", b / "dense", out], out, fd


def _dangling(b, t):
    (t / "out").symlink_to(t / "nowhere")
    return ["convert", b / "dense", t / "out"], None  # the tree check: the link stays as it was


def _file_out(b, t):
    (t / "out").write_text("a file")
    return ["convert", b / "dense", t / "out", "--force"], None  # the tree check: the file stays as it was


def _corrupt_state(mutate):
    def case(b, t):
        out = _copy(b / "distilled", t / "run")
        mutate(out / "distill_state")
        return ["distill", b / "msa", "--data", b / "d.npy", "--out", out, "--steps", 3, "--seq-len", 16, "--resume"], None
    return case


def _src_cfg(**changes):
    return lambda b, t: (["convert", _edit_config(_copy(b / "dense", t / "src"), **changes), t / "out"], t / "out")


def _src_tensor(name, fn, *extra):
    return lambda b, t: (["convert", _set_tensor(_copy(b / "dense", t / "src"), name, fn), t / "out", *extra], t / "out")


def _bytes_file(name, data):
    def make(b, t):
        (t / name).write_bytes(data)
        return t / name
    return make


_bad_txt = _bytes_file("bad.txt", b"def x \xff\xfe ( ) :" * 40)
_Q = "model.layers.1.self_attn.q_proj.weight"
_TRAIN = ["--steps", 1, "--seq-len", 16]

# id (the class of bad input) -> (case(base, tmp) -> (argv, out dir that must not appear[, fd]), needle in the error)
CASES = {
    # input and output never overlap (with or without --force)
    "overlap-convert-same": (lambda b, t: (["convert", _copy(b / "dense", t / "s"), t / "s", "--force"], None), "is the input"),
    "overlap-convert-parent": (lambda b, t: (["convert", _copy(b / "dense", t / "T" / "src"), t / "T", "--force"], None), "contains the input"),
    "overlap-convert-inside": (lambda b, t: (["convert", _copy(b / "dense", t / "s"), t / "s" / "o"], t / "s" / "o"), "inside the input"),
    "overlap-convert-dotdot": (lambda b, t: (["convert", _copy(b / "dense", t / "s"), t / "s" / ".." / "s", "--force"], None), "is the input"),
    "overlap-export-same": (lambda b, t: (["export-onnx", _copy(b / "msa", t / "m"), t / "m", "--force"], None), "is the input"),
    "overlap-export-parent": (lambda b, t: (["export-onnx", _copy(b / "msa", t / "T" / "m"), t / "T", "--force"], None), "contains the input"),
    "overlap-distill-same": (lambda b, t: (["distill", _copy(b / "msa", t / "m"), "--data", b / "d.npy", "--out", t / "m", "--force", *_TRAIN], None), "is the input"),
    "overlap-distill-inside": (lambda b, t: (["distill", _copy(b / "msa", t / "m"), "--data", b / "d.npy", "--out", t / "m" / "o", *_TRAIN], t / "m" / "o"), "inside the input"),
    "overlap-distill-data": (lambda b, t: (["distill", b / "msa", "--data", _copy(b / "msa", t / "m") / ".." / "m" / "config.json", "--out", t / "m", "--force", *_TRAIN], None), "contains the input"),
    "overlap-train-same": (lambda b, t: (["train", _copy(b / "msa", t / "m"), "--data", b / "d.npy", "--out", t / "m", *_TRAIN], None), "is the input"),
    # output paths
    "out-is-file": (_file_out, "is a file"),
    "out-dangling-symlink": (_dangling, "dangling symlink"),
    "out-parent-is-file": (lambda b, t: ((t / "f").write_text("x"), ["convert", b / "dense", t / "f" / "out"])[1:] + (None,), "is not a directory"),
    "out-exists": (lambda b, t: ((t / "out").mkdir(), ["convert", b / "dense", t / "out"])[1:] + (None,), "already exists"),
    "out-locked": (_lock, "being written by another process"),
    # non-finite weights
    "weights-nan": (_src_tensor(_Q, lambda w: w.index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(float("nan")))), _Q),
    "weights-inf": (_src_tensor("model.norm.weight", lambda w: w.fill_(float("inf"))), "model.norm.weight holds non-finite"),
    "weights-fp16-overflow": (_src_tensor(_Q, lambda w: (w.bfloat16() * 0 + 1e6), "--dtype", "float16"), f"{_Q} holds values up to"),
    # non-finite or bad numeric options
    "option-lr-inf": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--lr", "inf", *_TRAIN], t / "o"), "lr must be a finite number"),
    "option-lr-nan": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--lr", "nan", *_TRAIN], t / "o"), "lr must be a finite number"),
    "option-loss-coeff-nan": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--loss-coeff", "nan", *_TRAIN], t / "o"), "loss_coeff must be a finite"),
    "option-loss-coeff-inf": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--loss-coeff", "inf", *_TRAIN], t / "o"), "loss_coeff must be a finite"),
    "option-steps-zero": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--steps", 0], t / "o"), "steps must be >= 1"),
    "option-dtype": (lambda b, t: (["convert", b / "dense", t / "o", "--dtype", "float17"], t / "o"), "unknown dtype 'float17'"),
    # config.json: wrong type or range, encoding
    "config-string-int": (_src_cfg(vocab_size="256"), 'vocab_size must be an integer, got "256"'),
    "config-float-int": (_src_cfg(hidden_size=32.0), "hidden_size must be an integer, got 32.0"),
    "config-null-int": (_src_cfg(num_hidden_layers=None), "num_hidden_layers must be an integer, got null"),
    "config-list-int": (_src_cfg(intermediate_size=[48]), "intermediate_size must be an integer, got [48]"),
    "config-zero-heads": (_src_cfg(num_attention_heads=0), "num_attention_heads must be >= 1"),
    "config-bool-string": (_src_cfg(tie_word_embeddings="false"), 'tie_word_embeddings must be true or false, got "false"'),
    "config-eps-negative": (_src_cfg(rms_norm_eps=-1e-6), "rms_norm_eps must be > 0"),
    "config-theta-string": (_src_cfg(rope_theta="1e4"), "rope_theta must be a finite number"),
    "config-not-utf8": (lambda b, t: (["convert", (lambda d: ((d / "config.json").write_bytes(b'{"model_type": "ll\xe1ma"}'), d)[1])(_copy(b / "dense", t / "src")), t / "out"], t / "out"), "not UTF-8"),
    "config-not-object": (lambda b, t: (["convert", (lambda d: ((d / "config.json").write_text("[1, 2]"), d)[1])(_copy(b / "dense", t / "src")), t / "out"], t / "out"), "expected a JSON object"),
    # model.safetensors.index.json against the shards
    "index-weight-map-list": (_index_case(lambda d, wm: list(wm)), "weight_map must be an object"),
    "index-missing-entry": (_index_case(lambda d, wm: {k: v for k, v in wm.items() if k != _first(wm)}), "has no weight_map entry"),
    "index-wrong-file": (_index_case(lambda d, wm: {**wm, _first(wm): "b.safetensors"}), "it is in a.safetensors"),
    "index-tensor-in-two-shards": (_index_case(_dup_tensor), "is in two shards"),
    "index-outside-dir": (_index_case(lambda d, wm: {**wm, _first(wm): "../a.safetensors"}), "outside the checkpoint directory"),
    "index-not-a-file-name": (_index_case(lambda d, wm: {**wm, _first(wm): 7}), "must name a file"),
    # re-converting an MSA checkpoint with other settings
    "reconvert-block-size": (lambda b, t: (["convert", b / "msa", t / "o", "--block-size", 16], t / "o"), "block_size 8"),
    "reconvert-topk": (lambda b, t: (["convert", b / "msa", t / "o", "--topk", 4, "--block-size", 8], t / "o"), "topk 2"),
    # corrupt resume state
    "resume-bad-json": (_corrupt_state(lambda s: (s / "state.json").write_text("{bad")), "not valid JSON"),
    "resume-no-step": (_corrupt_state(lambda s: (s / "state.json").write_text("{}")), "corrupt resume state"),
    "resume-missing-file": (_corrupt_state(lambda s: (s / "optimizer.safetensors").unlink()), "is corrupt"),
    "resume-missing-tensors": (_corrupt_state(lambda s: save_file(dict(list(load_file(s / "index.safetensors").items())[:1]), str(s / "index.safetensors"))), "other tensors"),
    # data
    "data-not-utf8-eval": (lambda b, t: (["eval", b / "msa", "--data", _bad_txt(b, t), "--seq-len", 8], None), "not UTF-8 text"),
    "data-not-utf8-distill": (lambda b, t: (["distill", b / "msa", "--data", _bad_txt(b, t), "--out", t / "o", *_TRAIN], t / "o"), "not UTF-8 text"),
    # devices
    "device-cuda-eval": (lambda b, t: (["eval", b / "msa", "--data", b / "d.npy", "--device", "cuda"], None), "CUDA is not available"),
    "device-cuda-distill": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--device", "cuda", *_TRAIN], t / "o"), "CUDA is not available"),
    "device-unknown": (lambda b, t: (["eval", b / "msa", "--data", b / "d.npy", "--device", "gpu7"], None), "device 'gpu7'"),
    # click usage errors, one line
    "usage-bad-int": (lambda b, t: (["convert", b / "dense", t / "o", "--block-size", "abc"], t / "o"), "'abc' is not a valid integer"),
    "usage-unknown-option": (lambda b, t: (["convert", b / "dense", t / "o", "--frobnicate"], t / "o"), "No such option"),
    "usage-unknown-command": (lambda b, t: (["frobnicate"], None), "No such command"),
    "usage-missing-option": (lambda b, t: (["eval", b / "msa"], None), "Missing option '--data'"),
    "usage-src-and-preset": (lambda b, t: (["convert", b / "dense", "--preset", "m3-tiny", "--out", t / "o"], t / "o"), "give SRC or --preset"),
    "usage-seq-len": (lambda b, t: (["eval", b / "msa", "--data", b / "d.npy", "--seq-len", 0], None), "--seq-len must be >= 1"),
}
if torch.cuda.is_available():  # the CUDA cases need a machine without it
    CASES = {k: v for k, v in CASES.items() if not k.startswith("device-cuda")}


def test_every_bad_input_is_one_line_and_writes_nothing(base, tmp_path):
    """At least 40 distinct bad inputs: exit 2, one `error:` line on stderr, no traceback, the trees unchanged."""
    assert len(CASES) >= 40
    failures = []
    for name, (make, needle) in CASES.items():
        t = tmp_path / name
        t.mkdir()
        made = make(base, t)
        argv, out = made[0], made[1]
        before = _tree(t, base)
        code, output, stderr, exc = _invoke(*argv)
        if len(made) > 2:
            os.close(made[2])
        lines = stderr.splitlines()
        ok = (code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
              and "Traceback" not in output and isinstance(exc, SystemExit)
              and (out is None or not os.path.lexists(out)) and _tree(t, base) == before)
        if not ok:
            failures.append(f"{name}: exit {code}, stderr {stderr!r}, exc {exc!r}, tree changed: {_tree(t, base) != before}")
    assert not failures, "\n".join(failures)


def test_sigterm_mid_conversion_leaves_nothing(base, tmp_path, monkeypatch):
    """SIGTERM raises KeyboardInterrupt in the CLI: the temporary directory and the lock go, exit status 130."""
    real = streaming.SafetensorsWriter.write

    def write(self, name, t):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, name, t)

    monkeypatch.setattr(streaming.SafetensorsWriter, "write", write)
    previous = signal.getsignal(signal.SIGTERM)
    code, output, stderr, _ = _invoke("convert", base / "dense", tmp_path / "out")
    assert code == 130 and stderr.startswith("error: interrupted"), output
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is the CLI's only while it runs


def test_sigterm_swallowed_by_a_library_is_still_an_interrupt(base, tmp_path, monkeypatch):
    """safetensors turns a KeyboardInterrupt raised inside get_tensor into a ValueError (hence our read error):
    the CLI knows a signal came and still reports the interrupt, exit status 130."""
    def load(self, names):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            raise streaming.M3CompileError("x: cannot read tensor y (ValueError: could not determine the shape)") from None

    monkeypatch.setattr(streaming.SourceTensors, "load", load)
    code, output, stderr, _ = _invoke("convert", base / "dense", tmp_path / "out")
    assert code == 130 and stderr == "error: interrupted; no output was written\n", output
    assert list(tmp_path.iterdir()) == []


def test_stale_partials_are_removed(base, tmp_path):
    stale = tmp_path / ".out.partial-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    code, output, _, _ = _invoke("convert", base / "dense", tmp_path / "out", "--block-size", 8, "--topk", 2)
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_replaces_an_output_safely(base, tmp_path):
    out = _copy(base / "msa", tmp_path / "out")
    (out / "old.txt").write_text("old")
    code, output, _, _ = _invoke("convert", base / "dense", out, "--block-size", 8, "--topk", 2, "--force")
    assert code == 0, output
    assert not (out / "old.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_distill_ctrl_c_exits_130_and_says_where(base, tmp_path, monkeypatch):
    calls = []
    real = distill_mod._batch_ids

    def batch_ids(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(distill_mod, "_batch_ids", batch_ids)
    out = tmp_path / "run"
    code, output, stderr, _ = _invoke("distill", base / "msa", "--data", base / "d.npy", "--out", out, "--steps", 3,
                                      "--seq-len", 16)
    assert code == 130, output
    assert "interrupted after step 1" in stderr and f"state saved in {out}" in stderr and "--resume" in stderr
    assert json.loads((out / "distill_state" / "state.json").read_text())["step"] == 1
    assert not list(tmp_path.glob(".run.*"))


def test_eval_of_a_nan_model_is_a_clear_error(base, tmp_path):
    model = _copy(base / "msa", tmp_path / "m")
    _set_tensor(model, "model.norm.weight", lambda w: w.fill_(float("nan")))
    code, output, stderr, _ = _invoke("eval", model, "--data", base / "d.npy", "--seq-len", 16, "--json")
    assert code == 2 and stderr.startswith("error: ") and len(stderr.splitlines()) == 1  # refused as it loads
    assert "tensor model.norm.weight holds non-finite values (nan)" in stderr
    report = EvalReport(16, 1, 16, float("nan"), float("inf"), {1: float("nan")}, 0.1, {1: 0.5})
    text = json.dumps(report.to_dict(), allow_nan=False)  # never a bare NaN
    assert json.loads(text)["dense_loss"] is None and json.loads(text)["recall"] == {"1": None}


def test_convert_copies_the_tokenizer_and_eval_reads_text(base, tmp_path):
    out = tmp_path / "out"
    code, output, _, _ = _invoke("convert", base / "dense", out, "--block-size", 8, "--topk", 2)
    assert code == 0, output
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (base / "dense" / name).read_bytes(), name
    code, output, _, _ = _invoke("eval", out, "--data", base / "d.txt", "--seq-len", 16, "--json")
    assert code == 0, output
    assert json.loads(output)["windows"] == 12
    assert (base / "distilled" / "tokenizer.json").is_file()  # distill's output keeps the tokenizer too


def test_unwritable_parent(base, tmp_path, monkeypatch):
    """(Root may write anywhere, so the permission is faked.)"""
    from m3compile.io import output_dir

    monkeypatch.setattr(output_dir.os, "access", lambda path, mode: Path(path) != tmp_path)
    code, output, stderr, _ = _invoke("convert", base / "dense", tmp_path / "out")
    assert code == 2 and stderr == f"error: output {tmp_path / 'out'}: cannot write in {tmp_path} (permission denied)\n"
    assert list(tmp_path.iterdir()) == []


def test_bare_m3c_shows_the_help():
    code, output, stderr, _ = _invoke()
    assert output.startswith("Usage: ") and "COMMAND" in output and "error:" not in output


def test_sigterm_to_the_real_command(tmp_path):
    """The installed m3c, killed with SIGTERM while it writes: exit 130, no partial directory, no lock."""
    import subprocess
    import sys
    import time

    from tests.conftest import LLAMA_BYTE

    out = tmp_path / "out"
    for _ in range(5):  # the signal must land while the output is being written; a run it missed is redone
        proc = subprocess.Popen([sys.executable, "-m", "m3compile.cli", "convert", str(LLAMA_BYTE), str(out), "--json",
                                 "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        if proc.returncode == 130 and "no output was written" in stderr:
            break
        # it finished first (0), or the signal came once the output was in place: then it says so, and it is whole
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        assert proc.returncode == 0 or last == f"error: interrupted after {out} was written in full", stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "config.json").is_file()
        shutil.rmtree(out)
    else:
        raise AssertionError("five conversions finished before SIGTERM could reach them")
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted; no output was written"
    assert list(tmp_path.iterdir()) == []


def _write_under_sigterm(out: Path) -> None:
    """atomic_output_dir(out) writing a config.json, with SIGTERM raising KeyboardInterrupt (as m3c's handler stops
    a command) for the block; the test's patch sends the signal somewhere inside, and the interrupt must come out."""
    from m3compile.io import output_dir

    def to_interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, to_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with output_dir.atomic_output_dir(out) as tmp:
                (tmp / "config.json").write_text("{}")
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_as_the_partial_directory_is_made_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM arriving just after atomic_output_dir has created its `.NAME.partial-*` directory (a moment
    test_sigterm_to_the_real_command can hit): the signal is held until the directory is known, then the
    interrupted run removes it."""
    import tempfile

    mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_signal(*args, **kwargs):
        made = mkdtemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before the directory's path is returned
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_signal)
    _write_under_sigterm(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_signal_during_the_commit_comes_after_it(tmp_path, monkeypatch):
    """SIGTERM arriving while atomic_output_dir moves the output into place is held until the move is done and
    recorded: the output is whole, no partial directory stays, and m3c's message says what was written."""
    from m3compile.cli import _interrupted
    from m3compile.io import output_dir

    rename = Path.rename

    def rename_then_signal(self, target):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the commit
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_then_signal)
    output_dir.COMMITTED.clear()
    out = tmp_path / "out"
    _write_under_sigterm(out)
    assert (out / "config.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert output_dir.COMMITTED == [out] and _interrupted() == f"interrupted after {out} was written in full"
    output_dir.COMMITTED.clear()
    assert _interrupted() == "interrupted; no output was written"
