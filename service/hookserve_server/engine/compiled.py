"""`--compile auto`: compiled extraction graphs, built in the background.

The measurements behind each rule are in docs/performance.md. The device worker asks
`CompiledGraphs.capture` for each Extract batch. A graph is keyed by (model, capture
points, batch size, input HxW): the layers and `:input`s asked for (reductions, dtypes
and L2 apply to its outputs), a power-of-two batch size, the exact input size:

- **Never wait.** A batch whose keys have ready graphs runs them; any other runs the
  eager hooks (`capture/forward.py`). A batch of n runs as the powers of two that sum
  to n (5 = 4 + 1), each through its graph, once those are ready; until then the graph
  of n's bucket runs it padded with zero images (rows never mix in eval mode).
- **When to compile.** A key is queued at its `after`-th batch (`--compile-after`; the
  start-up warm-up pass does not count), or at start-up for each `--warm` entry. The
  model's thread traces the graph (torch.fx over a copy of the model); one background
  thread compiles the keys one at a time, each on a thread of its own that ends with
  the compile (no second OpenMP team outlives it), with inductor, frozen on the CPU,
  under the model thread's OpenMP thread count (torch.compile guards on it).
- **Bounds.** At most (buckets) x `max_sizes` keys per layer set (the first input sizes
  to become due, `--warm` entries included; others stay eager); a graph dropped from
  the LRU compiles again when due again, MAX_EVICTIONS times at most, and is freed
  (`capture/compiled.forget_graph`). Parts are used only when that many graphs of the
  layer set fit in the LRU together. The LRU holds at most `--compile-max-graphs`
  graphs and `--compile-max-bytes` of estimated memory (`graph_bytes`); a graph over
  that alone is not compiled. What is remembered per key and layer set (batch counts,
  sizes, estimates, failures): `max_tracked` entries each, least recently used out.
- **Failures.** A layer set whose graph cannot be compiled at an input size is served
  eagerly at that size from then on (any size: cannot be built, over the bound), logged.
- Attribute batches never come here: they keep the autograd path.
"""

from __future__ import annotations

import collections
import copy
import logging
import queue
import threading
import time

import torch

from ..capture import compiled as graphs
from ..capture.compiled import bucket, build_graph, graph_bytes, split, to_bucket
from ..capture.forward import capture
from ..capture.plan import CapturePlan, point_of
from ..capture.reduce import reduce
from ..capture.table import entry
from ..capture.tracing import sharing, tracing
from ..errors import ConfigError, HookserveError
from ..models import ServedModel
from ..precision import autocast
from ..recent import Recent
from ..spec import LayerSpec
from ..telemetry import Telemetry
from .config import CompileSettings, CompileStats

log = logging.getLogger("hookserve.compile")


#: How often one key's graph may be dropped from the LRU and compiled again.
MAX_EVICTIONS = 2


