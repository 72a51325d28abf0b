"""glibc's allocator and big answers: tuned once at start-up, and freed memory given
back to the OS once work stops.

`keep_large_buffers_on_heap` (server start-up) serves the chunk-sized buffers of
streamed answers from the heap. Answers under that mmap threshold are then freed into
malloc's arenas, which glibc keeps: after a burst of big answers the process RSS stays
high although nothing holds the memory. `MemoryReturn` fixes that: Sessions call
`freed(nbytes)` when answers go; once a lot was freed and the engine has had no
admitted image for a moment, `malloc_trim(0)` returns the free pages. Elsewhere than
glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable


def keep_large_buffers_on_heap(threshold: int = 32 << 20) -> None:
    """glibc only: serve allocations under `threshold` from the heap and keep it.

    Every streamed chunk makes a few chunk-sized (2 MiB) buffers: the bytes of the
    tensor slice, protobuf's copy, the serialised message, gRPC's copy. Above glibc's
    default mmap threshold each one is a fresh mmap, page faults on first touch and a
    munmap; on the 2-core dev VM that made streaming a 12.8 MB feature map several
    times slower (docs/performance.md). 32 MiB is glibc's largest allowed threshold;
    freed memory up to 4x that stays in the process. Elsewhere (musl, macOS) a no-op.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    mallopt(m_mmap_threshold, threshold)
    mallopt(m_trim_threshold, 4 * threshold)


log = logging.getLogger("hookserve.engine")

#: Trim once this many answer bytes were freed since the last trim...
TRIM_AFTER_BYTES = 64 << 20
#: ...and the engine has been idle (no admitted image) this long.
IDLE_S = 0.2


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class MemoryReturn:
    """A daemon thread that calls malloc_trim when freed bytes pile up and work stops."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self._busy = busy
        self._trim = _malloc_trim()
        self._cond = threading.Condition()
        self._freed = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        #: times malloc_trim ran (tests and logs)
        self.trims = 0

    def freed(self, nbytes: int) -> None:
        if self._trim is None or nbytes <= 0:
            return
        with self._cond:
            self._freed += nbytes
            if self._freed >= TRIM_AFTER_BYTES:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name="hookserve-memory-return")
                    self._thread.start()
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_returned(self, timeout: float) -> bool:
        """Until less than TRIM_AFTER_BYTES of freed memory waits to be returned."""
        with self._cond:
            return self._cond.wait_for(lambda: self._freed < TRIM_AFTER_BYTES, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._freed >= TRIM_AFTER_BYTES)
                if self._closed:
                    return
            # Let a burst finish: trimming under load would only be undone at once.
            time.sleep(IDLE_S)
            if self._busy():
                continue
            with self._cond:
                taken = self._freed
            t0 = time.perf_counter()
            self._trim(0)
            self.trims += 1
            log.debug("returned freed memory to the OS (malloc_trim, %.1f ms)",
                      (time.perf_counter() - t0) * 1000)
            with self._cond:
                self._freed -= taken
                self._cond.notify_all()
