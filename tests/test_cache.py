"""The answer cache on a real server: what hits and what misses, bit-for-bit answers,
single-flight, the LRU bound, and the shared Redis tier (a real redis-server).

Forwards are counted by the server's own Prometheus metrics (images per forward pass,
`hookserve_batch_size_sum`), cache outcomes by `hookserve_cache_events_total`.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hookserve import Layer

from conftest import RunningServer, encode, rand_image
from helpers import CACHE_BASE as BASE
from helpers import Counting, events, one, sample, shared_server


@pytest.fixture(scope="module")
def cached_server():
    s = RunningServer([*BASE, "--cache-bytes", "64MiB"])
    yield s
    s.stop(2.0)


@pytest.fixture
def cc(cached_server):
    with cached_server.client(timeout=120) as c:
        yield c


def test_second_answer_comes_from_cache_bit_for_bit(cached_server, cc):
    img = rand_image(seed=101)
    n = Counting(cached_server)
    fresh = one(cc, img, ["layer1", "fc"])
    assert fresh.cached == frozenset() and not fresh.from_cache
    again = one(cc, img, ["layer1", "fc"])
    assert again.cached == {"layer1", "fc"} and again.from_cache
    for name in ("layer1", "fc"):
        assert again.features[name].dtype == fresh.features[name].dtype
        assert again.features[name].tobytes() == fresh.features[name].tobytes()
    assert n.forwards == 1 and n.miss == 2 and n.hit == 2
    # ExtractImage (one image, no stream) takes the same cache.
    assert cc.extract(img, ["fc"])["fc"].tobytes() == fresh.features["fc"].tobytes()
    assert n.forwards == 1 and n.hit == 3


def _one_byte_off(img: np.ndarray) -> np.ndarray:
    out = img.copy()
    out[10, 10, 1] ^= 1
    return out


@pytest.mark.parametrize("what, image, layers, kw", [
    ("one byte of the image", _one_byte_off, [Layer("layer2", "avg")], {}),
    ("layer", None, [Layer("layer3", "avg")], {}),
    ("reduction", None, [Layer("layer2", "max")], {}),
    ("dtype", None, [Layer("layer2", "avg", dtype="float16")], {}),
    ("L2", None, [Layer("layer2", "avg", l2_normalize=True)], {}),
    ("resize", None, [Layer("layer2", "avg")], {"resize": 160, "crop": 128}),
    ("native", None, [Layer("layer2", "avg")], {"native": True}),
])
def test_each_part_of_the_key_misses(cached_server, cc, what, image, layers, kw):
    img = rand_image(seed=202)
    one(cc, img, [Layer("layer2", "avg")])  # the reference answer (cached now)
    assert one(cc, img, [Layer("layer2", "avg")]).from_cache
    n = Counting(cached_server)
    r = one(cc, image(img) if image else img, layers, **kw)
    assert r.cached == frozenset(), f"a different {what} must not hit"
    assert n.forwards == 1 and n.miss == 1 and n.hit == 0


def test_the_key_is_the_resolved_preprocessing(cached_server, cc):
    """The model's default geometry, asked for explicitly, is the same answer."""
    img = rand_image(seed=303)
    first = one(cc, img, [Layer("layer4", "avg")])
    explicit = one(cc, img, [Layer("layer4", "avg")], resize=256, crop=224)
    assert explicit.from_cache
    assert explicit.features["layer4"].tobytes() == first.features["layer4"].tobytes()


def test_partial_reuse_computes_only_the_new_layer(cached_server, cc):
    img = rand_image(seed=404)
    a = one(cc, img, [Layer("layer1", "avg")])
    n = Counting(cached_server)
    ab = one(cc, img, [Layer("layer1", "avg"), Layer("layer3", "avg")])
    assert ab.cached == {"layer1"}
    assert list(ab.features) == ["layer1", "layer3"]  # the spec's order
    assert ab.features["layer1"].tobytes() == a.features["layer1"].tobytes()
    # one forward, for layer3 only: one miss, one hit
    assert n.forwards == 1 and n.miss == 1 and n.hit == 1
    # and layer3 alone now hits too
    assert one(cc, img, [Layer("layer3", "avg")]).from_cache


