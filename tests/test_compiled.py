"""--compile auto: compiled extraction graphs answer like the eager hooks, never make a
request wait, stay within their bounds and fall back to eager when compiling fails.

The default suite compiles with torch.compile's "eager" backend or a custom backend
(dynamo traces the pruned graph, no code generation: seconds), and one small inductor
compile (resnet18's conv1, bn1 and relu at 64x64: seconds) that checks the graph is
frozen; the inductor tests over whole layer sets are marked slow (each compile takes
minutes on a shared 2-core machine)."""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from hookserve_server.capture.compiled import bucket, build_graph
from hookserve_server.capture.forward import capture
from hookserve_server.capture.plan import CapturePlan, CapturePoint
from hookserve_server.engine.config import CompileSettings, parse_warm
from hookserve_server.errors import ConfigError
from hookserve_server.spec import DType, LayerSpec, Reduction

from conftest import encode, rand_image

BASE = ["--model", "resnet18", "--model", "vgg11", "--weights", "random", "--seed", "0",
        "--max-batch-delay-ms", "2"]
LAYERS = {"resnet18": ["conv1:input", "relu", "layer1.0.conv2", "layer1.0.relu_1",
                       "layer2:input", "layer3", "fc"],
          "vgg11": ["features.0:input", "features.1:input", "features.1", "features.5",
                    "classifier.0:input", "classifier.6"]}
REDUCTIONS = ("none", "avg", "max", "flatten", "stats")
#: float32 answers agree within 1e-5; a float16 or bfloat16 answer is the float32 one
#: rounded, so a difference of 1e-7 may round to the neighbouring value: one unit in
#: the last place (relative to the layer's largest value) is allowed there.
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def extract(server, model, layers, images, **kw) -> list[dict[str, np.ndarray]]:
    with server.client(timeout=600) as c:
        out = list(c.extract_many(images, layers, model, **kw))
    assert all(r.error is None for r in out), [r.error for r in out]
    return [r.features for r in out]


def assert_same(got, want, tol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k].shape == w[k].shape and g[k].dtype == w[k].dtype, k
            a, b = g[k].astype(np.float64), w[k].astype(np.float64)
            scale = max(float(np.abs(b).max()), 1e-12)
            assert float(np.abs(a - b).max()) <= tol * scale, (k, np.abs(a - b).max(), scale)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [encode(rand_image(64, 64, seed=s)) for s in range(2)]


def stats(server):
    (graphs,) = server.engine.compiled
    return graphs.stats


def settle(server, timeout=600.0):
    (graphs,) = server.engine.compiled
    assert graphs.wait_idle(timeout), "compiling did not finish"


def compile_now(server, model, layers, images, **pre) -> None:
    """Ask for `layers` until a batch of them runs a compiled graph. A batch that is due
    a compile while another compile runs (the server's warm-up, say) leaves its own
    for a later batch, so one request is not always enough."""
    for _ in range(5):
        hits = stats(server).hits
        extract(server, model, layers, images, **pre)
        if stats(server).hits > hits:
            return
        settle(server)
    raise AssertionError(f"{model} {layers} never ran compiled: {stats(server)}")


def run_modes(eager, compiled, images, dtypes=("float32",), modes=None):
    """Every reduction (and dtype, preprocessing mode) of every model's layer set, on
    `compiled` after its graphs were compiled, compared with `eager`."""
    modes = modes or [{"native": True}]
    for model, layers in LAYERS.items():
        for pre in modes:
            compile_now(compiled, model, layers, images, **pre)
            hits = stats(compiled).hits
            for reduction in REDUCTIONS:
                for dtype in dtypes:
                    kw = {**pre, "reduction": reduction, "dtype": dtype}
                    assert_same(extract(compiled, model, layers, images, **kw),
                                extract(eager, model, layers, images, **kw),
                                ULP.get(dtype, 1e-5))
            assert stats(compiled).hits > hits, "the compiled graph was not used"


