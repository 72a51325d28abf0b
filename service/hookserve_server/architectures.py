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


@functools.cache
def classifier_keys(arch: str) -> tuple[str, ...]:
    """The state_dict keys of `arch`'s classifier head (read off a meta-device copy)."""
    with torch.device("meta"):
        model = build(arch)
    return tuple(head_keys(model, DEFAULT_CLASSES))