def test_single_flight_16_concurrent_identical_requests(cached_server):
    img = rand_image(seed=505)
    n = Counting(cached_server)
    start = threading.Barrier(16)
    results: list = [None] * 16

    def call(i: int) -> None:
        with cached_server.client(timeout=120) as c:
            start.wait()
            results[i] = c.extract(img, ["layer4"])["layer4"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    assert n.forwards == 1 and n.miss == 1
    assert n.hit + n.coalesced == 15


def test_attribute_answers_are_cached_keyed_on_method_target_and_steps(cached_server, cc):
    img = rand_image(seed=550)
    engine = cached_server.engine
    passes = engine.attribution_passes
    fresh = cc.attribute(img, "layer4", "grad_cam", target=3)
    assert fresh.ok and not fresh.cached
    again = cc.attribute(img, "layer4", "grad_cam", target=3)
    assert again.cached and engine.attribution_passes == passes + 1
    assert again.map.tobytes() == fresh.map.tobytes()
    assert again.targets == fresh.targets and again.top5 == fresh.top5
    # Each of these is another answer: computed, not served.
    for kw in ({"method": "layer_cam"}, {"target": 4}, {"layer": "layer3"}):
        args = {"layer": "layer4", "method": "grad_cam", "target": 3, **kw}
        assert not cc.attribute(img, **args).cached, kw
    ig = cc.attribute(img, None, "integrated_gradients", target=3, steps=4)
    assert not cc.attribute(img, None, "integrated_gradients", target=3, steps=5).cached
    assert cc.attribute(img, None, "integrated_gradients", target=3, steps=4).cached
    assert not ig.cached
    # An Extract answer of the same image is not an Attribute one, and back.
    assert not one(cc, img, ["layer4"]).cached


def test_batch_over_duplicates_forwards_each_unique_file_once(cached_server, tmp_path,
                                                             capsys):
    """`hookserve batch` over a folder where half the files repeat others: one forward
    per unique file (single-flight in the run, the cache after it); one row per input,
    duplicates recognisable by their sha256; a rerun into a new output computes none."""
    import pyarrow.parquet as pq

    from hookserve.cli import main

    root = tmp_path / "in"
    root.mkdir()
    for i in range(6):
        data = encode(rand_image(seed=900 + i))
        (root / f"u{i}.png").write_bytes(data)
        (root / f"z{i}.png").write_bytes(data)
    n = Counting(cached_server)
    for run in ("first", "rerun"):
        out = str(tmp_path / f"{run}.parquet")
        assert main(["batch", str(root), "--out", out, "--layers", "layer4:avg,fc",
                     "--server", cached_server.address, "--no-progress"]) == 0
        assert "done 12, skipped 0, failed 0" in capsys.readouterr().err
        t = pq.read_table(out)
        sha = dict(zip((os.path.basename(p) for p in t.column("path").to_pylist()),
                       t.column("sha256").to_pylist(), strict=True))
        assert len(sha) == 12 and len(set(sha.values())) == 6
        assert all(sha[f"u{i}.png"] == sha[f"z{i}.png"] for i in range(6))
        assert n.forwards == 6, run


def test_lru_bound_holds(make_server):
    # layer4 unreduced at 224x224: 512x7x7 float32 = 100352 bytes an entry
    s = make_server(*BASE, "--cache-bytes", "256KiB")
    cache = s.engine.cache.local
    with s.client(timeout=120) as c:
        imgs = [rand_image(seed=600 + i) for i in range(5)]
        for img in imgs:
            one(c, img, ["layer4"])
            assert cache.bytes <= 256 * 1024
        assert len(cache) == 2
        assert events(s)["eviction"] == 3
        assert sample(s, "hookserve_cache_bytes", tier="local") == cache.bytes
        assert one(c, imgs[-1], ["layer4"]).from_cache
        assert not one(c, imgs[0], ["layer4"]).from_cache  # evicted: computed again


def test_cache_flags_are_checked(make_server):
    from hookserve_server.errors import ConfigError

    with pytest.raises(ConfigError, match="half of --max-buffer-bytes"):
        make_server(*BASE, "--cache-bytes", "1G", "--max-buffer-bytes", str(1 << 30))
    with pytest.raises(ConfigError, match="redis://HOST:PORT"):
        make_server(*BASE, "--cache-url", "http://example:6379")
    for bad in ("12XB", "inf", "nan", "MiB"):
        with pytest.raises(SystemExit):
            make_server(*BASE, "--cache-bytes", bad)


# -- the shared tier: a real redis-server (conftest's redis_server) ----------------

def test_two_replicas_share_redis_and_weights_are_in_the_key(make_server, redis_server):
    first = shared_server(make_server, redis_server, "--cache-bytes", "16MiB")
    second = shared_server(make_server, redis_server)  # no local tier: Redis alone
    other = shared_server(make_server, redis_server, "--seed", "1")  # other weights
    imgs = [rand_image(seed=700 + i) for i in range(4)]
    layers = [Layer("layer2", "avg"), "fc"]
    with first.client(timeout=120) as c:
        fresh = list(c.extract_many(imgs, layers))
    assert not any(r.cached for r in fresh)
    assert first.engine.cache.shared.flush()
    n = Counting(second, "shared")
    with second.client(timeout=120) as c:
        again = list(c.extract_many(imgs, layers))
    assert all(r.from_cache for r in again)
    for a, b in zip(fresh, again, strict=True):
        for name in a.features:
            assert a.features[name].tobytes() == b.features[name].tobytes()
    assert n.forwards == 0 and n.hit == 8 and n.miss == 0
    n = Counting(other, "shared")
    with other.client(timeout=120) as c:
        stale = list(c.extract_many(imgs, layers))
    assert not any(r.cached for r in stale), "other weights must never hit"
    assert n.forwards == 4 and n.miss == 8


def test_redis_killed_mid_run_requests_go_on_as_misses(make_server, redis_server):
    s = shared_server(make_server, redis_server, "--cache-timeout-ms", "200")
    with s.client(timeout=120) as c:
        one(c, rand_image(seed=800), ["fc"])
        assert s.engine.cache.shared.flush()
        assert one(c, rand_image(seed=800), ["fc"]).from_cache
        redis_server.kill()
        n = Counting(s, "shared")
        results = list(c.extract_many([rand_image(seed=801 + i) for i in range(3)] +
                                      [rand_image(seed=800)], ["fc"]))
    assert all(r.ok and not r.cached for r in results)
    assert n.forwards == 4 and n.miss == 4
    assert n.error >= 4  # each lookup failed or was skipped, and said so


def test_a_stopped_redis_is_a_miss_after_the_timeout(make_server, redis_server):
    """A Redis that takes connections and never answers (SIGSTOP): lookups time out,
    the images are computed, and the timeouts are counted."""
    import signal

    s = shared_server(make_server, redis_server, "--cache-timeout-ms", "200")
    with s.client(timeout=120) as c:
        one(c, rand_image(seed=850), ["fc"])  # a connection is open before the stop
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            n = Counting(s, "shared")
            results = list(c.extract_many([rand_image(seed=851 + i) for i in range(3)],
                                          ["fc"]))
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
    assert all(r.ok and not r.cached for r in results)
    assert n.forwards == 3 and n.miss == 3 and n.error >= 3


def test_redis_values_have_a_ttl_and_a_size_cap(make_server, redis_server):
    import redis

    s = shared_server(make_server, redis_server, "--cache-ttl-seconds", "600",
                      "--cache-max-value-bytes", "64KiB")
    with s.client(timeout=120) as c:
        # fc: 1000 float32 = 4000 bytes, kept; layer4 unreduced: 100352 bytes, over the cap
        one(c, rand_image(seed=870), ["fc", "layer4"])
    assert s.engine.cache.shared.flush()
    db = redis.Redis(port=redis_server.port)
    keys = db.keys("hookserve:*")
    assert len(keys) == 1
    assert 0 < db.ttl(keys[0]) <= 600
    db.close()


def test_waiters_start_over_when_the_computation_they_followed_was_cancelled(cached_server):
    """Single-flight's failure rule, on the cache itself with the server's real model
    and spec, and a compute step the test finishes by hand: a computation that ends for
    its own call's reason (cancelled) sends its waiters to compute for themselves; an
    error about the bytes (INVALID_ARGUMENT) is theirs too."""
    from concurrent.futures import Future

    from hookserve_server.cache.front import AnswerCache
    from hookserve_server.cache.local import LocalCache
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import Cancelled, InvalidArgument
    from hookserve_server.spec import DType, ExtractionSpec, ImageInput, LayerOutput, LayerSpec

    spec = cached_server.engine.resolve(ExtractionSpec("resnet18", (LayerSpec("fc"),)))
    cache = AnswerCache(LocalCache(1 << 20))
    computing: list[Future] = []
    started = threading.Semaphore(0)

    def compute(part, fut: Future) -> None:
        computing.append(fut)
        started.release()

    image = ImageInput("x", raw=bytes(12), height=2, width=2)
    leader_call = CallState()
    a, b = Future(), Future()
    cache.submit(spec, image, leader_call, a, compute, (2, 2))
    cache.submit(spec, image, CallState(), b, compute, (2, 2))
    assert started.acquire(timeout=5) and len(computing) == 1  # b waits on a's work
    leader_call.cancel()
    computing[0].set_exception(Cancelled("the call was cancelled"))
    assert isinstance(a.exception(timeout=5), Cancelled)  # the leader's own error
    assert started.acquire(timeout=5) and len(computing) == 2  # b computes for itself
    value = LayerOutput("fc", DType.FLOAT32, (1,), memoryview(bytes(4)))
    computing[1].set_result([value])
    assert b.result(timeout=5) == [value]
    c: Future = Future()
    cache.submit(spec, image, CallState(), c, compute, (2, 2))
    assert c.result(timeout=5)[0].cached and len(computing) == 2

    other = ImageInput("y", raw=bytes(range(12)), height=2, width=2)
    d, e = Future(), Future()
    cache.submit(spec, other, CallState(), d, compute, (2, 2))
    cache.submit(spec, other, CallState(), e, compute, (2, 2))
    assert started.acquire(timeout=5) and len(computing) == 3
    computing[2].set_exception(InvalidArgument("the image is corrupt"))
    assert isinstance(d.exception(timeout=5), InvalidArgument)
    assert isinstance(e.exception(timeout=5), InvalidArgument)
    assert len(computing) == 3  # nobody computed it again
    cache.close()