def test_compiled_graph_answers_equal_eager(make_server, images):
    """The pruned graph (dynamo, eager backend): the same answers for every reduction,
    `:input` (in-place ReLU inputs too) and dtype, resnet18 and vgg11."""
    eager = make_server(*BASE)
    # one image a batch: every batch has the key (batch size 1) that was compiled;
    # batches in parts and padded are checked in test_parts_and_padding_answer_alike
    compiled = make_server(*BASE, "--compile", "auto", "--compile-after", "1",
                           "--compile-backend", "eager", "--max-batch-size", "1")
    run_modes(eager, compiled, images, dtypes=("float32", "float16", "bfloat16"))
    assert stats(compiled).failures == 0


@pytest.mark.slow
def test_inductor_answers_equal_eager(make_server, images):
    """Inductor with freezing: within 1e-5 of eager for every reduction, `:input`, dtype
    and preprocessing mode (native, resize+crop; default is 224 px: the same code at
    another size), resnet18 and vgg11."""
    eager = make_server(*BASE)
    compiled = make_server(*BASE, "--compile", "auto", "--compile-after", "1",
                           "--max-batch-size", "1")
    run_modes(eager, compiled, images, dtypes=("float32", "bfloat16"),
              modes=[{"native": True}, {"resize": 72, "crop": 64}])
    s = stats(compiled)
    assert s.failures == 0 and s.compiles >= 2 and s.compile_seconds > 0


def test_a_request_during_a_compile_is_answered_by_eager(make_server, images):
    entered, release = threading.Event(), threading.Event()

    def gated(gm, example_inputs):   # a torch.compile backend that holds the compile
        entered.set()
        release.wait(600)
        return gm.forward

    eager = make_server(*BASE)
    s = make_server(*BASE)
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=gated))
    layers = LAYERS["resnet18"]
    want = extract(eager, "resnet18", layers, images[:1])
    assert_same(extract(s, "resnet18", layers, images[:1]), want)  # queues the compile
    assert entered.wait(600)
    try:
        before = stats(s).eager
        for _ in range(3):   # answered while the compile is still held
            assert_same(extract(s, "resnet18", layers, images[:1]), want)
        assert stats(s).eager == before + 3 and stats(s).hits == 0
        assert stats(s).compiles == 0 and stats(s).pending == 1
    finally:
        release.set()
    settle(s)
    assert_same(extract(s, "resnet18", layers, images[:1]), want)
    assert stats(s).compiles == 1 and stats(s).hits == 1


def test_a_failed_compile_falls_back_to_eager_logged_once(make_server, images, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no code generation here")

    eager = make_server(*BASE)
    s = make_server(*BASE)
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=broken))
    layers = LAYERS["vgg11"]
    want = extract(eager, "vgg11", layers, images)
    with caplog.at_level(logging.WARNING, logger="hookserve.compile"):
        for _ in range(3):
            assert_same(extract(s, "vgg11", layers, images), want)
            settle(s)
    assert stats(s).failures == 1 and stats(s).compiles == 0 and stats(s).hits == 0
    assert len([r for r in caplog.records if "serving it eagerly" in r.message]) == 1


def graphs_of(make_server, **settings):
    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", **{"after": 1, "backend": "eager",
                                                       **settings}))
    (graphs,) = s.engine.compiled
    m = s.engine.models["resnet18"]
    plan = CapturePlan.for_batch(m, [(LayerSpec("layer1:input"), LayerSpec("relu"))])

    def run(n: int, h: int, w: int) -> None:
        x = torch.randn(n, 3, h, w).contiguous(memory_format=torch.channels_last)
        want = capture(m, x, plan)
        got = graphs.capture(m, x, plan)
        for spec, t in want.items():
            torch.testing.assert_close(got[spec], t, rtol=1e-5, atol=1e-5)
        assert graphs.wait_idle(600)
    return graphs, run


def test_bucketing_bounds_compiles(make_server):
    graphs, run = graphs_of(make_server)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 3, 5, 1, 8):
        for h, w in [(32, 32), (40, 48), (56, 56), (64, 40)]:
            run(n, h, w)
    keys = graphs.stats.compiled_keys
    # 8 batch sizes x 4 input sizes: 4 buckets x the first 2 sizes (--compile-max-sizes),
    # each compiled once; the other two sizes stay eager
    assert {k[2] for k in keys} == {1, 2, 4, 8}
    assert {k[3] for k in keys} == {(32, 32), (40, 48)}
    assert graphs.stats.compiles == 8 == len(set(keys))
    assert graphs.stats.hits == 24 - 8 and graphs.stats.evictions == 0
    assert graphs.stats.eager == 8 + 24


