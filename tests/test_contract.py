"""The proto, the wire parser and the reduce table agree; the server's layout keeps its
rules (no grpc in the engine, no torch in the servicer, no cycles, small files)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server import wire
from hookserve_server.capture.reduce import DTYPES, REDUCTIONS
from hookserve_server.errors import InvalidArgument
from hookserve_server.spec import DType, Mode, Reduction

from helpers import assert_no_new_cycles, import_graph

SERVER = Path(__file__).resolve().parents[1] / "service" / "hookserve_server"

#: Proto values whose server side is not in the table yet.
#: Empty this set in the change that adds the table entry.
PENDING: set[str] = set()


def _proto_values(enum_type, prefix: str) -> dict[str, int]:
    return {name: number for name, number in enum_type.items()
            if name != f"{prefix}UNSPECIFIED" and name not in PENDING}


def _layer(**kw) -> pb.ExtractionSpec:
    return pb.ExtractionSpec(layers=[pb.LayerRequest(name="conv1", **kw)])


@pytest.mark.parametrize("enum_type, prefix, domain, field", [
    (pb.Reduction, "REDUCTION_", Reduction, "reduction"),
    (pb.DType, "DTYPE_", DType, "dtype"),
])
def test_proto_enum_parser_and_table_agree(enum_type, prefix, domain, field):
    table = {"reduction": REDUCTIONS, "dtype": DTYPES}[field]
    proto = _proto_values(enum_type, prefix)
    # Every proto value is one domain member with the same number, and back.
    assert sorted(proto.values()) == sorted(m.value for m in domain)
    for name, number in proto.items():
        member = domain(number)
        # Names agree too (AVG_POOL is AVG, MAX_POOL is MAX).
        assert name.removeprefix(prefix).removesuffix("_POOL") == member.name
        # The parser turns the proto value into that member...
        parsed = getattr(wire.to_spec(_layer(**{field: number})).layers[0], field)
        assert parsed is member
        # ...and the table has exactly one entry for it.
        assert member in table
    assert set(table) == set(domain)
    # UNSPECIFIED is the default; an unknown number is refused with a clear message.
    default = getattr(wire.to_spec(_layer()).layers[0], field)
    assert default is domain(1)
    with pytest.raises(InvalidArgument, match=f"invalid {field} for conv1"):
        wire.to_spec(_layer(**{field: 99}))


def test_preprocessing_modes_agree():
    proto = _proto_values(pb.Preprocessing.Mode, "MODE_")
    assert {n.removeprefix("MODE_"): v for n, v in proto.items()} == {
        m.name: m.value for m in Mode}
    for number in proto.values():
        spec = pb.ExtractionSpec(preprocessing=pb.Preprocessing(mode=number))
        assert wire.to_spec(spec).preprocessing.mode is Mode(number)
    assert wire.to_spec(pb.ExtractionSpec()).preprocessing.mode is Mode.DEFAULT


def test_reduction_shapes_are_those_the_proto_documents():
    from hookserve_server.capture.reduce import reduced_shape
    from hookserve_server.spec import LayerSpec

    shapes = {r: reduced_shape(LayerSpec("x", r), (8, 5, 3)) for r in Reduction}
    assert shapes == {Reduction.NONE: (8, 5, 3), Reduction.AVG: (8,), Reduction.MAX: (8,),
                      Reduction.FLATTEN: (120,), Reduction.STATS: (8, 5)}


# -- layout rules ------------------------------------------------------------------------

def test_no_import_cycles_and_no_big_files():
    assert_no_new_cycles(import_graph(SERVER.parent, "hookserve_server"))
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
    for name in ("servicer.py", "wire.py", "spec.py", "telemetry.py"):
        assert not {"torch", "torchvision"} & _source_imports(SERVER / name), name
    # Transitively too, each in a fresh interpreter.
    torch_free = ("import sys, hookserve_server.servicer, hookserve_server.wire; "
                  "assert 'torch' not in sys.modules")
    grpc_free = ("import sys, hookserve_server.engine, hookserve_server.capture.forward; "
                 "assert not [m for m in sys.modules if m.split('.')[0] == 'grpc']")
    for code in (torch_free, grpc_free):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
