"""Structural rules of the package, checked from its source: no import circle (imports
inside functions included) and no function longer than 200 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bitsparse_core"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set) -> set:
    """Package modules ``path`` imports anywhere in its body."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # the deepest package module the import names
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict:
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    # Importing a package runs its __init__: a module depends on its parents too,
    # but a parent importing its own children is how packages work, not a circle.
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}
    return graph


def test_no_import_circle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_function_over_200_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 200:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n})")
    assert long == []



def test_backend_protocol_lists_what_every_backend_implements():
    """The typed contract (registry.Backend) names every method the package calls on a
    backend, and every registered backend has each of them."""
    import inspect

    import bitsparse_core as bc
    from bitsparse_core.backends.registry import Backend
    methods = {n for n, v in vars(Backend).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    called = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # p.backend.<method>(...) and be.<method>(...) on a looked-up backend
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "backend" and not node.attr.startswith("_")):
                called.add(node.attr)      # (a backend's own steps call its private parts)
    assert called - {"name"} <= methods, f"called but not in Backend: {called - methods}"
    for name in bc.registered_backends():
        try:
            be = bc.get_backend(name)
        except bc.BackendUnavailableError:
            continue
        missing = [m for m in sorted(methods) if not callable(getattr(be, m, None))]
        assert missing == [], f"{name} lacks {missing}"
