"""An image's request message, encoded by hand so that its bytes are copied once.

Building an ``ExtractRequest`` the generated way copies an input's bytes three times
(into the ``Image``, into the request, then into the serialised message), and every
copy lives while the image is unanswered. Here the request's wire bytes are written
directly (protobuf's wire format: a field's tag, a varint length, the payload), so the
input's bytes are copied once, into the request that the stream keeps and gRPC sends.
The bytes are what ``SerializeToString`` of the generated message gives
(``tests/test_wire.py``).

:class:`Stub` is the generated stub whose Extract and Attribute calls take such bytes
as they are (:func:`serialize`), or a message.
"""

from __future__ import annotations

import os
from typing import Any

from .images import read_file, to_image
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc

# Tags (field number << 3 | wire type): 2 is length-delimited, 0 a varint.
_REQUEST_IMAGE = b"\x12"    # ExtractRequest.image = 2, AttributeRequest.image = 2
_IMAGE_ID = b"\x0a"         # Image.id = 1
_IMAGE_ENCODED = b"\x12"    # Image.encoded = 2
_ATTRIBUTE_IMAGE = b"\x0a"  # AttributeImage.image = 1
_TARGET = b"\x10"           # AttributeImage.target_class = 2 (int64)


def varint(n: int) -> bytes:
    """``n`` (0 <= n < 2**64) as a protobuf varint."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


#: The initial metadata each Extract and Attribute stream's server sends: JSON {model:
#: the first characters of its weights digest} of every model it serves
#: (hookserve.proto, Extract).
WEIGHTS_HEADER = "hookserve-weights-bin"


def _delimited(tag: bytes, size: int) -> bytes:
    return tag + varint(size)


class Payload:
    """Encoded image bytes that their owner may send again (a retry on a later
    stream). Once encoded into a request, :attr:`data` is a view of the request's own
    bytes, so the buffer it was read into is freed and the input is held once."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data: bytes | memoryview = data

    def __len__(self) -> int:
        return len(self.data)


def _image(obj: Any, image_id: str, limit: int | None) -> list:
    """The parts of an ``Image`` message for `obj` (joined once by the caller); a file
    over `limit` bytes is refused unread (`images.read_file`)."""
    if isinstance(obj, Payload):
        data: Any = obj.data
    elif isinstance(obj, (str, os.PathLike)):
        data = read_file(obj, limit)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = obj
        if isinstance(obj, memoryview) and not (obj.c_contiguous and obj.ndim == 1
                                                and obj.itemsize == 1):
            data = obj.tobytes()
    else:  # pixels (an array, a PIL image): the generated message
        return [to_image(obj, image_id).SerializeToString()]
    name = image_id.encode("utf-8")
    head = (_delimited(_IMAGE_ID, len(name)) + name if name else b"") \
        + _delimited(_IMAGE_ENCODED, len(data))
    return [head, data]


def _join(parts: list, obj: Any) -> bytes:
    wire = b"".join(parts)
    if isinstance(obj, Payload):  # keep a view of the request; the read buffer goes
        offset = 0
        for part in parts:
            if part is obj.data:
                break
            offset += len(part)
        obj.data = memoryview(wire)[offset:offset + len(obj.data)]
    return wire


def _size(parts: list) -> int:
    return sum(len(p) for p in parts)


def extract_request(obj: Any, image_id: str, limit: int | None = None) -> bytes:
    """The wire bytes of ``ExtractRequest(image=Image(id=image_id, ...))`` for `obj`: a
    path or encoded bytes are sent encoded, an array or PIL image as raw pixels (see
    :func:`hookserve.images.to_image`). A :class:`Payload` becomes a view of the
    result. A file over `limit` bytes is refused unread."""
    image = _image(obj, image_id, limit)
    return _join([_delimited(_REQUEST_IMAGE, _size(image)), *image], obj)


def attribute_request(obj: Any, image_id: str, target: int | None,
                      limit: int | None = None) -> bytes:
    """The wire bytes of ``AttributeRequest(image=AttributeImage(image=..., target_class=
    target))``; `target` None leaves the class unset."""
    image = _image(obj, image_id, limit)
    inner = [_delimited(_ATTRIBUTE_IMAGE, _size(image)), *image]
    if target is not None:
        inner.append(_TARGET + varint(target & 0xFFFF_FFFF_FFFF_FFFF))  # int64: two's complement
    return _join([_delimited(_REQUEST_IMAGE, _size(inner)), *inner], obj)


def serialize(msg: Any) -> bytes:
    """A request's bytes: encoded ones as they are, a message serialised."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class Stub(pb_grpc.FeatureExtractorStub):
    """The generated stub, whose Extract and Attribute streams also take requests
    already encoded (:func:`extract_request`, :func:`attribute_request`)."""

    def __init__(self, channel: Any) -> None:
        super().__init__(channel)
        for name, answer in (("Extract", pb.ExtractResponse),
                             ("Attribute", pb.AttributeResponse)):
            setattr(self, name, channel.stream_stream(
                f"/hookserve.v1.FeatureExtractor/{name}", request_serializer=serialize,
                response_deserializer=answer.FromString, _registered_method=True))
