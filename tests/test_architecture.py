"""The package's shape: one import name, and imports that point one way through the pipeline's layers.

    cli -> commands -> bench -> api -> evaluation / train / tools -> vllm -> runtime -> conversion -> export -> io
    -> pipelines -> passes -> graph -> models, ops -> config, errors, memory, data, outputs -> kernels (a leaf that
    knows no torch.fx)

A module may import from its own layer or any layer below it, never above; no cycles; no private name
(`_x`) imported from another module; an import inside a function only for a module that needs an optional
dependency (Triton, ONNX) at import time, or in the modules of LAZY_BY_DESIGN.
"""
import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [  # bottom to top
    ("kernels", ("m3compile.kernels",)),
    ("base", ("m3compile.errors", "m3compile.config", "m3compile.memory", "m3compile.data", "m3compile.outputs")),
    ("models and ops", ("m3compile.models", "m3compile.ops")),
    ("graph", ("m3compile.graph",)),
    ("passes", ("m3compile.passes",)),
    ("pipelines", ("m3compile.pipelines",)),
    ("io", ("m3compile.io",)),
    ("export", ("m3compile.export",)),
    ("conversion", ("m3compile.conversion",)),
    ("runtime", ("m3compile.runtime",)),
    ("vllm", ("m3compile.vllm",)),  # the vLLM plugin: only vLLM imports it (its entry point)
    ("evaluation / train / tools", ("m3compile.evaluation", "m3compile.train", "m3compile.tools")),
    ("api", ("m3compile.api", "m3compile")),
    ("bench", ("m3compile.bench",)),  # above the library: only the command line and the tests import it
    ("commands", ("m3compile.commands",)),  # the command line's groups of subcommands
    ("cli", ("m3compile.cli",)),
    ("entry", ("m3compile.entry",)),  # the console script: signal handlers first, then the command line
]
# entry: imports the command line inside main(), after its signal handlers. The command line (cli and its commands):
# each command imports the library modules it runs inside its function, so --help and a usage error load no torch
LAZY_BY_DESIGN = {"m3compile.entry", "m3compile.cli", "m3compile.commands.common", "m3compile.commands.eval",
                  "m3compile.commands.train", "m3compile.commands.bench", "m3compile.commands.compile"}
OPTIONAL = {"triton", "onnx", "onnxscript", "onnxruntime", "vllm"}  # may be missing: modules that need them load lazily


def _modules() -> dict[str, Path]:
    """Module name -> source file, as installed (pyproject.toml maps kernels/, models/, passes/ and cli.py)."""
    out = {"m3compile.cli": ROOT / "cli.py"}
    for folder, package in (("m3compile", "m3compile"), ("kernels", "m3compile.kernels"),
                            ("models", "m3compile.models"), ("passes", "m3compile.passes")):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f.is_symlink():
                continue
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{module} is in no layer"
    return best[0]


def _imports(path: Path):
    """(target module, imported names, inside a function) for every import of the project in one file."""
    tree = ast.parse(path.read_text())
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        nested = id(node) in functions
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "m3compile":
                    yield a.name, [], nested
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "m3compile":
            names = [a.name for a in node.names]
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            for s in subs:
                yield s, [], nested
            rest = [n for n in names if f"{node.module}.{n}" not in MODULES]
            if rest:
                yield node.module, rest, nested


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_imports_point_down_the_layers_without_cycles():
    graph = nx.DiGraph()
    problems = []
    for module, path in MODULES.items():
        for target, names, nested in _imports(path):
            if target not in MODULES:
                problems.append(f"{module} imports {target}, which does not exist")
                continue
            graph.add_edge(module, target)
            if _layer(target) > _layer(module):
                problems.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                                f"({LAYERS[_layer(target)][0]}): an upward edge")
            private = [n for n in names if n.startswith("_")]
            if private and target != module:
                problems.append(f"{module} imports private {private} from {target}")
            if nested and module not in LAZY_BY_DESIGN and not (_top_level_imports(MODULES[target]) & OPTIONAL):
                problems.append(f"{module} imports {target} inside a function (it needs no optional dependency)")
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    problems += [f"import cycle: {' -> '.join(c + c[:1])}" for c in cycles]
    assert not problems, "\n".join(problems)


def test_kernels_know_no_torch_fx():
    for module, path in MODULES.items():
        if _layer(module) == 0:
            text = path.read_text()
            assert "torch.fx" not in text, f"{module} mentions torch.fx: kernels are a leaf"


