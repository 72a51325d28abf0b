"""Admission: the server-wide bound on images being prepared or queued (--max-queue).

Each admitted image holds a Permit until its answer (or error) is set on its future:
the permit is tied to the future (`Permit.bind`), so it is released exactly once,
whichever stage ends the image. `with permit:` releases it on leaving the block for
code that holds it in one place.

A request answered as one (an Open Inference Protocol inference of N images) takes
room for all its images at once (`Admission.room_for`): it is refused before any of
them runs, never after some have.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

from ..errors import Cancelled, DeadlineExceeded, ResourceExhausted, Unavailable
from .types import CallState, Room


class Admission:
    def __init__(self, max_queue: int, wait_s: float) -> None:
        self.max_queue = max_queue
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._admitted = 0
        #: places requests waiting for room for their images together need
        self._pending = 0
        self._closing = False

    @property
    def admitted(self) -> int:
        with self._cond:
            return self._admitted

    def wait_empty(self, timeout: float) -> bool:
        """Until no image is admitted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0, timeout)

    def close(self) -> None:
        """Refuse new images from now on (waiting ones get UNAVAILABLE)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def admit(self, call: CallState) -> Permit:
        """Wait up to `wait_s` for room; RESOURCE_EXHAUSTED (with a retry hint) after.
        A call that holds room already (`room_for`) takes from it, without a wait."""
        block = call.room
        if block is not None and block.take():
            return Permit(self)
        self._wait_room(1, call)
        return Permit(self)

    @contextlib.contextmanager
    def room_for(self, n: int, call: CallState) -> Iterator[None]:
        """Room for all `n` images of one request, taken at once (after waiting up to
        `wait_s`, as `admit`) and given to `call`: its images are admitted from it
        without a wait. What the call did not take is given back at the block's end.
        More images than --max-queue are admitted one by one as they come."""
        if n <= 1 or n > self.max_queue:
            yield
            return
        self._wait_room(n, call)
        call.room = block = Room(n)
        try:
            yield
        finally:
            call.room = None
            left = block.close()
            if left:
                self._release(left)

    def _wait_room(self, n: int, call: CallState) -> None:
        """Take `n` places, waiting up to `wait_s` and no longer than the call's
        deadline or its cancel. While a request waits for room for its images together,
        single images leave that much room to it (they would otherwise take every
        place freed, one at a time, and the request could never start)."""
        with self._cond:
            if self._fits(n) or self._closing:
                self._take(n)
                return
        wake = self._wake
        call.on_cancel(wake)   # (a cancelled call stops waiting at once)
        try:
            with self._cond:
                if n > 1:
                    self._pending += n
                try:
                    end = time.monotonic() + self.wait_s
                    if call.deadline is not None:
                        end = min(end, call.deadline)
                    while not (self._fits(n) or self._closing):
                        left = end - time.monotonic()
                        if call.cancelled:
                            raise Cancelled("the call was cancelled while its images waited "
                                            "for room in the queue")
                        if left <= 0:
                            raise self._refusal(n, call)
                        self._cond.wait(left)
                finally:
                    if n > 1:
                        self._pending -= n
                self._take(n)
        finally:
            call.forget(wake)

    def _fits(self, n: int) -> bool:
        """Room for `n` images now (a single image leaves room to waiting requests)."""
        return self._admitted + n + (self._pending if n == 1 else 0) <= self.max_queue

    def _take(self, n: int) -> None:
        if self._closing:
            raise Unavailable("server is shutting down: retry on another replica")
        self._admitted += n

    def _refusal(self, n: int, call: CallState):
        if call.deadline is not None and time.monotonic() >= call.deadline:
            return DeadlineExceeded("the call's deadline passed while its images waited "
                                    f"for room in the queue (--max-queue {self.max_queue})")
        need = f" (this request's {n} images need room together)" if n > 1 else ""
        return ResourceExhausted(
            f"server overloaded: {self._admitted} images queued (--max-queue "
            f"{self.max_queue}){need}; retry after a short delay", retry_after_s=0.5)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _release(self, n: int = 1) -> None:
        with self._cond:
            self._admitted -= n
            self._cond.notify_all()


class Permit:
    """Room for one image in the queue; released exactly once."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._lock = threading.Lock()

    def release(self, *_ignored) -> None:
        with self._lock:
            admission, self._admission = self._admission, None
        if admission is not None:
            admission._release()

    def bind(self, future: Future) -> None:
        """Release when `future` gets its result or exception."""
        future.add_done_callback(self.release)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
