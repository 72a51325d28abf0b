"""The answer cache's bounds on a real server: a wait on another call's computation
ends with the waiting call's own deadline or cancel, the Redis write queue is bounded by
bytes and counted in the budget, values read from Redis are checked, stored values own
their memory, and the key parts test_cache.py does not cover.

A long Integrated Gradients request (many steps, no deadline) is the computation other
calls wait on: it runs for seconds, in passes, so those calls are held concurrently.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

import hookserve
from hookserve import Layer

from conftest import encode, rand_image
from helpers import CACHE_BASE as BASE
from helpers import Counting, one, sample, shared_server

IG = dict(layer=None, method="integrated_gradients", target=3, steps=300)
SIZE = (32, 32)  # the model input the direct submits below give (no shared tier reads it)


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_leader(server, img) -> threading.Thread:
    """A long IG computation of `img` with no deadline, on a thread; returns once the
    model's thread runs its passes."""
    passes = server.engine.attribution_passes

    def lead() -> None:
        try:
            with server.client(timeout=600) as c:
                c.attribute(img, **IG)
        except hookserve.HookserveError:
            pass  # the server is stopped under it at the end of the test

    t = threading.Thread(target=lead, daemon=True)
    t.start()
    wait_until(lambda: server.engine.attribution_passes > passes, "the leader's passes")
    return t


def test_a_waiter_leaves_at_its_own_deadline_not_the_leaders(make_server):
    s = make_server(*BASE, "--cache-bytes", "16MiB", "--max-streams", "3")
    img = rand_image(seed=1)
    n = Counting(s)
    leader = start_leader(s, img)
    with s.client(timeout=1.5) as c, pytest.raises(hookserve.HookserveError):
        c.attribute(img, **IG)  # the same answer: it waits on the leader's computation
    assert n.coalesced == 1
    # The server lets go of the waiter (its stream, thread and bytes) at its deadline,
    # while the leader still computes.
    wait_until(lambda: s.server.stream_caps.work_streams == 1, "the waiter's stream to end")
    assert leader.is_alive()


def test_a_waiter_without_a_deadline_leaves_the_deadlines_of_others_kept(make_server):
    """A call with no deadline (grpcio says some 9.2e18 s remain) waits without one:
    taken as a deadline, it ended the thread that enforces every other waiter's."""
    s = make_server(*BASE, "--cache-bytes", "16MiB", "--max-streams", "4")
    img = rand_image(seed=2)
    n = Counting(s)
    leader = start_leader(s, img)

    def patient() -> None:
        try:
            with server_client(s) as c:
                c.attribute(img, **IG)
        except hookserve.HookserveError:
            pass  # the server is stopped under it at the end of the test

    threading.Thread(target=patient, daemon=True).start()
    wait_until(lambda: n.coalesced == 1, "the waiter without a deadline to wait")
    with s.client(timeout=1.5) as c, pytest.raises(hookserve.DeadlineExceeded):
        c.attribute(img, **IG)
    assert n.coalesced == 2
    # the server lets go of the waiter with a deadline; the other two go on
    wait_until(lambda: s.server.stream_caps.work_streams == 2, "the waiter's stream to end")
    assert leader.is_alive()
    thread = s.engine.cache.deadlines._thread
    assert thread is not None and thread.is_alive()   # still there for the next waiter


def server_client(server) -> hookserve.Client:
    """A client of `server` whose calls carry no deadline."""
    return server.client(timeout=None)


def test_single_flight_holds_concurrent_requests_on_one_computation(make_server):
    s = make_server(*BASE, "--cache-bytes", "16MiB")
    img = rand_image(seed=3)
    n = Counting(s)
    spec = dict(IG, steps=100)
    passes, jobs = s.engine.attribution_passes, s.engine.attribution_jobs[0]
    results: list = [None] * 8

    def call(i: int) -> None:
        with s.client(timeout=300) as c:
            results[i] = c.attribute(img, **spec)

    first = threading.Thread(target=call, args=(0,))
    first.start()
    wait_until(lambda: s.engine.attribution_passes > passes, "the first call's passes")
    rest = [threading.Thread(target=call, args=(i,)) for i in range(1, 8)]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join()
    assert all(r is not None and r.ok for r in results)
    assert all(r.map.tobytes() == results[0].map.tobytes() for r in results)
    assert n.miss == 1 and n.coalesced >= 1 and n.coalesced + n.hit == 7
    assert s.engine.attribution_jobs[0] - jobs == 1  # one computation


