"""Answer-byte budgets: every answer's bytes are reserved before it is computed.

Two budgets hold the answers computed and not yet sent: one per call
(--max-stream-buffer-bytes) and one across all calls (--max-buffer-bytes). An
image's answer size is known before its pixels are decoded (from the spec, or from
the header and the layer table: `Job.sizes`), so a call's reader (ExtractImage: its
handler thread) reserves it first, and waits, without reading further requests,
while either budget is full: a client that does not read its answers stops its own
stream (backpressure), and no set of streams can pin more than the global budget. An
answer bigger than a whole budget could never fit: it gets RESOURCE_EXHAUSTED with no
retry hint, and the stream goes on.

Streams whose clients stop reading must not stall everyone else: the global budget
keeps a headroom that only a stream holding no unsent answers may take. Streams that
hold answers fill it up to its capacity less the headroom, so a call that has none
waiting (a new call, or one whose client read everything) finds room for an answer up
to the headroom's size, unless other such calls are using it.

A Reservation is released exactly once: when the answer has been handed to the
transport, or when its call ends without sending it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import ResourceExhausted
from .limits import size_text

#: How often a waiting reader rechecks whether its call was cancelled.
_CANCEL_POLL_S = 0.25


class Budget:
    """A byte budget that readers wait on: the global one, or one stream's."""

    def __init__(self, capacity: int, flag: str, parent: Budget | None = None,
                 headroom: int = 0) -> None:
        self.capacity = capacity
        self.flag = flag
        #: the room left to streams (children) that hold none of this budget
        self.headroom = headroom
        self._parent = parent
        self._cond = parent._cond if parent is not None else threading.Condition()
        self.reserved = 0
        #: readers waiting for room right now (tests and metrics read it)
        self.waiting = 0

    def check(self, n: int, fix: str, what: str = "the answer for this image") -> None:
        """RESOURCE_EXHAUSTED (no retry hint) if `n` bytes could never fit."""
        b: Budget | None = self
        while b is not None:
            if n > b.capacity:
                raise ResourceExhausted(
                    f"{what} is {size_text(n)}, over this server's {b.flag} of "
                    f"{size_text(b.capacity)}: {fix}")
            b = b._parent

    def child(self, capacity: int, flag: str) -> Budget:
        """A stream's budget: also counted against this (the global) one."""
        return Budget(capacity, flag, parent=self)

    def _fits(self, n: int) -> bool:
        holds = self.reserved > 0
        b: Budget | None = self
        while b is not None:
            room = b.capacity - (b.headroom if holds and b is not self else 0)
            if b.reserved and b.reserved + n > room:
                return False
            b = b._parent
        return True

    def reserve(self, n: int, cancelled: Callable[[], bool], fix: str
                ) -> Reservation | None:
        """Wait for room for `n` bytes; None if the call was cancelled meanwhile.
        `fix`: what the caller can change, should `n` be over a whole budget.

        An empty budget always takes one answer that is not over its capacity, so a
        stream never waits for itself.
        """
        self.check(n, fix)
        with self._cond:
            root = self._root()
            if not self._fits(n):
                root.waiting += 1
                self._cond.notify_all()  # for wait_for() watchers
                try:
                    while not self._fits(n):
                        if cancelled():
                            return None
                        self._cond.wait(_CANCEL_POLL_S)
                finally:
                    root.waiting -= 1
            b = self
            while b is not None:
                b.reserved += n
                b = b._parent
        return Reservation(self, n)

    def _root(self) -> Budget:
        b = self
        while b._parent is not None:
            b = b._parent
        return b

    def _release(self, n: int) -> None:
        with self._cond:
            b: Budget | None = self
            while b is not None:
                b.reserved -= n
                b = b._parent
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake waiting readers (a call was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` (checked whenever reservations change)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)


class Reservation:
    """Room for one answer in a stream's and the global budget; released once."""

    __slots__ = ("_budget", "nbytes", "_lock")

    def __init__(self, budget: Budget, nbytes: int) -> None:
        self._budget: Budget | None = budget
        self.nbytes = nbytes
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            budget, self._budget = self._budget, None
        if budget is not None:
            budget._release(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
