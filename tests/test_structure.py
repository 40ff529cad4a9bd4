"""The shape of the code: no import cycle in peerd/ (every import counts: module level, inside a
function, under `if TYPE_CHECKING`), no class over 400 lines, no function over 100 lines outside
the tests and the generated code."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("peerd.v1",)
MAX_CLASS, MAX_FUNCTION = 400, 100


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every peerd module `name` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                       # relative: from the package this module is in
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` and `from a.b import c` run a/__init__, a/b/__init__ and c too
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in known and candidate != name:
                    found.add(candidate)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)) is not None:
                return c
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(graph):
        if n not in state and (c := visit(n)) is not None:
            return c
    return None


def import_graph() -> dict[str, set[str]]:
    mods = _modules("peerd")
    known = set(mods)
    # A package's __init__ importing its own submodules is how a package exposes them, not a cycle
    # of ours; every other edge counts.
    return {n: {m for m in _imports(n, p, known) if not (m.startswith(n + ".") and p.name == "__init__.py")}
            for n, p in mods.items()}


def test_no_import_cycle_in_peerd():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle_and_a_function_local_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from peerd.sync import events\n")
    assert _imports("x", mod, {"peerd", "peerd.sync", "peerd.sync.events"}) == {"peerd", "peerd.sync",
                                                                                "peerd.sync.events"}


def test_no_class_or_function_too_long():
    too_long = []
    for package in ("peerd", "cli"):
        for name, path in _modules(package).items():
            if name.startswith(GENERATED):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and lines > MAX_CLASS:
                    too_long.append(f"class {name}.{node.name}: {lines} lines")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION:
                    too_long.append(f"function {name}.{node.name}: {lines} lines")
    assert not too_long, "\n".join(too_long)
