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
from m3compile.io import shards as streaming
from m3compile.evaluation.loss import EvalReport
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
    """dense: a small Llama with a tokenizer; msa: it converted; distilled: msa after one distillation step;
    trained: msa after one step of training (m3c train)."""
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
    code, out = _invoke("train", root / "msa", "--data", root / "d.npy", "--out", root / "trained", "--steps", 1,
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
    "data-not-utf8-eval": (lambda b, t: (["eval", "loss", b / "msa", "--data", _bad_txt(b, t), "--seq-len", 8], None), "not UTF-8 text"),
    "data-not-utf8-distill": (lambda b, t: (["distill", b / "msa", "--data", _bad_txt(b, t), "--out", t / "o", *_TRAIN], t / "o"), "not UTF-8 text"),
    # devices
    "device-cuda-eval": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--device", "cuda"], None), "CUDA is not available"),
    "device-cuda-distill": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--device", "cuda", *_TRAIN], t / "o"), "CUDA is not available"),
    "device-unknown": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--device", "gpu7"], None), "device 'gpu7'"),
    # click usage errors, one line
    "usage-bad-int": (lambda b, t: (["convert", b / "dense", t / "o", "--block-size", "abc"], t / "o"), "'abc' is not a valid integer"),
    "usage-unknown-option": (lambda b, t: (["convert", b / "dense", t / "o", "--frobnicate"], t / "o"), "No such option"),
    "usage-unknown-command": (lambda b, t: (["frobnicate"], None), "No such command"),
    "usage-missing-option": (lambda b, t: (["eval", "loss", b / "msa"], None), "Missing option '--data'"),
    "usage-src-and-preset": (lambda b, t: (["convert", b / "dense", "--preset", "m3-tiny", "--out", t / "o"], t / "o"), "give SRC or --preset"),
    "usage-seq-len": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", 0], None), "--seq-len must be >= 1"),
}


def _model(b, t, name="msa"):
    return _copy(b / name, t / "m")


def _named(d: Path, part: str) -> str:
    """The first tensor of `d`'s model.safetensors whose name holds `part`."""
    return next(n for n in sorted(load_file(d / "model.safetensors")) if part in n)


def _bad_tensor(part, fn, command, *extra, name="msa"):
    """A copy of a checkpoint with `fn` applied to its first tensor named like `part`, given to `command`."""
    def case(b, t):
        d = _model(b, t, name)
        _set_tensor(d, _named(d, part), fn)
        args = {"eval loss": ["--data", b / "d.npy", "--seq-len", 16],
                "generate": ["--prompt", "def x ( ) :", "--max-new-tokens", 2],
                "distill": ["--data", b / "d.npy", "--out", t / "o", *_TRAIN],
                "export-onnx": [t / "o"],
                "attention-map": ["--data", b / "d.npy", "--layer", 1, "--seq-len", 16, "--out", t / "o.png"],
                "convert": [t / "o"]}[command]
        return [*command.split(), d, *args, *extra], t / ("o.png" if command == "attention-map" else "o")
    return case


def _nan_first(w):
    return w.index_put_((torch.tensor([0]),) * w.dim(), torch.tensor(float("nan"), dtype=w.dtype))


def _cfg(name, edit, command, *extra):
    """A copy of a checkpoint whose config.json `edit(cfg)` changed, given to `command` (eval or convert)."""
    def case(b, t):
        d = _model(b, t, name)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        if command == "convert":
            return ["convert", d, t / "o", *extra], t / "o"
        return ["eval", "loss", d, "--data", b / "d.npy", "--seq-len", 16, *extra], None
    return case


def _sparse(**changes):
    return lambda cfg: cfg["sparse_attention_config"].update(changes)


def _ids(t: Path, name: str, n: int, seed: int = 1) -> Path:
    np.save(t / name, np.random.default_rng(seed).integers(0, 256, n).astype(np.int64))
    return t / name


def _resume(model=None, data=None, mutate=None):
    """distill --resume of a copy of the distilled run, with another model / data, or its state mutated."""
    def case(b, t):
        out = _copy(b / "distilled", t / "run")
        if mutate:
            mutate(out)
        m = model(b, t) if model else b / "msa"
        d = data(b, t) if data else b / "d.npy"
        return ["distill", m, "--data", d, "--out", out, "--steps", 3, "--seq-len", 16, "--resume"], None
    return case


def _train_resume(model):
    """train --resume of a copy of the trained run with another model."""
    def case(b, t):
        out = _copy(b / "trained", t / "run")
        return ["train", model(b, t), "--data", b / "d.npy", "--out", out, "--steps", 3, "--seq-len", 16, "--resume"], None
    return case


def _other_weights(part):
    """A copy of the converted model with one tensor's values changed in place: every file keeps its size and the
    config its bytes (what the names-and-sizes fingerprint saw)."""
    def make(b, t):
        d = _model(b, t)
        path = d / "model.safetensors"
        with open(path, "r+b") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            entry = header[_named(d, part)]
            begin, end = entry["data_offsets"]
            f.seek(8 + size + begin)
            data = bytearray(f.read(end - begin))
            f.seek(8 + size + begin)
            f.write(bytes(data[4:] + data[:4]))  # the values rotated by 4 bytes: other values, all finite
        return d
    return make


