"""The hand-encoded requests (hookserve.wire) are the generated messages' bytes.

Each case is encoded by hand and built the generated way: the bytes are equal to
``SerializeToString`` and parse back (``ParseFromString``) to an equal message with the
same oneof set. A :class:`~hookserve.wire.Payload` ends as a view of its request.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hookserve import wire
from hookserve.images import to_image
from hookserve.v1 import hookserve_pb2 as pb

IDS = ["", "0#0", "ü/日本語 🖼.png", "x" * 300, "\x00nul"]
DATA = [b"", b"\x89PNG", os.urandom(200), os.urandom(70_000)]


def _same(raw: bytes, want, cls) -> None:
    got = cls()
    got.ParseFromString(raw)
    assert got == want
    assert got.WhichOneof("payload") == "image"
    assert raw == want.SerializeToString()


@pytest.mark.parametrize("image_id", IDS)
@pytest.mark.parametrize("size", [len(d) for d in DATA])
def test_extract_request_is_the_generated_message(image_id, size):
    data = next(d for d in DATA if len(d) == size)
    want = pb.ExtractRequest(image=pb.Image(id=image_id, encoded=data))
    for obj in (data, bytearray(data), memoryview(data), wire.Payload(data)):
        raw = wire.extract_request(obj, image_id)
        _same(raw, want, pb.ExtractRequest)
    got = pb.ExtractRequest.FromString(wire.extract_request(data, image_id))
    assert got.image.WhichOneof("data") == "encoded"  # set, also when empty


@pytest.mark.parametrize("target", [None, 0, 7, 999, -1, 2**63 - 1, -(2**63)])
@pytest.mark.parametrize("image_id", IDS[:3])
def test_attribute_request_is_the_generated_message(image_id, target):
    data = DATA[2]
    image = pb.AttributeImage(image=pb.Image(id=image_id, encoded=data))
    if target is not None:
        image.target_class = target
    want = pb.AttributeRequest(image=image)
    raw = wire.attribute_request(data, image_id, target)
    _same(raw, want, pb.AttributeRequest)
    assert pb.AttributeRequest.FromString(raw).image.HasField("target_class") == \
        (target is not None)


def test_a_large_image_is_copied_once_into_its_request():
    """A 64 MiB input: the request is its bytes after a few of framing, and a Payload
    afterwards points into the request (the read buffer is no longer referenced)."""
    data = os.urandom(64 << 20)
    p = wire.Payload(data)
    raw = wire.extract_request(p, "big")
    assert len(raw) - len(data) < 16
    assert isinstance(p.data, memoryview) and p.data.obj is raw and p.data == data
    want = pb.ExtractRequest(image=pb.Image(id="big", encoded=data))
    _same(raw, want, pb.ExtractRequest)
    # encoded again (a retry with a new id): from the view, into a new request
    again = wire.attribute_request(p, "big#1", 3)
    assert p.data.obj is again and p.data == data
    assert pb.AttributeRequest.FromString(again).image.image.encoded == data


def test_paths_and_pixels_encode_as_the_sdk_sends_them(tmp_path):
    f = tmp_path / "a.png"
    f.write_bytes(DATA[3])
    assert wire.extract_request(str(f), "a") == pb.ExtractRequest(
        image=pb.Image(id="a", encoded=DATA[3])).SerializeToString()
    pixels = np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3)
    for obj in (pixels, pixels[:, :, 0], np.ascontiguousarray(pixels[::-1])):
        want = pb.ExtractRequest(image=to_image(obj, "p"))
        _same(wire.extract_request(obj, "p"), want, pb.ExtractRequest)
    strided = memoryview(np.arange(12, dtype=np.uint8))[::2]
    _same(wire.extract_request(strided, "s"),
          pb.ExtractRequest(image=pb.Image(id="s", encoded=bytes(strided))), pb.ExtractRequest)
    with pytest.raises(TypeError):
        wire.extract_request(3.5, "bad")


def test_serialize_passes_bytes_and_serialises_messages():
    raw = wire.extract_request(b"abc", "i")
    assert wire.serialize(raw) is raw
    spec = pb.ExtractRequest(spec=pb.ExtractionSpec(model="resnet18"))
    assert wire.serialize(spec) == spec.SerializeToString()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 2**32, 2**64 - 1])
def test_varint(n):
    # an int64 field (target_class) is its tag, then the varint of its two's complement
    assert b"\x10" + wire.varint(n) == pb.AttributeImage(
        target_class=n - 2**64 if n >= 2**63 else n).SerializeToString()
