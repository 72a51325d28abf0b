"""One batched forward pass with hooks on the planned capture points.

Hooks are registered for this batch only and removed when it ends (an ExitStack,
even on errors); each keeps its state in this call's closure, never on the module, so
batches share nothing. The last hook to fire stops the pass: later layers never run.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from ..errors import InternalError
from ..precision import autocast
from ..spec import LayerSpec
from .plan import CapturePlan, Kind
from .reduce import reduce

if TYPE_CHECKING:  # a type only: models build on capture's table, not back
    from ..models import ServedModel


class _StopForward(Exception):
    """Raised by the last hook to fire: nothing after it needs to run."""


def stack_inputs(model: ServedModel, pixels: list[torch.Tensor],
                 device: torch.device) -> torch.Tensor:
    """uint8 3xHxW images -> the normalised input batch on the model's device."""
    if any(p.is_cuda for p in pixels):  # --gpu-decode put some on the device
        x = torch.stack([p.to(device, non_blocking=True) for p in pixels])
    else:
        x = torch.stack(pixels)
        if device.type == "cuda":
            x = x.pin_memory().to(device, non_blocking=True)
    x = x.to(torch.float32).div_(255.0).sub_(model.mean).div_(model.std)
    x = x.to(model.torch_dtype)
    if model.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def capture(model: ServedModel, x: torch.Tensor, plan: CapturePlan
            ) -> dict[LayerSpec, torch.Tensor]:
    """Run the model on `x`; each planned layer's reduced batch tensor, on the device."""
    captured: dict[LayerSpec, torch.Tensor] = {}
    remaining = [len(plan.points)]

    def make_fire(by_call: dict[int, list[LayerSpec]]):
        calls = [0]

        def fire(t) -> None:
            k = calls[0]
            calls[0] = k + 1
            specs = by_call.get(k)
            if not specs:
                return
            remaining[0] -= 1
            last = remaining[0] == 0 and plan.stop_early
            for spec in specs:
                captured[spec] = reduce(t, spec, may_alias=last)
            if last:
                raise _StopForward
        return fire

    def register(module, kind: Kind, fire):
        if kind is Kind.INPUT:   # a pre-hook sees (module, args) before the module runs
            return module.register_forward_pre_hook(
                lambda m, args: fire(args[0] if args else None))
        return module.register_forward_hook(lambda m, args, out: fire(out))

    with ExitStack() as stack, torch.inference_mode():
        stack.enter_context(autocast(model.precision, x.device))
        for (path, kind), by_call in plan.hooks().items():
            stack.enter_context(register(model.modules[path], kind, make_fire(by_call)))
        try:
            model.module(x)
        except _StopForward:
            pass
    if remaining[0] != 0:
        missing = sorted(s.name for s in plan.specs if s not in captured)
        raise InternalError(f"layers did not run in the forward pass: {missing}")
    return captured


def to_host(captured: dict[LayerSpec, torch.Tensor]) -> dict[LayerSpec, torch.Tensor]:
    """Start copying CUDA results into pinned host memory (record an event after it)."""
    host = {}
    for spec, t in captured.items():
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        host[spec] = buf
    return host
