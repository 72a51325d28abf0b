"""Parallel extraction streams of `hookserve batch`, fed from one shared work list.

- :class:`Scheduler` hands out work items and bounds those taken and not yet written
  (``--max-in-flight`` images, ``--max-in-flight-bytes`` of input), which bounds memory
  and what a kill can cost. Retries go back to it with a not-before time.
- :class:`Streams` runs ``--streams`` worker threads, each one ``Client.extract_many``
  stream fed by a :class:`Feed`. Answers go to :attr:`Streams.results`, a queue that
  the run's main thread (the only writer) reads.
- Per-image UNAVAILABLE answers, and RESOURCE_EXHAUSTED ones that carry the server's
  overload retry hint, are retried (after that hint); a RESOURCE_EXHAUSTED without a
  hint (the answer or the image is too big) fails at once; a stream that fails as a
  whole has its unanswered images re-queued. The Client itself already moves a broken
  stream's unanswered images to the next server, and the writer ignores a second
  answer for an image, so nothing is lost or written twice.
"""

from __future__ import annotations

import hashlib
import heapq
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from .. import errors
from ..retry import RETRY_STREAM, RETRYABLE, RetryPolicy
from .errors import Abort
from .inputs import MAX_FILE_BYTES, encode_name, read_bytes
from .limits import IN_FLIGHT_BYTES, Cap, LastRequest
from .streamcall import Watchdog, extract_many


@dataclass
class Item:
    """One image of the work list."""

    pos: int                    # position in the work list = write order
    path: str                   # as os functions take it (may hold surrogate escapes)
    size: int
    mtime_ns: int
    attempts: int = 0
    sha256: str = ""
    name: str = ""              # its id: inputs.encode_name(path), valid UTF-8

    def __post_init__(self) -> None:
        self.name = self.name or encode_name(self.path)

    def __lt__(self, other: Item) -> bool:
        return self.pos < other.pos


DONE = object()


