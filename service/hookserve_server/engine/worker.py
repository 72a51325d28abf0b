"""The device worker: the one thread that runs the models of one device.

It takes batches from its BatchQueue, drops images whose call was cancelled or whose
deadline passed, runs the forward pass (capture/forward.py), splits a batch that runs
out of memory, and hands finished batches to a completer thread, which waits for the
device-to-host copy and gives each image its own answer, off the model's thread. A
lone image on the CPU (nothing to wait for, nothing to copy out of a batch) is
answered on the model's thread: one thread hop less where latency matters most.

An Attribute batch becomes a job (engine/attribute.py) that runs one pass at a time.
The loop takes at most one batch from the queue, then runs one pass of the next job
in turn (one job per call, round robin), so other calls' batches and jobs interleave
with a long attribution between any two passes. Before each pass the job's call is
checked: a cancelled call or a passed deadline ends the job there.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch

from ..capture.forward import stack_inputs, to_host
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
from .attribute import AttributeJob, start_job
from .compiled import CompiledGraphs
from .queue import BatchQueue
from .types import EngineConfig, WorkItem

log = logging.getLogger("hookserve.engine")

#: What an Attribute image that runs out of memory can ask for instead.
ATTRIBUTION_FIX = "a smaller top_k, or a CAM method at a later layer"


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
        #: Attribute jobs in turn (engine/attribute.py): at most one per call
        self._jobs: collections.deque[AttributeJob] = collections.deque()
        #: Attribute passes run and jobs started (Engine.attribution_passes, _jobs)
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
        """Finish the queue, then stop; `end` is a time.monotonic() deadline."""
        def left():
            return None if end is None else max(0.0, end - time.monotonic())
        self.queue.close()
        self.compiled.close()
        self._thread.join(left())
        self._done.put(None)
        self._completer.join(left())

    # -- the model's thread ------------------------------------------------------------
    @property
    def jobs(self) -> int:
        """Attribute jobs started and not finished."""
        return len(self._jobs)

    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        jobs = self._jobs
        while True:
            batch = self.queue.next_batch(wait=not jobs, busy={j.call for j in jobs},
                                          held=sum(j.memory for j in jobs))
            if batch is None and not jobs:
                return
            if batch:
                try:
                    self._serve_batch(batch)
                except Exception:  # never let the model's only thread die
                    log.exception("device worker failed on a batch of %d", len(batch))
                    for it in batch:
                        _fail(it, InternalError("internal error while running the model"))
            # Let go before the next wait: an idle worker must not pin the last batch's
            # pixels, answers (via its futures) and calls.
            batch = it = None
            if jobs:
                job = jobs[0]
                try:
                    over = self._attribution_pass(job)
                except Exception:
                    log.exception("device worker failed on an attribution pass")
                    for it in job.items:
                        _fail(it, InternalError("internal error while running the model"))
                    over = True
                if over:
                    jobs.popleft()
                else:
                    jobs.rotate(-1)  # its turn comes again after the others'
                job = it = None

    def _live(self, batch: list[WorkItem]) -> list[WorkItem]:
        """The images whose call is still on; the others get their error."""
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
        return live

    def _serve_batch(self, batch: list[WorkItem]) -> None:
        self.telemetry.queue_depth(str(self.device), len(self.queue))
        live = self._live(batch)
        if not live:
            return
        if live[0].task is None:
            self._run(live)
            return
        held = sum(j.memory for j in self._jobs)
        try:
            x = stack_inputs(live[0].model, [it.pixels for it in live], self.device)
            self._jobs.append(start_job(live[0].model, x, live,
                                        self.cfg.max_batch_bytes - held, self.cfg))
            self.jobs_started += 1
        except Exception as exc:
            for it in live:
                _fail(it, self._error(exc, len(live), ATTRIBUTION_FIX))

    def _attribution_pass(self, job: AttributeJob) -> bool:
        """One pass of `job`, unless its call ended; True when the job is over."""
        call = job.call
        if call.cancelled or call.expired():
            done, total = job.job.passes, job.job.total_passes()
            err: HookserveError = Cancelled(
                f"the call was cancelled after {done} of its {total} attribution passes")
            if not call.cancelled:
                err = DeadlineExceeded(
                    f"the call's deadline passed after {done} of the {total} attribution "
                    "passes of its batch: allow more time, or ask for fewer steps, "
                    "samples or top_k")
            for it in job.items:
                _fail(it, err)
            return True
        model = job.items[0].model
        t0 = time.perf_counter()
        try:
            done = job.job.run_pass()
            outputs = job.outputs() if done else None
        except Exception as exc:
            if is_oom(exc) and self._cuda:
                torch.cuda.empty_cache()
            if is_oom(exc) and job.job.plan.rows > 1:
                log.warning("out of memory in an attribution pass of %d rows: restarting "
                            "its batch with half the rows", job.job.plan.rows)
                job.job.restart(job.job.plan.rows // 2)
                return False
            for it in job.items:
                _fail(it, self._error(exc, len(job.items), ATTRIBUTION_FIX))
            return True
        self.passes += 1
        self.telemetry.forward(model.name, job.job.plan.rows, time.perf_counter() - t0)
        if not done:
            return False
        for it, out in zip(job.items, outputs, strict=True):
            if not it.future.done():
                it.future.set_result(out)
        return True

    def _error(self, exc: Exception, n: int,
               fix: str = "request fewer or earlier layers") -> HookserveError:
        """The error images get when their batch failed with `exc`."""
        if is_oom(exc):
            return ResourceExhausted(
                "this image needs more device memory than is free: use a smaller "
                f"input size (preprocessing) or {fix}")
        if isinstance(exc, HookserveError):
            return exc
        log.exception("forward pass failed for a batch of %d", n)
        return InternalError("internal error while running the model")

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
            err = self._error(exc, len(items))
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
        """Per image: (LayerSpec, tensor) pairs."""
        model = items[0].model
        t0 = time.perf_counter()
        x = stack_inputs(model, [it.pixels for it in items], self.device)
        plan = CapturePlan.for_batch(model, (it.layers for it in items))
        captured = self.compiled.capture(model, x, plan)
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
