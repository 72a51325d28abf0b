"""Taps: make one call's activation (a module's output or input) a tensor autograd
can differentiate a score against.

A tap hooks one call of one module. A forward hook (output) or forward pre-hook
(input) detaches the tensor, marks the copy ``requires_grad`` and lets the forward
pass go on with a clone of it. ``torch.autograd.grad(score, tap.activation)`` then
gives dscore/dA. Module full backward hooks are not used: they fail when the next op
is torchvision's in-place ReLU (pytorch#61519, vision#4164); the clone is what
in-place ops downstream modify, so the captured leaf keeps its values and autograd
its history. Detaching also means nothing before the layer is recorded for the
backward pass, and no parameter ever gets a gradient (served models hold their
parameters with ``requires_grad=False``).

``graph_bytes`` counts what the backward pass keeps, on a meta-device copy of the
model: the memory estimate of an Attribute pass (engine/attribute.py) rests on it.
"""

from __future__ import annotations

import functools
import math
import threading
from contextlib import nullcontext

import torch
from torch import nn

from ..architectures import build_meta
from ..errors import InternalError


class Tap:
    """Captures call ``call`` of ``module``'s output (or input, ``on_input``) as a leaf
    that requires grad. Use as a context manager; ``activation`` is set by the forward
    pass, and the hook is removed on exit whatever happens."""

    def __init__(self, module: nn.Module, call: int, on_input: bool, name: str) -> None:
        self.module = module
        self.call = call
        self.on_input = on_input
        self.name = name
        self.activation: torch.Tensor | None = None
        self._calls = 0
        self._handle = None

    def _leaf(self, t) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InternalError(f"layer {self.name} does not see a tensor")
        self.activation = t.detach().requires_grad_(True)
        return self.activation.clone()

    def _pre_hook(self, module, args):
        k, self._calls = self._calls, self._calls + 1
        if k != self.call or not args:
            return None
        return (self._leaf(args[0]), *args[1:])

    def _hook(self, module, args, out):
        k, self._calls = self._calls, self._calls + 1
        if k != self.call:
            return None
        return self._leaf(out)

    def __enter__(self) -> Tap:
        self._calls = 0
        self.activation = None
        if self.on_input:
            self._handle = self.module.register_forward_pre_hook(self._pre_hook)
        else:
            self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def take(self) -> torch.Tensor:
        """The captured activation; raises when the layer did not run."""
        if self.activation is None:
            raise InternalError(f"layer {self.name} did not run in the forward pass")
        return self.activation


_META_LOCK = threading.Lock()


@functools.lru_cache(maxsize=8)
def _meta_model(arch: str, dtype: torch.dtype) -> nn.Module:
    m = build_meta(arch)
    return m.eval().requires_grad_(False).to(dtype=dtype)


@functools.lru_cache(maxsize=256)
def graph_bytes(arch: str, dtype: torch.dtype, height: int, width: int,
                tap: tuple[str, int, bool] | None) -> tuple[int, int]:
    """What a pass of one image at input HxW needs besides the activations, counted on
    a meta-device copy of the model (no compute, no memory): the bytes autograd saves
    for the backward pass (each saved storage once, parameters not counted), and the
    scratch memory of the largest convolution: its weight (kernels reorder it) plus its
    unfolded input (in_channels/groups x kernel area x output pixels, a convolution
    done as a matrix product). `tap` is (module path, call, on_input) of the
    differentiated activation; None differentiates the input."""
    with _META_LOCK:
        m = _meta_model(arch, dtype)
        params = {t.untyped_storage()._cdata for t in (*m.parameters(), *m.buffers())}
        seen: dict[int, int] = {}
        columns = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                seen[storage._cdata] = storage.nbytes()
            return t

        def scratch(conv: nn.Module, args, out: torch.Tensor) -> None:
            area = conv.in_channels // conv.groups * math.prod(conv.kernel_size)
            unfolded = area * math.prod(out.shape[2:]) * out.element_size()
            weight = conv.weight.numel() * conv.weight.element_size()
            columns[0] = max(columns[0], unfolded + weight)

        hooks = [c.register_forward_hook(scratch) for c in m.modules()
                 if isinstance(c, nn.Conv2d)]
        x = torch.empty(1, 3, height, width, device="meta", dtype=dtype)
        ctx = nullcontext()
        if tap is None:
            x.requires_grad_(True)
        else:
            path, call, on_input = tap
            ctx = Tap(m.get_submodule(path), call, on_input, path)
        try:
            with (torch.enable_grad(), ctx,
                  torch.autograd.graph.saved_tensors_hooks(pack, _same)):
                m(x)
        finally:
            for h in hooks:
                h.remove()
        return sum(seen.values()), columns[0]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
