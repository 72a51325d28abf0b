"""The SDK across failing servers and odd inputs, each against real gRPC calls:

- a stream's retries count the failures since its last answer (a long stream outlived
  only `retries` restarts in all, however much it answered between them);
- with several dead addresses, every address gets a try before a call gives up;
- a call past its deadline on a hung address sends the next calls elsewhere;
- `attribute(timeout=...)` and `max_in_flight=` are refused, as `extract`'s are;
- closing an asyncio client under running calls raises `hookserve.Cancelled` in them,
  not a bare CancelledError in tasks nobody cancelled;
- ids that run out give the answered images first;
- a PIL image is turned by its EXIF orientation, as the same file's bytes are; an
  HxWx1 array is grey, as HxW is.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from PIL import Image

import hookserve
from hookserve.endpoints import Endpoints
from hookserve.v1 import hookserve_pb2 as pb

from conftest import encode, rand_image


def _dead_addresses(n: int) -> list[str]:
    """Ports nothing listens on (bound here, never listening, for the test's length)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    _dead_addresses.keep = socks   # (released with the module)
    return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]


def test_a_streams_retries_count_failures_since_its_last_answer():
    ep = Endpoints(_dead_addresses(2), token=None, retries=1, retry_backoff=0.01)
    calls = []

    def fn(stub):   # answers one item, then its call fails for real (nothing listens)
        calls.append(1)
        yield len(calls)
        if len(calls) < 6:
            stub.ListModels(pb.ListModelsRequest(), timeout=5)

    assert list(ep.stream(fn)) == [1, 2, 3, 4, 5, 6]   # five failures, each after an answer
    ep.close()


def test_every_address_gets_a_try_before_a_call_gives_up(make_server):
    live = make_server("--model", "resnet18", "--weights", "random")
    with hookserve.Client([*_dead_addresses(7), live.address], timeout=30,
                          retry_backoff=0.01) as c:   # (3 retries, 8 addresses)
        for _ in range(6):
            assert c.list_models()[0].name == "resnet18"


def test_the_sdks_keepalive_pings_are_ones_the_server_takes():
    """An image stream that waits (a slow source) is kept alive by the SDK's pings; a
    server that took them as too many would end it (GOAWAY too_many_pings)."""
    from hookserve.endpoints import CHANNEL_OPTIONS
    from hookserve_server.server import MIN_PING_INTERVAL_MS

    assert dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"] >= MIN_PING_INTERVAL_MS


def test_a_hung_address_is_skipped_after_a_call_timed_out_on_it(make_server):
    live = make_server("--model", "resnet18", "--weights", "random")
    with socket.socket() as hung:   # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        with hookserve.Client([address, live.address], timeout=1, retries=0) as c:
            outcomes = []
            for _ in range(6):
                try:
                    outcomes.append(c.list_models()[0].name)
                except hookserve.DeadlineExceeded:
                    outcomes.append("timed out")
    assert outcomes.count("timed out") <= 1, outcomes


def test_one_image_attribute_refuses_a_streams_options(server):
    img = rand_image(32, 32, seed=1)
    with server.client() as c:
        for name, value in (("timeout", 0.05), ("max_in_flight", 3)):
            with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
                c.attribute(img, **{name: value})

    async def aio():
        async with hookserve.aio.Client(server.address) as ac:
            with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
                await ac.attribute(img, timeout=0.05)
    asyncio.run(aio())


def test_closing_an_asyncio_client_under_running_calls_cancels_them_typed(server):
    imgs = [encode(rand_image(64, 64, seed=i)) for i in range(40)]

    async def main():
        ac = hookserve.aio.Client(server.address, timeout=60)
        await ac.list_models()

        async def one(i):
            return await ac.extract(imgs[i % len(imgs)], ["layer4"])

        async def stream():
            return [r async for r in ac.extract_many(imgs, ["layer4"])]

        tasks = [asyncio.create_task(one(i)) for i in range(20)]
        tasks.append(asyncio.create_task(stream()))
        await asyncio.sleep(0)   # (the calls start)
        await ac.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert not any(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    assert all(isinstance(o, (dict, list, hookserve.Cancelled)) for o in outcomes), outcomes


def test_ids_that_run_out_give_the_answered_images_first(server):
    imgs = [rand_image(32, 32, seed=i) for i in range(5)]
    got = []
    with server.client() as c, pytest.raises(ValueError, match="ids has fewer items"):
        for r in c.extract_many(imgs, ["fc"], ids=["a", "b"]):
            got.append(r.id)
    assert got == ["a", "b"]


def test_a_pil_image_is_turned_by_its_exif_orientation(server, tmp_path):
    img = Image.fromarray(rand_image(40, 64, seed=3))
    exif = Image.Exif()
    exif[0x0112] = 6   # rotate 90 degrees clockwise to show
    path = tmp_path / "turned.jpg"
    img.save(path, exif=exif, quality=95)
    with server.client() as c:
        from_file = c.extract(str(path), ["fc"])["fc"]
        with Image.open(path) as opened:
            from_pil = c.extract(opened, ["fc"])["fc"]
        damaged = Image.fromarray(rand_image(30, 30, seed=5))
        plain = c.extract(damaged, ["fc"])["fc"]
        damaged.info["exif"] = b"not a TIFF block"   # unreadable EXIF: the pixels as they are
        np.testing.assert_array_equal(c.extract(damaged, ["fc"])["fc"], plain)
        grey = rand_image(30, 30, seed=4)[:, :, :1]
        np.testing.assert_array_equal(c.extract(grey, ["fc"])["fc"],
                                      c.extract(grey[:, :, 0], ["fc"])["fc"])
    np.testing.assert_allclose(from_pil, from_file, rtol=1e-5, atol=1e-5)
