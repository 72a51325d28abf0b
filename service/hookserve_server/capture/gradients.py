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
"""

from __future__ import annotations

import torch
from torch import nn

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
