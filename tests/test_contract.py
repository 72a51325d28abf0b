"""The server's layout keeps its rules: no grpc in the engine, no torch in the servicer,
no import cycles (type-checking and function-level imports counted), small files. (The value lists'
agreement with the proto: tests/test_value_lists.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import assert_no_new_cycles, import_graph

SERVER = Path(__file__).resolve().parents[1] / "service" / "hookserve_server"

# -- layout rules ------------------------------------------------------------------------

def test_no_import_cycles_and_no_big_files():
    graph = import_graph(SERVER.parent, "hookserve_server")
    assert_no_new_cycles(graph)
    # The engine's shared types are a leaf of the engine: every stage may import them.
    engine = "hookserve_server.engine"
    assert not {m for m in graph[f"{engine}.types"] if m.startswith(engine)}
    big = {str(f.relative_to(SERVER)): n for f in SERVER.rglob("*.py")
           if (n := len(f.read_text().splitlines())) > 400}
    assert not big, big


def _source_imports(path: Path) -> set[str]:
    """Top-level names of the modules `path` imports anywhere (relative ones as '.')."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return names


def test_engine_and_capture_import_no_grpc_and_servicer_no_torch():
    for pkg in ("engine", "cache", "capture", "preprocess"):
        for f in (SERVER / pkg).glob("*.py"):
            assert not {"grpc", "grpc_health", "google", "hookserve"} & _source_imports(f), f
    for name in ("servicer.py", "calls.py", "wire.py", "spec.py", "telemetry.py"):
        assert not {"torch", "torchvision"} & _source_imports(SERVER / name), name
    # Transitively too, each in a fresh interpreter.
    torch_free = ("import sys, hookserve_server.servicer, hookserve_server.wire; "
                  "assert 'torch' not in sys.modules")
    grpc_free = ("import sys, hookserve_server.engine, hookserve_server.capture.forward; "
                 "assert not [m for m in sys.modules if m.split('.')[0] == 'grpc']")
    for code in (torch_free, grpc_free):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
