"""Preparation of one image on the pool: decode, geometry, per-image limits, queue.

Runs on the preprocessing pool (--preprocess-workers threads). Decoding is on the
CPU (preprocess/decode.py) or, with --gpu-decode, on the model's device
(preprocess/gpu_decode.py); geometry follows (preprocess/geometry.py). Before that,
on the call's reader thread (ExtractImage: its handler thread), `plan` reads the
header and checks every size the image will go through (engine/limits.py) and its
answer and activation bytes (`Job.sizes`: engine/limits.py for Extract,
engine/attribute.py for Attribute), so nothing is decoded or resized that the limits
would refuse. The result is a WorkItem on the
device's BatchQueue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import (
    Cancelled,
    DeadlineExceeded,
    HookserveError,
    InternalError,
    InvalidArgument,
    Unavailable,
)
from ..models import ServedModel
from ..openmp import one_thread_here
from ..preprocess.decode import decode, read_header
from ..preprocess.geometry import Geometry, apply_geometry, geometry_on_tensor, plan_geometry
from ..preprocess.gpu_decode import decode_jpeg_on_device, probe_jpeg_bytes
from ..spec import ImageInput
from ..telemetry import Telemetry
from .budget import Budget
from .config import EngineConfig
from .limits import Limits
from .queue import BatchQueue
from .types import CallState, ResolvedSpec, WorkItem

log = logging.getLogger("hookserve.engine")

#: What a caller can change when an image's decode and resize would not fit.
SMALLER_DECODE = "send a smaller image, or ask for a smaller resize"


@dataclass(frozen=True)
class ImagePlan:
    """One image's sizes and costs, known from its header before it is decoded."""

    geometry: Geometry
    #: bytes of its answer (reserved in the answer budgets before it is computed)
    answer_bytes: int
    #: activation bytes it adds to a batch (--max-batch-bytes)
    activation_bytes: int


