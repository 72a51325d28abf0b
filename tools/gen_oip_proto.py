"""Regenerate the Open Inference Protocol stubs in service/hookserve_server/oip/.

The source is Triton's own `grpc_service.proto` and `model_config.proto` as compiled
into the `tritonclient` wheel (its `service_pb2.py` and `model_config_pb2.py` embed
each file's FileDescriptorProto). They are written to a descriptor set and compiled
again with this project's pinned grpcio-tools, messages only (the server registers
its handlers itself). The file names and packages stay Triton's, so the server's
stubs and tritonclient's can share one process. Origin and licence:
service/hookserve_server/oip/PROTO_ORIGIN.md.

    pip install --no-deps tritonclient==2.73.0
    python tools/gen_oip_proto.py [OUT_DIR]
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
import tempfile

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "service" / "hookserve_server" / "oip"
#: tritonclient's modules, in dependency order, and the .proto each was built from.
SOURCES = (("model_config_pb2.py", "model_config.proto"),
           ("service_pb2.py", "grpc_service.proto"))


def _embedded(path: pathlib.Path) -> bytes:
    """The serialized FileDescriptorProto a generated _pb2.py adds to its pool."""
    text = path.read_text()
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", text, re.S)
    if not m:
        raise SystemExit(f"{path}: no embedded descriptor found")
    return eval(m.group(1), {})  # a bytes literal written by protoc


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("tritonclient is not installed: pip install --no-deps "
                         "tritonclient==2.73.0")
    grpc_dir = pathlib.Path(spec.submodule_search_locations[0]) / "grpc"
    fds = descriptor_pb2.FileDescriptorSet()
    for module, proto in SOURCES:
        fd = fds.file.add()
        fd.ParseFromString(_embedded(grpc_dir / module))
        if fd.name != proto:
            raise SystemExit(f"{module} holds {fd.name}, expected {proto}")
    return fds


def generate(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        desc = pathlib.Path(tmp) / "triton.binpb"
        desc.write_bytes(descriptor_set().SerializeToString())
        args = ["protoc", f"--descriptor_set_in={desc}", f"--python_out={out}",
                f"--pyi_out={out}", *(proto for _, proto in SOURCES)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    # protoc writes `import model_config_pb2`: a sibling module here.
    for name in ("grpc_service_pb2.py", "grpc_service_pb2.pyi"):
        f = out / name
        f.write_text(f.read_text().replace("import model_config_pb2 as",
                                           "from . import model_config_pb2 as"))


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