def test_stored_values_own_their_bytes(make_server):
    """A cached value is a copy in ordinary memory, not a view of a batch's buffer
    (pinned on CUDA): it holds, and counts, exactly its own bytes."""
    s = make_server(*BASE, "--cache-bytes", "16MiB", "--max-batch-size", "4",
                    "--max-batch-delay-ms", "200")
    with s.client(timeout=120) as c:
        for r in c.extract_many([rand_image(seed=10 + i) for i in range(4)],
                                ["layer3", "fc"]):
            r.raise_for_error()
    entries = list(s.engine.cache.local._entries.values())
    assert len(entries) == 8
    for v in entries:
        assert isinstance(v.data.obj, bytes) and len(v.data.obj) == v.nbytes
        assert not np.shares_memory(np.frombuffer(v.data, np.uint8),
                                    np.frombuffer(entries[0].data, np.uint8)) or v is entries[0]


@pytest.mark.parametrize("what, kw", [
    ("score", {"score": "softmax"}),
    ("baseline", {"baseline": "black"}),
    ("steps", {"steps": 5}),
])
def test_each_part_of_the_attribute_key_misses(make_server, what, kw):
    s = make_server(*BASE, "--cache-bytes", "16MiB")
    img = rand_image(seed=20)
    ref = dict(layer=None, method="integrated_gradients", target=3, steps=4)
    with s.client(timeout=120) as c:
        assert not c.attribute(img, **ref).cached
        assert c.attribute(img, **ref).cached
        assert not c.attribute(img, **{**ref, **kw}).cached, f"another {what} must miss"
        sg = dict(layer=None, method="smooth_grad", target=3, samples=2)
        assert not c.attribute(img, **sg, seed=1).cached
        assert c.attribute(img, **sg, seed=1).cached
        assert not c.attribute(img, **sg, seed=2).cached, "another seed must miss"
        top = dict(layer="layer4", method="grad_cam")
        assert not c.attribute(img, **top, top_k=1).cached
        assert not c.attribute(img, **top, top_k=2).cached, "another top_k must miss"


def test_raw_pixels_and_their_encoding_are_other_keys_and_stats_is_a_reduction(make_server):
    s = make_server(*BASE, "--cache-bytes", "16MiB")
    img = rand_image(seed=30)
    with s.client(timeout=120) as c:
        raw = one(c, img, [Layer("layer2", "avg")])
        assert not raw.cached
        assert one(c, img, [Layer("layer2", "avg")]).from_cache
        png = one(c, encode(img), [Layer("layer2", "avg")])
        assert not png.cached, "encoded bytes are another key than the raw pixels"
        assert one(c, encode(img), [Layer("layer2", "avg")]).from_cache
        stats = one(c, img, [Layer("layer2", "stats")])
        assert not stats.cached
        again = one(c, img, [Layer("layer2", "stats")])
        assert again.from_cache
        assert again.features["layer2"].tobytes() == stats.features["layer2"].tobytes()


def test_the_cache_comes_out_of_the_buffer_budget(make_server, redis_server):
    local = make_server(*BASE, "--cache-bytes", "8MiB", "--max-buffer-bytes", str(256 << 20))
    assert local.engine.budget.capacity == (256 << 20) - (8 << 20)
    both = shared_server(make_server, redis_server, "--cache-bytes", "8MiB",
                         "--max-buffer-bytes", str(256 << 20))
    queue = both.engine.cache.shared.queue_bytes
    assert queue == 32 << 20
    assert both.engine.budget.capacity == (256 << 20) - (8 << 20) - queue


