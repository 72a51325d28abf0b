"""What one input may cost a `hookserve batch` run, decided before the input is read.

- :class:`Cap`: the per-file cap. ``--max-file-bytes``, lowered to what every server
  accepts (DescribeModel's ``max_message_bytes`` less :data:`FRAMING`) and to what the
  client's channel sends. An input over it gets its own ``INVALID_ARGUMENT`` row that
  names the cap, from its size (a stat, a tar header, a listing, a Parquet offset, a
  Content-Length), before any of it is read.
- :class:`ByteBudget`: the input bytes read and not yet answered, across all streams
  (``--max-in-flight-bytes``). A reader takes an input's size from it before it reads
  the input and gives it back once the input is answered; one input larger than the
  whole budget is read only when nothing else is held.
- :class:`LastRequest`: an answered input's bytes stay counted while gRPC still holds
  its request (the last one a stream sent).
- :func:`check_flags`: every numeric flag's range, and --out's format, checked before
  anything starts.
- :func:`return_freed_inputs`: the allocator setting under which the memory bound of
  docs/limits.md holds (inputs' buffers go back to the system once freed).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import errors
from ..endpoints import CHANNEL_OPTIONS
from .errors import Abort

MiB = 1 << 20
#: Room left in a request message for what is not the image's bytes: its id, the
#: field tags and lengths. Ids sent by `hookserve batch` are at most a path's length.
FRAMING = 16 << 10
#: The client's own send limit (its channel's grpc.max_send_message_length).
CLIENT_SEND_BYTES = dict(CHANNEL_OPTIONS)["grpc.max_send_message_length"]
#: Default of --max-in-flight-bytes.
IN_FLIGHT_BYTES = 256 * MiB


def size_text(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


@dataclass(frozen=True)
class Cap:
    """The per-file cap and what sets it (a flag, or what the server accepts)."""

    limit: int
    source: str = "--max-file-bytes"

    def refuse(self, size: int, what: str = "the file") -> errors.InvalidArgument:
        """The error row of an input of `size` bytes over the cap (read no further)."""
        return errors.InvalidArgument(
            f"{what} is {size} bytes, over the per-file cap of {self.limit} bytes "
            f"({self.source}); it was not read")

    def check(self, size: int, what: str = "the file") -> None:
        if size > self.limit:
            raise self.refuse(size, what)


def file_cap(max_file_bytes: int, server_limits: list[int] | None = None,
             flag: str = "--max-file-bytes") -> Cap:
    """The per-file cap: the lowest of `max_file_bytes` (set by `flag`), the client's
    send limit and every server's request limit, each less :data:`FRAMING`. A server
    that does not report its limit (0) counts as the client's send limit."""
    cap = Cap(max_file_bytes, flag)
    sent = Cap(CLIENT_SEND_BYTES - FRAMING,
               f"the client's {size_text(CLIENT_SEND_BYTES)} message limit less framing")
    if sent.limit < cap.limit:
        cap = sent
    for limit in server_limits or []:
        if limit and limit - FRAMING < cap.limit:
            cap = Cap(max(1, limit - FRAMING), f"what the server accepts: its "
                      f"--max-message-bytes of {size_text(limit)} less framing")
    return cap


class ByteBudget:
    """Bytes of input read and not yet answered, shared by every stream of a run.

    :meth:`try_acquire` never waits; :meth:`acquire` waits until the bytes fit (or
    nothing is held: one input larger than the whole budget then goes alone), or
    until :meth:`cancel`. A stream must only wait while it holds nothing unanswered,
    so a full budget never stops the thread that would read the answers.
    """

    def __init__(self, limit: int = IN_FLIGHT_BYTES) -> None:
        self.limit = max(1, int(limit))
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._cancelled = False

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if not self._fits(n):
                return False
            self._take(n)
            return True

    def acquire(self, n: int) -> bool:
        """Wait for `n` bytes; False once cancelled."""
        with self._cond:
            while not self._fits(n):
                if self._cancelled:
                    return False
                self._cond.wait(0.5)
            self._take(n)
            return True

    def release(self, n: int) -> None:
        if n:
            with self._cond:
                self.used -= n
                self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


class LastRequest:
    """The input whose request gRPC took last on one stream.

    gRPC keeps the last request it sent until it takes the next one or the stream
    ends, so an answered input's bytes are still held until then. A stream notes each
    request it hands on (:meth:`handed`); an answer to the last one keeps its bytes
    counted (:meth:`answered`) until the next request or the stream's end
    (:meth:`let_go`), when `release` gets them.
    """

    def __init__(self, release: Callable[[int], None]) -> None:
        self.release = release
        self.key: object = None
        self.kept = 0

    def handed(self, key: object) -> None:
        self.let_go()
        self.key = key

    def answered(self, key: object, nbytes: int) -> bool:
        """Whether `nbytes` of the answered input `key` stay counted for now."""
        if self.key is None or key != self.key or self.kept:
            return False
        self.kept = nbytes
        return True

    def let_go(self) -> None:
        if self.kept:
            self.release(self.kept)
            self.kept = 0


def return_freed_inputs(threshold: int = 1 << 20) -> bool:
    """glibc only: allocate buffers of `threshold` bytes or more (encoded inputs, their
    messages) with mmap, so a freed one goes back to the system at once.

    glibc's default threshold grows with the largest buffer freed (up to 32 MiB), after
    which such buffers come from per-thread heaps that keep freed memory: measured, that
    doubled the batch client's peak (211 MB against 101 MB for 24 MiB of inputs in
    flight). Not done in a process that also runs a server, which keeps its own
    setting. -> whether it was set."""
    if "hookserve_server.allocator" in sys.modules:  # a server set its own
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # from <malloc.h>; setting it also fixes it
    return bool(mallopt(m_mmap_threshold, threshold))


#: flag -> (lowest value, what it is), checked by :func:`check_flags`.
_RANGES = {
    "streams": (1, "parallel streams"), "max_in_flight": (1, "images in flight"),
    "max_in_flight_bytes": (1, "bytes in flight"), "retries": (0, "tries"),
    "checkpoint": (1, "images per checkpoint"), "max_file_bytes": (1, "bytes"),
    "listing_shards": (1, "shards per listing"), "shard_bytes": (1, "bytes"),
}

#: flag -> (highest value, why), checked by :func:`check_flags`.
_HIGHEST = {
    "streams": (256, "each stream is a thread here and an open call the server holds, "
                     "which its --max-streams caps"),
}


def check_flags(args) -> None:
    """Raise :class:`Abort` (exit code 2, one line) for a flag out of its range, or an
    --out of no known format."""
    from .sinks import unknown_format
    why = unknown_format(args.out) if isinstance(getattr(args, "out", None), str) else None
    if why:
        raise Abort(why)
    for name, (low, what) in _RANGES.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise Abort(f"--{name.replace('_', '-')} must be at least {low} ({what}), "
                        f"got {value}")
    for name, (high, what) in _HIGHEST.items():
        value = getattr(args, name, None)
        if value is not None and value > high:
            raise Abort(f"--{name.replace('_', '-')} must be at most {high} ({what}), "
                        f"got {value}")
    for name in ("timeout", "checkpoint_secs"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise Abort(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                        f"got {value}")
    from .inputs import parse_shard
    from .remote import parse_storage_options
    try:
        if getattr(args, "shard", None) is not None:
            parse_shard(args.shard)
        parse_storage_options(getattr(args, "storage_option", None))
    except ValueError as exc:
        raise Abort(str(exc)) from None