def test_a_batch_runs_as_its_binary_parts_not_padded(make_server):
    """5 images run as the graphs for 4 and 1 once both are ready (no padding); before
    that, padded into the ready graph for 8, while the parts count towards compiles."""
    here = threading.current_thread()
    rows: list[int] = []

    def recording(gm, example_inputs):   # a torch.compile backend: no code generation
        def run(*args):
            if threading.current_thread() is here:   # not the compile's warm-up call
                # the images (weights are graph inputs too)
                rows.extend(a.shape[0] for a in args if isinstance(a, torch.Tensor)
                            and tuple(a.shape[1:]) == (3, 32, 32))
            return gm.forward(*args)
        return run

    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=recording))
    (graphs,) = s.engine.compiled
    m = s.engine.models["resnet18"]
    plan = CapturePlan.for_batch(m, [(LayerSpec("relu"),)])

    def run(n: int) -> list[int]:
        rows.clear()
        x = torch.randn(n, 3, 32, 32)
        want = capture(m, x, plan)
        got = graphs.capture(m, x, plan)
        for spec, t in want.items():
            torch.testing.assert_close(got[spec], t, rtol=1e-5, atol=1e-5)
        assert graphs.wait_idle(600)
        return list(rows)

    assert run(8) == []          # eager; the graph for 8 is compiled
    assert run(5) == [8]         # padded into it; 4 and 1 become due
    for _ in range(3):           # one compile at a time: 1 may follow at the next batch
        if (got := run(5)) == [4, 1]:
            break
        assert got == [8]
    assert got == [4, 1]
    assert run(7) == [8] and run(7) == [4, 2, 1]
    assert sorted(k[2] for k in graphs.stats.compiled_keys) == [1, 2, 4, 8]


def test_parts_and_padding_answer_alike(make_server):
    """Every reduction and dtype of a batch of 3 run as parts (2 + 1) and padded into
    the graph for 4 equals the eager hooks."""
    specs = tuple(LayerSpec(name, reduction=r, dtype=d)
                  for name in ("layer1:input", "relu", "layer2")
                  for r in Reduction for d in (DType.FLOAT32, DType.BFLOAT16))
    for parts in (True, False):
        s = make_server("--model", "resnet18", "--weights", "random")
        s.engine.compile_graphs(CompileSettings("auto", after=1, backend="eager",
                                                max_graphs=4 if parts else 1))
        (graphs,) = s.engine.compiled
        m = s.engine.models["resnet18"]
        plan = CapturePlan.for_batch(m, [specs])
        x = torch.randn(3, 3, 40, 40)
        want = capture(m, x, plan)
        for _ in range(6):
            hits = graphs.stats.hits
            got = graphs.capture(m, x, plan)
            assert graphs.wait_idle(600)
            if graphs.stats.hits > hits:
                break
        assert graphs.stats.hits > hits, "no compiled graph answered"
        assert sorted(k[2] for k in graphs._graphs) == ([1, 2] if parts else [4])
        for spec in specs:
            tol = 1e-5 if spec.dtype is DType.FLOAT32 else 2.0 ** -7
            torch.testing.assert_close(got[spec].float(), want[spec].float(),
                                       rtol=tol, atol=tol)


@pytest.mark.parametrize("room", [{"max_graphs": 1}, {"max_bytes": 60_000}],
                         ids=["count", "bytes"])
