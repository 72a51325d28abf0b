"""The Extract path of the engine: its kind of work (`ExtractJob`) and its batch on the
model's thread.

A batch of Extract images shares model and input size; the specs may differ (each
image brings its layers). One forward pass with hooks on the union of their capture
points (capture/plan.py, capture/forward.py), stopped after the last one; a batch
that runs out of memory is split in halves. The device-to-host wait and each image's
own copy of its rows happen on the completer thread (`Device.complete`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

import torch

from ..cache import key as cache_key
from ..capture.forward import stack_inputs, to_host
from ..capture.plan import CapturePlan
from ..capture.reduce import DTYPE_OF_TORCH, REDUCTIONS, reduced_shape
from ..capture.table import entry
from ..models import ServedModel
from ..spec import ImageInput, LayerOutput, LayerSpec, UnitType
from .limits import Limits
from .types import CallState, Device, WorkItem
from .worker import batch_error, is_oom

log = logging.getLogger("hookserve.engine")


class ExtractJob:
    """An ExtractionSpec's work for each image: its layers, reduced."""

    cost = 0
    resumable = False
    smaller = "request fewer layers, a reduction (avg/max), float16, or a smaller input size"

    def __init__(self, limits: Limits, model: ServedModel, layers: tuple[LayerSpec, ...]
                 ) -> None:
        self.limits = limits
        self.model = model
        self.layers = layers

    def sizes(self, h: int, w: int) -> tuple[int, int]:
        return self.limits.answer(self.model, self.layers, h, w)

    def target_of(self, image: ImageInput) -> None:
        return None

    def batch_key(self, call: CallState) -> Hashable:
        return ExtractJob  # any spec and any call: the batch's layers are their union

    def cache_keys(self, state, image: ImageInput) -> list[bytes]:
        return [cache_key.layer_key(state, layer) for layer in self.layers]

    def only(self, units: list[int]) -> ExtractJob:
        return ExtractJob(self.limits, self.model, tuple(self.layers[i] for i in units))

    def unit_types(self, h: int, w: int) -> list[UnitType]:
        table = self.model.layer_table(h, w)
        return [UnitType(False, layer.name, layer.dtype,
                         reduced_shape(layer, entry(table, layer.name).shape),
                         REDUCTIONS[layer.reduction].columns) for layer in self.layers]

    def run_batch(self, device: Device, items: list[WorkItem]) -> None:
        try:
            outputs = _forward(device, items)
        except Exception as exc:
            if is_oom(exc):
                if device.device.type == "cuda":
                    torch.cuda.empty_cache()
                if len(items) > 1:
                    log.warning("out of memory on a batch of %d: splitting", len(items))
                    half = len(items) // 2
                    self.run_batch(device, items[:half])
                    self.run_batch(device, items[half:])
                    return
            err = batch_error(exc, len(items))
            for it in items:
                it.fail(err)
            return
        device.complete(items, outputs, _answer)


def _forward(device: Device, items: list[WorkItem]) -> list[list]:
    """Per image: (LayerSpec, tensor) pairs."""
    model = items[0].model
    t0 = time.perf_counter()
    x = stack_inputs(model, [it.pixels for it in items], device.device)
    plan = CapturePlan.for_batch(model, (it.job.layers for it in items))
    captured = device.compiled.capture(model, x, plan)  # eager until a graph is ready
    if device.device.type == "cuda":
        captured = to_host(captured)
    outputs = [[(s, captured[s][i]) for s in it.job.layers] for i, it in enumerate(items)]
    device.telemetry.forward(model.name, len(items), time.perf_counter() - t0)
    return outputs


def _answer(out: list[tuple[LayerSpec, torch.Tensor]], copy: bool) -> list[LayerOutput]:
    # A row is a view of the whole batch tensor: copy it, so a slow reader holding one
    # answer does not pin the batch's answers.
    return [layer_output(s, t.clone() if copy else t) for s, t in out]


def layer_output(spec: LayerSpec, t: torch.Tensor) -> LayerOutput:
    """A contiguous CPU tensor as the bytes sent for it (a zero-copy view)."""
    return LayerOutput(spec.name, DTYPE_OF_TORCH[t.dtype], tuple(t.shape),
                       memoryview(t.reshape(-1).view(torch.uint8).numpy()),
                       REDUCTIONS[spec.reduction].columns)
