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
helper thread, so one caller's cancel never fails another's image.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import HookserveError, InternalError
from ..spec import ImageInput, LayerOutput
from ..telemetry import Telemetry
from . import key as keys
from .local import HIT, LEAD, LocalCache

log = logging.getLogger("hookserve.cache")

#: Times an image starts over after computations it waited on failed for their caller.
MAX_RESTARTS = 3

#: compute(spec, fut): the engine's own path for an image with `spec`.
Compute = Callable[[object, Future], None]


def marked(value: LayerOutput) -> LayerOutput:
    return value if value.cached else dataclasses.replace(value, cached=True)


class AnswerCache:
    """The local tier, and the shared one when configured (cache/shared.py)."""

    def __init__(self, local: LocalCache, shared=None, telemetry: Telemetry | None = None
                 ) -> None:
        self.local = local
        self.shared = shared
        self.telemetry = telemetry or Telemetry()
        self._restarts = ThreadPoolExecutor(1, thread_name_prefix="hookserve-cache")

    @property
    def capacity(self) -> int:
        return self.local.capacity

    def _count(self, tier: str, event: str, n: int) -> None:
        if n:
            self.telemetry.cache_event(tier, event, n)

    def close(self) -> None:
        self._restarts.shutdown(wait=False)
        if self.shared is not None:
            self.shared.close()

    # -- keys ----------------------------------------------------------------------------
    @staticmethod
    def unit_keys(spec, image: ImageInput) -> list[bytes]:
        """One key per unit of the answer, in the answer's order (the spec's job says
        what a unit is: `Job.cache_keys`)."""
        state = keys.base(keys.image_digest(image), spec.model, spec.preprocess)
        return spec.job.cache_keys(state, image)

    # -- the seam ------------------------------------------------------------------------
    def submit(self, spec, image: ImageInput, call, fut: Future, compute: Compute,
               restarts: int = 0) -> None:
        """Answer `fut` from the cache where it can, computing only what is missing
        (with `compute`, the engine's path). Raises HookserveError as `compute` does."""
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
            found = self.shared.get_many([unit_keys[i] for i in lead])
            for i in [i for i in lead if unit_keys[i] in found]:
                value = found[unit_keys[i]]
                self.local.finish(unit_keys[i], value)
                parts[i] = marked(value)
                lead.remove(i)
            self._count("shared", "hit", len(found))
        # a miss is counted once, by the last tier asked
        self._count("local" if self.shared is None else "shared", "miss", len(lead))
        gather = _Gather(self, (spec, image, call, fut, compute), parts, set(lead), restarts)
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
                value = None if values is None else values[n]
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
    """One image's answer from its units' values and Futures."""

    def __init__(self, cache: AnswerCache, args: tuple, parts: list, lead: set[int],
                 restarts: int) -> None:
        self.cache = cache
        #: (spec, image, call, fut, compute), as AnswerCache.submit got them
        self.args = args
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
        for p in list(self.parts):
            if isinstance(p, Future):
                p.add_done_callback(self._one_done)

    def _one_done(self, _f: Future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        fut = self.args[3]
        values = []
        for i, p in enumerate(self.parts):
            if not isinstance(p, Future):
                values.append(p)
                continue
            error = p.exception()
            if error is not None:
                if isinstance(error, HookserveError):
                    error = error.detached()  # one copy per image: it is raised apart
                self._failed(error, own=i in self.lead)
                return
            values.append(p.result() if i in self.lead else marked(p.result()))
        if not fut.done():
            fut.set_result(values)

    def _failed(self, error: BaseException, own: bool) -> None:
        """A unit failed: its error is this image's if the image computed it, or if it
        is about the bytes themselves; else the image starts over."""
        spec, image, call, fut, compute = self.args
        about_bytes = isinstance(error, HookserveError) and error.code == "INVALID_ARGUMENT"
        if own or about_bytes or call.cancelled or self.restarts >= MAX_RESTARTS:
            if not fut.done():
                fut.set_exception(error)
            return

        def again() -> None:
            try:
                self.cache.submit(spec, image, call, fut, compute, self.restarts + 1)
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
                fut.set_exception(error)
