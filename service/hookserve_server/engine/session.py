"""One work call (Extract, Attribute, or ExtractImage's one image): a reader thread
admits images; answers come back in send order. A Session knows the engine only as
a `Pipeline`, the few members it uses."""

from __future__ import annotations

import functools
import hashlib
import logging
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from typing import Protocol

from ..attribution_spec import AttributionSpec
from ..errors import (
    Cancelled,
    HookserveError,
    InternalError,
    InvalidArgument,
    Unavailable,
)
from ..spec import ExtractionSpec, ImageInput, ImageResult
from .budget import Budget, Reservation
from .limits import MAX_ID_CHARS, check_image_id
from .prepare import ImagePlan
from .types import CallState, ResolvedSpec

log = logging.getLogger("hookserve.engine")

#: Duplicate ids are detected among the last this-many ids of a stream (~5 MB a stream).
ID_HISTORY = 65_536


class Pipeline(Protocol):
    """What a Session needs of the engine (engine/core.py's Engine is one)."""

    #: Set when shutdown began: open streams stop taking new images.
    draining: bool

    def register(self, session: Session) -> None:
        """A running Session, told when a drain starts (`Session.drain`)."""

    def resolve(self, spec: ExtractionSpec | AttributionSpec) -> ResolvedSpec:
        """A spec checked against its model; raises its HookserveError."""

    def plan(self, spec: ResolvedSpec, image: ImageInput) -> ImagePlan:
        """An image's sizes and answer bytes from its header, checked."""

    def submit(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan,
               call: CallState, fut: Future) -> None:
        """Admit an image and start its work; `fut` gets its answer or error."""

    def freed(self, nbytes: int) -> None:
        """An answer of `nbytes` was handed on or dropped."""


def drain_error() -> Unavailable:
    return Unavailable("server is shutting down: images from here on were not taken; "
                       "send them to another replica")