def test_the_rule_catches_an_upward_edge_and_a_cycle(tmp_path):
    """The check itself: an upward import and a cycle among modules are what it reports."""
    assert _layer("m3compile.passes.gqa_to_msa") > _layer("m3compile.graph.matching") > _layer("m3compile.ops")
    g = nx.DiGraph([("m3compile.conversion.save", "m3compile.conversion.streaming"), ("m3compile.conversion.streaming", "m3compile.conversion.save")])
    assert [c for c in nx.simple_cycles(g) if len(c) > 1]
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from m3compile.io.load import load\nfrom m3compile.ops import _grid\n")
    found = list(_imports(f))
    assert ("m3compile.io.load", ["load"], True) in found and ("m3compile.ops", ["_grid"], False) in found


def test_one_top_level_package_is_installed(tmp_path):
    """The wheel holds m3compile/ only (top_level.txt says so), the CLI module among it; and the installed
    environment resolves no bare kernels / models / passes / cli, outside the repository."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)]
    if subprocess.run(build[:4] + ["--no-build-isolation"] + build[4:], capture_output=True).returncode:
        subprocess.run(build, check=True, capture_output=True)  # this setuptools cannot build wheels: isolated
    wheel = next(tmp_path.glob("m3compile-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = z.read(next(n for n in names if n.endswith("top_level.txt"))).decode().split()
    assert top == ["m3compile"]
    assert {n.split("/")[0] for n in names} == {"m3compile", next(n for n in names if ".dist-info/" in n).split("/")[0]}
    for f in ("m3compile/cli.py", "m3compile/kernels/indexer/__init__.py", "m3compile/models/decoder.py",
              "m3compile/passes/gqa_to_msa.py", "m3compile/ops.py", "m3compile/graph/matching.py"):
        assert f in names, f
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util as u; import m3compile.kernels, m3compile.cli; "
            "print([n for n in ('kernels', 'models', 'passes', 'cli') if u.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["kernels", "models", "passes", "cli"])
def test_bare_names_do_not_import(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_the_command_line_starts_without_torch():
    """`import m3compile`, `m3c --help`, a command's help and a usage error import no torch, Triton, numpy,
    networkx, matplotlib or rich: the package's public names and each command's modules load when first used."""
    code = ("import sys\nfrom m3compile.cli import main\n"
            "for args in (['--help'], ['generate', '--help'], ['bench', 'model', '--help'], ['convert', '--bogus'],\n"
            "             ['eval', 'ruler', '--help'], ['eval', 'M', '--task', 'ruler'], ['eval', 'loss', 'M']):\n"
            "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
            "heavy = ('torch', 'triton', 'numpy', 'networkx', 'matplotlib', 'onnx', 'tokenizers', 'rich')\n"
            "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def test_generate_imports_no_torch_dynamo():
    """What `m3c generate` imports leaves torch._dynamo out (torch.nn.attention.bias alone pulls it in: 1.7 s of a
    CPU run's 3.3 s start); only a prefill in chunks imports it, when it needs its causal mask."""
    code = ("import sys\nimport m3compile.cli, m3compile.runtime.generate, m3compile.runtime\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stderr


def test_generate_imports_only_what_it_runs(tmp_path):
    """`m3c generate` on the CPU, prompts streamed and batched: no rich (it draws nothing), no ONNX, networkx,
    transformers, matplotlib or Triton, and none of the library's tracing, passes, conversion, evaluation, training,
    tools or bench modules."""
    (tmp_path / "p.jsonl").write_text('"def f(x):"\n"import os"\n')
    code = ("import sys\nfrom m3compile.cli import main\n"
            f"for args in (['--prompt', 'def f(x):'], ['--prompts-jsonl', {str(tmp_path / 'p.jsonl')!r}, '--json']):\n"
            f"    try:\n        main(['generate', {str(ROOT / 'checkpoints' / 'byte-llama')!r}, *args, "
            "'--max-new-tokens', '2'])\n"
            "    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print(sorted(sys.modules), file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as on a user's CPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stderr.strip().splitlines()[-1])
    assert '"prompt_index": 1' in out.stdout and '"prompt_index": 2' in out.stdout  # the batch ran
    foreign = ("rich", "onnx", "onnxscript", "onnxruntime", "networkx", "transformers", "matplotlib", "triton")
    library = ("m3compile.graph", "m3compile.passes", "m3compile.pipelines", "m3compile.conversion",
               "m3compile.evaluation", "m3compile.train", "m3compile.tools", "m3compile.bench", "m3compile.export.onnx")
    assert "torch" in loaded and "m3compile.runtime.generate" in loaded
    assert [m for m in loaded if m.split(".")[0] in foreign or any(m == p or m.startswith(p + ".") for p in library)] \
        == []


def test_the_command_line_names_the_ruler_tasks_it_does_not_import():
    """`m3c eval ruler --help` lists the tasks from m3compile.config, which names them in the suite's order."""
    from m3compile.config import RULER_TASKS
    from m3compile.evaluation.ruler_tasks import TASKS

    assert RULER_TASKS == tuple(TASKS)