def test_the_redis_write_queue_is_bounded_by_bytes(make_server, redis_server):
    """Redis stopped (SIGSTOP): the writer is stuck on one write; what does not fit the
    queue's bytes is dropped and counted, never held."""
    import signal

    from hookserve_server.spec import DType, LayerOutput

    s = shared_server(make_server, redis_server, "--cache-max-value-bytes", "16MiB")
    shared = s.engine.cache.shared
    value = LayerOutput("fc", DType.FLOAT32, (3 << 20,), memoryview(bytes(12 << 20)))
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        for i in range(6):
            shared.put(bytes([i]) * 32, value)
            assert shared.queued_bytes <= shared.queue_bytes
        dropped = sample(s, "hookserve_cache_events_total", tier="shared", event="dropped")
        assert dropped >= 2  # 72 MiB offered, 32 MiB (+1) held
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert shared.flush(30)
    assert shared.queued_bytes == 0


def test_values_from_redis_are_checked(make_server, redis_server):
    import redis

    first = shared_server(make_server, redis_server)
    img = rand_image(seed=40)
    with first.client(timeout=120) as c:
        fresh = one(c, img, ["fc"])
    assert first.engine.cache.shared.flush()
    db = redis.Redis(port=redis_server.port)
    (key,) = db.keys("hookserve:*")
    db.set(key, db.get(key)[:-4])  # four bytes short of its shape
    db.close()
    second = shared_server(make_server, redis_server)
    n = Counting(second, "shared")
    with second.client(timeout=120) as c:
        again = one(c, img, ["fc"])
    assert not again.cached and n.forwards == 1 and n.error == 1 and n.miss == 1
    assert again.features["fc"].tobytes() == fresh.features["fc"].tobytes()


def test_close_writes_what_is_queued(make_server, redis_server):
    import redis

    s = shared_server(make_server, redis_server)
    with s.client(timeout=120) as c:
        one(c, rand_image(seed=50), ["fc", "layer4"])
    s.engine.cache.shared.close()
    db = redis.Redis(port=redis_server.port)
    assert len(db.keys("hookserve:*")) == 2
    db.close()


def test_a_waiter_after_close_gets_unavailable(cached_spec):
    """The cache closed (shutdown): an image whose leader's call was cancelled cannot
    start over; it gets UNAVAILABLE (retry), not the other call's CANCELLED."""
    from hookserve_server.cache.front import AnswerCache
    from hookserve_server.cache.local import LocalCache
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import Cancelled, Unavailable
    from hookserve_server.spec import ImageInput

    cache = AnswerCache(LocalCache(1 << 20))
    computing: list[Future] = []
    image = ImageInput("x", raw=bytes(12), height=2, width=2)
    leader_call, a, b = CallState(), Future(), Future()
    cache.submit(cached_spec, image, leader_call, a,
                 lambda part, f: computing.append(f), SIZE)
    cache.submit(cached_spec, image, CallState(), b,
                 lambda part, f: computing.append(f), SIZE)
    assert len(computing) == 1
    cache.close()
    leader_call.cancel()
    computing[0].set_exception(Cancelled("the call was cancelled"))
    assert isinstance(a.exception(timeout=5), Cancelled)
    assert isinstance(b.exception(timeout=5), Unavailable)


@pytest.fixture
def cached_spec(make_server):
    from hookserve_server.spec import ExtractionSpec, LayerSpec

    s = make_server(*BASE)
    return s.engine.resolve(ExtractionSpec("resnet18", (LayerSpec("fc"),)))


def test_cache_events_help_names_every_event():
    from hookserve_server.metrics import PrometheusTelemetry

    help_text = PrometheusTelemetry().cache_events._documentation
    for event in ("hit", "miss", "coalesced", "eviction", "error", "store", "dropped"):
        assert event in help_text


def test_a_layers_input_is_its_own_key(make_server):
    """layer2's input is layer1's output (same numbers), but another answer: a miss."""
    s = make_server(*BASE, "--cache-bytes", "16MiB")
    img = rand_image(seed=60)
    with s.client(timeout=120) as c:
        out = one(c, img, [Layer("layer1", "avg")])
        inp = one(c, img, [Layer("layer2:input", "avg")])
        assert not inp.cached
        assert one(c, img, [Layer("layer2:input", "avg")]).from_cache
    assert inp.features["layer2:input"].tobytes() == out.features["layer1"].tobytes()


