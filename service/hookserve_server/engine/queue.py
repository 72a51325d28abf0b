"""The batch queue of one device: prepared images in, compatible batches out."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Collection

from .config import EngineConfig
from .types import CallState, WorkItem


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

    def abandon(self) -> list[WorkItem]:
        """Take every queued image out (a stop past its grace: they will not run)."""
        with self._cond:
            items, self._items = list(self._items), collections.deque()
            self.incoming = 0
            self._cond.notify_all()
            return items

    def next_batch(self, wait: bool = True, busy: Collection[CallState] = (),
                   held: int = 0) -> list[WorkItem] | None:
        """The next batch: same model, input size and `Job.batch_key` (an Attribute
        batch: one spec and one call), FIFO by its first image.

        An image whose job runs a pass at a time (`Job.resumable`: Attribute) is
        eligible unless its call is in `busy` (a call has one such batch on the model's
        thread at a time), and while running batches hold `held` bytes, only if its
        memory fits in the rest of --max-batch-bytes; other images always are. A batch
        is bounded by --max-batch-size, by --max-batch-bytes less `held`, and by
        --max-attribution-cost (its images' summed `Job.cost`); its first image always
        fits.

        With `wait`, blocks for an eligible image, then waits up to max_batch_delay_ms
        for more compatible ones while images are still being prepared (under load
        the queue fills while the previous batch runs). Without, it returns at once:
        [] when nothing is eligible. None once closed and empty.
        """
        cfg = self.cfg
        room = cfg.max_batch_bytes - held

        def eligible(it: WorkItem) -> bool:
            return not it.job.resumable or (it.call not in busy
                                       and (held <= 0 or it.activation_bytes <= room))

        with self._cond:
            while True:
                first = next((it for it in self._items if eligible(it)), None)
                if first is not None:
                    break
                if self._closed and self.incoming <= 0 and not self._items:
                    return None
                if not wait:
                    return []
                self._cond.wait()
            key = first.key
            until = first.enqueued + cfg.max_batch_delay_ms / 1000.0
            while True:
                batch, nbytes, cost, left_out = [], 0, 0, False
                for it in self._items:
                    if it.key != key:
                        continue
                    if batch and (len(batch) >= cfg.max_batch_size
                                  or nbytes + it.activation_bytes > room
                                  or cost + it.cost > cfg.max_attribution_cost):
                        left_out = True
                        break
                    batch.append(it)
                    nbytes += it.activation_bytes
                    cost += it.cost
                full = (left_out or len(batch) >= cfg.max_batch_size or nbytes >= room
                        or (first.cost > 0 and cost >= cfg.max_attribution_cost))
                remaining = until - time.monotonic()
                if full or not wait or self.incoming <= 0 or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            chosen = set(map(id, batch))
            self._items = collections.deque(it for it in self._items if id(it) not in chosen)
            return batch