def test_parts_that_cannot_all_be_kept_compile_the_padded_bucket(make_server, room):
    """With room for one graph (by count, or by memory: this layer set's graph is
    estimated at 38 KB), a batch of 3 would compile 2 and 1 and each would evict the
    other, forever: once that is known the bucket's key (4) compiles instead, and then
    every batch of 3 is a hit. (Before the first compile ends a graph's size is
    unknown, so both parts may be queued: at most 3 compiles.)"""
    graphs, run = graphs_of(make_server, after=2, **room)
    for _ in range(12):
        run(3, 32, 32)
    assert all(30_000 < b <= 60_000 for _, b, _ in graphs._graphs.values())
    s = graphs.stats
    assert s.compiles <= 3 and s.evictions <= 2, s
    assert [k[2] for k in graphs._graphs] == [4]
    hits = s.hits
    for _ in range(3):
        run(3, 32, 32)
    assert graphs.stats.hits == hits + 3 and graphs.stats.compiles == s.compiles


def test_the_cache_bound_holds(make_server):
    graphs, run = graphs_of(make_server, max_graphs=2, max_sizes=8)
    for h in (32, 40, 48, 32):
        run(1, h, h)
    assert graphs.stats.compiles == 4 and graphs.stats.evictions == 2
    assert len(graphs._graphs) == 2
    # a graph over the memory bound alone is not kept: its batches stay eager (and
    # right: `run` compares them with the eager hooks)
    graphs, run = graphs_of(make_server, max_bytes=1, max_sizes=8)
    for h in (32, 40, 32):
        run(2, h, h)
    assert graphs.stats.compiles == 0 and graphs.stats.failures == 1   # (at any size)
    assert len(graphs._graphs) == 0 and graphs.stats.graph_bytes == 0


def test_graphs_that_do_not_fit_together_do_not_compile_without_end(make_server):
    """Two keys taking turns with room for one graph: each is dropped and compiled
    again MAX_EVICTIONS times at most, then served eagerly (they recompiled for ever)."""
    from hookserve_server.engine.compiled import MAX_EVICTIONS

    graphs, run = graphs_of(make_server, max_graphs=1, max_sizes=8)
    for _ in range(12):
        for h in (32, 40):
            run(1, h, h)
    compiles, hits = graphs.stats.compiles, graphs.stats.hits
    assert 2 < compiles <= 2 * (1 + MAX_EVICTIONS)
    for _ in range(6):
        for h in (32, 40):
            run(1, h, h)
    assert graphs.stats.compiles == compiles   # bounded for good
    assert graphs.stats.hits - hits == 6   # the key left in the LRU runs its graph


def test_what_is_remembered_per_key_and_layer_set_is_bounded(make_server):
    """Clients choose layer sets and (native mode) input sizes: a stream of new ones,
    each seen once, never grows the counts beyond `max_tracked`; nor do the sizes,
    estimates and failures of many layer sets. Counting still works for the recent."""
    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=2, backend="eager", max_tracked=4))
    (graphs,) = s.engine.compiled
    m = s.engine.models["resnet18"]
    names = [n for n in m.layer_index if n.startswith("layer1")][:6]
    for i, name in enumerate(names):
        for side in (32, 40, 48):
            x = torch.randn(1 + i % 3, 3, side, side)
            graphs.capture(m, x, CapturePlan.for_batch(m, [(LayerSpec(name),)]))
    assert len(names) == 6 and len(graphs._seen) == 4, len(graphs._seen)
    assert graphs.stats.compiles == 0 and graphs.wait_idle(600)
    # the most recent keys are still counted: the last batch (3 images, run as 2 + 1)
    # counted the key of 1 image at 48x48, and a second batch of that key compiles it
    graphs.capture(m, torch.randn(1, 3, 48, 48),
                   CapturePlan.for_batch(m, [(LayerSpec(names[-1]),)]))
    assert graphs.wait_idle(600) and graphs.stats.compiles == 1

    def broken(gm, example_inputs):
        raise RuntimeError("no code generation here")

    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=broken, max_tracked=2,
                                            max_graphs=2))
    (graphs,) = s.engine.compiled
    m = s.engine.models["resnet18"]
    for name in names:
        x = torch.randn(1, 3, 32, 32)
        graphs.capture(m, x, CapturePlan.for_batch(m, [(LayerSpec(name),)]))
        assert graphs.wait_idle(600)
    assert graphs.stats.failures == 6
    assert len(graphs._failed) == len(graphs._sizes) == 2 and len(graphs._seen) == 2
    assert len(graphs._layer_bytes) == 0

    ok = make_server("--model", "resnet18", "--weights", "random")
    ok.engine.compile_graphs(CompileSettings("auto", after=1, backend="eager", max_tracked=2,
                                             max_graphs=1))
    (graphs,) = ok.engine.compiled
    m = ok.engine.models["resnet18"]
    for name in names[:4]:
        graphs.capture(m, torch.randn(1, 3, 32, 32),
                       CapturePlan.for_batch(m, [(LayerSpec(name),)]))
        assert graphs.wait_idle(600)
    assert graphs.stats.compiles == 4 and graphs.stats.evictions == 3
    assert len(graphs._layer_bytes) == len(graphs._sizes) == 2


