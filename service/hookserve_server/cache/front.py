"""Where the engine consults the cache: one call, `AnswerCache.submit`, in place of
computing an image's answer.

An image's answer is split into units, each with its own key (cache/key.py): one per
requested layer for Extract, one for an Attribute answer. Each unit is a hit (local
tier, then the shared tier), a wait on the same key's computation already under way
(single-flight), or a miss that this image leads. Only the missed units are computed:
the image goes down the usual path (admission, preparation, the model's thread) with
its spec cut to the missed layers, so the forward pass stops early at the last of
them. When every unit is in, the image's Future gets the answer in the spec's order,
each layer marked `cached` when it was not computed for this image.

A computation that fails hands its error to the images that waited on it when the
error is the image's own (INVALID_ARGUMENT: the same bytes fail the same way);
otherwise (its call was cancelled, out of time or out of room) they start over on a
few helper threads, so one caller's cancel never fails another's image; an image whose
computations failed that way MAX_RESTARTS times gets UNAVAILABLE (retry).

A wait is the waiting call's own: when that call is cancelled or its deadline passes,
its image fails at once with CANCELLED or DEADLINE_EXCEEDED (the computation it waited
on goes on for the others), so a waiter never holds its stream, its thread or its
reserved bytes for longer than its own call allows.

What the cache keeps is a copy of the answer in ordinary memory, never a view of a
batch's (possibly pinned) buffer: an entry holds and counts exactly its own bytes.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import Cancelled, DeadlineExceeded, HookserveError, InternalError, Unavailable
from ..spec import ImageInput, LayerOutput
from ..telemetry import Telemetry
from . import key as keys
from .local import HIT, LEAD, LocalCache

log = logging.getLogger("hookserve.cache")

#: Times an image starts over after computations it waited on failed for their caller.
MAX_RESTARTS = 3
#: Threads that start images over (each may wait for admission, up to --queue-wait).
RESTART_THREADS = 4

#: compute(spec, fut): the engine's own path for an image with `spec`.
Compute = Callable[[object, Future], None]


def marked(value: LayerOutput) -> LayerOutput:
    return value if value.cached else dataclasses.replace(value, cached=True)


def owned(value: LayerOutput) -> LayerOutput:
    """`value` with its bytes copied into memory of their own (not a batch's buffer)."""
    return dataclasses.replace(value, data=memoryview(bytes(value.data)))


def exhausted_error() -> Unavailable:
    return Unavailable(f"the computation of this image, shared with other calls, failed "
                       f"{MAX_RESTARTS + 1} times for those calls' reasons (cancelled or "
                       "out of time): retry the image")


class AnswerCache:
    """The local tier, and the shared one when configured (cache/shared.py)."""

    def __init__(self, local: LocalCache, shared=None, telemetry: Telemetry | None = None,
                 gpu_decode: bool = False) -> None:
        self.local = local
        self.shared = shared
        self.telemetry = telemetry or Telemetry()
        #: --gpu-decode: JPEGs decoded on a CUDA model's device are other answers
        self.gpu_decode = gpu_decode
        self._restarts = ThreadPoolExecutor(RESTART_THREADS,
                                            thread_name_prefix="hookserve-cache")
        self.deadlines = _Deadlines()

    @property
    def capacity(self) -> int:
        """Bytes the cache may hold: the local tier and the shared tier's write queue."""
        return self.local.capacity + (0 if self.shared is None else self.shared.queue_bytes)

    def _count(self, tier: str, event: str, n: int) -> None:
        if n:
            self.telemetry.cache_event(tier, event, n)

    def close(self) -> None:
        self._restarts.shutdown(wait=False)
        self.deadlines.close()
        if self.shared is not None:
            self.shared.close()

    # -- keys ----------------------------------------------------------------------------
    def unit_keys(self, spec, image: ImageInput) -> list[bytes]:
        """One key per unit of the answer, in the answer's order (the spec's job says
        what a unit is: `Job.cache_keys`)."""
        state = keys.base(keys.image_digest(image), spec.model, spec.preprocess,
                          self.gpu_decode)
        return spec.job.cache_keys(state, image)

    # -- the seam ------------------------------------------------------------------------
    def submit(self, spec, image: ImageInput, call, fut: Future, compute: Compute,
               size: tuple[int, int], restarts: int = 0) -> None:
        """Answer `fut` from the cache where it can, computing only what is missing
        (with `compute`, the engine's path). `size`: the image's model input HxW (what
        a value read back is checked against, `Job.unit_types`). Raises HookserveError
        as `compute` does."""
        unit_keys = self.unit_keys(spec, image)
        parts: list[LayerOutput | Future | None] = []
        lead: list[int] = []
        waits = hits = 0
        for i, k in enumerate(unit_keys):
            kind, got = self.local.claim(k)
            if kind == HIT:
                parts.append(marked(got))
                hits += 1
            else:
                parts.append(got)  # a Future: someone else's flight, or ours
                if kind == LEAD:
                    lead.append(i)
                else:
                    waits += 1
        self._count("local", "hit", hits)
        self._count("local", "coalesced", waits)
        if lead and self.shared is not None:
            expect = spec.job.unit_types(*size)
            found = self.shared.get_many([unit_keys[i] for i in lead],
                                         [expect[i] for i in lead])
            for i in [i for i in lead if unit_keys[i] in found]:
                value = found[unit_keys[i]]
                self.local.finish(unit_keys[i], value)
                parts[i] = marked(value)
                lead.remove(i)
            self._count("shared", "hit", len(found))
        # a miss is counted once, by the last tier asked
        self._count("local" if self.shared is None else "shared", "miss", len(lead))
        gather = _Gather(self, (spec, image, call, fut, compute, size), parts, set(lead),
                         restarts)
        if lead:
            self._compute(spec, call, unit_keys, lead, parts, compute)
        gather.start()

    def _compute(self, spec, call, unit_keys: list[bytes], lead: list[int], parts: list,
                 compute: Compute) -> None:
        """Compute the units in `lead`; their flights (in `parts`) end with the answer."""
        if len(lead) < len(unit_keys):
            spec = dataclasses.replace(spec, job=spec.job.only(lead))
        inner: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            values = None if error is not None else f.result()
            for n, i in enumerate(lead):
                value = None if values is None else owned(values[n])
                self.local.finish(unit_keys[i], value, error)
                if value is not None and self.shared is not None:
                    self.shared.put(unit_keys[i], value)

        inner.add_done_callback(done)
        try:
            compute(spec, inner)
        except HookserveError as exc:
            if not inner.done():
                inner.set_exception(exc.detached())
        except BaseException:
            if not inner.done():
                inner.set_exception(InternalError("internal error while admitting the image"))
            raise


class _Gather:
    """One image's answer from its units' values and Futures.

    While it waits on other calls' computations, its own call's cancel and deadline end
    it (`give_up`); the first of finishing and giving up sets the image's Future."""

    def __init__(self, cache: AnswerCache, args: tuple, parts: list, lead: set[int],
                 restarts: int) -> None:
        self.cache = cache
        #: (spec, image, call, fut, compute, size), as AnswerCache.submit got them; None once
        #: the image's Future was set
        self.args: tuple | None = args
        self.parts = parts
        #: the units this image computes itself (their errors are its own)
        self.lead = lead
        self.restarts = restarts
        self._lock = threading.Lock()
        self._left = sum(isinstance(p, Future) for p in parts)

    def start(self) -> None:
        if self._left == 0:
            self._finish()
            return
        call = self.args[2]
        if len(self.lead) < self._left:  # it waits on another call's computation
            call.on_cancel(self.cancelled)
            if call.deadline is not None:
                self.cache.deadlines.add(call.deadline, self)
        for p in list(self.parts):
            if isinstance(p, Future):
                p.add_done_callback(self._one_done)

    def _end(self) -> tuple | None:
        """Take the arguments (the right to set the image's Future): once only."""
        with self._lock:
            args, self.args = self.args, None
        if args is not None:
            args[2].forget(self.cancelled)
        return args

    def cancelled(self) -> None:
        self.give_up(Cancelled("the call was cancelled"))

    def expired(self) -> None:
        self.give_up(DeadlineExceeded(
            "the call's deadline passed while its image waited for the same answer being "
            "computed for another call: allow more time"))

    def give_up(self, error: BaseException) -> None:
        args = self._end()
        if args is not None and not args[3].done():
            args[3].set_exception(error)

    def _one_done(self, _f: Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        args = self._end()
        if args is None:  # the call gave up already
            return
        fut = args[3]
        values = []
        for i, p in enumerate(self.parts):
            if not isinstance(p, Future):
                values.append(p)
                continue
            error = p.exception()
            if error is not None:
                if isinstance(error, HookserveError):
                    error = error.detached()  # one copy per image: it is raised apart
                self._failed(args, error, own=i in self.lead)
                return
            values.append(p.result() if i in self.lead else marked(p.result()))
        if not fut.done():
            fut.set_result(values)

    def _failed(self, args: tuple, error: BaseException, own: bool) -> None:
        """A unit failed: its error is this image's if the image computed it, or if it
        is about the bytes themselves; else the image starts over."""
        spec, image, call, fut, compute, size = args
        about_bytes = isinstance(error, HookserveError) and error.code == "INVALID_ARGUMENT"
        if own or about_bytes or call.cancelled or call.expired():
            if not fut.done():
                fut.set_exception(error)
            return
        if self.restarts >= MAX_RESTARTS:
            if not fut.done():
                fut.set_exception(exhausted_error())
            return

        def again() -> None:
            try:
                self.cache.submit(spec, image, call, fut, compute, size, self.restarts + 1)
            except HookserveError as exc:
                if not fut.done():
                    fut.set_exception(exc.detached())
            except Exception:
                log.exception("restarting an image after a failed shared computation")
                if not fut.done():
                    fut.set_exception(InternalError("internal error in the answer cache"))

        try:
            self.cache._restarts.submit(again)
        except RuntimeError:  # shut down
            if not fut.done():
                fut.set_exception(Unavailable("server is shutting down: retry the image "
                                              "on another replica"))


class _Deadlines:
    """One thread that gives up waits whose call's deadline passed (held weakly: a
    wait that ended is not kept alive by its deadline)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, deadline: float, gather: _Gather) -> None:
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(gather)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hookserve-cache-deadlines")
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (
                        not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else min(
                        self._heap[0][0] - time.monotonic(), threading.TIMEOUT_MAX))
                if self._closed:
                    return
                _, _, ref = heapq.heappop(self._heap)
            gather = ref()
            if gather is not None:
                gather.expired()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
