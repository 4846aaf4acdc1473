"""Every code block of README.md and of the pages in docs/ runs (CPU-sized), so the pages cannot drift from the code.
The pages are read in order, README.md first, in one temporary directory that holds links to the repository's
checkpoints/ and scripts/, so commands run as a reader runs them from the repository root.

    Quickstart bash blocks   run command by command (`m3c` in-process, the scripts as processes), as written, with
                             the sizes of SIZES made small; what the README says each step prints is checked in its
                             output. A block with "cuda" in it is a GPU block: parsed.
    Set-up block             `m3c` runs (the default preset); `pip install` extras and `pytest` paths must exist.
    other bash blocks        a command whose comment says `# error: MESSAGE` runs and must fail with exit status 2
                             and that message (up to a "..."); every other `m3c` command (also after
                             `torchrun ... -m m3compile.cli` or `$(which m3c)`) is parsed by click as it would be
                             run, options and value types included, without running; scripts named must exist;
                             serving commands (`pip install` of the extras, which must exist, vLLM's server, curl):
                             tests/vllm/test_server.py sends README's requests to a real server.
    python blocks            executed in order in one namespace, with the paths and sizes of python_inputs swapped
                             for tiny models (and cuda for the CPU); the names a block leaves to the reader
                             (input_ids, frames, ...) are given tiny values. A block with an OpenAI client (a
                             server's) is compiled here and runs against a real server in tests/vllm/test_server.py.
    blocks without a language (the layout tree, config excerpts) are not code.

Also: every relative link of the pages resolves, and README's Layout names every top-level folder and every
package of m3compile/, each of which exists.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
import transformers
from click.testing import CliRunner

import m3compile
from m3compile import MSAConfig, cli
from tests.conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SIZES = {"--seq-len": "128", "--max-windows": "1", "--steps": "2", "--warmup-steps": "1", "--max-new-tokens": "8"}
# what the quickstart says each command (or group and subcommand) prints (a phrase of it)
PRINTS = {"convert": "pass gqa_to_msa: replaced 5 attention ops", "eval loss": "sparse loss", "distill": "wrote",
          "generate": "\n"}  # the streamed text, then a newline


def blocks(page: Path = README) -> list[tuple[str, str, str]]:
    """(section heading, language, code) for every fenced block of a page, in order."""
    out, section = [], ""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"^```(\w*)\s*$", line)
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((section, m[1], "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


def commands(code: str) -> list[list[str]]:
    """Shell commands of a bash block: continuation lines joined, comments dropped, `a && b` split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in out if c]


def error_examples(code: str) -> list[tuple[list[str], str]]:
    """(command, message) for each line of a bash block whose comment reads `# error: message` (cut at " ...")."""
    out = []
    for line in code.splitlines():
        if "# error: " in line:
            command, message = line.split("# error: ", 1)
            out.append((shlex.split(command), message.split(" ...")[0].strip()))
    return out


def m3c_args(words: list[str]) -> list[str] | None:
    """The m3c arguments of a command line (`m3c ...`, `torchrun ... -m m3compile.cli ...`), or None."""
    if words[0] == "m3c":
        return words[1:]
    if words[0] == "torchrun":
        for i, w in enumerate(words):
            if w == "m3compile.cli" and words[i - 1] == "-m":
                return words[i + 1:]
            if w == "$(which":  # torchrun ... $(which m3c) distill ...
                return words[i + 2:]
    return None


def dry_parse(args: list[str]) -> None:
    """Parse an m3c command line as click would before running it (unknown options, bad values, missing
    arguments raise); `a / b` in the README means two commands, `m3c bench a` and `m3c bench b`."""
    if "/" in args:
        head, rest = args[:1], args[1:]
        while "/" in rest:
            cut = rest.index("/")
            dry_parse(head + rest[:cut])
            rest = rest[cut + 1:]
        return dry_parse(head + rest)
    parent, command, name = None, cli.main, "m3c"
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):  # m3c bench model: its options
        parent = click.Context(command, info_name=name, parent=parent)
        name, args = args[0], args[1:]
        command = command.get_command(parent, name)
        assert command is not None, f"m3c has no command {name!r}"
    try:
        command.make_context(name, args, parent=parent)
    except click.exceptions.Exit as e:  # --help
        assert e.exit_code == 0


def run_m3c(args: list[str]) -> str:
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, f"m3c {' '.join(args)}:\n{result.output}"
    return result.output