class CompiledGraphs:
    """The compiled graphs of one device's models, and the thread that compiles them."""

    def __init__(self, settings: CompileSettings | None = None,
                 telemetry: Telemetry | None = None) -> None:
        self.settings = settings or CompileSettings()
        self.telemetry = telemetry or Telemetry()
        self.stats = CompileStats()
        self._graphs: collections.OrderedDict = collections.OrderedDict()  # (fn, bytes, mods)
        self._dropped: list = []   # (fn, mods) of graphs out of the LRU, to free
        # What is remembered per key and per layer set is bounded (max_tracked each):
        # clients choose layer sets and, in native mode, input sizes.
        limit = self.settings.max_tracked
        #: key -> the batches counted towards its compile; key -> times evicted (after
        #: MAX_EVICTIONS it stays eager: graphs that do not fit together cannot thrash)
        self._seen, self._evicted = Recent(limit), Recent(limit)
        self._queued: set = set()
        #: (model name, points, input size) -> True: served eagerly after a failure
        self._failed = Recent(limit)
        self._counting = True   # (`counting`)
        #: (model name, points) -> the input sizes compiled or queued for it
        self._sizes = Recent(limit)
        #: (model name, points) -> the memory estimate of one of its graphs
        self._layer_bytes = Recent(limit)
        self._lock = threading.Condition()
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: held while a graph is traced or compiled (one at a time, never both)
        self._busy = threading.Lock()
        #: model name -> the copy of its module the graphs are built over
        self._copies: dict = {}

    @property
    def enabled(self) -> bool:
        return self.settings.mode == "auto"

    def capture(self, model: ServedModel, x: torch.Tensor, plan: CapturePlan
                ) -> dict[LayerSpec, torch.Tensor]:
        """`capture(model, x, plan)`'s answer: from compiled graphs when they are ready
        for this batch, else by the eager hooks (and the batch's keys counted).

        A batch of n images runs as the powers of two that sum to n, largest first
        (5 = 4 + 1), each part through the graph of its size, when all of them are
        ready: no image is padded. Otherwise the graph of n's bucket runs it padded
        with zero images (5 in the graph for 8) when that one is ready, and else the
        eager hooks do. The missing parts' keys count towards their compiles when that
        many graphs of the layer set fit in the cache together; else the bucket's key
        does (parts that cannot all be kept would evict each other). Graphs dropped
        from the LRU are freed here first, on the one thread that calls them."""
        while self._dropped:   # (no lock: list.pop is atomic, and one late is freed next)
            graphs.forget_graph(*self._dropped.pop())
        if not self.enabled:
            return capture(model, x, plan)
        points = tuple(sorted(plan.points, key=graphs.point_order))
        n, size = x.shape[0], tuple(x.shape[2:])
        parts = split(n)
        keys = [(model.name, points, rows, size) for rows in parts]
        due: list = []
        with self._lock:
            fns = [self._graphs.get(k) for k in keys]
            if not all(fns):
                padded = (model.name, points, bucket(n), size)
                if self._parts_fit(model.name, points, len(parts)):
                    # the missing parts count towards their compiles; the ready ones
                    # stay recent while they wait for them
                    for k, fn in zip(keys, fns, strict=True):
                        if fn is not None:
                            self._graphs.move_to_end(k)
                    missing = [k for k, fn in zip(keys, fns, strict=True) if fn is None]
                else:   # parts that cannot all be kept would evict each other
                    missing = [padded]
                due = [k for k in missing if k not in self._graphs and self._count(k)]
                fns, keys, parts = [self._graphs.get(padded)], [padded], [bucket(n)]
            if fns[0] is not None:
                for k in keys:
                    self._graphs.move_to_end(k)
        for key in due:   # (a trace runs alone: before this batch shares the graphs)
            self._submit(model, key)
        with sharing(wait=False) as shared:   # while a trace runs, this batch is eager
            ready = fns[0] is not None and shared
            with self._lock:
                if ready:
                    self.stats.hits += 1
                else:
                    self.stats.eager += 1
            self.telemetry.compile_event("hit" if ready else "eager")
            if ready:
                outs, start = [], 0
                with torch.inference_mode(), autocast(model.precision, x.device):
                    for (fn, _, _), rows in zip(fns, parts, strict=True):
                        chunk = x[start:start + rows]
                        outs.append(fn(to_bucket(chunk, rows, model.channels_last)))
                        start += chunk.shape[0]
                    joined = outs[0] if len(outs) == 1 else [
                        torch.cat(ts) for ts in zip(*outs, strict=True)]
        if not ready:
            return capture(model, x, plan)
        captured = {}
        for point, t in zip(points, joined, strict=True):
            for spec in plan.points[point]:
                captured[spec] = reduce(t[:n], spec, may_alias=False)
        return captured

    def warm(self, models: dict[str, ServedModel]) -> list:
        """Trace the `--warm` entries (start-up), to be queued by `start` once every
        device's are traced: a trace waits for any compile already running."""
        jobs = []
        for w in self.settings.warm if self.enabled else ():
            m = models.get(w.model)
            unknown = [n for n in w.layers if m is not None and n not in m.layer_index]
            why = m.tables.why_not(unknown[0]) if unknown else None
            if m is None or unknown:
                what = f"model {w.model}" if m is None else f"layer {unknown[0]}"
                raise ConfigError(f"--warm {w.model}={'+'.join(w.layers)}: " + (
                    f"{unknown[0]} cannot be captured: {why}" if why else
                    f"no {what} here (see ListModels and DescribeModel)"))
            points = tuple(sorted({point_of(m, LayerSpec(name)) for name in w.layers},
                                  key=graphs.point_order))
            size = w.size or m.defaults.crop
            try:
                table = m.layer_table(*size)
                for name in w.layers:
                    entry(table, name)
            except HookserveError as exc:   # (its words are a request's: say ours)
                raise ConfigError(f"--warm {w.model}={'+'.join(w.layers)}@{size[0]}x"
                                  f"{size[1]}: it cannot run at that size ("
                                  f"{exc.message.split(': ')[0]}): give another @HxW, "
                                  "or another layer") from None
            jobs.append((m, (m.name, points, bucket(w.batch), tuple(size))))
        # every entry traced before the first compile starts, in one turn of the gate
        with self._busy, tracing():
            return [(m, key, self._trace(m, key)) for m, key in jobs]

    def start(self, traced: list) -> None:
        """Queue the compiles of `warm`'s traced entries (the worker serves meanwhile)."""
        for job in traced:
            self._enqueue(*job)

    def counting(self, on: bool) -> None:
        """Whether batches count towards compiles (not while the server warms up)."""
        with self._lock:
            self._counting = on

    def wait_idle(self, timeout: float) -> bool:
        """Until nothing is queued or compiling (tests, benches); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        """Stop compiling: queued keys are dropped, the one compiling ends."""
        if self._thread is None:
            return
        with self._lock:
            while True:
                try:
                    job = self._todo.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._queued.discard(job[1])
            self.stats.pending = len(self._queued)
            self._lock.notify_all()
        self._todo.put(None)

    def _parts_fit(self, model: str, points, count: int) -> bool:
        """(Under the lock) whether `count` graphs of this layer set fit in the cache
        together (a graph's estimate is the same at every batch size; unknown until
        its first compile, and assumed to fit until then)."""
        each = self._layer_bytes.get((model, points), 0)
        return count <= self.settings.max_graphs and count * each <= self.settings.max_bytes

    def _count(self, key) -> bool:
        """(Under the lock) count a batch of `key`: True when it is due a compile.
        A layer set compiles at most `max_sizes` input sizes; other sizes stay eager."""
        if (not self._counting or key in self._queued or self._failed.get(_failure(key))
                or self._failed.get((key[0], key[1], None))
                or self._evicted.get(key, 0) >= MAX_EVICTIONS):
            return False
        sizes = self._sizes.get((key[0], key[1]), ())
        if key[3] not in sizes and len(sizes) >= self.settings.max_sizes:
            return False
        seen = self._seen.get(key, 0) + 1
        self._seen[key] = seen
        return seen >= self.settings.after

    def _submit(self, model: ServedModel, key) -> None:
        """Trace `key`'s graph here and queue its compile. A trace runs alone: never
        beside this device's compile (`_busy`), nor any compile or compiled graph's
        call in the process (`capture/tracing.py`). It waits for none of them: the
        key stays due and is traced at a later batch."""
        if not self._busy.acquire(blocking=False):
            return
        try:
            with tracing(wait=False) as alone:
                if not alone:
                    return
                gm = self._trace(model, key)
        finally:
            self._busy.release()
        self._enqueue(model, key, gm)

    def _trace(self, model: ServedModel, key):
        """(Holding `_busy`) the graph of `key`, None, or the exception building it
        raised. The graph is built over a copy of the model, so the eager path's hooks
        on the served module never meet the compile thread."""
        try:
            if model.name not in self._copies:
                self._copies[model.name] = copy.deepcopy(model.module)
            return build_graph(self._copies[model.name], key[1])
        except Exception as exc:
            return exc

    def _enqueue(self, model: ServedModel, key, gm) -> None:
        with self._lock:
            if key in self._queued or key in self._graphs:
                return
            self._queued.add(key)
            layers = (key[0], key[1])
            self._sizes[layers] = {*self._sizes.get(layers, ()), key[3]}
            self.stats.pending = len(self._queued)
            self._todo.put((model, key, gm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._compile_loop, daemon=True,
                                                name="hookserve-compile")
                self._thread.start()

    # -- the compile thread ------------------------------------------------------------
    def _compile_loop(self) -> None:
        while (job := self._todo.get()) is not None:
            model, key, gm = job
            t0 = time.perf_counter()
            # A thread per compile: libgomp keeps the OpenMP team of the warm-up pass
            # until its thread ends, and a second team beside the model thread's cuts
            # every team's spin (49 -> 44 img/s, docs/performance.md).
            done: list = []
            worker = threading.Thread(target=self._compile_job, args=(model, key, gm, done),
                                      daemon=True, name="hookserve-compile-job")
            worker.start()
            worker.join()
            fn, nbytes, mods, exc = done[0] if done else (None, 0, [], RuntimeError("ended"))
            if exc is not None:   # the layer set is served eagerly at that size from now on
                log.warning("compiling %s %s failed; serving it eagerly: %s: %s", key[0],
                            [graphs.point_name(p) for p in key[1]], type(exc).__name__,
                            " ".join(str(exc).split())[:300])
            seconds = time.perf_counter() - t0
            with self._lock:
                self._queued.discard(key)
                self.stats.pending = len(self._queued)
                if fn is None:
                    graphs.forget_graph(None, mods)
                    self._failed[_failure(key, exc)] = True
                    self.stats.failures += 1
                    self.telemetry.compile_event("failure")
                else:
                    self.stats.compiles += 1
                    self.stats.compile_seconds += seconds
                    self.stats.compiled_keys.append(key)
                    self._graphs[key] = (fn, nbytes, mods)
                    self._layer_bytes[(key[0], key[1])] = nbytes
                    self._evict()
                    self.telemetry.compile_event("compile")
                    self.telemetry.compile_state(seconds, self.stats.graph_bytes)
                    log.info("compiled %s %s at batch %d, %dx%d in %.1f s", key[0],
                             [graphs.point_name(p) for p in key[1]], key[2], *key[3], seconds)
                self._lock.notify_all()
            job = model = fn = gm = mods = None

    def _compile_job(self, model: ServedModel, key, gm, done: list) -> None:
        """(On a compile job's own thread) compile `key`'s graph; append (fn, bytes,
        the modules inductor loaded, None) or (None, 0, those modules, the exception)."""
        # This thread keeps the OpenMP thread count the model's thread has (the
        # process default): torch.compile's guards include it, and a graph compiled
        # under another count would be compiled again by its first batch, on the
        # model's thread.
        mods: list = []
        try:
            if self.settings.backend == "inductor":
                import torch._inductor.config as inductor

                # inductor's settings are per thread: these hold for this compile only.
                # One compiler process beside the serving threads, not one per core.
                inductor.compile_threads = 1
                # Freezing is the CPU speed-up (49 against 32 img/s unfrozen, resnet50
                # `layer4`); torch.compile(options={"freezing": True}) leaves the graph
                # unfrozen in torch 2.14, this thread's setting does not. CUDA graphs
                # compile unfrozen, as they were measured (docs/performance.md).
                inductor.freezing = model.device.type == "cpu"
            with self._busy, sharing(), graphs.loaded_modules(mods):
                fn, nbytes = self._compile(model, key, gm)
            done.append((fn, nbytes, mods, None))
        except BaseException as exc:   # reported by the compile loop, with its cause
            done.append((None, 0, mods, exc))

    def _compile(self, model: ServedModel, key, gm):
        _, points, rows, (h, w) = key
        if isinstance(gm, Exception):   # a trace: the same at every size
            raise _AnySize(f"{type(gm).__name__}: {gm}") from gm
        if gm is None:
            raise _AnySize("one captured module contains another")
        s = self.settings
        frozen = s.backend == "inductor" and model.device.type == "cpu"
        nbytes = graph_bytes(gm, frozen)   # (what the weights take: known before compiling)
        if nbytes > s.max_bytes:
            raise _AnySize(f"its graph takes about {nbytes} bytes, over --compile-max-bytes "
                           f"{s.max_bytes}")
        fn = torch.compile(gm, backend=s.backend, dynamic=False)
        x = torch.zeros((rows, 3, h, w), dtype=model.torch_dtype, device=model.device)
        with torch.inference_mode(), autocast(model.precision, model.device):
            fn(to_bucket(x, rows, model.channels_last))   # compiles here
        return fn, nbytes

    def _evict(self) -> None:
        s = self.settings
        self.stats.graph_bytes = sum(b for _, b, _ in self._graphs.values())
        while len(self._graphs) > 1 and (len(self._graphs) > s.max_graphs
                                         or self.stats.graph_bytes > s.max_bytes):
            old, (fn, _, mods) = self._graphs.popitem(last=False)
            self._dropped.append((fn, mods))   # freed by `capture`, between batches
            self._seen.pop(old, None)
            self._evicted[old] = self._evicted.get(old, 0) + 1
            self.stats.evictions += 1
            self.telemetry.compile_event("eviction")
            self.stats.graph_bytes = sum(b for _, b, _ in self._graphs.values())


class _AnySize(ValueError):
    """A layer set that cannot be compiled at any input size."""


def _failure(key, exc: BaseException | None = None) -> tuple:
    """What a failed compile is remembered under: the layer set at that input size
    (another size may well compile), or at any size (None) for an `_AnySize`."""
    return (key[0], key[1], None if isinstance(exc, _AnySize) else key[3])

