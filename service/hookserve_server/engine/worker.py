"""The device worker: the one thread that runs the models of one device.

It takes batches from its BatchQueue, drops images whose call was cancelled or whose
deadline passed, and hands the rest to their kind of work (`Job.run_batch`: Extract
in engine/extract.py, Attribute in engine/attribute.py); it never asks which kind a
batch is. Finished batches go to a completer thread, which waits for the
device-to-host copy and gives each image its own answer, off the model's thread. A
lone image on the CPU (nothing to wait for, nothing to copy out of a batch) is
answered on the model's thread: one thread hop less where latency matters most.

A batch that runs a pass at a time (`Running`, Attribute) is kept here. The loop
takes at most one batch from the queue, then runs one pass of the next running batch
in turn (one per call, round robin), so other calls' batches and passes interleave
with a long attribution between any two passes. Before each pass the batch's call is
checked: a cancelled call or a passed deadline ends it there.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import (
    Cancelled,
    DeadlineExceeded,
    HookserveError,
    InternalError,
    ResourceExhausted,
    Unavailable,
)
from ..telemetry import Telemetry
from .compiled import CompiledGraphs
from .config import EngineConfig
from .queue import BatchQueue
from .types import Running, WorkItem

log = logging.getLogger("hookserve.engine")


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    msg = str(exc)
    return isinstance(exc, oom) or "out of memory" in msg or "can't allocate memory" in msg


def batch_error(exc: Exception, n: int, fix: str = "request fewer or earlier layers"
                ) -> HookserveError:
    """The error images get when their batch of `n` failed with `exc`."""
    if is_oom(exc):
        return ResourceExhausted(
            "this image needs more device memory than is free: use a smaller "
            f"input size (preprocessing) or {fix}")
    if isinstance(exc, HookserveError):
        return exc
    log.exception("forward pass failed for a batch of %d", n)
    return InternalError("internal error while running the model")


class DeviceWorker:
    def __init__(self, device: torch.device, cfg: EngineConfig, telemetry: Telemetry) -> None:
        self.device = device
        self.cfg = cfg
        self.telemetry = telemetry
        self.queue = BatchQueue(cfg)
        self._cuda = device.type == "cuda"
        # Finished batches go to the completer thread.
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        #: batches that run a pass at a time, in turn: at most one per call
        self._runs: collections.deque[Running] = collections.deque()
        #: passes of those batches run, and batches started (Engine.attribution_*)
        self.passes = self.jobs_started = 0
        #: compiled extraction graphs (--compile; off unless Engine.compile_graphs)
        self.compiled = CompiledGraphs()
        self._thread = threading.Thread(target=self._loop, name=f"hookserve-{device}",
                                        daemon=True)
        self._completer = threading.Thread(target=self._complete_loop,
                                           name=f"hookserve-{device}-done", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._completer.start()

    def close(self, end: float | None = None) -> None:
        """Finish the queue, then stop; `end` is a time.monotonic() deadline. Images
        still queued at `end` fail UNAVAILABLE, and the batch running then is waited
        for: the process must not end under a forward pass (it aborts) nor keep a call
        waiting for an answer that never comes."""
        def left():
            return None if end is None else max(0.0, end - time.monotonic())
        self.queue.close()
        self.compiled.close()
        self._thread.join(left())
        if self._thread.is_alive():
            for item in self.queue.abandon():
                item.fail(Unavailable("the server stopped before this image ran: send it "
                                      "to another replica"))
            self._thread.join()   # (the batch it runs: a pass at most)
        self._done.put(None)
        self._completer.join()

    # -- what a job's batch uses (types.Device) ----------------------------------------
    @property
    def jobs(self) -> int:
        """Batches running a pass at a time, not finished."""
        return len(self._runs)

    @property
    def room(self) -> int:
        return self.cfg.max_batch_bytes - sum(r.memory for r in self._runs)

    def resume(self, run: Running) -> None:
        self._runs.append(run)
        self.jobs_started += 1

    def ran_pass(self, model: str, rows: int, seconds: float) -> None:
        self.passes += 1
        self.telemetry.forward(model, rows, seconds)

    def complete(self, items: list[WorkItem], outputs: list,
                 answer: Callable[[Any, bool], Any]) -> None:
        if not self._cuda and len(items) == 1:
            # A lone image on the CPU: no copy to wait for and no rows to copy out of a
            # batch, so the answer is handed out here, without a hop to the completer.
            self._hand_out(None, items, outputs, answer)
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._done.put((event, items, outputs, answer))

    # -- the model's thread ------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        runs = self._runs
        while True:
            batch = self.queue.next_batch(wait=not runs, busy={r.call for r in runs},
                                          held=sum(r.memory for r in runs))
            if batch is None and not runs:
                return
            if batch:
                try:
                    self._serve_batch(batch)
                except Exception:  # never let the model's only thread die
                    log.exception("device worker failed on a batch of %d", len(batch))
                    for it in batch:
                        it.fail(InternalError("internal error while running the model"))
            # Let go before the next wait: an idle worker must not pin the last batch's
            # pixels, answers (via its futures) and calls.
            batch = it = None
            if runs:
                run = runs[0]
                try:
                    over = run.step(self)
                except Exception:
                    log.exception("device worker failed on a pass of a running batch")
                    for it in run.items:
                        it.fail(InternalError("internal error while running the model"))
                    over = True
                if over:
                    runs.popleft()
                else:
                    runs.rotate(-1)  # its turn comes again after the others'
                run = it = None

    def _live(self, batch: list[WorkItem]) -> list[WorkItem]:
        """The images whose call is still on; the others get their error."""
        live = []
        now = time.monotonic()
        for it in batch:
            if it.call.cancelled:
                it.fail(Cancelled("the call was cancelled"))
            elif it.call.expired(now):
                it.fail(DeadlineExceeded("the call's deadline passed while the image was "
                                         "queued"))
            else:
                self.telemetry.queue_wait_seconds(now - it.enqueued)
                live.append(it)
        return live

    def _serve_batch(self, batch: list[WorkItem]) -> None:
        self.telemetry.queue_depth(str(self.device), len(self.queue))
        live = self._live(batch)
        if live:
            live[0].job.run_batch(self, live)

    # -- the completer thread ----------------------------------------------------------
    def _complete_loop(self) -> None:
        while True:
            done = self._done.get()
            if done is None:
                return
            self._hand_out(*done)
            # As in _loop: don't pin the last batch's buffers while idle.
            done = None

    def _hand_out(self, event, items: list[WorkItem], outputs, answer) -> None:
        """Give each image its own answer (after the device-to-host copy, on CUDA)."""
        try:
            if event is not None:
                event.synchronize()
            copy = len(items) > 1
            for it, out in zip(items, outputs, strict=True):
                out = answer(out, copy)
                if not it.future.done():
                    it.future.set_result(out)
        except Exception:
            log.exception("handing out a batch's answers failed")
            for it in items:
                it.fail(InternalError("internal error while handing out the answer"))
