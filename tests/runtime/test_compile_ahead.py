"""Kernels compiled ahead (io/kernel_cache.py, runtime/compile_ahead.py, m3c compile): the synthetic runs cover the kernel variants of a
real generation at other sizes, the manifest says what the cache was built for, and a cache built for another model
or GPU is never used."""
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

import m3compile
from m3compile import cli
from m3compile.conversion import checkpoint
from m3compile.errors import M3CompileError
from m3compile.io.load import from_preset
from m3compile.io import kernel_cache as kc
from m3compile.runtime import compile_ahead as ahead
from m3compile.runtime.timings import kernel_census


@pytest.fixture
def model(tiny_msa, tmp_path):
    """A copy of the converted m3-tiny (8-token blocks, top-2) that a test may write its kernel cache into."""
    out = tmp_path / "msa"
    shutil.copytree(tiny_msa, out)
    return out


def test_the_synthetic_runs_cover_a_real_generation(tmp_path, monkeypatch):
    """A build under the interpreter runs every synthetic generation in two processes and records the variants they
    launch; a generation at other prompt lengths, another batch size and another cache size launches none outside
    them, so on a GPU it compiles nothing. The model stores an answer budget (the prompt's last 8 tokens and the
    answer at top-4, the prompt at top-2), which generate runs by default: its variants are covered too (the
    synthetic prompts pass the larger top-k's blocks), and the model's own (a twin of each run, 18 in all). The
    model is m3-tiny's first two layers (one dense, one MSA: every kernel a generation launches; more layers launch
    the same variants again)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tmp_path / "msa"
    monkeypatch.setattr(checkpoint, "from_preset", lambda name: from_preset(name, n_layers=2))
    m3compile.convert_checkpoint(None, model, m3compile.MSAConfig(block_size=8, topk=2, dense_layers=(0,),
                                                                  answer_budget="k4", answer_tokens=8),
                                 dtype="float32")
    assert m3compile.load(model).args.n_layers == 2
    assert ahead.scenarios(m3compile.load(model).args, None)[2]["lengths"][0] > (4 + 2) * 8
    done = []
    report = ahead.build(model, device="cpu", workers=2, new_tokens=2, max_cache=256,
                         progress=lambda d, t: done.append((d, t)))
    assert done == [(1, 2), (2, 2)] and report.workers == 2
    manifest = json.loads((model / kc.CACHE_DIR / "manifest.json").read_text())
    assert {k: manifest[k] for k in kc.identity(model)} == kc.identity(model)
    assert manifest["runs"] == 18 and manifest["batches"] == [1, 2] and manifest["variants"] == report.variants
    built = {tuple(v) for v in json.loads((model / kc.CACHE_DIR / "variants.json").read_text())}
    assert len(built) == report.variants and {name for name, _ in built} >= {"index_topk_kernel", "gather_q_fwd_kernel"}
    assert kc.status(model) == ("valid", "")

    net = m3compile.load(model)
    prompts = [torch.randint(0, net.args.vocab_size, (n,)).tolist() for n in (45, 7, 58, 83)]  # lengths not built
    with kernel_census() as census:
        m3compile.generate(net, prompts, 3, kernels=True)  # batch 4: not built
        m3compile.generate(net, prompts[:1], 2, kernels=True, prefill_chunk=24, cache_len=200)  # 25 pages
        m3compile.generate(net, prompts[:2], 3, kernels=True, answer_budget="off")  # the model's budget alone
    seen = {(name, repr(k)) for name, keys in census.variants.items() for k in keys}
    assert seen and seen <= built, sorted(seen - built)[:2]


def _fake_cache(model, changes=None):
    """A kernel-cache folder whose manifest says it was built for identity(model) with `changes`."""
    folder = model / kc.CACHE_DIR
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(kc.identity(model) | (changes or {})))
    return folder


def test_a_valid_cache_becomes_tritons_cache(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert kc.activate(model).state == "none" and "TRITON_CACHE_DIR" not in os.environ
    folder = _fake_cache(model)
    (folder / "KEY").mkdir()  # a kernel's file group as Triton wrote it where the cache was built
    (folder / "KEY" / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": "/elsewhere/KEY/k.json"}}))
    assert kc.activate(model).state == "used"
    assert os.environ["TRITON_CACHE_DIR"] == str(folder.resolve())
    group = json.loads((folder / "KEY" / "__grp__k.json").read_text())
    assert group == {"child_paths": {"k.json": str(folder.resolve() / "KEY" / "k.json")}}


@pytest.mark.parametrize("changes, why", [
    ({"gpu": "NVIDIA H200"}, "built for GPU NVIDIA H200, not triton-interpreter"),
    ({"model": "0123456789abcdef"}, "built for another model (config.json differs)"),
    ({"triton": "0.0.1"}, "built for Triton 0.0.1, not"),
])
def test_a_cache_of_another_model_or_gpu_is_never_used(model, monkeypatch, changes, why):
    """Not writable or not to be rebuilt: left aside, with one line; else rebuilt before it is used."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _fake_cache(model, changes)
    state, reason = kc.status(model)
    assert state == "stale" and reason.startswith(why)
    lines = []
    got = kc.activate(model, warn=lines.append)
    assert got.state == "stale" and "TRITON_CACHE_DIR" not in os.environ
    assert len(lines) == 1 and why in lines[0] and "not used" in lines[0]

    built = []

    def rebuild(model_dir, **kwargs):  # what activate asks of build (the build itself: the test above)
        built.append(kwargs)
        shutil.rmtree(model_dir / kc.CACHE_DIR)
        _fake_cache(model_dir)
    monkeypatch.setattr(ahead, "build", rebuild)
    got = ahead.activate(model, dtype="float32", kv_cache="fp8", device="cpu", warn=lines.append)
    assert got.state == "rebuilt" and "rebuilding" in lines[-1]
    assert built == [{"dtypes": ["float32"], "kv_caches": ["fp8"], "batches": (1, 2), "device": "cpu"}]
    assert os.environ["TRITON_CACHE_DIR"] == str((model / kc.CACHE_DIR).resolve())


