"""Admission: the server-wide bound on images being prepared or queued (--max-queue).

Each admitted image holds a Permit until its answer (or error) is set on its future:
the permit is tied to the future (`Permit.bind`), so it is released exactly once,
whichever stage ends the image. `with permit:` releases it on leaving the block for
code that holds it in one place.
"""

from __future__ import annotations

import threading
import time
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
        """Wait up to `wait_s` for room; RESOURCE_EXHAUSTED (with a retry hint) after."""
        with self._cond:
            end = time.monotonic() + self.wait_s
            while self._admitted >= self.max_queue and not self._closing:
                left = end - time.monotonic()
                if left <= 0 or call.cancelled:
                    raise ResourceExhausted(
                        f"server overloaded: {self._admitted} images queued (--max-queue "
                        f"{self.max_queue}); retry after a short delay",
                        retry_after_s=0.5)
                self._cond.wait(left)
            if self._closing:
                raise Unavailable("server is shutting down: retry on another replica")
            self._admitted += 1
        return Permit(self)

    def _release(self) -> None:
        with self._cond:
            self._admitted -= 1
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