def test_bucket_and_warm_parsing(make_server):
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 16, 32]
    w = parse_warm("resnet18=layer4+layer3:input@96x128#8")
    assert (w.model, w.layers, w.size, w.batch) == ("resnet18", ("layer4", "layer3:input"),
                                                    (96, 128), 8)
    with pytest.raises(ConfigError, match="MODEL=LAYER"):
        parse_warm("resnet18")
    # each number says which it is (all were told the whole syntax again)
    for spec, words in [("resnet18=fc#0", "the batch '0' is not a whole number of 1"),
                        ("resnet18=fc#1.5", "the batch '1.5' is not a whole number"),
                        ("resnet18=fc@0x64", "a side '0' is not a whole number"),
                        ("resnet18=fc@-5x64", "a side '-5' is not a whole number"),
                        # a compiled graph keeps captured modules whole: it was accepted,
                        # then served eagerly, logged only
                        ("resnet18=layer4+layer4.1:input", "layer4 holds layer4.1")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            parse_warm(spec)
    assert parse_warm("resnet18=layer4+layer4:input").layers == ("layer4", "layer4:input")
    with pytest.raises(ConfigError, match="no layer layer9"):
        make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                    "--warm", "resnet18=layer9")
    layer = "features.denseblock1.denselayer1"
    with pytest.raises(ConfigError, match=f"{layer}:input cannot be captured: {layer} "
                       r"\(_DenseLayer\) takes a list of 1 tensor as its input"):
        make_server("--model", "densenet121", "--weights", "random", "--compile", "auto",
                    "--warm", f"densenet121={layer}:input")


def test_warm_compiles_at_start_up_and_metrics_count(make_server, images):
    s = make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                    "--compile-backend", "eager", "--warm", "resnet18=layer2+relu@64x64",
                    "--metrics-port", "0")
    settle(s)
    assert stats(s).compiles == 1
    graphs = dict(counters["stats"])
    extract(s, "resnet18", ["relu", "layer2"], images[:1], native=True)
    assert stats(s).hits == 1
    # the graph compiled on the compile thread runs as is on the model's thread: no
    # guard (the OpenMP thread count is one) makes dynamo compile it again there
    assert dict(counters["stats"]) == graphs
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics") as r:
        text = r.read().decode()
    for line in ('hookserve_compile_events_total{event="compile"} 1.0',
                 'hookserve_compile_events_total{event="hit"} 1.0'):
        assert line in text
    assert "hookserve_compile_seconds_total " in text
    assert "hookserve_compiled_graph_bytes " in text


def test_inductor_freezes_the_graph(make_server, images):
    """The graph is compiled with freezing (batch norm folded into the convolutions,
    oneDNN's packed weights): without it a compiled CPU graph runs at eager's speed.
    Inductor counts the folds it makes; a compile without freezing makes none."""
    before = counters["inductor"]["binary_folding"]
    s = make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                    "--warm", "resnet18=relu@64x64")
    settle(s)
    assert stats(s).compiles == 1 and stats(s).failures == 0
    assert counters["inductor"]["binary_folding"] > before
    eager = make_server("--model", "resnet18", "--weights", "random")
    want = extract(eager, "resnet18", ["relu"], images[:1], native=True)
    hits, graphs = stats(s).hits, dict(counters["stats"])
    assert_same(extract(s, "resnet18", ["relu"], images[:1], native=True), want)
    assert stats(s).hits == hits + 1
    # the frozen graph runs as compiled: no recompile on the model's thread (where
    # inductor's per-thread settings would leave a new graph unfrozen)
    assert dict(counters["stats"]) == graphs


