"""Raw tensor contents of the Open Inference Protocol: BYTES elements as a 4-byte
little-endian length then the bytes, every other type row-major little-endian."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import InvalidArgument
from ..spec import DType

#: hookserve's answer dtypes as OIP datatypes.
DATATYPES: dict[DType, str] = {DType.FLOAT32: "FP32", DType.FLOAT16: "FP16",
                               DType.BFLOAT16: "BF16"}
#: Bytes per element of the input datatypes read here.
ELEMENT_BYTES = {"UINT8": 1, "INT32": 4, "INT64": 8}
_LENGTH = struct.Struct("<I")


class TooMany(InvalidArgument):
    """Raw BYTES contents with more elements than the caller takes (`unpack_bytes`)."""


def unpack_bytes(raw: bytes | memoryview, what: str, most: int | None = None
                 ) -> list[bytes]:
    """A raw BYTES tensor as its elements; TooMany at the first one past `most`."""
    view = memoryview(raw)
    out: list[bytes] = []
    pos = 0
    while pos < len(view):
        if most is not None and len(out) == most:
            raise TooMany(f"{what}: the raw contents hold more than {most} elements")
        if pos + 4 > len(view):
            raise InvalidArgument(f"{what}: raw BYTES contents end inside an element's "
                                  "4-byte length: each element is a little-endian uint32 "
                                  "length, then that many bytes")
        (n,) = _LENGTH.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise InvalidArgument(f"{what}: element {len(out)} says {n} bytes, only "
                                  f"{len(view) - pos} follow")
        out.append(bytes(view[pos:pos + n]))
        pos += n
    return out


def pack_bytes(elements: list[bytes]) -> bytes:
    """BYTES elements as raw contents."""
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


def unpack_ints(raw: bytes | memoryview, datatype: str, what: str) -> list[int]:
    """A raw INT32/INT64 tensor as Python ints."""
    size = ELEMENT_BYTES[datatype]
    if len(raw) % size:
        raise InvalidArgument(f"{what}: {len(raw)} bytes is not a whole number of "
                              f"{datatype} elements ({size} bytes each)")
    fmt = f"<{len(raw) // size}{'i' if size == 4 else 'q'}"
    return list(struct.unpack(fmt, raw))


def element_count(shape: tuple[int, ...], what: str) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise InvalidArgument(f"{what}: shape {list(shape)} has a negative dimension")
        n *= d
    return n


@dataclass
class OutTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass
class InferAnswer:
    model: str
    id: str
    outputs: list[OutTensor]


def stack(name: str, per_image: list) -> OutTensor:
    """Each image's tensor as one [N, ...] tensor."""
    shapes = {tuple(o.shape) for o in per_image}
    if len(shapes) > 1:
        raise InvalidArgument(f"output {name[:100]!r}: the images gave different shapes "
                              f"({', '.join(str(list(s)) for s in sorted(shapes))}): use "
                              "the default geometry, or one image per request")
    first = per_image[0]
    return OutTensor(name, DATATYPES[first.dtype], (len(per_image), *first.shape),
                     b"".join(o.data for o in per_image))
