"""The SDK's shape: no import cycle, no torch anywhere, no source file over ~400 lines.

Reads client/hookserve with `ast` (nothing is imported), so it checks every module,
including those that only some commands load.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "client"
PKG = ROOT / "hookserve"
MAX_LINES = 420  # "about 400"; generated stubs (v1/) are exempt


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if "v1" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of this package that `name` imports, and every top-level name."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                prefix = base[:len(base) - node.level + 1]
                mod = ".".join(prefix + ([mod] if mod else []))
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
            # `from . import errors` imports that module (and the package, which
            # any submodule's import does: not counted as an edge).
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(mod)
    return found


def test_sdk_imports_no_torch_and_has_no_cycle():
    known = _modules()
    graph = {}
    for name, path in known.items():
        imported = _imports(name, path, known)
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "torchvision"))
        assert not heavy, f"{name} imports {heavy}: the SDK must stay torch-free"
        # One door to the server package: the CLI imports `hookserve_server.command`
        # (for `serve`), and nothing else of it.
        server = sorted(m for m in imported if m.split(".")[0] == "hookserve_server")
        allowed = ["hookserve_server.command"] if name == "hookserve.cli" else []
        assert server in ([], allowed), f"{name} imports {server}"
        graph[name] = {m for m in imported if m in known and m != name}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_sdk_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in _modules().values()}
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not over, f"split these files (over {MAX_LINES} lines): {over}"


def test_no_package_name_shadows_one_of_its_modules():
    """`hookserve.batch.run` is a function: no module of that name may hide behind it.
    `hookserve.overlay` is the one such name, kept: the function is the documented API,
    and its module's other names import as ``from hookserve.overlay import heat``."""
    import importlib
    import types

    for name in sorted(set(_modules()) - {"hookserve.overlay"}):
        pkg_name, _, sub = name.rpartition(".")
        if not pkg_name:
            continue
        pkg = importlib.import_module(pkg_name)
        if not hasattr(pkg, "__path__"):
            continue
        module = importlib.import_module(name)
        value = getattr(pkg, sub, module)
        assert value is module, f"{pkg_name}.{sub} is {value!r}, not the module {name}"
        assert isinstance(module, types.ModuleType)
