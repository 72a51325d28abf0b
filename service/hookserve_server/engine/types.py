"""The engine's own types: its configuration, a resolved spec, the per-call state,
and the work item that travels from preparation to the device worker."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..models import ServedModel
from ..spec import ImageInput, LayerSpec, Preprocess

if TYPE_CHECKING:
    from .attribute import AttributeTask
    from .limits import Limits


@dataclass
class EngineConfig:
    """Limits and batching knobs. Every size a client controls is bounded here."""

    max_batch_size: int = 32
    max_batch_delay_ms: float = 5.0
    #: Cap on activation bytes (full, unreduced outputs of the requested layers) per batch.
    max_batch_bytes: int = 1 << 30
    #: Images admitted (being preprocessed or queued for the model) across all calls.
    max_queue: int = 1024
    #: How long an image waits for room in a full queue before RESOURCE_EXHAUSTED.
    queue_wait_s: float = 2.0
    #: Images of one stream admitted but not yet answered (backpressure beyond that).
    max_inflight_per_stream: int = 64
    #: Bytes of answers one stream may have reserved and not yet sent.
    max_stream_buffer_bytes: int = 256 << 20
    #: The same across all streams (--max-buffer-bytes).
    max_buffer_bytes: int = 2 << 30
    #: Estimated peak memory of the images being decoded and resized at once.
    max_preprocess_bytes: int = 4 << 30
    max_image_pixels: int = 50_000_000
    #: Estimated response bytes for one image (all its layers, after reduction).
    max_response_bytes: int = 1 << 30
    max_layers: int = 256
    max_input_side: int = 8192
    preprocess_workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 2))
    #: Decode plain RGB JPEGs on the model's CUDA device (--gpu-decode); CPU otherwise.
    gpu_decode: bool = False
    #: Largest Attribute request, in forward-equivalents (AttributionSpec.cost) per image,
    #: per batch and per call at once on the model's thread.
    max_attribution_cost: int = 1024
    #: Forward-equivalents of one Attribute pass; other work runs between passes.
    attribution_pass_cost: int = 16


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated spec bound to its model."""

    model: ServedModel
    layers: tuple[LayerSpec, ...]
    preprocess: Preprocess
    #: Model input size when it does not depend on the image.
    fixed_size: tuple[int, int] | None
    #: Answer and activation bytes per image at fixed_size (0 when the size varies).
    answer_bytes: int = 0
    activation_bytes: int = 0

    def sizes(self, limits: Limits, h: int, w: int) -> tuple[int, int]:
        """(answer, activation) bytes per image at input HxW; enforces the limits."""
        return limits.answer(self.model, self.layers, h, w)

    def task_for(self, image: ImageInput) -> AttributeTask | None:
        """What an image's work item carries besides its layers (Attribute only)."""
        return None


class CallState:
    """What the stages after admission need of a call: its deadline and whether it
    was cancelled. Work items point here, not to the Session."""

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
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
    layers: tuple[LayerSpec, ...]
    activation_bytes: int
    call: CallState
    future: Future
    enqueued: float = 0.0
    #: An Attribute image's spec and target (engine/attribute.py); None for Extract.
    task: AttributeTask | None = None

    @property
    def key(self):
        """Images with the same key can share a batch (an Attribute batch: one spec and
        one call)."""
        return (self.model.name, self.pixels.shape[1], self.pixels.shape[2],
                None if self.task is None else (self.task.batch_key, self.call))

    @property
    def cost(self) -> int:
        """Forward-equivalents of this image (0 for Extract)."""
        return 0 if self.task is None else self.task.spec.attribution.cost
