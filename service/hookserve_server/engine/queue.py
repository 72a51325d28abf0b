"""The batch queue of one device: prepared images in, compatible batches out."""

from __future__ import annotations

import collections
import threading
import time

from .types import EngineConfig, WorkItem


class BatchQueue:
    """FIFO of prepared images; hands out batches of one model and input size."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._items: collections.deque[WorkItem] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        #: images admitted and still being prepared (more may arrive soon)
        self.incoming = 0

    def __len__(self) -> int:
        return len(self._items)

    def add_incoming(self, n: int) -> None:
        with self._cond:
            self.incoming += n
            if n < 0:
                self._cond.notify_all()

    def put(self, item: WorkItem) -> None:
        with self._cond:
            item.enqueued = time.monotonic()
            self._items.append(item)
            self.incoming -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_batch(self) -> list[WorkItem] | None:
        """Block for the next batch: same model and input size, FIFO by first item.

        Waits up to max_batch_delay_ms for more compatible images, but only while
        images are still being prepared; under load the queue fills while the
        previous batch runs, so no wait is needed. None once closed and empty.
        """
        cfg = self.cfg
        with self._cond:
            while not self._items:
                if self._closed and self.incoming <= 0:
                    return None
                self._cond.wait()
            first = self._items[0]
            key = first.key
            until = first.enqueued + cfg.max_batch_delay_ms / 1000.0
            while True:
                batch, nbytes = [], 0
                for it in self._items:
                    if it.key != key:
                        continue
                    if batch and (len(batch) >= cfg.max_batch_size
                                  or nbytes + it.activation_bytes > cfg.max_batch_bytes):
                        break
                    batch.append(it)
                    nbytes += it.activation_bytes
                full = (len(batch) >= cfg.max_batch_size
                        or nbytes >= cfg.max_batch_bytes
                        or len(batch) < sum(1 for it in self._items if it.key == key))
                remaining = until - time.monotonic()
                if full or self.incoming <= 0 or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            chosen = set(map(id, batch))
            self._items = collections.deque(it for it in self._items if id(it) not in chosen)
            return batch