class Scheduler:
    """The shared work list: hands items to streams, takes them back for retries."""

    def __init__(self, items: list[Item], max_in_flight: int,
                 max_bytes: int = IN_FLIGHT_BYTES) -> None:
        self.cond = threading.Condition()
        self.ready = deque(items)
        self.retry: list[tuple[float, Item]] = []  # heap of (not before, item)
        self.in_flight = 0       # taken and not yet written; retries keep their slot
        self.max_in_flight = max(1, max_in_flight)
        #: input bytes taken and not yet written; one larger item goes when none are
        self.bytes = 0
        self.max_bytes = max(1, max_bytes)
        self.remaining = len(items)
        self.stopped = False
        self.stream_failures = 0  # consecutive, reset by any answered image

    def take(self, block: bool):
        """The next item, None when none is available now (block=False), or DONE."""
        with self.cond:
            while True:
                if self.stopped or self.remaining <= 0:
                    return DONE
                now = time.monotonic()
                if self.retry and self.retry[0][0] <= now:
                    return heapq.heappop(self.retry)[1]  # already holds a slot
                if self.ready and self.in_flight < self.max_in_flight and (
                        self.bytes == 0 or self.bytes + self.ready[0].size <= self.max_bytes):
                    self.in_flight += 1
                    self.bytes += self.ready[0].size
                    return self.ready.popleft()
                if not block:
                    return None
                # Wake on notify (a write freed a slot, a retry was queued, stop) or
                # when the earliest retry is due.
                wait = self.retry[0][0] - now if self.retry else None
                self.cond.wait(timeout=wait)

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` more input bytes as held (negative: fewer), besides the items
        taken: an answered image whose request gRPC still holds (:class:`Feed`)."""
        with self.cond:
            self.bytes += nbytes
            if nbytes < 0:
                self.cond.notify_all()

    def requeue(self, item: Item, delay: float) -> None:
        with self.cond:
            heapq.heappush(self.retry, (time.monotonic() + delay, item))
            self.cond.notify_all()

    def written(self, n: int, nbytes: int = 0) -> None:
        """`n` items taken earlier, of `nbytes` input bytes, were written."""
        with self.cond:
            self.in_flight -= n
            self.bytes -= nbytes
            self.remaining -= n
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class Feed:
    """The image and id iterables of one extract_many stream.

    extract_many pulls the next image only when its window has room, and calls
    next(ids) right after next(images). The feed never blocks: when no item is
    available now it ends the stream, and the worker waits for one with no stream open.

    An answered image's bytes stay counted in the scheduler's while gRPC still holds
    its request (:class:`~.limits.LastRequest`).
    """

    def __init__(self, sched: Scheduler, first: Item, failed, cap: Cap) -> None:
        self.sched = sched
        self.first: Item | None = first
        self.pending: dict[str, Item] = {}
        self._ids: deque[str] = deque()
        self.failed = failed            # failed(item, error): a file that cannot be read
        self.cap = cap
        self.last = LastRequest(lambda n: sched.hold(-n))

    def answered(self, item: Item) -> None:
        """`item` got its answer (the writer gives its bytes back once it is written)."""
        if self.last.answered(item.pos, item.size):
            self.sched.hold(item.size)

    def let_go(self) -> None:
        """The stream ended: gRPC holds none of its requests."""
        self.last.let_go()

    def images(self):
        while True:
            if self.first is not None:
                item, self.first = self.first, None
            else:
                item = self.sched.take(block=False)
                if item is None or item is DONE:
                    return
            try:  # a FIFO, device, vanished or changed file fails here, never blocks
                data = read_bytes(item.path, self.cap.limit, (item.size, item.mtime_ns),
                                  self.cap)
            except errors.HookserveError as exc:
                self.failed(item, exc)
                continue
            # A server rejects an id seen before on the same stream, and a retry may
            # land on the stream that pushed the image back: tag each retry's id.
            sid = item.name if item.attempts == 0 else f"{item.name}#retry{item.attempts}"
            self.pending[sid] = item
            self._ids.append(sid)
            item.sha256 = hashlib.sha256(data).hexdigest()
            self.last.handed(item.pos)  # replaces the last request in gRPC's hands
            # Handed on unbound (this frame keeps no reference while it waits): once
            # encoded into its request, the read buffer is freed.
            held = [data]
            del data
            yield held.pop()

    def ids(self):
        while True:
            yield self._ids.popleft()


#: Consecutive streams per stream ended UNAVAILABLE, each after the SDK's `--retries`
#: tries without an answer, before a run whose servers stay down stops (exit 2): the
#: time to give up grows with --retries, not with its square.
GIVE_UP_ROUNDS = 4


class Streams:
    """The worker threads of one run and what they report to the writer.

    :attr:`results` receives ``(item, features, error)`` per finished image, and
    None to wake the writer (a fatal error, a signal).
    """

    def __init__(self, client, sched: Scheduler, layers, opts: dict, *, model: str | None,
                 retries: int, streams: int, window: int, cap: Cap | None = None,
                 timeout: float | None = None, weights: tuple[str, str] | None = None
                 ) -> None:
        self.client = client
        self.cap = cap or Cap(MAX_FILE_BYTES)
        self.watchdog = Watchdog(timeout, weights)
        self.sched = sched
        self.layers = layers
        self.opts = opts
        self.model = model
        self.retries = retries
        self.policy = RetryPolicy(retries)
        self.window = window
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.fatal: BaseException | None = None
        self.interrupted = False
        self.retried = 0  # images sent again (overload, lost server)
        self.threads = [threading.Thread(target=self._worker, name=f"hookserve-batch-{i}",
                                         daemon=True) for i in range(max(1, streams))]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def interrupt(self) -> None:
        self.interrupted = True
        self.results.put(None)

    def stop(self, timeout: float = 30) -> None:
        self.sched.stop()
        for t in self.threads:
            if t.ident is not None:
                t.join(timeout=timeout)

    def _worker(self) -> None:
        sched = self.sched
        try:
            while True:
                first = sched.take(block=True)
                if first is DONE:
                    return
                feed = Feed(sched, first, lambda item, exc: self.results.put((item, None, exc)),
                            self.cap)
                try:
                    for r in extract_many(
                            self.client, feed.images(), self.layers, model=self.model,
                            ids=feed.ids(), window=self.window, watchdog=self.watchdog,
                            **self.opts):
                        item = feed.pending.pop(r.id, None)
                        if item is None:  # not ours (cannot happen): never write twice
                            continue
                        feed.answered(item)
                        self._answer(item, r.features, r.error)
                except errors.HookserveError as exc:
                    unanswered = list(feed.pending.values())
                    if exc.code not in RETRY_STREAM:
                        self._fail(exc)
                        return
                    with sched.cond:
                        sched.stream_failures += 1
                        # UNAVAILABLE came after the SDK's own --retries tries (a bound
                        # that grew with them too grew with their square); other codes
                        # (a busy server's refusal, a timeout) come at once
                        give_up = sched.stream_failures > (
                            GIVE_UP_ROUNDS * len(self.threads)
                            if exc.code in RETRYABLE
                            else self.retries * 4 + 8)
                    if give_up:
                        self._fail(Abort(f"no server answered after repeated retries: {exc}"))
                        return
                    for item in unanswered:
                        item.attempts += 1
                        if item.attempts > self.retries:
                            self.results.put((item, None, exc))
                        else:
                            self.retried += 1
                            sched.requeue(item, self.policy.backoff(item.attempts))
                finally:
                    feed.let_go()  # the stream is over: gRPC holds none of its requests
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self._fail(exc)

    def _answer(self, item: Item, features, error) -> None:
        with self.sched.cond:
            self.sched.stream_failures = 0
        delay = self.policy.image_delay(error, item.attempts)
        if delay is not None:
            item.attempts += 1
            self.retried += 1
            self.sched.requeue(item, delay)
            return
        self.results.put((item, features, error))

    def _fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.results.put(None)  # wake the writer
