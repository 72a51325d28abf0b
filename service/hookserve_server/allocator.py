"""Process-wide allocator tuning for streaming large answers (done once, at start-up)."""

from __future__ import annotations

import ctypes


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
