"""Building a served architecture: torchvision's classifiers by name, with the number
of classes of the weights they serve.

The names themselves are `config.ARCHITECTURES` (torch-free, so start-up checks them
before torch loads).
"""

from __future__ import annotations

import functools

import torch
import torchvision
from torch import nn

from .checkpoints import head_keys

#: Outputs of torchvision's classifiers as built without arguments (ImageNet-1k).
DEFAULT_CLASSES = 1000


def build(arch: str, num_classes: int | None = None) -> nn.Module:
    """`arch` with random weights (on the current default device), with `num_classes`
    outputs (None: the architecture's default)."""
    kwargs = {} if num_classes in (None, DEFAULT_CLASSES) else {"num_classes": num_classes}
    return torchvision.models.get_model(arch, weights=None, **kwargs)


def build_meta(arch: str, num_classes: int | None = None) -> nn.Module:
    """`arch` on the meta device (shapes, no memory). A builder that computes with
    tensors (regnet's widths) cannot run there: it is built on the CPU and moved."""
    try:
        with torch.device("meta"):
            return build(arch, num_classes)
    except (NotImplementedError, RuntimeError):
        return build(arch, num_classes).to("meta")


@functools.cache
def classifier_keys(arch: str) -> tuple[str, ...]:
    """The state_dict keys of `arch`'s classifier head (read off a meta-device copy)."""
    return tuple(head_keys(build_meta(arch), DEFAULT_CLASSES))