def test_a_stale_cache_in_a_read_only_folder_is_not_used(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _fake_cache(model, {"gpu": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(kc.os, "access", lambda path, mode: False)
    assert ahead.activate(model).state == "stale" and "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_kernel_cache_m3compile_did_not_write_is_neither_used_nor_replaced(model, monkeypatch, kind):
    """A build moves its folder into place whole, manifest included: a kernel-cache without one is the user's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    theirs = model / kc.CACHE_DIR
    if kind == "folder":
        theirs.mkdir()
        (theirs / "notes.txt").write_text("mine")
    else:
        theirs.write_text("mine")
    state, why = kc.status(model)
    assert state == "foreign" and f"is a {kind} m3compile did not write (no readable manifest.json)" in why
    lines = []
    monkeypatch.setattr(ahead, "build", lambda *a, **k: pytest.fail("a foreign kernel-cache was rebuilt"))
    assert ahead.activate(model, warn=lines.append).state == "foreign" and "TRITON_CACHE_DIR" not in os.environ
    assert len(lines) == 1 and "not used" in lines[0]
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = CliRunner().invoke(cli.main, ["compile", str(model), "--workers", "1"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [f"error: {why}"]
    assert (theirs / "notes.txt" if kind == "folder" else theirs).read_text() == "mine"
    assert not list(model.glob(".kernel-cache*"))


def test_m3c_compile_bad_input(model, tmp_path, monkeypatch):
    """One line each, exit status 2, and no kernel-cache folder."""
    run = CliRunner().invoke
    r = run(cli.main, ["compile", str(model), "--kv-cache", "fp4"])
    assert r.exit_code == 2 and "fp4" in r.output
    r = run(cli.main, ["compile", str(model), "--batch-sizes", "1,x"])
    assert r.exit_code == 2 and "--batch-sizes" in r.output
    r = run(cli.main, ["compile", str(model), "--batch-sizes", "0"])
    assert r.exit_code == 2 and "batch sizes must be whole numbers >= 1, got 0" in r.output
    r = run(cli.main, ["compile", str(model), "--workers", "0"])
    assert r.exit_code == 2 and "--workers" in r.output
    (tmp_path / "empty").mkdir()
    r = run(cli.main, ["compile", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "not a model directory (no config.json)" in r.output
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = run(cli.main, ["compile", str(model)])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == \
        "error: compiling kernels ahead needs a CUDA GPU (or TRITON_INTERPRET=1 to run them on the CPU)"
    assert not (model / kc.CACHE_DIR).exists() and not list(model.parent.glob(".kernel-cache*"))


def test_generate_timings_name_the_cache(model, monkeypatch):
    """--timings says whether the run loaded kernels compiled ahead."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _fake_cache(model)
    r = CliRunner().invoke(cli.main, ["generate", str(model), "--prompt", "abc", "--max-new-tokens", "2", "--timings"])
    assert r.exit_code == 0, r.output
    timings = json.loads(r.output.strip().splitlines()[-1])
    assert timings["kernel_cache"] == "used" and timings["kernel_cache_s"] >= 0


def test_convert_compiles_only_on_a_gpu(tmp_path, monkeypatch):
    """Without a GPU convert writes no kernel cache unless asked; asked, the failure names the converted model."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(cli.main, ["convert", "--preset", "m3-tiny", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0 and not (tmp_path / "a" / kc.CACHE_DIR).exists()
    r = CliRunner().invoke(cli.main, ["convert", "--preset", "m3-tiny", "--out", str(tmp_path / "b"), "--compile"])
    assert r.exit_code == 2 and "converted, but compiling kernels ahead needs a CUDA GPU" in r.output
    assert (tmp_path / "b" / "config.json").is_file() and not (tmp_path / "b" / kc.CACHE_DIR).exists()
    with pytest.raises(M3CompileError, match="not a model directory"):
        ahead.build(tmp_path / "nothing")


def test_generate_cache_len(tiny_msa):
    """cache_len: caches larger than the run needs, within the model's positions; the tokens do not change."""
    net = m3compile.load(tiny_msa)
    base = m3compile.generate(net, [[1, 2, 3]], 3)
    assert m3compile.generate(net, [[1, 2, 3]], 3, cache_len=100).tokens == base.tokens
    for bad in (0, 2.5, True):
        with pytest.raises(M3CompileError, match="cache_len must be a whole number of positions >= 1"):
            m3compile.generate(net, [[1, 2, 3]], 3, cache_len=bad)


def test_workers_fit_the_gpu_with_the_largest_cache_in_one_of_them(model, monkeypatch):
    """Each worker holds the weights (a quarter more and 1 GiB beside); the scenarios of large caches all run in the
    first worker, so the largest cache is held once, and what is left of 80% of free memory sets the count."""
    jobs = ahead._plan(model, ["auto"], ["auto"], [1, 2], max_cache=4096)
    big = [j for j in jobs if j["scenario"].get("cache")]
    assert len(big) >= 2
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    base, cache_bytes = 1.25 * weights + (1 << 30), ahead._cache_bytes(model, big)
    assert cache_bytes == max(ahead._cache_bytes(model, [j]) for j in big) > 0
    monkeypatch.setattr(ahead, "interpreting", lambda: False)
    monkeypatch.setattr(ahead.os, "cpu_count", lambda: 16)
    for fit, free in ((3, (3.5 * base + cache_bytes) / 0.8), (1, (0.5 * base + cache_bytes) / 0.8)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(2 * free)))
        groups = ahead._split(model, jobs, "cuda", None)
        assert len(groups) == fit and all(j in groups[0] for j in big)
        assert sorted(map(json.dumps, sum(groups, []))) == sorted(map(json.dumps, jobs))  # each job once
    assert len(ahead._split(model, jobs, "cuda", 4)) == 4  # as asked


def test_a_cache_moved_after_its_build_is_found_by_triton(tmp_path, monkeypatch):
    """Triton's own cache manager records a kernel's files by absolute path and takes a group whose paths are gone
    for a miss: a cache built in one folder and moved (the build's temporary folder; a model folder copied) loads
    nothing until its groups are relocated."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    built = tmp_path / "building" / "kernel-cache"
    built.mkdir(parents=True)
    monkeypatch.setattr(knobs.cache, "dir", str(built))
    manager = FileCacheManager("KEY")
    paths = {name: manager.put(b"binary" if name.endswith("bin") else "{}", name) for name in ("k.json", "k.cubin")}
    manager.put_group("k.json", paths)
    assert FileCacheManager("KEY").get_group("k.json") == paths
    moved = tmp_path / "model" / "kernel-cache"
    moved.parent.mkdir()
    built.rename(moved)
    monkeypatch.setattr(knobs.cache, "dir", str(moved))
    assert FileCacheManager("KEY").get_group("k.json") is None  # a miss: the kernels would compile again
    assert kc.relocate(moved) == 1 and kc.relocate(moved) == 0
    assert FileCacheManager("KEY").get_group("k.json") == {name: str(moved.resolve() / "KEY" / name) for name in paths}

