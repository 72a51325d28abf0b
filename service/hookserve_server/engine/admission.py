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

from ..errors import ResourceExhausted, Unavailable
from .types import CallState


class Admission:
    def __init__(self, max_queue: int, wait_s: float) -> None:
        self.max_queue = max_queue
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._admitted = 0
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
        with self._cond:
            end = time.monotonic() + self.wait_s
            while self._admitted + n > self.max_queue and not self._closing:
                left = end - time.monotonic()
                if left <= 0 or call.cancelled:
                    need = f" (this request's {n} images need room together)" if n > 1 else ""
                    raise ResourceExhausted(
                        f"server overloaded: {self._admitted} images queued (--max-queue "
                        f"{self.max_queue}){need}; retry after a short delay",
                        retry_after_s=0.5)
                self._cond.wait(left)
            if self._closing:
                raise Unavailable("server is shutting down: retry on another replica")
            self._admitted += n

    def _release(self, n: int = 1) -> None:
        with self._cond:
            self._admitted -= n
            self._cond.notify_all()


class Room:
    """Room taken for a request's images together: each image takes one place."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            return True

    def close(self) -> int:
        """The places not taken (none can be taken from here on)."""
        with self._lock:
            left, self._left = self._left, 0
            return left


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