class Session:
    """One work call: reads requests, keeps a bounded window, answers in order.

    The window bounds images admitted and not yet yielded, by count
    (``max_inflight_per_stream``), and by answer bytes: each image's answer size is
    known from its header before it is decoded (engine/prepare.py, ``plan``), and is
    reserved in this stream's budget (``max_stream_buffer_bytes``) and the global one
    (``max_buffer_bytes``) before the image is admitted (engine/budget.py). While
    either is full the reader stops reading requests. A reservation is released when
    its answer has been handed on (the consumer asked for the next one), or when the
    call ends without sending it.
    """

    def __init__(self, engine: Pipeline, budget: Budget, window: int,
                 deadline: float | None = None) -> None:
        self.engine = engine
        #: What queued work items see of this call (never the Session itself).
        self.call = CallState(deadline)
        #: this stream's answer bytes (a child of the server-wide budget)
        self._budget = budget
        #: images admitted and not yet yielded, at most
        self._window = window
        self._cond = threading.Condition()
        self._inflight = 0
        self._reader_done = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        #: done once the call is cancelled: a wait for an image's answer ends with it
        self._woken: Future = Future()
        # 64-bit digests of the last ID_HISTORY non-empty ids, oldest first.
        #: hashes of the ids seen, oldest first (a dict keeps insertion order)
        self._ids: dict[int, None] = {}
        #: (index, error) of the first image that failed, on a `fail_fast` run
        self.failure: tuple[int, HookserveError] | None = None

    @property
    def cancelled(self) -> bool:
        return self.call.cancelled

    def cancel(self) -> None:
        with self._cond:
            self.call.cancel()
            self._cond.notify_all()
        try:
            self._woken.set_result(None)
        except InvalidStateError:   # (cancelled before)
            pass
        self._budget.wake()

    def _outcome(self, fut: Future) -> BaseException | None:
        """The image's error (None: its outputs are `fut.result()`), read without
        raising it; Cancelled when the call is cancelled first (at the end of a drain's
        grace the model's thread may stop with the image still queued: the wait must
        not outlive the call)."""
        if not fut.done():
            wait((fut, self._woken), return_when=FIRST_COMPLETED)
        if not fut.done():
            return Cancelled("the call was cancelled before this image was answered")
        return fut.exception()

    def drain(self) -> None:
        """Shutdown began: end the call now if nothing of it is in flight."""
        with self._cond:
            if self._inflight == 0 and not self._reader_done:
                self._out.put(drain_error())

    # -- the window ----------------------------------------------------------------------
    def _acquire(self) -> bool:
        limit = self._window
        with self._cond:
            while self._inflight >= limit and not self.cancelled:
                self._cond.wait()
            if self.cancelled:
                return False
            self._inflight += 1
            return True

    def _release(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _free(self, reservation: Reservation | None) -> None:
        """An answer was handed on or dropped: its bytes leave the budgets."""
        if reservation is not None:
            reservation.release()
            self.engine.freed(reservation.nbytes)

    def _drop_unsent(self) -> None:
        """The call ended: release what waits in the output queue (answers included)."""
        while True:
            try:
                entry = self._out.get_nowait()
            except queue.Empty:
                return
            if isinstance(entry, tuple):
                self._free(entry[3])

    def _check_id(self, image_id: str) -> None:
        if not image_id:
            return
        check_image_id(image_id)
        h = int.from_bytes(hashlib.blake2b(image_id.encode(), digest_size=8).digest(), "little")
        if h in self._ids:
            raise InvalidArgument(
                f"duplicate image id {image_id!r} in this stream: ids must be unique "
                "per stream (or empty)")
        self._ids[h] = None
        if len(self._ids) > ID_HISTORY:  # bounded memory on endless streams
            del self._ids[next(iter(self._ids))]

    def _plan_and_reserve(self, spec: ResolvedSpec, image: ImageInput
                          ) -> tuple[ImagePlan, Reservation | None]:
        """One image's id check, its plan from the header (sizes, bytes), and its answer
        bytes reserved; the reservation is None if the call was cancelled while
        waiting for room."""
        self._check_id(image.id)
        plan = self.engine.plan(spec, image)
        return plan, self._budget.reserve(plan.answer_bytes, lambda: self.cancelled,
                                          spec.job.smaller)

    # -- the call ------------------------------------------------------------------------
    def run(self, requests: Iterable[ExtractionSpec | ImageInput],
            fail_fast: bool = False) -> Iterator[ImageResult]:
        """Consume requests on a reader thread; yield one ImageResult per image, in order.

        A bad spec ends the iteration by raising its HookserveError, after the images
        sent before it have been yielded. So does shutdown (Unavailable), once the
        images already admitted have been yielded. `fail_fast` (a call answered as
        one, which one failed image fails): the first image to fail cancels the call at
        once, so the images queued behind it do not run, and is kept in `failure`.
        """
        self.engine.register(self)
        reader = threading.Thread(target=self._read, args=(requests, fail_fast),
                                  name="hookserve-reader", daemon=True)
        reader.start()
        try:
            while True:
                entry = self._out.get()
                if entry is None:
                    return
                if isinstance(entry, HookserveError):
                    try:
                        raise entry.detached()
                    finally:
                        entry = None  # (this frame must not hold what it raised)
                index, image_id, fut, reservation = entry
                # Read the error without raising it: a raised error would tie this frame
                # to the future it is stored in (a reference cycle).
                error = self._outcome(fut)
                result = (ImageResult(index, image_id, error=error) if error is not None
                          else ImageResult(index, image_id, outputs=fut.result()))
                entry = fut = error = None
                try:
                    yield result
                finally:
                    result = None
                    self._free(reservation)
                    self._release()
                    if self.engine.draining:
                        self.drain()
        finally:
            self.cancel()
            self._drop_unsent()

    def run_one(self, spec: ExtractionSpec | AttributionSpec,
                image: ImageInput) -> Iterator[ImageResult]:
        """A one-image call (ExtractImage): no reader thread and no request stream.

        The calling thread resolves the spec, plans the image from its header, reserves
        its answer bytes and admits it, as the reader does on a stream, then waits for
        its answer: the path is the caller's thread -> preprocessing pool -> model's
        thread -> the caller's thread. Yields the one ImageResult; the reservation is
        released once it was handed on (the generator resumed or closed). A bad spec
        raises its HookserveError; a failed image (from its header on) is a result
        with `error` set.
        """
        self.engine.register(self)
        with self._cond:
            self._reader_done = True  # nothing to read: a drain leaves this call be
        resolved = self.engine.resolve(spec)  # a bad spec fails the call itself
        fut: Future = Future()
        reservation = None
        try:  # what fails from here on is the image's error, as on a stream
            plan, reservation = self._plan_and_reserve(resolved, image)
            if reservation is None:
                raise Cancelled("the call was cancelled while waiting for buffer room")
            self.engine.submit(resolved, image, plan, self.call, fut)
        except HookserveError as exc:  # a bound admission permit goes with the future
            fut.set_exception(exc.detached())
        except BaseException:
            self.cancel()
            self._free(reservation)
            raise
        try:
            error = self._outcome(fut)  # read, not raised: no cycle through the future
            result = (ImageResult(0, image.id, error=error) if error is not None
                      else ImageResult(0, image.id, outputs=fut.result()))
            fut = error = None
            yield result
        finally:
            result = None
            self.cancel()
            self._free(reservation)

    def _read(self, requests, fail_fast: bool) -> None:
        out = self._out
        me = weakref.ref(self)
        spec: ResolvedSpec | None = None
        index = 0
        try:
            for req in requests:
                if self.cancelled:
                    break
                if isinstance(req, (ExtractionSpec, AttributionSpec)):
                    spec = self.engine.resolve(req)
                    continue
                if spec is None:
                    raise InvalidArgument(
                        "an image came before any spec: send a spec first (an ExtractionSpec "
                        "on Extract, an AttributionSpec on Attribute)")
                if self.engine.draining:
                    raise drain_error()
                # The future is all later stages hold of this image's call, with
                # self.call; nothing they keep points back to this Session.
                fut: Future = Future()
                if fail_fast:   # (a weak reference: the future must not hold us)
                    fut.add_done_callback(functools.partial(_failed, me, index))
                reservation = plan = None
                try:
                    plan, reservation = self._plan_and_reserve(spec, req)
                    if reservation is None:  # cancelled while waiting for room
                        break
                except HookserveError as exc:
                    fut.set_exception(exc.detached())
                if not self._acquire():  # cancelled
                    self._free(reservation)
                    break
                if reservation is not None:
                    try:
                        self.engine.submit(spec, req, plan, self.call, fut)
                    except HookserveError as exc:
                        fut.set_exception(exc.detached())
                # An over-long id is not echoed back (the answer carries image_index).
                out.put((index, req.id if len(req.id) <= MAX_ID_CHARS else "", fut,
                         reservation))
                index += 1
        except Cancelled:  # the request stream broke: the client went away
            self.cancel()
        except HookserveError as exc:
            out.put(exc)
        except Exception:
            if not self.cancelled:  # a bug, not the client going away: say so
                log.exception("reading the request stream failed")
                out.put(InternalError("internal error while reading the request stream"))
        finally:
            with self._cond:
                self._reader_done = True
            if self.cancelled:  # run() may have emptied the queue before our last put
                self._drop_unsent()
            out.put(None)


def _failed(ref: weakref.ref, index: int, fut: Future) -> None:
    """A fail-fast run's image is done: the first to fail cancels its call (an image
    Cancelled after the call was cancelled failed by that cancel, not first)."""
    session = ref()
    error = None if session is None or fut.cancelled() else fut.exception()
    if error is None or (isinstance(error, Cancelled) and session.cancelled):
        return
    with session._cond:
        if session.failure is not None:
            return
        session.failure = (index, error)
    session.cancel()
