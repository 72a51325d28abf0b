"""The local tier: answers in memory, least recently used first out, bounded by bytes,
and the single-flight table: concurrent misses on one key compute it once.

`claim` is the one entry: a hit gives the value; a key being computed gives that
computation's Future to wait on; otherwise the caller leads: it gets a new Future,
computes, and calls `finish`, which stores the value (when it fits), ends the flight
and wakes whoever waited.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from ..spec import LayerOutput
from ..telemetry import Telemetry

#: Bytes an entry costs besides its tensor (key, objects, dict slot): a fair bound.
ENTRY_OVERHEAD = 512

HIT, WAIT, LEAD = "hit", "wait", "lead"


def entry_bytes(value: LayerOutput) -> int:
    return value.nbytes + ENTRY_OVERHEAD


class LocalCache:
    """An LRU of answers bounded by `capacity` bytes (0: none kept; single-flight still
    applies)."""

    def __init__(self, capacity: int, telemetry: Telemetry | None = None) -> None:
        self.capacity = capacity
        self.telemetry = telemetry or Telemetry()
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, LayerOutput] = OrderedDict()
        self._flights: dict[bytes, Future] = {}
        #: bytes held now (entries and their overhead), never over `capacity`
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def claim(self, key: bytes) -> tuple[str, object]:
        """(HIT, value), (WAIT, the flight's Future) or (LEAD, a new flight's Future)."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                return HIT, value
            flight = self._flights.get(key)
            if flight is not None:
                return WAIT, flight
            flight = self._flights[key] = Future()
            return LEAD, flight

    def finish(self, key: bytes, value: LayerOutput | None,
               error: BaseException | None = None) -> None:
        """End the flight of `key`: store `value` and give it to the waiters, or give
        them `error`."""
        with self._lock:
            flight = self._flights.pop(key, None)
            if value is not None:
                self._store(key, value)
        if flight is not None:  # outside the lock: the waiters' callbacks run here
            if value is not None:
                flight.set_result(value)
            else:
                flight.set_exception(error)

    def _store(self, key: bytes, value: LayerOutput) -> None:
        size = entry_bytes(value)
        if size > self.capacity or key in self._entries:
            return
        evicted = 0
        while self.bytes + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= entry_bytes(old)
            evicted += 1
        self._entries[key] = value
        self.bytes += size
        self.evictions += evicted
        if evicted:
            self.telemetry.cache_event("local", "eviction", evicted)
        self.telemetry.cache_bytes("local", self.bytes)
