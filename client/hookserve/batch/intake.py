"""A shard's entries, started in order within the run's byte budget (:class:`Intake`).

Each entry's bytes are reserved (:class:`~.limits.ByteBudget`) before it is read, and
given back once it is answered. An id already seen in the shard becomes an
ALREADY_EXISTS error entry (final: the first input with that id keeps it), so ids are
unique in the shard's part.
"""

from __future__ import annotations

from collections import deque

import grpc

from .. import errors
from .limits import ByteBudget
from .readers import AHEAD, Entry
from .remote import NeedMore


class Interrupted(Exception):
    """The run is stopping: the shard is left without a marker."""


class Intake:
    """A shard's entries, started in order within the run's byte budget.

    :meth:`next` waits for budget only when `may_wait` (the stream has nothing
    unanswered); otherwise, with the budget full, it returns None and the stream ends
    its pass, so the thread can read its answers. Bytes are held from an entry's start
    until :meth:`release` (its answer) or :meth:`close`.
    """

    def __init__(self, source, budget: ByteBudget) -> None:
        self.source = enumerate(source)
        self.budget = budget
        self.ahead: deque[tuple[int, Entry]] = deque()  # started, bytes held
        self.queue: deque[tuple[int, Entry]] = deque()  # pulled, bytes not yet held
        self.ended = False
        self.held = 0
        self.seen: set[str] = set()

    @property
    def exhausted(self) -> bool:
        return self.ended and not self.ahead and not self.queue

    def _pull(self) -> bool:
        try:
            pos, e = next(self.source)
        except StopIteration:
            self.ended = True
            return False
        if e.error is None and e.id in self.seen:
            e = Entry(e.id, error=errors.HookserveError(
                "another input of this shard has the same id; the first one is kept "
                "(ids must be unique in an output)", grpc.StatusCode.ALREADY_EXISTS))
        self.seen.add(e.id)
        (self.ahead if e.error is not None else self.queue).append((pos, e))
        return True

    def _fill(self, may_wait: bool) -> None:
        while len(self.ahead) < AHEAD:
            if not self.queue and (self.ended or not self._pull()):
                return
            if not self.queue:
                continue
            pos, e = self.queue[0]
            if not self.budget.try_acquire(e.bound):
                if not may_wait or self.ahead:
                    return
                if not self.budget.acquire(e.bound):
                    raise Interrupted
            self.queue.popleft()
            self.held += e.bound
            e.start()
            self.ahead.append((pos, e))

    def next(self, may_wait: bool) -> tuple[int, str, bytes | errors.HookserveError] | None:
        """The next (position, id, bytes or error); None when the shard's entries are
        all handed out, or the budget is full and `may_wait` is False."""
        while True:
            self._fill(may_wait)
            if not self.ahead:
                return None
            pos, e = self.ahead.popleft()
            if e.error is not None:
                return pos, e.id, e.error
            try:
                data = e.result()
            except NeedMore as more:  # larger than first reserved: reserve more, again
                self.release(e.bound)
                self.queue.appendleft((pos, e.again(more.bound)))
                continue
            except errors.HookserveError as exc:
                self.release(e.bound)
                return pos, e.id, exc
            self.release(e.bound - len(data))
            return pos, e.id, data

    def release(self, n: int) -> None:
        self.held -= n
        self.budget.release(n)

    def close(self) -> None:
        self.budget.release(self.held)
        self.held = 0
