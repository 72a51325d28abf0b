"""An image whose request is over the server's --max-message-bytes fails alone.

gRPC refuses such a message by ending the whole call, so the SDK learns the server's
limit from that refusal, starts the stream again for the images not yet answered,
and fails the images over the limit itself, each with a message that says what to
change; the other images of the stream are answered as usual, in order. A lone image
(`extract`) gets the same message.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import hookserve

from conftest import RunningServer, encode, rand_image
from helpers import R18

LIMIT = 1 << 20
SMALL = [rand_image(48, 48, seed=s) for s in range(3)]
#: 1.9 MB of raw pixels, and a PNG of noise over the limit
BIG_RAW = np.random.default_rng(5).integers(0, 256, (800, 800, 3), dtype=np.uint8)
BIG_PNG = encode(np.random.default_rng(6).integers(0, 256, (700, 700, 3), dtype=np.uint8))
assert len(BIG_PNG) > LIMIT


@pytest.fixture(scope="module")
def small_limit() -> RunningServer:
    s = RunningServer([*R18, "--max-message-bytes", str(LIMIT)])
    yield s
    s.stop(2.0)


def _check(results, want_ok) -> None:
    assert [r.index for r in results] == list(range(len(want_ok)))
    for r, ok in zip(results, want_ok, strict=True):
        if ok:
            assert r.ok, r.error
            continue
        assert r.error.code.name == "RESOURCE_EXHAUSTED"
        assert f"image {r.id!r}: its request of" in r.error.message
        assert f"over the server's limit of {LIMIT} bytes" in r.error.message
        assert "--max-message-bytes" in r.error.message


def test_a_stream_goes_on_past_images_over_the_limit(small_limit):
    images = [SMALL[0], BIG_RAW, SMALL[1], BIG_PNG, SMALL[2]]
    with small_limit.client(timeout=120) as c:
        results = list(c.extract_many(images, ["layer4"], reduction="avg"))
        _check(results, [True, False, True, False, True])
        for r, img in zip(results[::2], SMALL, strict=True):   # the same answers
            np.testing.assert_array_equal(
                r.features["layer4"], c.extract(img, ["layer4"], reduction="avg")["layer4"])
        # The limit is known now: the next stream fails the big image before sending.
        _check(list(c.extract_many([BIG_RAW, SMALL[0]], ["layer4"], reduction="avg")),
               [False, True])


def test_the_asyncio_client_and_attribution_streams_go_on_too(small_limit):
    async def main():
        async with hookserve.aio.Client(small_limit.address, timeout=120) as c:
            return [r async for r in c.extract_many([BIG_PNG, SMALL[0]], ["layer4"],
                                                    reduction="avg")]
    _check(asyncio.run(main()), [False, True])
    with small_limit.client(timeout=120) as c:
        _check(list(c.attribute_many([SMALL[0], BIG_RAW, SMALL[1]], "layer4")),
               [True, False, True])


def test_a_lone_image_over_the_limit_says_what_to_change(small_limit):
    with small_limit.client(timeout=120) as c, \
            pytest.raises(hookserve.errors.ResourceExhausted) as err:
        c.extract(BIG_RAW, ["layer4"])
    assert f"over the server's limit of {LIMIT} bytes (its --max-message-bytes)" in \
        str(err.value) and "Received message larger" not in str(err.value)


def test_the_clients_own_send_limit_fails_one_image_too(small_limit):
    """Over the client's own limit (a channel option), gRPC ends the call on the client
    side: the same recovery, and the message names the client's limit."""
    with hookserve.Client(small_limit.address, timeout=120,
                          options=[("grpc.max_send_message_length", 500_000)]) as c:
        results = list(c.extract_many([SMALL[0], BIG_RAW, SMALL[1]], ["layer4"],
                                      reduction="avg"))
    assert results[0].ok and results[2].ok
    assert "over this client's limit of 500000 bytes" in results[1].error.message
    assert "grpc.max_send_message_length" in results[1].error.message