def test_the_key_holds_the_versions_of_what_decodes_and_computes(make_server):
    import PIL
    import torchvision

    from hookserve_server import __version__
    from hookserve_server.cache import key

    s = make_server(*BASE, start=True)
    part = key.model_part(s.engine.models["resnet18"], gpu_decode=True)
    for version in (__version__, torchvision.__version__, PIL.__version__):
        assert version in part
    assert part[-1] is False  # --gpu-decode does not apply to a CPU model


def test_a_wait_ends_with_its_calls_deadline_or_cancel_on_the_cache_itself(cached_spec):
    """On the wire the server cancels a call whose deadline passed; the cache does not
    rely on it: a waiter's own deadline ends its wait too (and its cancel, at once)."""
    from hookserve_server.cache.front import AnswerCache
    from hookserve_server.cache.local import LocalCache
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import Cancelled, DeadlineExceeded
    from hookserve_server.spec import ImageInput

    cache = AnswerCache(LocalCache(1 << 20))
    computing: list[Future] = []
    image = ImageInput("x", raw=bytes(12), height=2, width=2)
    lead, late, gone = Future(), Future(), Future()
    cache.submit(cached_spec, image, CallState(), lead,
                 lambda part, f: computing.append(f), SIZE)
    cache.submit(cached_spec, image, CallState(time.monotonic() + 0.2), late,
                 lambda part, f: computing.append(f), SIZE)
    call = CallState()
    cache.submit(cached_spec, image, call, gone, lambda part, f: computing.append(f), SIZE)
    call.cancel()
    assert isinstance(gone.exception(timeout=0), Cancelled)  # at once
    assert isinstance(late.exception(timeout=30), DeadlineExceeded)
    assert len(computing) == 1 and not lead.done()  # the computation goes on
    cache.close()


def test_an_image_out_of_restarts_gets_unavailable(cached_spec):
    """An image that already started over MAX_RESTARTS times, whose computation fails
    again for another call's reason, gets UNAVAILABLE (retry), not that call's error."""
    from hookserve_server.cache.front import MAX_RESTARTS, AnswerCache
    from hookserve_server.cache.local import LocalCache
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import Cancelled, Unavailable
    from hookserve_server.spec import ImageInput

    cache = AnswerCache(LocalCache(1 << 20))
    computing: list[Future] = []
    image = ImageInput("x", raw=bytes(12), height=2, width=2)
    leader_call, a, b = CallState(), Future(), Future()
    cache.submit(cached_spec, image, leader_call, a,
                 lambda part, f: computing.append(f), SIZE)
    cache.submit(cached_spec, image, CallState(), b, lambda part, f: computing.append(f),
                 SIZE, restarts=MAX_RESTARTS)
    leader_call.cancel()
    computing[0].set_exception(Cancelled("the call was cancelled"))
    error = b.exception(timeout=5)
    assert isinstance(error, Unavailable) and "retry" in str(error)
    assert len(computing) == 1
    cache.close()


def test_replicas_with_other_class_names_share_no_attribution(make_server, redis_server,
                                                              tmp_path):
    """The same weights under other --labels: an Attribute answer (its top 5 carries the
    names) is never read from the other replica's work."""
    files = []
    for tag in ("a", "b"):
        f = tmp_path / f"{tag}.txt"
        f.write_text("".join(f"{tag}-class-{i}\n" for i in range(1000)))
        files.append(f)
    first = shared_server(make_server, redis_server, "--cache-bytes", "16MiB",
                          "--labels", f"resnet18={files[0]}")
    second = shared_server(make_server, redis_server, "--labels", f"resnet18={files[1]}")
    img = rand_image(seed=901)
    with first.client(timeout=120) as c:
        a = c.attribute(img, "layer4", "grad_cam", native=True)
        again = c.attribute(img, "layer4", "grad_cam", native=True)
    assert not a.cached and again.cached  # the first replica's own work is reused
    assert first.engine.cache.shared.flush()
    with second.client(timeout=120) as c:
        b = c.attribute(img, "layer4", "grad_cam", native=True)
    assert not b.cached, "an answer carrying other class names was read from Redis"
    assert {s.label.split("-")[0] for s in b.top5} == {"b"}
    np.testing.assert_array_equal(a.map, b.map)  # the same weights: the same map
