"""The package's import structure, checked by parsing the source (nothing is imported).

Import cycles between `rlhf` modules make import order matter and tempt function-level imports as a
workaround; those in turn hide dependencies and defer import errors to run time. So: no cycles, and no
imports inside functions except of the optional heavy engines, which a run may not have installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# optional heavy engines, plus `datasets`: it takes 1.5 s to import and only `dataset=mix` runs need it, while
# every CLI process and Ray worker imports the package (the test suite launches about 60 of them); `gem` (GEM's
# environments) is optional and takes 2 s to import, needed by `env.name=gem` runs only; `reasoning_gym` likewise (1.5 s,
# dataset/reward=reasoning_gym only); `math_verify`, `wandb` and `gguf` are extras that only their own reward / logging.wandb / a .gguf model need
OPTIONAL_ENGINES = {"vllm", "deepspeed", "ray", "peft", "datasets", "gem", "reasoning_gym", "math_verify", "wandb", "gguf"}
# the package's own modules that wrap such a stack: the agent endpoint's HTTP side (FastAPI and uvicorn, 0.28 s of every
# process's import, and absent from the GPU image bench/GPU.md is measured on) loads when an endpoint serves
OPTIONAL_MODULES = {"rlhf.agents.server"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ancestors(module: str) -> list[str]:
    """The packages ``module`` lies in, innermost last: rlhf.a.b -> [rlhf, rlhf.a]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """({module: rlhf modules it imports, at any nesting level, and the packages whose __init__ that import runs},
    ["file:line" of function-level imports])."""
    files = {module_name(p): p for p in sorted((SRC / "rlhf").rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    offenders = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, [base, node.module]))
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in files and "." in target:  # `import rlhf.a.b.name` -> rlhf.a.b
                    target = target.rpartition(".")[0]
                if target in files and target != name:
                    graph[name].add(target)
                # importing rlhf.a.b first runs the __init__ of package rlhf.a, unless it is the importer's own
                for package in ancestors(target):
                    if package in files and package != name and not name.startswith(package + "."):
                        graph[name].add(package)
            roots = {t.split(".")[0] for t in targets}
            if id(node) in nested and not (roots <= OPTIONAL_ENGINES or set(targets) <= OPTIONAL_MODULES):
                offenders.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    return graph, offenders


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], by depth-first search; None when the graph is acyclic."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        for child in sorted(graph[node]):
            if cycle := visit(child):
                return cycle
        stack.pop()
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node))), None)


def test_rlhf_modules_import_each_other_without_cycles():
    cycle = find_cycle(import_graph()[0])
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def folder_of(module: str) -> str:
    """The folder a module lies in (rlhf.step.learner -> rlhf.step); a module at the package root is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{folder: the other folders (and root modules) its modules import}."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folders.setdefault(folder_of(module), set())
        for target in targets:
            folders.setdefault(folder_of(target), set())
            if folder_of(target) != folder_of(module):
                folders[folder_of(module)].add(folder_of(target))
    return folders


def test_folders_import_each_other_without_cycles():
    """Each folder is a layer: if `rlhf.a` imports from `rlhf.b`, nothing in `rlhf.b` imports from `rlhf.a`, so a
    folder can be read, tested and replaced knowing only the folders below it."""
    cycle = find_cycle(folder_graph(import_graph()[0]))
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)


def test_the_folder_check_finds_a_cycle_between_folders():
    graph = {"rlhf.a.x": {"rlhf.b.y"}, "rlhf.b.y": {"rlhf.b.z"}, "rlhf.b.z": {"rlhf.a.w"}, "rlhf.a.w": set()}
    assert find_cycle(graph) is None  # no cycle between the modules themselves
    assert find_cycle(folder_graph(graph)) == ["rlhf.a", "rlhf.b", "rlhf.a"]


def test_imports_sit_at_module_level_except_optional_engines():
    offenders = import_graph()[1]
    assert not offenders, "function-level imports (move them to the top of the file):\n" + "\n".join(offenders)