class Preparer:
    def __init__(self, config: EngineConfig, limits: Limits, telemetry: Telemetry,
                 freed: Callable[[int], None] = lambda nbytes: None) -> None:
        self.config = config
        #: told the bytes an image's decode and resize held once it is done (the
        #: allocator's MemoryReturn: a large photo's decode is given back when idle)
        self._freed = freed
        self.limits = limits
        self.telemetry = telemetry
        # One OpenMP team in the process, the model thread's (openmp.py says why).
        self._pool = ThreadPoolExecutor(config.preprocess_workers,
                                        thread_name_prefix="hookserve-pre",
                                        initializer=one_thread_here)
        #: estimated peak bytes of the images being decoded and resized right now
        self._memory = Budget(config.max_preprocess_bytes, "--max-preprocess-bytes")
        #: Set by probe_gpu_decode() when the GPU decoder fails on a known-good JPEG.
        self._gpu_decode_off = False

    def probe_gpu_decode(self, device: torch.device) -> None:
        """--gpu-decode: try the GPU decoder once; decode on the CPU if it fails.

        Per-image failures later never switch it off, so corrupt uploads cannot turn
        it off for everyone.
        """
        try:
            decode_jpeg_on_device(ImageInput("probe", encoded=probe_jpeg_bytes()),
                                  self.config.max_image_pixels, device)
        except Exception as exc:
            log.warning("--gpu-decode: the GPU JPEG decoder does not work here (%s); "
                        "decoding on the CPU", exc)
            self._gpu_decode_off = True

    def shutdown(self) -> None:
        """Images already submitted are still prepared and queued."""
        self._pool.shutdown(wait=False)

    def plan(self, spec: ResolvedSpec, image: ImageInput) -> ImagePlan:
        """Every size and byte count of one image, from its header alone, checked
        against the limits (raises InvalidArgument / ResourceExhausted). Cheap: it runs
        on the call's reader thread, before the image is admitted."""
        m = spec.model
        h, w = read_header(image, self.config.max_image_pixels)
        g = plan_geometry(spec.preprocess, m.defaults.resize, m.defaults.crop, h, w)
        self.limits.geometry(g)
        self._memory.check(g.peak_bytes, SMALLER_DECODE,
                           what="the memory to decode and resize this image")
        if spec.fixed_size is not None:
            return ImagePlan(g, spec.answer_bytes, spec.activation_bytes)
        answer, activation = spec.job.sizes(*g.input)
        return ImagePlan(g, answer, activation)

    def submit(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan, call: CallState,
               fut: Future, queue: BatchQueue) -> None:
        """Start preparing an admitted image; `fut` gets its error if that fails."""
        queue.add_incoming(1)
        try:
            self._pool.submit(self._prepare, spec, image, plan, call, fut, queue)
        except RuntimeError:  # pool shut down
            queue.add_incoming(-1)
            raise Unavailable("server is shutting down: retry on another replica") from None

    def _prepare(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan,
                 call: CallState, fut: Future, queue: BatchQueue) -> None:
        t0 = time.perf_counter()
        try:
            item = self._work_item(spec, image, plan, call, fut)
        except Exception as exc:
            queue.add_incoming(-1)
            if not isinstance(exc, HookserveError):
                log.exception("preprocessing failed")
                exc = InternalError("internal error while preprocessing the image")
            fut.set_exception(exc.detached())
            return
        self.telemetry.preprocess_seconds(time.perf_counter() - t0)
        queue.put(item)

    def _work_item(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan,
                   call: CallState, fut: Future) -> WorkItem:
        if call.cancelled:
            raise Cancelled("the call was cancelled")
        if call.expired():
            raise DeadlineExceeded("the call's deadline passed before the image was decoded")
        held = self._memory.reserve(plan.geometry.peak_bytes, lambda: call.cancelled,
                                    SMALLER_DECODE)
        if held is None:
            raise Cancelled("the call was cancelled")
        try:
            with held:
                return self._decode_and_resize(spec, image, plan, call, fut)
        finally:
            self._freed(plan.geometry.peak_bytes)

    def _decode_and_resize(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan,
                           call: CallState, fut: Future) -> WorkItem:
        m = spec.model
        d = m.defaults
        on_device = self._decode_on_device(m, image)
        if on_device is None:
            arr = decode(image, self.config.max_image_pixels)
            size = (arr.shape[0], arr.shape[1])
        else:
            size = (on_device.shape[1], on_device.shape[2])
        if size != plan.geometry.decoded:  # the limits were checked on the header's size
            h, w = plan.geometry.decoded
            raise InvalidArgument(f"the image decoded to {size[0]}x{size[1]} pixels but its "
                                  f"header says {h}x{w}: the file is inconsistent")
        if on_device is None:
            pixels = apply_geometry(arr, spec.preprocess, d.resize, d.crop, d.interpolation)
        else:
            pixels = geometry_on_tensor(on_device, spec.preprocess, d.resize, d.crop,
                                        d.interpolation)
        return WorkItem(m, pixels, spec.job, plan.activation_bytes, call, fut,
                        target=spec.job.target_of(image))

    def _decode_on_device(self, m: ServedModel, image: ImageInput) -> torch.Tensor | None:
        """--gpu-decode: a plain RGB JPEG decoded on the model's CUDA device, else None.

        None means "use the CPU path": other formats, CPU models, the flag off, a GPU
        decoder that failed its warm-up probe, and any failure on this image (the CPU
        path then decodes it, or reports it as corrupt with its usual message).
        """
        if not self.config.gpu_decode or m.device.type != "cuda" or self._gpu_decode_off:
            return None
        try:
            return decode_jpeg_on_device(image, self.config.max_image_pixels, m.device)
        except Exception as exc:
            log.debug("GPU JPEG decoding failed for one image, decoding on the CPU: %s", exc)
            return None
