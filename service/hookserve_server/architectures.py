"""Building a served architecture: torchvision's classifiers by name, with the number
of classes of the weights they serve.

The names themselves are `config.ARCHITECTURES` (torch-free, so start-up checks them
before torch loads). ``timm:<name>`` is a timm model (the optional `timm` extra),
random or from a weights file: nothing is downloaded.
"""

from __future__ import annotations

import functools
import math

import torch
import torchvision
from torch import nn

from .checkpoints import head_keys
from .config import TIMM_PREFIX
from .errors import ConfigError

#: Outputs of torchvision's classifiers as built without arguments (ImageNet-1k).
DEFAULT_CLASSES = 1000
#: The number of classes of a model served without a classifier head (its weights file
#: holds none, as a backbone saved for its features does): the head's layers become
#: nn.Identity, so the head's name gives the features it would have read.
NO_HEAD = 0


def is_timm(arch: str) -> bool:
    return arch.startswith(TIMM_PREFIX)


def _timm():
    try:
        import timm
    except ImportError:
        raise ConfigError("timm models need the timm extra: pip install 'hookserve[timm]'") \
            from None
    return timm


def check_timm(arch: str) -> None:
    """ConfigError unless timm is installed and knows `arch` (``timm:<name>``)."""
    if not _timm().is_model(arch[len(TIMM_PREFIX):]):
        raise ConfigError(f"unknown timm model {arch[len(TIMM_PREFIX):]!r} "
                          "(timm.list_models() lists them)")


def build(arch: str, num_classes: int | None = None) -> nn.Module:
    """`arch` with random weights (on the current default device), with `num_classes`
    outputs (None: the architecture's default; NO_HEAD: none, the head's layers are
    nn.Identity). ``timm:<name>`` builds a timm model, never downloading weights."""
    kwargs = {} if num_classes in (None, DEFAULT_CLASSES) else {"num_classes": num_classes}
    if is_timm(arch):   # (timm's num_classes=0 is its own model without a head)
        return _timm().create_model(arch[len(TIMM_PREFIX):], pretrained=False, **kwargs)
    if num_classes == NO_HEAD:
        model = torchvision.models.get_model(arch, weights=None)
        for path in {k.rsplit(".", 1)[0] for k in head_keys(model, DEFAULT_CLASSES)}:
            model.set_submodule(path, nn.Identity())
        return model
    return torchvision.models.get_model(arch, weights=None, **kwargs)


def timm_transforms(arch: str) -> tuple[int, tuple[int, int], tuple, tuple]:
    """(resize, crop, mean, std) of a timm model's data config (its eval transforms:
    resize to crop / crop_pct, then centre crop)."""
    cfg = _timm().data.resolve_model_data_config(build_meta(arch))
    h, w = (int(s) for s in cfg["input_size"][1:])
    return (int(math.floor(min(h, w) / cfg.get("crop_pct", 0.875))), (h, w),
            tuple(float(x) for x in cfg["mean"]), tuple(float(x) for x in cfg["std"]))


def build_meta(arch: str, num_classes: int | None = None) -> nn.Module:
    """`arch` on the meta device (shapes, no memory). A builder that computes with
    tensors (regnet's widths) cannot run there: it is built on the CPU and moved."""
    try:
        with torch.device("meta"):
            return build(arch, num_classes)
    except (NotImplementedError, RuntimeError):
        return build(arch, num_classes).to("meta")


@functools.cache
def state_dict_keys(arch: str) -> frozenset[str]:
    """The state_dict keys of `arch` (read off a meta-device copy)."""
    return frozenset(build_meta(arch).state_dict())


@functools.cache
def classifier_keys(arch: str) -> tuple[str, ...]:
    """The state_dict keys of `arch`'s classifier head (read off a meta-device copy)."""
    return tuple(head_keys(build_meta(arch), DEFAULT_CLASSES))
