"""The device worker: the one thread that runs the models of one device.

It takes batches from its BatchQueue, drops images whose call was cancelled or whose
deadline passed, runs the forward pass (capture/forward.py), splits a batch that runs
out of memory, and hands finished batches to a completer thread, which waits for the
device-to-host copy and gives each image its own answer, off the model's thread. A
lone image on the CPU (nothing to wait for, nothing to copy out of a batch) is
answered on the model's thread: one thread hop less where latency matters most.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ..capture.forward import capture, stack_inputs, to_host
from ..capture.plan import CapturePlan
from ..capture.reduce import DTYPE_OF_TORCH, REDUCTIONS
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    HookserveError,
    InternalError,
    ResourceExhausted,
)
from ..spec import LayerOutput, LayerSpec
from ..telemetry import Telemetry
from .attribute import run_batch as attribution_batch
from .queue import BatchQueue
from .types import EngineConfig, WorkItem

log = logging.getLogger("hookserve.engine")


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    msg = str(exc)
    return isinstance(exc, oom) or "out of memory" in msg or "can't allocate memory" in msg


def layer_output(spec: LayerSpec, t: torch.Tensor) -> LayerOutput:
    """A contiguous CPU tensor as the bytes sent for it (a zero-copy view)."""
    return LayerOutput(spec.name, DTYPE_OF_TORCH[t.dtype], tuple(t.shape),
                       memoryview(t.reshape(-1).view(torch.uint8).numpy()),
                       REDUCTIONS[spec.reduction].columns)


class DeviceWorker:
    def __init__(self, device: torch.device, cfg: EngineConfig, telemetry: Telemetry) -> None:
        self.device = device
        self.cfg = cfg
        self.telemetry = telemetry
        self.queue = BatchQueue(cfg)
        self._cuda = device.type == "cuda"
        # Finished batches go to the completer thread.
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"hookserve-{device}",
                                        daemon=True)
        self._completer = threading.Thread(target=self._complete_loop,
                                           name=f"hookserve-{device}-done", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._completer.start()

    def close(self, end: float | None = None) -> None:
        """Finish the queue, then stop; `end` is a time.monotonic() deadline."""
        def left():
            return None if end is None else max(0.0, end - time.monotonic())
        self.queue.close()
        self._thread.join(left())
        self._done.put(None)
        self._completer.join(left())

    # -- the model's thread ------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            batch = self.queue.next_batch()
            if batch is None:
                return
            try:
                self._serve_batch(batch)
            except Exception:  # never let the model's only thread die
                log.exception("device worker failed on a batch of %d", len(batch))
                for it in batch:
                    _fail(it, InternalError("internal error while running the model"))
            # Let go before blocking for the next batch: an idle worker must not pin
            # the last batch's pixels, answers (via its futures) and calls.
            batch = it = None

    def _serve_batch(self, batch: list[WorkItem]) -> None:
        self.telemetry.queue_depth(str(self.device), len(self.queue))
        live = []
        now = time.monotonic()
        for it in batch:
            if it.call.cancelled:
                _fail(it, Cancelled("the call was cancelled"))
            elif it.call.expired(now):
                _fail(it, DeadlineExceeded(
                    "the call's deadline passed while the image was queued"))
            else:
                self.telemetry.queue_wait_seconds(now - it.enqueued)
                live.append(it)
        if live:
            self._run(live)

    def _run(self, items: list[WorkItem]) -> None:
        try:
            outputs = self._forward(items)
        except Exception as exc:
            if is_oom(exc):
                if self._cuda:
                    torch.cuda.empty_cache()
                if len(items) > 1:
                    log.warning("out of memory on a batch of %d: splitting", len(items))
                    half = len(items) // 2
                    self._run(items[:half])
                    self._run(items[half:])
                    return
                err: HookserveError = ResourceExhausted(
                    "this image needs more device memory than is free: use a smaller "
                    "input size (preprocessing) or request fewer or earlier layers")
            elif isinstance(exc, HookserveError):
                err = exc
            else:
                log.exception("forward pass failed for a batch of %d", len(items))
                err = InternalError("internal error while running the model")
            for it in items:
                _fail(it, err)
            return
        if not self._cuda and len(items) == 1:
            # A lone image on the CPU: no copy to wait for and no rows to copy out of a
            # batch, so the answer is handed out here, without a hop to the completer.
            self._hand_out(None, items, outputs)
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._done.put((event, items, outputs))

    def _forward(self, items: list[WorkItem]) -> list[list]:
        """Per image: (LayerSpec, tensor) pairs (Extract), or its finished answer, an
        AttributionOutput on the CPU (Attribute: engine/attribute.py)."""
        model = items[0].model
        t0 = time.perf_counter()
        x = stack_inputs(model, [it.pixels for it in items], self.device)
        if items[0].task is not None:
            outputs = attribution_batch(model, x, items)
        else:
            plan = CapturePlan.for_batch(model, (it.layers for it in items))
            captured = capture(model, x, plan)
            if self._cuda:
                captured = to_host(captured)
            outputs = [[(s, captured[s][i]) for s in it.layers] for i, it in enumerate(items)]
        self.telemetry.forward(model.name, len(items), time.perf_counter() - t0)
        return outputs

    # -- the completer thread ----------------------------------------------------------
    def _complete_loop(self) -> None:
        while True:
            job = self._done.get()
            if job is None:
                return
            self._hand_out(*job)
            # As in _loop: don't pin the last batch's buffers while idle.
            job = None

    def _hand_out(self, event, items: list[WorkItem], outputs) -> None:
        """Give each image its own answer (after the device-to-host copy, on CUDA)."""
        try:
            if event is not None:
                event.synchronize()
            for it, out in zip(items, outputs, strict=True):
                if it.task is None:  # Attribute answers come finished
                    if len(items) > 1:
                        # A row is a view of the whole batch tensor: copy it, so a slow
                        # reader holding one answer does not pin the batch's answers.
                        out = [(spec, t.clone()) for spec, t in out]
                    out = [layer_output(s, t) for s, t in out]
                if not it.future.done():
                    it.future.set_result(out)
        except Exception:
            log.exception("handing out a batch's answers failed")
            for it in items:
                _fail(it, InternalError("internal error while handing out the answer"))


def _fail(it: WorkItem, error: HookserveError) -> None:
    """End one image with an error (its permit is released by its future)."""
    if not it.future.done():
        it.future.set_exception(error.detached())
