"""The package's layout: no import cycles, and imports run one way, attention <- models <-
integrations <- tools (a module imports only its own layer and the layers before it).

Read from the source with ast, lazy imports inside functions included: a cycle through a lazy
import is still a cycle for a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import causal_attention

LAYERS = ("attention", "models", "integrations", "tools")
# The package's top level (the public face and __main__) may import any layer.
TOP_LEVEL = len(LAYERS)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that a module's source imports (a from-import of a module names it)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in out if m in known}


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(ast.parse(p.read_text()), name, p.name == "__init__.py", known) - {name}
            for name, p in paths.items()}


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP_LEVEL


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. A package's __init__ importing its own modules
    is not a cycle (Python runs it first), so edges into a package from inside it are left out."""
    def edges(name: str) -> set[str]:
        return {m for m in graph[name] if not name.startswith(m + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(edges(name)):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} imports {dep}" for name, deps in graph.items() for dep in deps
                  if layer(name) < TOP_LEVEL and layer(dep) > layer(name))


ROOT = Path(causal_attention.__file__).resolve().parent


def test_the_package_has_no_import_cycle() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_imports_run_from_tools_down_to_attention() -> None:
    assert layer_violations(import_graph(ROOT)) == []


def test_every_module_is_in_a_layer_or_the_public_face() -> None:
    top = sorted(name for name in import_graph(ROOT) if layer(name) == TOP_LEVEL)
    assert top == ["causal_attention", "causal_attention.__main__", "causal_attention._paths"]


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "causal_attention" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "causal_attention"


@pytest.mark.parametrize("lazy", [False, True], ids=["top", "lazy"])
def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path: Path, lazy: bool) -> None:
    """The checks can fail: a cycle models.gpt <-> models.convert (a lazy import too), and
    attention importing tools."""
    back = "def f():\n    from . import gpt\n" if lazy else "from . import gpt\n"
    root = write(tmp_path, {
        "__init__.py": "", "attention/__init__.py": "", "models/__init__.py": "", "tools/__init__.py": "",
        "models/gpt.py": "from .convert import x\n", "models/convert.py": back,
        "attention/module.py": "from ..tools import cli\n", "tools/cli.py": "",
    })
    graph = import_graph(root)
    assert find_cycle(graph) in (["causal_attention.models.convert", "causal_attention.models.gpt",
                                  "causal_attention.models.convert"],
                                 ["causal_attention.models.gpt", "causal_attention.models.convert",
                                  "causal_attention.models.gpt"])
    assert layer_violations(graph) == ["causal_attention.attention.module imports causal_attention.tools",
                                       "causal_attention.attention.module imports causal_attention.tools.cli"]