def _lock_held(command, name="r.json"):
    def case(b, t):
        fd = os.open(t / f".{name}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return [*command(b, t), t / name], t / name, fd
    return case


def _loop(t: Path, name: str) -> Path:
    (t / name).symlink_to(t / name)  # a link to itself
    return t / name


def _jsonl(lines):
    def case(b, t):
        (t / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return ["eval", "loss", b / "msa", "--data", t / "d.jsonl", "--seq-len", 4], None
    return case


def _shards_beside_single(index: bool):
    def case(b, t):
        d, wm = _two_shards(_copy(b / "dense", t / "src"))
        if index:
            _index(d, wm)
        else:  # shards named as Hugging Face names them, without an index
            (d / "a.safetensors").rename(d / "model-00001-of-00002.safetensors")
            (d / "b.safetensors").rename(d / "model-00002-of-00002.safetensors")
        shutil.copyfile(b / "dense" / "model.safetensors", d / "model.safetensors")
        return ["convert", d, t / "o"], t / "o"
    return case


def _without_positions(d: Path) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _nan_state(run: Path) -> None:
    path = run / "distill_state" / "index.safetensors"
    save_file({k: _nan_first(v.clone()) for k, v in load_file(path).items()}, str(path))


def _generation_config(data: bytes):
    def case(b, t):
        d = _model(b, t)
        (d / "generation_config.json").write_bytes(data)
        return ["generate", d, "--prompt", "def x", "--max-new-tokens", 2], None
    return case


def _tokenizer_file(write):
    def case(b, t):
        d = _model(b, t)
        write(d / "tokenizer.json")
        return ["eval", "retrieval", d, "--data", b / "d.npy", "--seq-len", 100, "--distances", 60,
                "--probes", 1], None
    return case


def _wide_tokenizer(path: Path) -> None:
    """A tokenizer whose unknown-word id (900) is past the model's 256 ids: not the model's tokenizer."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 900, "x": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


_PNG = ["--layer", 1, "--seq-len", 16]
_LONG = "n" * 240  # with the 18 bytes of `.NAME.partial-XXXXXXXX` past a file system's 255

# The output guard, weights on every load, the resume fingerprint, options that cannot apply, context lengths past
# the model's positions, errors that used to escape as tracebacks: each case as in CASES
CASES.update({
    # an output never overwrites an input (inspect and attention-map included; --calib, --data; symlinks, hard links)
    "overlap-inspect-into-model": (lambda b, t: (["inspect", (m := _model(b, t, "dense")), "--format", "json", "--out", m / "config.json"], None), "inside the input"),
    "overlap-inspect-symlink": (lambda b, t: (["inspect", (m := _model(b, t, "dense")), "--format", "json", "--out", (t / "r.json", (t / "r.json").symlink_to(m / "config.json"))[0]], None), "inside the input"),
    "overlap-inspect-hard-link": (lambda b, t: (["inspect", (m := _model(b, t, "dense")), "--format", "json", "--out", (t / "r.json", os.link(m / "config.json", t / "r.json"))[0]], None), "a hard link"),
    "overlap-convert-calib": (lambda b, t: (["convert", b / "dense", (o := _copy(b / "msa", t / "out")), "--force", "--calib", _ids(o, "calib.npy", 64)], None), "contains the input"),
    "overlap-convert-calib-symlink": (lambda b, t: (["convert", b / "dense", (o := _copy(b / "msa", t / "out")), "--force", "--calib", (t / "c.npy", (t / "c.npy").symlink_to(_ids(o, "calib.npy", 64)))[0]], None), "contains the input"),
    "overlap-convert-calib-is-out": (lambda b, t: (["convert", b / "dense", _ids(t, "c.npy", 64), "--force", "--calib", t / "c.npy"], None), "is the input"),
    "overlap-map-into-model": (lambda b, t: (["attention-map", (m := _model(b, t)), "--data", b / "d.npy", *_PNG, "--out", m / "map.png"], m / "map.png"), "inside the input"),
    "overlap-map-is-data": (lambda b, t: (["attention-map", b / "msa", "--data", (shutil.copyfile(b / "d.npy", t / "d.png"), t / "d.png")[1], *_PNG, "--out", t / "d.png"], None), "is the input"),
    "overlap-distill-data-in-out": (lambda b, t: (["distill", b / "msa", "--data", _ids(_copy(b / "distilled", t / "run"), "d.npy", 400), "--out", t / "run", "--resume", "--steps", 3, "--seq-len", 16], None), "contains the input"),
    "overlap-train-data-in-out": (lambda b, t: (["train", b / "msa", "--data", _ids(_copy(b / "msa", t / "o"), "d.npy", 400), "--out", t / "o", "--force", *_TRAIN], None), "contains the input"),
    "overlap-export-data": (lambda b, t: (["export-onnx", (m := _model(b, t)), m / "graph", "--force"], None), "inside the input"),
    # output paths: a directory or a file where the other is needed, a missing or odd parent, loops, locks, long names
    "out-inspect-is-dir": (lambda b, t: ((t / "r.json").mkdir(), ["inspect", b / "dense", "--format", "json", "--out", t / "r.json"])[1:] + (None,), "is a directory"),
    "out-map-is-dir": (lambda b, t: ((t / "m.png").mkdir(), ["attention-map", b / "msa", "--data", b / "d.npy", *_PNG, "--out", t / "m.png"])[1:] + (None,), "is a directory"),
    "out-inspect-parent-is-file": (lambda b, t: ((t / "f").write_text("x"), ["inspect", b / "dense", "--format", "json", "--out", t / "f" / "r.json"])[1:] + (None,), "is not a directory"),
    "out-map-parent-is-file": (lambda b, t: ((t / "f").write_text("x"), ["attention-map", b / "msa", "--data", b / "d.npy", *_PNG, "--out", t / "f" / "m.png"])[1:] + (None,), "is not a directory"),
    "out-inspect-rich": (lambda b, t: (["inspect", b / "dense", "--out", t / "r.txt"], t / "r.txt"), "--out writes --format json"),
    "out-map-not-png": (lambda b, t: (["attention-map", b / "msa", "--data", b / "d.npy", *_PNG, "--out", t / "m.jpg"], t / "m.jpg"), "name the file *.png"),
    "out-symlink-loop": (lambda b, t: (["convert", b / "dense", _loop(t, "out")], None), "cannot follow its symlinks"),
    "out-inspect-symlink-loop": (lambda b, t: (["inspect", b / "dense", "--format", "json", "--out", _loop(t, "r.json")], None), "cannot follow its symlinks"),
    "src-symlink-loop": (lambda b, t: (["convert", _loop(t, "src"), t / "o"], t / "o"), "cannot follow its symlinks"),
    "data-symlink-loop": (lambda b, t: (["distill", b / "msa", "--data", _loop(t, "d.npy"), "--out", t / "o", *_TRAIN], t / "o"), "cannot follow its symlinks"),
    "out-lock-is-dir": (lambda b, t: ((t / ".out.lock").mkdir(), ["convert", b / "dense", t / "out"])[1:] + (t / "out",), "cannot create the lock file"),
    "out-lock-is-dir-distill": (lambda b, t: ((t / ".o.lock").mkdir(), ["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", *_TRAIN])[1:] + (t / "o",), "cannot create the lock file"),
    "out-lock-is-dir-inspect": (lambda b, t: ((t / ".r.json.lock").mkdir(), ["inspect", b / "dense", "--format", "json", "--out", t / "r.json"])[1:] + (t / "r.json",), "cannot create the lock file"),
    "out-locked-inspect": (_lock_held(lambda b, t: ["inspect", b / "dense", "--format", "json", "--out"]), "being written by another process"),
    "out-locked-map": (_lock_held(lambda b, t: ["attention-map", b / "msa", "--data", b / "d.npy", *_PNG, "--out"], "m.png"), "being written by another process"),
    "out-name-long-convert": (lambda b, t: (["convert", b / "dense", t / _LONG], t / _LONG), "too long"),
    "out-name-long-distill": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / _LONG, *_TRAIN], t / _LONG), "too long"),
    "out-name-long-train": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / _LONG, *_TRAIN], t / _LONG), "too long"),
    "out-name-long-export": (lambda b, t: (["export-onnx", b / "msa", t / _LONG], t / _LONG), "too long"),
    "out-name-long-inspect": (lambda b, t: (["inspect", b / "dense", "--format", "json", "--out", t / (_LONG + ".json")], t / (_LONG + ".json")), "too long"),
    "out-name-long-map": (lambda b, t: (["attention-map", b / "msa", "--data", b / "d.npy", *_PNG, "--out", t / (_LONG + ".png")], t / (_LONG + ".png")), "too long"),
    # non-finite weights, index branch included, refused by every command that loads them
    "weights-nan-index-eval": (_bad_tensor("index_q_proj", _nan_first, "eval loss"), "index_q_proj.weight holds non-finite values (nan)"),
    "weights-inf-index-generate": (_bad_tensor("index_k_proj", lambda w: w.fill_(float("inf")), "generate"), "index_k_proj.weight holds non-finite values (inf)"),
    "weights-nan-index-norm-distill": (_bad_tensor("index_q_norm", _nan_first, "distill"), "index_q_norm.weight holds non-finite"),
    "weights-nan-export": (_bad_tensor("index_q_proj", _nan_first, "export-onnx"), "holds non-finite"),
    "weights-nan-map": (_bad_tensor("v_proj", _nan_first, "attention-map"), "v_proj.weight holds non-finite"),
    "weights-ninf-embed-eval": (_bad_tensor("embed_tokens", lambda w: w.fill_(float("-inf")), "eval loss"), "embed_tokens.weight holds non-finite values (-inf)"),
    "weights-nan-resume-state": (_resume(mutate=_nan_state), "refusing to continue"),
    # the resume fingerprint knows the weights and the tokens
    "resume-other-index-weights": (_resume(model=_other_weights("index_q_proj")), "other weights"),
    "resume-other-backbone-weights": (_resume(model=_other_weights("o_proj")), "other weights"),
    "resume-other-tokens": (_resume(data=lambda b, t: _ids(t, "d.npy", 400, seed=7)), "other tokens"),
    "train-resume-other-backbone-weights": (_train_resume(_other_weights("o_proj")), "other weights"),
    "train-resume-other-index-weights": (_train_resume(_other_weights("index_q_proj")), "other weights"),
    "resume-garbage-report": (_resume(mutate=lambda o: (o / "distill_report.json").write_text("{bad")), "not a valid run report"),
    "resume-report-not-object": (_resume(mutate=lambda o: (o / "distill_report.json").write_text("[1, 2]")), "not a valid run report"),
    "resume-report-not-utf8": (_resume(mutate=lambda o: (o / "distill_report.json").write_bytes(b'{"history": "\xff"}')), "not a valid run report"),
    # options that cannot apply, or far past sense
    "option-max-windows-zero": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", 16, "--max-windows", 0], None), "max_windows must be >= 1"),
    "option-max-windows-negative": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", 16, "--max-windows", -2], None), "max_windows must be >= 1"),
    "option-index-dtype-dense-eval": (lambda b, t: (["eval", "loss", b / "dense", "--data", b / "d.npy", "--seq-len", 16, "--index-dtype", "fp8"], None), "applies to MSA layers"),
    "option-index-dtype-dense-retrieval": (lambda b, t: (["eval", "retrieval", b / "dense", "--data", b / "d.npy", "--index-dtype", "fp8"], None), "applies to MSA layers"),
    "option-index-dtype-all-dense": (lambda b, t: (["convert", b / "dense", t / "o", "--index-dtype", "fp8", "--dense-layers", "0,1,2"], t / "o"), "every layer is kept dense"),
    "option-out-twice": (lambda b, t: (["convert", b / "dense", t / "a", "--out", t / "b"], t / "a"), "OUT given twice"),
    "option-block-size-huge": (lambda b, t: (["convert", b / "dense", t / "o", "--block-size", 10**9], t / "o"), "past any sensible setting"),
    "option-topk-huge": (lambda b, t: (["convert", b / "dense", t / "o", "--topk", 10**9], t / "o"), "past any sensible setting"),
    "option-index-dim-huge": (lambda b, t: (["convert", b / "dense", t / "o", "--index-dim", 10**6], t / "o"), "past any sensible setting"),
    "option-index-heads-huge": (lambda b, t: (["convert", b / "dense", t / "o", "--index-heads", 10**6], t / "o"), "past any sensible setting"),
    "option-shard-inf": (lambda b, t: (["convert", b / "dense", t / "o", "--max-shard-size", "inf"], t / "o"), "expected a positive size"),
    "option-shard-inf-gb": (lambda b, t: (["convert", b / "dense", t / "o", "--max-shard-size", "infGB"], t / "o"), "expected a positive size"),
    "option-shard-nan": (lambda b, t: (["convert", b / "dense", t / "o", "--max-shard-size", "nanMB"], t / "o"), "expected a positive size"),
    "option-shard-zero": (lambda b, t: (["convert", b / "dense", t / "o", "--max-shard-size", "0"], t / "o"), "expected a positive size"),
    "option-shard-negative": (lambda b, t: (["convert", b / "dense", t / "o", "--max-shard-size", "-5GB"], t / "o"), "expected a positive size"),
    "option-seed-generate": (lambda b, t: (["generate", b / "msa", "--prompt", "def x", "--temperature", 1, "--seed", 2**64], None), "seed must be an integer in"),
    "option-seed-distill": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--seed", 2**64, *_TRAIN], t / "o"), "seed must be in"),
    "option-max-new-tokens-huge": (lambda b, t: (["generate", b / "msa", "--prompt", "def x", "--max-new-tokens", 10**6], None), "past the model's 512 positions"),
    "option-prompt-not-utf8": (lambda b, t: (["generate", b / "msa", "--prompt", "def \udcff x"], None), "--prompt is not UTF-8 text"),
    # a converted config.json whose MSA settings or layer lists cannot be
    "config-local-over-topk": (_cfg("msa", _sparse(sparse_local_block=3), "eval"), "exceed sparse_attention_config.sparse_topk_blocks (2)"),
    "config-init-over-topk": (_cfg("msa", _sparse(sparse_init_block=2), "eval"), "exceed"),
    "config-block-size-huge": (_cfg("msa", _sparse(sparse_block_size=10**9), "eval"), "past any sensible setting"),
    "config-freq-two": (_cfg("msa", _sparse(sparse_attention_freq=[0, 2, 1]), "eval"), "entries must be 0 or 1"),
    "config-format-newer": (_cfg("msa", _sparse(m3compile_format_version=2), "eval"), "m3compile_format_version is 2, a newer format than this m3compile reads (1)"),
    "config-format-string": (_cfg("msa", _sparse(m3compile_format_version="1"), "eval"), "m3compile_format_version must be"),
    "config-freq-string": (_cfg("msa", _sparse(sparse_attention_freq=[0, "1", 1]), "eval"), "entries must be 0 or 1"),
    "config-freq-null": (_cfg("msa", _sparse(sparse_attention_freq=[0, None, 1]), "eval"), "entries must be 0 or 1"),
    "config-moe-freq": (_cfg("dense", lambda c: c.update(moe_layer_freq=[0, 3, 0]), "convert"), "entries must be 0 or 1"),
    "config-heads-kv": (_cfg("dense", lambda c: c.update(num_key_value_heads=3), "convert"), "must be a multiple of num_key_value_heads (3)"),
    "config-heads-kv-eval": (_cfg("msa", lambda c: c.update(num_key_value_heads=3), "eval"), "must be a multiple of num_key_value_heads (3)"),
    "config-rope-unsupported": (_cfg("dense", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "convert"), 'RoPE scaling "yarn" is not supported'),
    "config-rope-no-factor": (_cfg("dense", lambda c: c.update(rope_scaling={"rope_type": "linear"}), "convert"), "linear RoPE scaling needs factor"),
    "config-rope-factor-string": (_cfg("msa", lambda c: c.update(rope_scaling={"type": "linear", "factor": "2"}), "eval"), "factor must be a finite number"),
    "config-rope-llama3-order": (_cfg("dense", lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "convert"), "must exceed low_freq_factor"),
    "config-rope-parameters": (_cfg("dense", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "convert"), 'RoPE scaling "dynamic" is not supported'),
    # weights of the wrong kind; a directory with two checkpoints in it
    "weights-int-norm-convert": (_src_tensor("model.norm.weight", lambda w: w.long()), "model.norm.weight has dtype int64"),
    "weights-int-norm-eval": (_bad_tensor("input_layernorm", lambda w: w.int(), "eval loss"), "has dtype int32"),
    "shards-beside-single-index": (_shards_beside_single(True), "holds both model.safetensors and a sharded checkpoint"),
    "shards-beside-single-named": (_shards_beside_single(False), "holds both model.safetensors and a sharded checkpoint"),
    # JSON-lines text that is not a string
    "data-jsonl-text-list": (_jsonl([{"text": "def x"}, {"text": ["def", "x"]}]), ":2: the 'text' field must be a string, got list"),
    "data-jsonl-text-number": (_jsonl([{"text": 5}]), "must be a string, got int"),
    "data-jsonl-text-null": (_jsonl([{"text": None}]), "must be a string, got NoneType"),
    "data-jsonl-line-list": (_jsonl([["def", "x"]]), "expected a JSON object with a 'text' field"),
    # context lengths past the model's 512 positions
    "context-eval": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", 600], None), "--seq-len 600 is past the model's 512 positions"),
    "context-retrieval": (lambda b, t: (["eval", "retrieval", b / "msa", "--data", _ids(t, "long.npy", 2000), "--seq-len", 1000, "--distances", 600, "--probes", 1], None), "distance 600 needs probes"),
    "context-distill": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--steps", 1, "--seq-len", 600], t / "o"), "--seq-len 600 is past the model's 512 positions"),
    "context-train": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--steps", 1, "--seq-len", 513], t / "o"), "past the model's 512 positions"),
    "context-calibration": (lambda b, t: (["convert", b / "dense", t / "o", "--calib", _ids(t, "c.npy", 1000), "--calib-seq-len", 600], t / "o"), "calibration windows of 600 tokens are past the model's 512"),
    "context-map": (lambda b, t: (["attention-map", b / "msa", "--data", _ids(t, "long.npy", 1000), "--layer", 1, "--seq-len", 600, "--out", t / "m.png"], t / "m.png"), "past the model's 512 positions"),
    "context-inspect": (lambda b, t: (["inspect", b / "dense", "--context", 600], None), "--context 600 is past the model's 512 positions"),
    "context-generate": (lambda b, t: (["generate", b / "msa", "--prompt", "def x ( ) :", "--max-new-tokens", 510], None), "past the model's 512 positions"),
    # what used to escape the command line's handler as a traceback
    "generation-config-garbage": (_generation_config(b"{bad"), "generation_config.json: not valid JSON"),
    "generation-config-not-utf8": (_generation_config(b"\xff\xfe"), "generation_config.json: not valid JSON"),
    "retrieval-tokenizer-garbage": (_tokenizer_file(lambda p: p.write_text("{not a tokenizer")), "cannot read tokenizer"),
    "retrieval-tokenizer-out-of-vocab": (_tokenizer_file(_wide_tokenizer), "token id 900"),
})

def _text(t: Path, name: str = "hay.txt") -> Path:
    (t / name).write_text(" ".join(WORDS * 50) + "\n")
    return t / name


_RULER = ["--samples", 1, "--tasks", "niah_single_1"]


def _chat(name: str, content: str | bytes):
    """eval ruler on a copy of the converted model whose file `name` holds `content`."""
    def case(b, t):
        d = _model(b, t)
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        return ["eval", "ruler", d, "--data", _text(t), *_RULER], None
    return case

# Every path the product writes goes through the one output guard; sizes are parsed and bounded in one place; chat
# templates are checked as the model opens; options that cannot apply are refused: each case as in CASES
CASES.update({
    # eval ruler --plot and m3c bench --out: the output guard, before any work
    "plot-is-data": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t, "hay.png"), "--plot", t / "hay.png", *_RULER], None), "is the input"),
    "plot-into-model": (lambda b, t: (["eval", "ruler", (m := _model(b, t)), "--data", _text(t), "--plot", m / "ruler.png", *_RULER], m / "ruler.png"), "inside the input"),
    "plot-is-dir": (lambda b, t: ((t / "p.png").mkdir(), ["eval", "ruler", b / "msa", "--data", _text(t), "--plot", t / "p.png", *_RULER])[1:] + (None,), "is a directory"),
    "plot-parent-is-file": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--plot", t / "hay.txt" / "p.png", *_RULER], None), "inside the input"),
    "plot-not-png": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--plot", t / "p.jpg", *_RULER], t / "p.jpg"), "name the file *.png"),
    "bench-distill-out-into-model": (lambda b, t: (["bench", "distill", (m := _model(b, t)), "--device", "cpu", "--out", m / "bo"], m / "bo"), "inside the input"),
    "bench-model-out-into-model": (lambda b, t: (["bench", "model", (m := _model(b, t)), "--device", "cpu", "--out", m / "bo"], m / "bo"), "inside the input"),
    "bench-kernels-out-is-file": (lambda b, t: ((t / "f").write_text("x"), ["bench", "kernels", "--device", "cpu", "--out", t / "f"])[1:] + (None,), "is a file, not a directory"),
    "bench-vision-out-parent-is-file": (lambda b, t: ((t / "f").write_text("x"), ["bench", "vision", "--device", "cpu", "--out", t / "f" / "o"])[1:] + (None,), "is not a directory"),
    # one parser and one ceiling for sizes, before any allocation
    "size-lengths-inf": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--lengths", "inf"], None), "--lengths inf is past the ceiling of 16,777,216 tokens"),
    "size-lengths-nan": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--lengths", "nanK"], None), "expected a size such as"),
    "size-samples-huge": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--samples", 10**9], None), "--samples 1000000000 is past the ceiling of 10,000 samples"),
    "size-ruler-batch-huge": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--batch", 10**9], None), "past the ceiling of 1,024 sequences"),
    "size-prefill-chunk-inf": (lambda b, t: (["generate", b / "msa", "--prompt", "def x", "--prefill-chunk", "inf"], None), "--prefill-chunk inf is past the ceiling"),
    "size-max-new-tokens-1e12": (lambda b, t: (["generate", b / "msa", "--prompt", "def x", "--max-new-tokens", "1e12"], None), "past the ceiling of 16,777,216 tokens"),
    "size-eval-seq-len-fraction": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", "1.5"], None), "is not a whole number of tokens"),
    "size-eval-batch-huge": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--batch", "1e9"], None), "past the ceiling of 1,024 sequences"),
    "size-probes-huge": (lambda b, t: (["eval", "retrieval", b / "msa", "--data", b / "d.npy", "--probes", 10**7], None), "past the ceiling of 10,000 samples"),
    "size-distill-seq-len-inf": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--steps", 1, "--seq-len", "inf"], t / "o"), "--seq-len inf is past the ceiling"),
    "size-bench-decode-lengths": (lambda b, t: (["bench", "kernels", "--device", "cpu", "--decode-lengths", "1e12", "--out", t / "o"], t / "o"), "--decode-lengths 1e12 is past the ceiling of 16,777,216 tokens"),
    "size-bench-decode-steps": (lambda b, t: (["bench", "model", "m3-tiny", "--device", "cpu", "--decode-steps", 10**9, "--out", t / "o"], t / "o"), "past the ceiling of 65,536 steps"),
    "size-bench-distill-seq-len": (lambda b, t: (["bench", "distill", "m3-tiny", "--device", "cpu", "--seq-len", "inf", "--out", t / "o"], t / "o"), "--seq-len inf is past the ceiling"),
    "bench-rep-ms-negative": (lambda b, t: (["bench", "kernels", "--device", "cpu", "--rep-ms", -1, "--out", t / "o"], t / "o"), "rep_ms must be >= 1"),
    "bench-no-lengths": (lambda b, t: (["bench", "kernels", "--device", "cpu", "--prefill-lengths", "", "--decode-lengths", "", "--out", t / "o"], t / "o"), "nothing to run"),
    "bench-backward-no-lengths": (lambda b, t: (["bench", "backward", "--device", "cpu", "--lengths", "", "--out", t / "o"], t / "o"), "nothing to run"),
    # chat templates: checked as the model opens, every failure one line naming the file
    "chat-template-type-error": (_chat("chat_template.jinja", "{{ messages[0]['content'] + 1 }}"), "chat_template.jinja: cannot render the chat template (TypeError"),
    "chat-template-range": (_chat("chat_template.jinja", "{% for i in range(10**6) %}{% endfor %}"), "chat_template.jinja: cannot render the chat template (OverflowError"),
    "chat-template-not-utf8": (_chat("chat_template.jinja", b"{{ messages }} \xff\xfe"), "chat_template.jinja: not UTF-8 text"),
    "chat-template-syntax": (_chat("chat_template.jinja", "{% for %}"), "chat_template.jinja: cannot read the chat template"),
    "chat-template-raises": (_chat("chat_template.jinja", "{{ raise_exception('no user turns') }}"), "refused the prompt: no user turns"),
    "chat-tokenizer-config-list": (_chat("tokenizer_config.json", "[1, 2]"), "tokenizer_config.json: expected a JSON object, got list"),
    "chat-template-number": (_chat("tokenizer_config.json", json.dumps({"chat_template": 42})), "tokenizer_config.json: chat_template must be text"),
    # the RULER-style suite: what a task needs from the data, before any work
    "ruler-keys-from-few-words": (lambda b, t: (["eval", "ruler", b / "msa", "--data", _text(t), "--lengths", 512, "--samples", 1, "--tasks", "niah_multikey_1"], None), "holds 2 distinct words"),
    # options that cannot apply
    "option-index-cache-dense": (lambda b, t: (["generate", b / "dense", "--prompt", "def x", "--index-cache", "fp8"], None), "--index-cache fp8 applies to the index keys of MSA layers"),
    "option-lr-min-constant": (lambda b, t: (["distill", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--lr-min", 0.2, *_TRAIN], t / "o"), "lr_min shapes the cosine schedule"),
    "option-lr-decay-constant": (lambda b, t: (["train", b / "msa", "--data", b / "d.npy", "--out", t / "o", "--lr-decay-steps", 5, *_TRAIN], t / "o"), "lr_decay_steps shapes the cosine schedule"),
    "option-dense-layers-all": (lambda b, t: (["convert", b / "dense", t / "o", "--dense-layers", "0,1,2"], t / "o"), "the output would have no MSA layer"),
    "option-bench-block-converted": (lambda b, t: (["bench", "model", b / "msa", "--device", "cpu", "--block", 32, "--out", t / "o"], t / "o"), "already converted with block 8: --block 32 cannot apply"),
    "option-bench-top-p-converted": (lambda b, t: (["bench", "model", b / "msa", "--device", "cpu", "--top-p", 0.5, "--out", t / "o"], t / "o"), "already converted with top-p 1.0: --top-p 0.5 cannot apply"),
    "option-bench-topk-converted": (lambda b, t: (["bench", "distill", b / "msa", "--device", "cpu", "--topk", 4, "--out", t / "o"], t / "o"), "already converted with topk 2: --topk 4 cannot apply"),
    "option-index-dtype-dense-ruler": (lambda b, t: (["eval", "ruler", b / "dense", "--data", _text(t), "--index-dtype", "fp8", *_RULER], None), "applies to MSA layers"),
    "option-kv-cache-batch": (lambda b, t: (["eval", "loss", b / "msa", "--data", b / "d.npy", "--seq-len", 16, "--kv-cache", "fp8", "--batch", 2], None), "--batch 2 cannot apply"),
})

if torch.cuda.is_available():  # the CUDA cases need a machine without it
    CASES = {k: v for k, v in CASES.items() if not k.startswith("device-cuda")}


def test_every_bad_input_is_one_line_and_writes_nothing(base, tmp_path):
    """At least 100 distinct bad inputs: exit 2, one `error:` line on stderr, no traceback, the trees unchanged."""
    assert len(CASES) >= 100
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
    code, output, stderr, _ = _invoke("eval", "loss", model, "--data", base / "d.npy", "--seq-len", 16, "--json")
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
    code, output, _, _ = _invoke("eval", "loss", out, "--data", base / "d.txt", "--seq-len", 16, "--json")
    assert code == 0, output
    assert json.loads(output)["windows"] == 12
    assert (base / "distilled" / "tokenizer.json").is_file()  # distill's output keeps the tokenizer too


def test_unwritable_parent(base, tmp_path, monkeypatch):
    """(Root may write anywhere, so the permission is faked.)"""
    from m3compile import outputs as output_dir

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
    from m3compile import outputs as output_dir

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
    from m3compile import outputs as output_dir

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_m3c_starts_is_one_line(sig):
    """The console script's entry (m3compile.entry, what `m3c` runs) handles SIGINT and SIGTERM before torch is
    imported: a signal that lands while the command line is still importing exits 130 with one line."""
    import subprocess
    import sys
    import time

    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("needs /proc to see when the handlers are in place")
    proc = subprocess.Popen([sys.executable, "-c", "from m3compile.entry import main; main()", "inspect", "--preset",
                             "m3-tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    caught, maps, deadline = 0, "", time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # until SIGTERM is caught (the handlers are in)
        try:
            caught = int(next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                              if line.startswith("SigCgt:")).split()[1], 16)
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except (OSError, StopIteration):
            pass
        if caught >> (signal.SIGTERM - 1) & 1:
            break
        time.sleep(0.001)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert "libtorch" not in maps  # the handlers were in place before torch was loaded
    assert proc.returncode == 130 and stderr == "error: interrupted; no output was written\n", stderr


def test_an_interrupt_between_api_calls_is_one_line(monkeypatch):
    """Ctrl-C or SIGTERM outside the API calls (here: as the table is drawn) ends as every interrupt: one line."""
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "stdout_console", interrupted)
    code, output, stderr, _ = _invoke("passes")
    assert code == 130 and stderr == "error: interrupted; no output was written\n", (output, stderr)


def test_a_tiny_temperature_samples_the_top_token():
    """--temperature 1e-40 overflows logits / T; the sampler shifts the logits first, so it draws the greedy tokens
    instead of meeting NaN probabilities. Logits that are not finite are a one-line error."""
    from m3compile.runtime.generate import _pick

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [8.0, -3.0, 7.5, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert _pick(logits, 1e-40, 1.0, g).tolist() == [1, 0] == _pick(logits, 1e-40, 0.5, g).tolist()
    assert _pick(logits, 1e-3, 1.0, g).tolist() == [1, 0]  # as before: no overflow, no shift
    with pytest.raises(streaming.M3CompileError, match="logits are not finite"):
        _pick(torch.tensor([[float("nan"), 1.0]]), 1e-40, 1.0, g)


def test_a_state_saved_without_content_digests_still_resumes(base, tmp_path):
    """The fingerprint's weights and tokens digests are checked when the state has them; a state written before
    they existed (no such keys) resumes as it did."""
    out = _copy(base / "distilled", tmp_path / "run")
    state = json.loads((out / "distill_state" / "state.json").read_text())
    assert {"weights", "tokens"} <= set(state["fingerprint"])
    for key in ("weights", "tokens"):
        del state["fingerprint"][key]
    (out / "distill_state" / "state.json").write_text(json.dumps(state))
    code, output, _, _ = _invoke("distill", base / "msa", "--data", base / "d.npy", "--out", out, "--steps", 2,
                                 "--seq-len", 16, "--resume", "--json")
    assert code == 0, output
    assert json.loads(output)["start_step"] == 1
    saved = json.loads((out / "distill_state" / "state.json").read_text())["fingerprint"]
    assert {"weights", "tokens"} <= set(saved)  # written again, with the digests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2])
def test_first_non_finite_finds_any_bad_value(dtype):
    from m3compile.io.weights import first_non_finite

    big = torch.finfo(dtype).max
    good = torch.full((3, 37), big, dtype=torch.float64).to(dtype)  # a sum would overflow: still finite
    assert first_non_finite([("a", good), ("n", torch.zeros(0, dtype=dtype)), ("i", torch.arange(3))]) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        if dtype == torch.float8_e5m2 and bad != bad:
            continue  # (e5m2 has NaN, but tensors made from a NaN float are enough with the infinities)
        t = good.clone()
        t[2, 36] = bad  # the last element of an odd-sized tensor (a vector loop's tail)
        name, value = first_non_finite([("a", good), ("b", t), ("c", t)])
        assert name == "b" and (value != value if bad != bad else value == bad)


def test_checkpoint_digest_follows_the_content_not_the_layout(tmp_path):
    from m3compile.io.weights import checkpoint_digest

    state = {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.arange(3)}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    save_file(state, str(one / "model.safetensors"))
    save_file({"b": state["b"]}, str(two / "x.safetensors"), metadata={"format": "pt"})
    save_file({"a": state["a"], "c": state["c"]}, str(two / "y.safetensors"))
    _index(two, {"a": "y.safetensors", "b": "x.safetensors", "c": "y.safetensors"})
    assert checkpoint_digest(one) == checkpoint_digest(two)  # same tensors in other shards and order
    for changed in ({**state, "a": state["a"].flip(0)}, {**state, "c": state["c"].view(1, 3)},
                    {"a": state["a"], "b": state["b"], "d": state["c"]}):
        save_file(changed, str(one / "model.safetensors"))
        assert checkpoint_digest(one) != checkpoint_digest(two)


def test_file_outputs_are_written_whole_beside_nothing(base, tmp_path):
    """inspect --out replaces an existing file (as it always did) and creates a missing parent; no temporary or lock
    file stays beside it."""
    out = tmp_path / "new" / "dir" / "r.json"
    code, output, _, _ = _invoke("inspect", base / "dense", "--format", "json", "--out", out)
    assert code == 0 and json.loads(out.read_text())["source"] == str(base / "dense"), output
    out.write_text("old")
    code, output, _, _ = _invoke("inspect", base / "dense", "--format", "mermaid", "--out", out)
    assert code == 0 and out.read_text().startswith("flowchart"), output
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]


def test_the_default_calibration_window_fits_the_model(base, tmp_path):
    """Without --calib-seq-len the calibration windows are 2048 tokens, or the model's positions if fewer (512
    here): a default never runs past the model."""
    out = tmp_path / "o"
    code, output, _, _ = _invoke("convert", base / "dense", out, "--block-size", 8, "--topk", 2, "--calib",
                                 _ids(tmp_path, "c.npy", 1100), "--json")
    assert code == 0, output
    init = json.loads(output)["index_init"]
    assert (init["seq_len"], init["windows"]) == (512, 2)


def _leaf_commands(group, path=()):
    """(argv prefix, command) of every command m3c runs, subcommands of every group included."""
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _leaf_commands(command, path + (name,))
        else:
            yield path + (name,), command


def _argv_for(command, tmp: Path, output, value) -> list[str]:
    """Arguments that parse for `command`: `value` for the parameter `output`, an existing model directory for every
    path it reads (arguments and required options), 1 or a first choice for what else it needs."""
    import click

    from m3compile.commands.common import InputPath, OutputPath

    model = tmp / "model"
    model.mkdir(exist_ok=True)
    args, opts = [], []
    for p in command.params:
        if p is output:
            given = str(value)
        elif isinstance(p.type, InputPath) and (isinstance(p, click.Argument) or p.required):
            given = str(model)
        elif isinstance(p.type, OutputPath) and (isinstance(p, click.Argument) or p.required):
            given = str(tmp / f"other-{p.name}")
        elif p.required:
            given = p.type.choices[0] if isinstance(p.type, click.Choice) else "1"
        else:
            continue
        if isinstance(p, click.Argument):
            args.append(given)
        else:
            opts += [p.opts[0], given]
    return args + opts


def test_every_written_path_goes_through_the_output_guard(tmp_path, monkeypatch):
    """Every click parameter of type Path in m3c is declared as read (InputPath) or written (OutputPath), and every
    written one passes the output guard before the command runs: a parent that is a file, and (where the command
    reads paths) a place inside what it reads, are refused as one line, with the command never called."""
    import click

    from m3compile.commands.common import Command, InputPath, OutputPath

    outputs = []
    for words, command in _leaf_commands(cli.main):
        assert isinstance(command, Command), f"m3c {' '.join(words)} is not an m3c Command (no output guard)"
        for p in command.params:
            if isinstance(p.type, click.Path):
                assert isinstance(p.type, (InputPath, OutputPath)), f"m3c {' '.join(words)} {p.name}: read or written?"
            if isinstance(p.type, OutputPath):
                outputs.append((words, command, p))
    assert len(outputs) >= 12  # convert (2), attention-map, inspect, export-onnx, eval ruler, distill, train, bench (5)
    for words, command, p in outputs:
        reached = []
        monkeypatch.setattr(command, "callback", lambda **kw: reached.append(kw))
        t = tmp_path / "-".join(words + (p.name,))
        (t / "model").mkdir(parents=True)
        (t / "f").write_text("a file")
        name = "o" + (p.type.suffix or "")
        places = [(t / "f" / name, "is not a directory")]
        if any(isinstance(q.type, InputPath) and (isinstance(q, click.Argument) or q.required) for q in command.params):
            places.append((t / "model" / name, "inside the input"))
        for place, needle in places:
            before = _tree(t)
            code, output, stderr, _ = _invoke(*words, *_argv_for(command, t, p, place))
            assert (code, reached) == (2, []) and stderr.startswith("error: ") and needle in stderr, \
                (words, p.name, place, output)
            assert len(stderr.splitlines()) == 1 and _tree(t) == before, (words, p.name, stderr)


def test_a_generation_past_memory_is_refused_before_any_allocation(base, tmp_path, monkeypatch):
    """A model that does not say its positions, asked for more tokens than its caches can hold in the memory there
    is (here 1 MB): one line with the numbers and what would fit, nothing allocated."""
    from m3compile import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1e6)
    code, output, stderr, _ = _invoke("generate", _without_positions(_model(base, tmp_path)), "--prompt", "def x",
                                      "--max-new-tokens", 10**6)
    assert code == 2 and len(stderr.splitlines()) == 1 and "MB free; it would fit with at most" in stderr, stderr


def test_the_default_held_out_slice_never_takes_the_data_a_run_needs(base, tmp_path):
    """Data of exactly two sequences and no --holdout-tokens: the default holds out at most a tenth of the data, as
    its help says (here none), so the run trains on both; a --holdout-tokens that leaves no sequence is refused by its
    name, the only option the error names."""
    data = _ids(tmp_path, "two.npy", 2 * 16 + 1)
    code, output, stderr, _ = _invoke("distill", base / "msa", "--data", data, "--out", tmp_path / "o", "--steps", 1,
                                      "--seq-len", 16, "--json")
    assert code == 0, (output, stderr)
    assert json.loads(output)["holdout"] is None
    code, output, stderr, _ = _invoke("distill", base / "msa", "--data", data, "--out", tmp_path / "p", "--steps", 1,
                                      "--seq-len", 16, "--holdout-tokens", 16)
    assert code == 2 and stderr.startswith("error: holding out 16 tokens") and "--holdout-tokens" in stderr
    assert "--" not in stderr.replace("--holdout-tokens", "") and not (tmp_path / "p").exists()


_NOISY = """
import logging, sys, warnings
from m3compile import cli
from m3compile.errors import M3CompileError

def noisy(**kwargs):  # a library that warns, and logs through a handler it makes as it loads (as torch.onnx does)
    warnings.warn("a library's FutureWarning", FutureWarning)
    logging.getLogger("somelib").addHandler(logging.StreamHandler())
    logging.getLogger("somelib").warning("somelib: torchvision is not installed")
    raise M3CompileError("not enough room for the weights")

cli.main.commands["passes"].callback = noisy
from m3compile.entry import main
main()
"""


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_library_warnings_go_to_the_log_and_the_error_stays_one_line(tmp_path, verbose):
    """What libraries print on stderr while a command runs (Python warnings, their loggers' lines) goes to the log
    ($M3C_LOG), and the error is the terminal's one line; with --verbose the terminal shows them too."""
    import subprocess
    import sys

    log = tmp_path / "m3c.log"
    proc = subprocess.run([sys.executable, "-c", _NOISY, *(["--verbose"] if verbose else []), "passes"],
                          capture_output=True, text=True, env={**os.environ, "M3C_LOG": str(log)}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.endswith("error: not enough room for the weights\n"), proc.stderr
    if verbose:
        assert "FutureWarning" in proc.stderr and "torchvision is not installed" in proc.stderr and not log.exists()
    else:
        assert proc.stderr == "error: not enough room for the weights\n"
        text = log.read_text()
        assert text.startswith("--- ") and " m3c passes\n" in text.splitlines()[0] + "\n"
        assert "a library's FutureWarning" in text and "somelib: torchvision is not installed" in text


_FINISHED_THEN_SIGTERM = """
import os, signal, sys, time
from pathlib import Path
from m3compile import cli
from m3compile.outputs import COMMITTED

class SlowTeardown:  # a module torn down slowly as the interpreter shuts down (torch's take long): SIGTERM meanwhile
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)

SLOW = SlowTeardown()

def done(**kwargs):
    COMMITTED.append(Path("out"))
    print("wrote out")

cli.main.commands["passes"].callback = done
from m3compile.entry import main
main()
"""


def test_a_signal_after_the_command_finished_is_not_a_silent_kill():
    """A finished command's process ends at once with its status, its SIGTERM handler in place to the end: the
    interpreter's shutdown (which puts the default handlers back before it tears the modules down) never runs, so a
    SIGTERM then cannot kill it silently (-15, no line)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FINISHED_THEN_SIGTERM, "passes"], capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "wrote out\n", "")


def test_outputs_get_the_modes_the_umask_gives(base, tmp_path):
    """What the atomic writers put in place (a directory from its private temporary directory, safetensors shards
    however the writer made them, a single file) has the modes a process creates under its umask (here 027)."""
    import stat

    previous = os.umask(0o027)
    try:
        for argv in (["convert", "--preset", "m3-tiny", "--out", tmp_path / "tiny"], ["convert", base / "dense", tmp_path / "o"],
                     ["inspect", base / "dense", "--format", "json", "--out", tmp_path / "r.json"]):
            code, output, _, _ = _invoke(*argv)
            assert code == 0, output
    finally:
        os.umask(previous)
    written = [p for root in (tmp_path / "tiny", tmp_path / "o") for p in [root, *root.rglob("*")]] + [tmp_path / "r.json"]
    assert any(p.name == "model.safetensors" for p in written)
    for p in written:
        want = 0o750 if p.is_dir() else 0o640
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


def test_every_ruler_length_and_task_pair_is_checked_before_any_work(base, tmp_path, monkeypatch):
    """--lengths that one of the tasks cannot fill (niah_single_2's smallest prompt is past 512 tokens here): refused
    before the first prompt is generated, not after the tasks before it ran (which dropped their scores)."""
    from m3compile.evaluation import ruler as ruler_mod

    ran = []
    monkeypatch.setattr(ruler_mod, "run_samples", lambda *a, **k: ran.append(a) or [1.0])
    code, output, stderr, _ = _invoke("eval", "ruler", base / "msa", "--data", _text(tmp_path), "--lengths", 512,
                                      "--samples", 1, "--tasks", "niah_single_1,niah_single_2")
    assert code == 2 and stderr.startswith("error: length 512 is too short for niah_single_2") and ran == [], stderr


def test_eval_shows_windows_done_and_left(base, monkeypatch):
    """m3c eval loss counts its windows from the start (evaluate reports 0 of them before the first): done of all,
    how many are left, and the time left."""
    import io

    from rich.console import Console

    import m3compile
    from m3compile.commands import eval as eval_cmd
    from m3compile.data import load_tokens

    calls = []
    model = m3compile.load(base / "msa", dtype="float32")
    m3compile.evaluate(model, load_tokens(base / "d.npy", 256), 16, 3, oracle=False, progress=lambda *a: calls.append(a))
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]

    screen = io.StringIO()
    monkeypatch.setattr(eval_cmd, "stdout_console", lambda: Console(file=screen, force_terminal=True, color_system=None,
                                                                          width=100))
    code, output, _, _ = _invoke("eval", "loss", base / "msa", "--data", base / "d.npy", "--seq-len", 16,
                                 "--max-windows", 3, "--no-oracle")
    assert code == 0, output
    shown = screen.getvalue()
    assert "3/3 windows, 0 left" in shown, shown  # (the bar's last refresh; the ones before depend on timing)


def test_inspect_costs_at_the_model_s_own_context_by_default(base):
    """Without --context the cost figures are at 131,072 tokens, or at the model's positions if fewer (512 here)."""
    code, output, _, _ = _invoke("inspect", base / "dense", "--format", "json")
    assert code == 0 and json.loads(output)["cost"]["context"] == 512, output