def test_a_compile_leaves_no_thread_behind(make_server, images):
    """Each compile runs on a thread that ends with it: the thread that runs a graph's
    warm-up pass keeps an OpenMP team while it lives, and a second team beside the
    model thread's slows every forward pass where threads match cores."""
    ran_on: list[threading.Thread] = []

    def recording(gm, example_inputs):   # a torch.compile backend: no code generation
        ran_on.append(threading.current_thread())
        return gm.forward

    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=recording))
    for layers in (["relu"], ["layer1"]):
        compile_now(s, "resnet18", layers, images[:1], native=True)
    assert stats(s).compiles == 2 and len(ran_on) == 2
    assert ran_on[0] is not ran_on[1]
    for t in ran_on:
        t.join(60)   # the result is recorded just before its thread returns
        assert not t.is_alive(), t.name


class Paused(torch.nn.Module):
    """A module whose forward waits on `release` (after setting `inside`): traced by
    `build_graph` on a thread of its own, it holds a real trace open."""

    def __init__(self, inside: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.inside, self.release = inside, release

    def forward(self, x):
        x = self.a(x)
        self.inside.set()
        self.release.wait(120)   # the trace is on while this waits
        return self.b(x)


@contextmanager
def trace_held_open():
    """A real torch.fx trace, held open on another thread while the body runs; yields
    the list its GraphModule is appended to when it ends."""
    inside, release, built = threading.Event(), threading.Event(), []
    t = threading.Thread(target=lambda: built.append(
        build_graph(Paused(inside, release), (CapturePoint("a", 0),))))
    t.start()
    try:
        assert inside.wait(120)
        yield built
    finally:
        release.set()
        t.join(120)


def test_a_trace_leaves_other_threads_module_calls_alone(server, images):
    """torch.fx replaces nn.Module.__call__ for the whole process while it traces. With
    a trace held open on one thread, what other threads run meanwhile is served as
    usual: a new input size's layer table (DescribeModel: a meta dry run on a gRPC
    thread) and an Extract's forward pass on the model's thread. The trace still
    records its own module calls."""
    with trace_held_open() as built, server.client(timeout=120) as c:
        described = c.describe("resnet18", "72x88")   # a size no other test asks for
        got = c.extract(images[0], ["layer1", "fc"], model="resnet18", native=True)
    assert described.input_size == (72, 88)
    assert [li.shape for li in described.layers if li.name == "layer1"] == [(64, 18, 22)]
    assert got["layer1"].shape == (64, 16, 16) and got["fc"].shape == (1000,)
    (gm,) = built
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["a"]


def test_a_trace_elsewhere_never_meets_a_compiled_graph(make_server, images):
    """A compiled graph called while another thread traces would recompile on the
    model's thread (dynamo guards on nn.Module.__call__, which the trace replaces), and
    a due layer set would wait for the trace. Neither happens: while the trace is open,
    batches are answered by eager, nothing is traced or compiled, and afterwards the
    graph answers again without a second compile."""
    ran = []

    def recording(gm, example_inputs):   # a torch.compile backend: no code generation
        ran.append(gm)
        return gm.forward

    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=recording))
    compile_now(s, "resnet18", ["layer1"], images[:1], native=True)
    hits, eager = stats(s).hits, stats(s).eager
    with trace_held_open(), s.client(timeout=60) as c:
        for layers in (["layer1"], ["layer2"], ["layer2"]):   # ready; due, then due again
            assert c.extract(images[0], layers, model="resnet18", native=True)
        assert (stats(s).hits, stats(s).eager, stats(s).pending) == (hits, eager + 3, 0)
    assert (stats(s).compiles, len(ran)) == (1, 1)
    compile_now(s, "resnet18", ["layer1"], images[:1], native=True)
    compile_now(s, "resnet18", ["layer2"], images[:1], native=True)
    assert (stats(s).compiles, len(ran)) == (2, 2)