def check_setup(words: list[str]) -> None:
    """pip's extras and pytest's paths of the set-up block exist (running them is the CI itself)."""
    if words[:2] == ["pip", "install"]:
        section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        extras = re.findall(r"^(\w+)\s*=", section, re.M)
        for w in words[2:]:
            for extra in re.findall(r"\[([\w,]+)\]", w):
                assert set(extra.split(",")) <= set(extras), w
    elif words[1:3] == ["-m", "pytest"]:
        assert all((ROOT / w).exists() for w in words[3:] if not w.startswith("-") and not w.isdigit())
    else:
        raise AssertionError(f"README set-up command not covered: {' '.join(words)}")


def serving_command(words: list[str]) -> bool:
    """A command of serving with vLLM: pip (an install's extras must exist), vLLM's server (`vllm serve`, or the
    module behind it), curl. tests/vllm/test_server.py runs README's requests against a real server."""
    if words[:2] == ["pip", "install"]:
        check_setup(words)
        return True
    return words[:2] in (["pip", "uninstall"], ["vllm", "serve"]) or words[0] == "curl" \
        or words[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def small(args: list[str]) -> list[str]:
    return [SIZES[args[i - 1]] if i and args[i - 1] in SIZES else a for i, a in enumerate(args)]


def run_script(words: list[str]) -> None:
    """`python3 scripts/NAME.py ...` of the quickstart, as a process in the current directory."""
    assert words[0] == "python3" and words[1].startswith("scripts/"), f"quickstart command not covered: {words}"
    done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------------------------------------------
# The tiny models and inputs python blocks run on


def tiny_llama(path: Path) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_vl(path: Path) -> Path:
    """A converted tiny minimax_m3_vl (text: 2 layers, MSA with block 4 / top-2; vision: 1 layer, patch 4)."""
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=16, dense_intermediate_size=24,
                shared_intermediate_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=8,
                index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
                layer_types=["full_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                bos_token_id=None, eos_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, rope_parameters={"rope_type": "axial", "rope_theta": 1e4})
    cfg = transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=24,
                                         image_token_index=60, video_token_index=61)
    transformers.MiniMaxM3SparseForConditionalGeneration(cfg).save_pretrained(path / "src")
    m3compile.convert_checkpoint(path / "src", path / "msa", MSAConfig(block_size=4, topk=2, dense_layers=(0,)))
    return path / "msa"


def python_inputs(code: str, tmp: Path) -> tuple[list[tuple[str, str]], dict]:
    """(substitutions, names to define) for one python block."""
    subs = [('device="cuda"', 'device="cpu"'), ("max_new_tokens=64", "max_new_tokens=4"),
            ("seq_len=4096", "seq_len=64")]
    names = {"input_ids": torch.randint(0, 256, (1, 40)), "prompt_ids": list(range(30, 50)),
             "other_ids": list(range(70, 83))}
    if '"path/to/llama"' in code:
        (tmp / "code.bin").write_bytes(bytes(range(256)) * 2)
        subs += [('"path/to/llama"', repr(str(tiny_llama(tmp / "tiny-llama")))),
                 ('"code.bin"', repr(str(tmp / "code.bin")))]
    if "patchify" in code:
        subs.append(('"m3vl-msa"', repr(str(tiny_vl(tmp / "vl")))))
        names["frames"] = torch.randn(2, 3, 8, 8)  # 2 frames -> 1 temporal step of 2 x 2 patches -> 1 merged token
        names["input_ids"] = torch.tensor([[5, 61, 7, 9]])  # one video placeholder
    return subs, names


def test_every_code_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a reader's CPU: the torch references (kernels: tests/kernels)
    for name in ("checkpoints", "scripts"):  # the quickstart runs from the repository root
        (tmp_path / name).symlink_to(ROOT / name)
    namespace: dict = {}
    ran = {"quickstart": 0, "errors": 0, "parsed": 0, "python": 0}
    assert any(s.startswith("Quickstart") and lang == "bash" for s, lang, _ in blocks()), "README has no quickstart"
    for page in PAGES:
        for section, lang, code in blocks(page):
            if lang in ("", "text"):
                continue
            if lang == "bash":
                run_bash(page, section, code, ran)
            elif lang == "python" and "OpenAI(" in code:
                compile(code, f"{page.name} ({section})", "exec")
            elif lang == "python":
                subs, names = python_inputs(code, tmp_path)
                for old, new in subs:
                    code = code.replace(old, new)
                namespace.update(names)
                exec(compile(code, f"{page.name} ({section})", "exec"), namespace)
                ran["python"] += 1
            else:
                pytest.fail(f"{page.name} block in language {lang!r} ({section}): add a rule to tests/test_readme.py")
    assert ran["quickstart"] >= 6 and ran["errors"] >= 3 and ran["parsed"] >= 30 and ran["python"] >= 4, ran


def run_bash(page: Path, section: str, code: str, ran: dict) -> None:
    errors = error_examples(code)
    for words, message in errors:
        args = m3c_args(words)
        assert args is not None, f"{page.name}: error example is not m3c: {words}"
        result = CliRunner().invoke(cli.main, args)
        assert result.exit_code == 2 and f"error: {message}" in result.output, (words, result.output)
        ran["errors"] += 1
    for words in commands(code):
        if any(words == w for w, _ in errors):
            continue
        args = m3c_args(words)
        if page == README and section.startswith("Quickstart") and "cuda" not in code:
            if args is None:
                run_script(words)
            else:
                out = run_m3c(small(args))
                assert PRINTS.get(" ".join(args[:2]), PRINTS.get(args[0])) in out, out
            ran["quickstart"] += 1
        elif page == README and section.startswith("Set-up"):
            if args is not None:
                run_m3c(args)
            else:
                check_setup(words)
        elif args is not None:
            dry_parse(args)
            ran["parsed"] += 1
        elif serving_command(words):
            continue
        else:
            script = next((w for w in words if w.startswith(("benchmarks/", "scripts/"))), None)
            assert script and (ROOT / script).is_file(), f"{page.name}: command not covered: {' '.join(words)}"


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name}: link to {target} resolves to nothing"


