"""hookserve.aio.Client against real servers: the sync client's answers and errors,
laziness, failover, auth, timeouts and cancellation, over the wire.

Each test runs its coroutine with asyncio.run (no plugin needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import grpc
import numpy as np
import pytest

import hookserve
import hookserve.aio

from conftest import TOKEN, encode, rand_image
from helpers import METRICS, R18, answered, computed, wait_until

TOL = {"rtol": 1e-4, "atol": 1e-5}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240))


def calls(s, code: str, method: str = "Extract") -> int:
    v = s.telemetry.registry.get_sample_value(
        "hookserve_requests_total",
        {"method": method, "model": "resnet18", "code": code, "attribution_method": ""})
    return int(v or 0)


@pytest.fixture(scope="module")
def imgs():
    return [rand_image(48 + 8 * (i % 3), 64, seed=i) for i in range(6)]


def test_answers_equal_the_sync_clients(server, client, imgs, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encode(imgs[0]))
    inputs = [str(path), imgs[1], encode(imgs[2]), b"no image", imgs[3]]
    want = list(client.extract_many(inputs, ["layer2", "fc"], reduction="avg"))
    want_maps = list(client.attribute_many(imgs[:3], "layer3", targets=[5, None, 7]))

    async def main():
        async with hookserve.aio.Client(server.address, timeout=120) as c:
            assert await c.list_models() == client.list_models()
            assert await c.describe("vgg11", "64x96") == client.describe("vgg11", (64, 96))
            assert await c.health() == "SERVING"
            one = await c.extract(str(path), ["layer2", "fc"], reduction="avg")
            many = [r async for r in c.extract_many(inputs, ["layer2", "fc"],
                                                    reduction="avg", max_in_flight=2)]
            a = await c.attribute(imgs[0], "layer3", target=5)
            maps = [m async for m in c.attribute_many(imgs[:3], "layer3",
                                                      targets=[5, None, 7])]
            return one, many, a, maps

    one, many, a, maps = run(main())
    for name in ("layer2", "fc"):
        np.testing.assert_allclose(one[name], want[0].features[name], **TOL)
    assert [(r.index, r.id, r.ok) for r in many] == [(r.index, r.id, r.ok) for r in want]
    assert many[3].error.code == grpc.StatusCode.INVALID_ARGUMENT == want[3].error.code
    assert many[3].error.message == want[3].error.message
    for got, ref in zip(many, want, strict=True):
        for name in (ref.features or {}):
            np.testing.assert_allclose(got.features[name], ref.features[name], **TOL)
            assert got.features[name].flags.writeable
    for got, ref in zip([a, *maps], [want_maps[0], *want_maps], strict=True):
        np.testing.assert_allclose(got.map, ref.map, **TOL)
        assert (got.target, got.top5[0].index, got.geometry) == (
            ref.target, ref.top5[0].index, ref.geometry)


def test_errors_are_the_sync_clients_typed_errors(server, imgs):
    async def main():
        async with hookserve.aio.Client(server.address, timeout=60) as c:
            with pytest.raises(hookserve.NotFound, match="unknown model 'nope'"):
                await c.describe("nope")
            with pytest.raises(hookserve.InvalidArgument, match="closest valid layers"):
                await c.extract(imgs[0], ["layer4.1.con2"])
            with pytest.raises(hookserve.InvalidArgument, match="closest valid layers"):
                async for _ in c.extract_many(imgs, ["layer4.1.con2"]):
                    pass
            with pytest.raises(hookserve.InvalidArgument, match="not a recognised image"):
                await c.extract(b"\x00" * 64, ["conv1"])
            with pytest.raises(hookserve.InvalidArgument, match="could not read image"):
                await c.attribute("/nonexistent/x.png", "layer4")
            with pytest.raises(ValueError, match="reduction must be one of"):
                c.extract_many(imgs, ["conv1"], reduction="mean")   # at the call
            with pytest.raises(ValueError, match="crop must be HxW"):
                await c.extract(imgs[0], ["conv1"], crop="big")

    run(main())


def test_extract_many_is_lazy_and_windowed_over_sync_and_async_sources(server, imgs):
    pulled = []

    def sync_source():
        for i in itertools.count():
            pulled.append(i)
            yield imgs[i % len(imgs)]

    async def async_source():
        for i in range(10):
            await asyncio.sleep(0)
            yield imgs[i % len(imgs)]

    async def main():
        async with hookserve.aio.Client(server.address, timeout=60) as c:
            it = c.extract_many(sync_source(), ["conv1"], reduction="avg", max_in_flight=3)
            assert pulled == []                      # nothing before the first await
            async with contextlib.aclosing(it):
                first = await anext(it)
                assert first.ok and len(pulled) <= 3
                for _ in range(5):
                    await anext(it)
                assert len(pulled) <= 6 + 3          # answered + the window, no more
            got = [r.index async for r in c.extract_many(async_source(), ["conv1"],
                                                         reduction="avg")]
            assert got == list(range(10))

    run(main())


def test_failover_mid_stream_loses_and_duplicates_no_image(make_server):
    a = make_server(*R18, *METRICS, "--max-batch-size", "2", "--max-batch-delay-ms", "1")
    b = make_server(*R18, *METRICS)
    data = [rand_image(64, 64, i) for i in range(40)]
    with b.client(timeout=120) as cb:
        ref = [r.features["layer4"] for r in cb.extract_many(data, "layer4", reduction="avg")]
    b_before = answered(b)

    async def main():
        async with hookserve.aio.Client([a.address, b.address], timeout=120,
                                        max_in_flight=8) as c:
            c._endpoints._rr = itertools.count(0)   # the stream starts on A
            it = c.extract_many(data, "layer4", reduction="avg")
            results = [await anext(it)]
            stopping = asyncio.create_task(asyncio.to_thread(a.stop, 30.0))  # drain A
            results += [r async for r in it]
            await stopping
            moved = answered(b) - b_before
            # A is down now: a new call goes to B at once, and so does a new stream.
            assert (await c.list_models())[0].name == "resnet18"
            again = [r async for r in c.extract_many(data[:3], "layer4", reduction="avg")]
            return results, moved, again

    results, moved, again = run(main())
    assert [r.index for r in results] == list(range(40))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    for r in results:
        np.testing.assert_allclose(r.features["layer4"], ref[r.index], **TOL)
    assert 0 < moved < 40, moved            # A answered what it had admitted, B the rest
    assert [r.ok for r in again] == [True] * 3


def test_a_dead_address_is_skipped_and_all_dead_is_unavailable(make_server, imgs):
    live = make_server(*R18)

    async def main():
        async with hookserve.aio.Client(["127.0.0.1:9", live.address], retries=2,
                                        timeout=30) as c:
            for _ in range(4):
                assert (await c.describe()).model.name == "resnet18"
                assert [r.ok async for r in c.extract_many(imgs[:2], "conv1")] == [True] * 2
        async with hookserve.aio.Client(["127.0.0.1:9", "127.0.0.1:10"], retries=1,
                                        retry_backoff=0.01, timeout=5) as c:
            with pytest.raises(hookserve.Unavailable):
                await c.list_models()
            with pytest.raises(hookserve.Unavailable):
                async for _ in c.extract_many(imgs, "conv1"):
                    pass

    run(main())


def test_token_and_tls(token_server, pki, make_server, monkeypatch):
    monkeypatch.delenv("HOOKSERVE_TOKEN", raising=False)
    tls = make_server(*R18, "--max-batch-delay-ms", "2", "--tls-cert", str(pki["server"].cert_path),
                      "--tls-key", str(pki["server"].key_path))
    img = rand_image(32, 32)

    async def main():
        async with hookserve.aio.Client(token_server.address, token=TOKEN) as c:
            assert (await c.extract(img, "conv1", reduction="avg"))["conv1"].shape == (64,)
        for token in (None, "wrong"):
            async with hookserve.aio.Client(token_server.address, token=token) as c:
                with pytest.raises(hookserve.Unauthenticated):
                    await c.list_models()
                with pytest.raises(hookserve.Unauthenticated):
                    async for _ in c.extract_many([img], "conv1"):
                        pass
                assert await c.health() == "SERVING"      # health stays open
        monkeypatch.setenv("HOOKSERVE_TOKEN", TOKEN)
        async with hookserve.aio.Client(token_server.address) as c:
            assert len(await c.list_models()) == 1
        async with hookserve.aio.Client(f"grpcs://localhost:{tls.port}", timeout=30,
                                        root_certificates=pki["server_ca"].path) as c:
            assert [m.name for m in await c.list_models()] == ["resnet18"]
            assert [r.ok async for r in c.attribute_many([img], "layer4")] == [True]
        async with hookserve.aio.Client(tls.address, timeout=5, retries=0) as c:  # plaintext
            with pytest.raises(hookserve.Unavailable):
                await c.list_models()

    run(main())


def test_timeouts_bound_every_call(server, silent_address, imgs):
    async def main():
        # A listener that never answers: a unary call can only end at its deadline.
        async with hookserve.aio.Client(silent_address, timeout=0.3, retries=0) as c:
            for call in (c.list_models, c.describe, c.health):
                t0 = time.monotonic()
                with pytest.raises(hookserve.DeadlineExceeded):
                    await call()
                assert time.monotonic() - t0 < 10
        async with hookserve.aio.Client(server.address, timeout=1e-3) as c:
            for one in (c.extract(imgs[0], "layer4"), c.attribute(imgs[0], "layer4")):
                with pytest.raises(hookserve.DeadlineExceeded):
                    await one
        async with hookserve.aio.Client(server.address, timeout=60) as c:
            for stream in (c.extract_many(imgs * 20, "layer4", timeout=1e-3),
                           c.attribute_many(imgs * 20, "layer4", timeout=1e-3)):
                with pytest.raises(hookserve.DeadlineExceeded):
                    async for _ in stream:
                        pass

    run(main())


@pytest.mark.parametrize("how", ["aclose", "cancel the task"])
def test_cancelling_the_iterator_cancels_the_call(make_server, how):
    s = make_server(*R18, *METRICS, "--max-batch-size", "2", "--max-batch-delay-ms", "1")
    data = [rand_image(64, 64, i) for i in range(200)]

    async def main():
        async with hookserve.aio.Client(s.address, timeout=120) as c:
            await c.extract(data[0], "layer4", reduction="avg")     # warm
            base = computed(s)
            it = c.extract_many(data, "layer4", reduction="avg", max_in_flight=8)
            if how == "aclose":
                assert (await anext(it)).ok
                await it.aclose()
            else:
                first = asyncio.Event()

                async def consume():
                    async for r in it:
                        assert r.ok
                        first.set()

                task = asyncio.create_task(consume())
                await first.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # waited for in a thread: the loop goes on meanwhile
            for cond, what in [(lambda: calls(s, "CANCELLED") == 1, "the call to be cancelled"),
                               (lambda: s.server.stream_caps.work_streams == 0, "no open stream"),
                               (lambda: s.engine.queued == 0, "queued images dropped")]:
                await asyncio.to_thread(wait_until, cond, 30, what)
            # The window bounds what was sent: nothing beyond it was computed.
            assert computed(s) - base <= 8 + 2
            # The client goes on working after a cancelled stream.
            assert [r.ok async for r in c.extract_many(data[:3], "conv1")] == [True] * 3

    run(main())
    assert s.engine.hook_count() == 0


def test_a_server_without_extract_image_gets_a_stream(server, client, imgs):
    """Both clients fall back to an Extract stream when ExtractImage is UNIMPLEMENTED
    (a server that predates it: here a proxy that forwards Extract only)."""
    from concurrent import futures

    upstream = grpc.insecure_channel(server.address)
    forward = upstream.stream_stream("/hookserve.v1.FeatureExtractor/Extract",
                                     request_serializer=None, response_deserializer=None)
    proxy = grpc.server(futures.ThreadPoolExecutor(4))
    proxy.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "hookserve.v1.FeatureExtractor",
        {"Extract": grpc.stream_stream_rpc_method_handler(
            lambda requests, ctx: forward(requests, timeout=60))})])
    port = proxy.add_insecure_port("127.0.0.1:0")
    proxy.start()
    try:
        want = client.extract(imgs[0], "layer2", reduction="avg")["layer2"]
        with hookserve.Client(f"127.0.0.1:{port}", timeout=60) as c:
            for _ in range(2):
                np.testing.assert_allclose(
                    c.extract(imgs[0], "layer2", reduction="avg")["layer2"], want, **TOL)
            assert c._image_rpc is False

        async def main():
            async with hookserve.aio.Client(f"127.0.0.1:{port}", timeout=60) as c:
                for _ in range(2):
                    got = await c.extract(imgs[0], "layer2", reduction="avg")
                    np.testing.assert_allclose(got["layer2"], want, **TOL)
                assert c._image_rpc is False
                with pytest.raises(hookserve.InvalidArgument, match="not a recognised"):
                    await c.extract(b"junk", "layer2")

        run(main())
    finally:
        proxy.stop(0)
        upstream.close()
