"""The SDK's shape: no import cycle, no torch anywhere, no source file over ~400 lines.

Reads client/hookserve with `ast` (nothing is imported), so it checks every module,
including those that only some commands load; imports under TYPE_CHECKING and inside
functions count.
"""

from __future__ import annotations

from pathlib import Path

from helpers import (
    assert_no_new_cycles,
    import_cycles,
    import_graph,
    module_imports,
    package_modules,
)

ROOT = Path(__file__).resolve().parent.parent / "client"
PKG = ROOT / "hookserve"
MAX_LINES = 420  # "about 400"; generated stubs (v1/) are exempt


def _modules() -> dict[str, Path]:
    return package_modules(ROOT, "hookserve", skip={"v1"})


def test_sdk_imports_no_torch_and_has_no_cycle():
    known = _modules()
    for name, path in known.items():
        imported = module_imports(name, path, known)
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "torchvision"))
        assert not heavy, f"{name} imports {heavy}: the SDK must stay torch-free"
        # One door to the server package: the CLI imports `hookserve_server.command`
        # (for `serve`), and nothing else of it.
        server = sorted(m for m in imported if m.split(".")[0] == "hookserve_server")
        allowed = ["hookserve_server.command"] if name == "hookserve.cli" else []
        assert server in ([], allowed), f"{name} imports {server}"
    assert_no_new_cycles(import_graph(ROOT, "hookserve", skip={"v1"}))


def test_sdk_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in _modules().values()}
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not over, f"split these files (over {MAX_LINES} lines): {over}"


def test_no_package_name_shadows_one_of_its_modules():
    """`hookserve.batch.run` is a function: no module of that name may hide behind it
    (the function `hookserve.overlay` lives in `hookserve.overlays`)."""
    import importlib
    import types

    for name in sorted(_modules()):
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


def test_the_import_graph_counts_type_checking_and_function_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from p import a\n    return a\n")
    (pkg / "c.py").write_text("from . import b\n")
    graph = import_graph(tmp_path, "p")
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.b"}}
    assert import_cycles(graph) == [("p.a", "p.b")]
