"""Regenerate the Python stubs from proto/ into a directory (default: client/).

`make proto` runs this; tests/test_proto_drift.py runs it into a temporary
directory and fails when the checked-in stubs differ.
"""

from __future__ import annotations

import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTOS = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))


def _googleapis_include() -> str:
    # google/rpc/status.proto ships with googleapis-common-protos.
    import google.rpc

    return str(pathlib.Path(google.rpc.__path__[0]).parents[1])


def generate(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    wkt = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{_googleapis_include()}",
        f"-I{wkt}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client")
