"""The project's import graph points down only and has no cycles.

The layers, lowest first (a module belongs to the layer of the longest prefix that names it; it may import its
own layer and the layers below, never a layer above):

0. ``kernels``: Triton kernels and their PyTorch references.
1. ``core``: ``lragent`` (plain PyTorch + transformers + peft; never Lightning), including ``lragent.command``
   (the parser machinery) and ``lragent.loading`` (model + adapters).
2. ``lightning``: ``datamodules``, ``lit_modules``: thin Lightning adapters over the core.
3. ``agents``: ``lragent.agents``: the AutoAct loop, policies, tools and prompts over the core.
4. ``scoring``: ``eval_suite.report`` and ``eval_suite.scoring`` (report helpers, scores, metrics, paired tests).
5. ``evaluation``: ``eval_suite.evaluate`` (running the agents: ``eval``, ``session``, ``zero-shot`` and their
   machinery), ``eval_suite.bench`` (speed benches and profilers, ``bench kernel`` included) and
   ``eval_suite.diagnostics`` (similarity, fidelity, DroidSpeak selection, data statistics); these three never
   import one another.
6. ``commands``: ``eval_suite.serve`` and ``eval_suite.study`` (over the evaluation), ``lit_modules.cli`` (fit /
   validate / test / export) and ``lragent.cli_main`` (the entry point that dispatches to every command, by module
   name).

``kernels`` has no command of its own: it imports nothing of the project outside ``kernels``.

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:`` (a type-only import is still
a dependency a reader has to follow). Edges are read from the source with :mod:`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lragent", "kernels", "datamodules", "lit_modules", "eval_suite")
LAYERS: dict[str, int] = {
    "kernels": 0,
    "lragent": 1,
    "datamodules": 2,
    "lit_modules": 2,
    "lragent.agents": 3,
    "eval_suite": 4,
    "eval_suite.scoring": 4,
    "eval_suite.evaluate": 5,
    "eval_suite.bench": 5,
    "eval_suite.diagnostics": 5,
    "eval_suite.serve": 6,
    "eval_suite.study": 6,
    "lit_modules.cli": 6,
    "lragent.cli_main": 6,
}
LAYER_NAMES = ("kernels", "core", "lightning", "agents", "scoring", "evaluation", "commands")
SIBLINGS = ("eval_suite.evaluate", "eval_suite.bench", "eval_suite.diagnostics")


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int:
    """The layer of ``module``: that of the longest prefix in ``layers`` that names it or one of its packages."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in layers:
            return layers[prefix]
    raise KeyError(f"{module} is in no layer")


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under the packages."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """``{module: modules of the project it imports}``; ``from pkg import name`` is an edge to ``pkg.name`` when that
    is a module, else to ``pkg``."""
    mods = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and "." in t:  # import a.b.c where c is a name in a.b
                    t = t.rsplit(".", 1)[0]
                if t.split(".")[0] in packages and t in mods and t != mod:
                    edges.add(t)
        graph[mod] = edges
    return graph


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
    """``"a (layer) -> b (layer)"`` for every import of a higher layer."""
    bad = []
    for mod, edges in sorted(graph.items()):
        for t in sorted(edges):
            if layer_of(t, layers) > layer_of(mod, layers):
                la, lb = LAYER_NAMES[layer_of(mod, layers)], LAYER_NAMES[layer_of(t, layers)]
                bad.append(f"{mod} ({la}) -> {t} ({lb})")
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_module_has_a_layer():
    for mod in module_files(ROOT):
        layer_of(mod)


def test_imports_point_down_only():
    bad = upward_imports(import_graph(ROOT))
    assert not bad, "imports of a higher layer (see this file's docstring for the layers):\n" + "\n".join(bad)


def test_kernels_and_datamodules_never_import_eval_suite_or_agents():
    """By directory, whatever the layer table says: ``kernels/`` (the ``bench kernel`` command included) and
    ``datamodules/`` stay importable without the evaluation suite and the agents."""
    graph = import_graph(ROOT)
    bad = [
        f"{m} -> {t}"
        for m, edges in sorted(graph.items())
        if m.split(".")[0] in ("kernels", "datamodules")
        for t in sorted(edges)
        if t.split(".")[0] == "eval_suite" or t.startswith("lragent.agents")
    ]
    assert not bad, bad


def sibling_imports(graph: dict[str, set[str]], siblings: tuple[str, ...] = SIBLINGS) -> list[str]:
    """``"a -> b"`` for every import between two different packages of ``siblings`` (one floor, separate concerns)."""

    def package(module: str) -> str | None:
        return next((p for p in siblings if module == p or module.startswith(p + ".")), None)

    return [
        f"{m} -> {t}"
        for m, edges in sorted(graph.items())
        for t in sorted(edges)
        if package(m) and package(t) and package(m) != package(t)
    ]


def test_evaluation_bench_and_diagnostics_never_import_one_another():
    bad = sibling_imports(import_graph(ROOT))
    assert not bad, bad


def test_commands_never_import_commands():
    """A command module (one that ``lragent`` dispatches to) imports no other command module: what two commands
    share lives in a library module (``lragent.loading``, ``lragent.schemes``, ``eval_suite.diagnostics.fidelity``
    ...)."""
    from lragent.cli_main import BENCHES, COMMANDS

    commands = {module for module, _ in [*COMMANDS.values(), *BENCHES.values()]}
    graph = import_graph(ROOT)
    bad = [f"{m} -> {t}" for m in sorted(commands) for t in sorted(graph[m]) if t in commands]
    assert not bad, bad


def test_no_import_cycle():
    cycles = find_cycles(import_graph(ROOT))
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_catch_a_planted_cycle_and_upward_import(tmp_path):
    """The walker on a small tree with one upward import (kernels -> eval_suite, inside a function) and one cycle
    (a type-only import back)."""
    files = {
        "kernels/__init__.py": "",
        "kernels/k.py": "def f():\n    from eval_suite.report import write_json\n",
        "lragent/__init__.py": "",
        "lragent/a.py": "from lragent.b import x\n",
        "lragent/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lragent import a\nx = 1\n",
        "eval_suite/__init__.py": "",
        "eval_suite/report.py": "from . import helpers\nfrom lragent.a import *\n",
        "eval_suite/helpers.py": "",
        "eval_suite/bench/__init__.py": "",
        "eval_suite/bench/b.py": "import eval_suite.diagnostics.d\n",
        "eval_suite/diagnostics/__init__.py": "",
        "eval_suite/diagnostics/d.py": "from eval_suite.report import write_json\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    packages = ("kernels", "lragent", "eval_suite")
    graph = import_graph(tmp_path, packages)
    assert graph["eval_suite.report"] == {"eval_suite.helpers", "lragent.a"}
    assert upward_imports(graph) == ["kernels.k (kernels) -> eval_suite.report (scoring)"]
    assert find_cycles(graph) == [["lragent.a", "lragent.b"]]
    assert sibling_imports(graph) == ["eval_suite.bench.b -> eval_suite.diagnostics.d"]


def test_the_serving_core_knows_no_http():
    """``lragent/serving`` (trajectories, scheduler, metrics) is core: it imports no web framework or HTTP client;
    the OpenAI front end over it is ``eval_suite/serve``."""
    http = ("fastapi", "starlette", "uvicorn", "httpx", "openai", "http", "urllib", "aiohttp", "requests")
    bad = []
    for path in sorted((ROOT / "lragent" / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in http]
    assert (ROOT / "lragent" / "serving" / "scheduler.py").is_file()
    assert not bad, bad
