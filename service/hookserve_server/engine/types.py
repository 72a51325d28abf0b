"""The engine's own types, shared by its stages: a resolved spec, the per-call state, the
work item that travels from preparation to the device worker, and the seam of each kind
of work (`Job`) with what it uses of the device worker (`Device`, `Running`).

A leaf: it imports no other engine module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import HookserveError
from ..models import ServedModel
from ..spec import ImageInput, LayerSpec, Preprocess, UnitType
from ..telemetry import Telemetry

if TYPE_CHECKING:
    from ..capture.plan import CapturePlan


class Job(Protocol):
    """One kind of work (Extract, Attribute), as one resolved spec asks it of each image.

    The shared stages (session, preparation, batch queue, device worker) know a kind of
    work only through these members.
    """

    #: Forward-equivalents of one image, bounded per batch by --max-attribution-cost
    #: (0: not counted).
    cost: int
    #: Its batch stays on the model's thread and runs a pass at a time (`Running`); a
    #: call has one such batch there at a time, and its memory counts while it runs.
    resumable: bool
    #: What a caller can change to make one image's answer smaller (in refusals).
    smaller: str

    def sizes(self, h: int, w: int) -> tuple[int, int]:
        """(answer, activation) bytes per image at input HxW; enforces the limits."""

    def target_of(self, image: ImageInput) -> int | None:
        """What an image asks besides the spec (Attribute: its target class, checked)."""

    def batch_key(self, call: CallState) -> Hashable:
        """What the images of one batch share besides model and input size."""

    def run_batch(self, device: Device, items: list[WorkItem]) -> None:
        """Run one batch on the model's thread; every image gets its answer or error,
        here, on the completer (`Device.complete`), or pass by pass (`Device.resume`)."""

    def cache_keys(self, state: Any, image: ImageInput) -> list[bytes]:
        """One answer-cache key per unit of an image's answer, in the answer's order,
        continuing `state` (cache/key.py `base`: the image, model and preprocessing)."""

    def only(self, units: list[int]) -> Job:
        """This job for some units of its answer (the cache computes what it misses)."""

    def unit_types(self, h: int, w: int) -> list[UnitType]:
        """What each unit's value is for an image at model input HxW, in the answer's
        order; the cache checks what it reads back against them."""


class Running(Protocol):
    """A batch that runs a pass at a time between other work (Attribute)."""

    items: list[WorkItem]
    #: Bytes it holds on the device while it runs (counted against --max-batch-bytes).
    memory: int

    @property
    def call(self) -> CallState: ...

    def step(self, device: Device) -> bool:
        """One pass, unless its call ended; True when the batch is over."""


class Capturer(Protocol):
    """The forward pass an Extract batch runs: eager hooks, or a compiled graph once
    one is ready for its shape (engine/compiled.py)."""

    def capture(self, model: ServedModel, x: torch.Tensor, plan: CapturePlan
                ) -> dict[LayerSpec, torch.Tensor]:
        """Each planned layer's reduced batch tensor."""


class Device(Protocol):
    """What a job's batch uses of the device worker that runs it."""

    device: torch.device
    telemetry: Telemetry
    #: how Extract batches run their forward pass (--compile)
    compiled: Capturer

    @property
    def room(self) -> int:
        """--max-batch-bytes less what running batches hold."""

    def complete(self, items: list[WorkItem], outputs: list,
                 answer: Callable[[Any, bool], Any]) -> None:
        """Hand each image `answer(its output, copy)` once the device is done (`copy`:
        the output is a row of a batch tensor)."""

    def resume(self, run: Running) -> None:
        """Keep `run` and give it a pass in turn with the other running batches."""

    def ran_pass(self, model: str, rows: int, seconds: float) -> None:
        """A pass of a running batch ran (counted, observed)."""


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated spec bound to its model and its kind of work."""

    model: ServedModel
    job: Job
    preprocess: Preprocess
    #: Model input size when it does not depend on the image.
    fixed_size: tuple[int, int] | None
    #: Answer and activation bytes per image at fixed_size (0 when the size varies).
    answer_bytes: int = 0
    activation_bytes: int = 0


class Room:
    """Room taken for a request's images together: each image takes one place."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            return True

    def close(self) -> int:
        """The places not taken (none can be taken from here on)."""
        with self._lock:
            left, self._left = self._left, 0
            return left


class CallState:
    """What the stages after admission need of a call: its deadline and whether it
    was cancelled. Work items point here, not to the Session."""

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        #: room in the queue taken for all this call's images at once
        #: (`Admission.room_for`); None: each image waits for its own
        self.room: Room | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._on_cancel: list = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            callbacks, self._on_cancel = self._on_cancel, []
        for fn in callbacks:
            fn()

    def on_cancel(self, fn) -> None:
        """Call `fn()` once when the call is cancelled (now, if it was already)."""
        with self._lock:
            if not self._cancelled.is_set():
                self._on_cancel.append(fn)
                return
        fn()

    def forget(self, fn) -> None:
        """`fn` is no longer needed (its wait ended)."""
        with self._lock:
            if fn in self._on_cancel:
                self._on_cancel.remove(fn)

    def expired(self, now: float | None = None) -> bool:
        if now is None:
            now = time.monotonic()
        return self.deadline is not None and now > self.deadline


@dataclass(eq=False)
class WorkItem:
    """One prepared image waiting for (or in) a batch."""

    model: ServedModel
    pixels: torch.Tensor            # uint8 3xHxW, on the CPU (or the device: --gpu-decode)
    job: Job
    activation_bytes: int
    call: CallState
    future: Future
    enqueued: float = 0.0
    #: What the image asks besides its spec (`Job.target_of`; Attribute: its target).
    target: int | None = None

    @property
    def key(self) -> tuple:
        """Images with the same key can share a batch."""
        return (self.model.name, self.pixels.shape[1], self.pixels.shape[2],
                self.job.batch_key(self.call))

    @property
    def cost(self) -> int:
        return self.job.cost

    def fail(self, error: HookserveError) -> None:
        """End this image with an error (its permit is released by its future)."""
        if not self.future.done():
            self.future.set_exception(error.detached())