def _tracked_top_level() -> set[str]:
    """The repository's top-level folders (tracked files only: no build or test outputs)."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the folders less what .gitignore names
        ignored = {"build", "m3-tiny-msa", "__pycache__", ".pytest_cache"}
        return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                and p.name not in ignored and not p.name.endswith(".egg-info")}
    return {f.split("/")[0] for f in files.splitlines() if "/" in f and not f.startswith(".")}


def test_layout_names_the_tree():
    text = README.read_text().split("## Layout", 1)[1]
    tree = text.split("```", 2)[1]
    named = [line.split()[0] for line in tree.splitlines()[1:] if line.strip() and not line.startswith(" ")]
    for path in named:
        assert (ROOT / path).exists(), f"README Layout names {path}, which does not exist"
    folders = {p.rstrip("/") for p in named if p.endswith("/")}
    assert _tracked_top_level() <= folders, _tracked_top_level() - folders
    packages = {f"m3compile/{p.name}" for p in (ROOT / "m3compile").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= folders, packages - folders


def test_tests_mirror_the_package():
    """Each folder of tests/ is named after the package folder (or cli.py) whose code it tests."""
    rooms = {p.name for p in (ROOT / "m3compile").iterdir() if (p / "__init__.py").is_file()}
    rooms |= {"kernels", "models", "passes", "cli"}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= rooms, folders - rooms


def test_headline_picture_is_drawn_from_the_results(tmp_path):
    """docs/headline.png is what benchmarks/plot_headline.py draws from benchmarks/results, and those figures are
    BENCHMARKS.md's (prefill 25.9x at 1M, decode 7.27x / 10.93x, SmolLM2 oracle +0.94%, init +6.68%, distilled
    +1.54%)."""
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "plot_headline.py"))
    f = script["figures"]()
    assert round(f["prefill"][-1][1], 1) == 25.9 and f["prefill"][-1][0] == 1 << 20
    assert [round(x, 2) for x in f["decode"][-1][1:]] == [7.27, 10.93]
    assert round(dict(f["quality"])["SmolLM2\noracle"], 2) == 0.94
    assert round(dict(f["quality"])["SmolLM2\ndistilled\n(dim 128)"], 2) == 1.54
    assert round(dict(f["quality"])["SmolLM2\ncalibrated\ninit (dim 128)"], 2) == 6.68 and "**+6.68%**" in \
        (ROOT / "BENCHMARKS.md").read_text()
    bench = (ROOT / "BENCHMARKS.md").read_text()
    assert "**25.9**" in bench and "**7.27**" in bench and "**10.93**" in bench and "**+0.94%**" in bench
    png = script["draw"](tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "headline.png").is_file() and "docs/headline.png" in README.read_text()
