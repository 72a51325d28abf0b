"""Building a served architecture: torchvision's classifiers by name, with the number
of classes of the weights they serve.

The names themselves are `config.ARCHITECTURES` (torch-free, so start-up checks them
before torch loads). ``timm:<name>`` is a timm model (the optional `timm` extra),
random or from a weights file: nothing is downloaded.
"""

from __future__ import annotations

import functools
import math
import re

import torch
import torchvision
from torch import nn

from .checkpoints import HeadSlot, head_keys, head_modules
from .config import TIMM_PREFIX
from .errors import ConfigError
from .model_file import INTERPOLATIONS

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


#: Heads that run only in training (torchvision's googlenet and inception_v3): models
#: are built without them, and a weights file's keys for them are left out.
AUX_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}
#: Architectures whose ImageNet weights expect their input re-normalised inside the
#: model: torchvision sets ``transform_input=True`` when it loads those weights, and a
#: model fine-tuned from them keeps it (a state_dict does not record it).
TRANSFORM_INPUT = ("googlenet", "inception_v3")


def build(arch: str, num_classes: int | None = None, transform_input: bool = False,
          left_out: tuple[str, ...] = (), linear_head: str = "") -> nn.Module:
    """`arch` with random weights (on the current default device), with `num_classes`
    outputs (None: the architecture's default; NO_HEAD: none, the modules `left_out`,
    by default the head's layers, are nn.Identity), re-normalising its input inside
    the model when `transform_input` (TRANSFORM_INPUT architectures only). With
    `linear_head`, that container of the head (``classifier``) is one nn.Linear to
    `num_classes`, as ``model.classifier = nn.Linear(...)`` fine-tunes it.
    ``timm:<name>`` builds a timm model, never downloading weights."""
    if is_timm(arch):   # (timm's num_classes=0 is its own model without a head)
        kwargs = {} if num_classes is None else {"num_classes": num_classes}
        return _timm().create_model(arch[len(TIMM_PREFIX):], pretrained=False, **kwargs)
    kwargs: dict = {} if num_classes in (None, DEFAULT_CLASSES, NO_HEAD) else {
        "num_classes": num_classes}
    if arch in AUX_HEADS:
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True   # what it defaults to, said: no FutureWarning
    if transform_input:
        kwargs["transform_input"] = True
    model = torchvision.models.get_model(arch, weights=None, **kwargs)
    if num_classes == NO_HEAD:
        for path in left_out or head_modules(head_keys(model, default_classes(model))):
            model.set_submodule(path, nn.Identity())
    if linear_head:
        first = next(m for m in model.get_submodule(linear_head).modules()
                     if isinstance(m, nn.Linear))
        model.set_submodule(linear_head, nn.Linear(first.in_features, int(num_classes or 0)))
    return model


def default_classes(model: nn.Module) -> int:
    """The number of classes `model` was built with by default (timm models say)."""
    return int(getattr(model, "num_classes", DEFAULT_CLASSES) or DEFAULT_CLASSES)


#: Key names torchvision's own published weights still use, as the current modules name
#: them (torchvision renames them itself when it loads those files), by architecture
#: family: densenet's ``denselayerN.norm.1.weight`` (now ``norm1``), vit's MLP
#: ``linear_1`` and ``linear_2`` (now ``0`` and ``3``).
LEGACY_KEYS = {
    "densenet": (re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\."
                            r"(?:weight|bias|running_mean|running_var|num_batches_tracked))$"),
                 lambda m: m[1] + m[2]),
    "vit_": (re.compile(r"^(.*\.mlp\.)linear_([12])\.(weight|bias)$"),
             lambda m: f"{m[1]}{3 * (int(m[2]) - 1)}.{m[3]}"),
}


def as_built(arch: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` as `build` makes `arch`: torchvision's legacy key names (LEGACY_KEYS)
    renamed, and the keys of its training-only heads (AUX_HEADS) left out."""
    for family, (pattern, new) in LEGACY_KEYS.items():
        if arch.startswith(family) and any(pattern.match(k) for k in sd):
            sd = {(new(m) if (m := pattern.match(k)) else k): v for k, v in sd.items()}
    prefixes = AUX_HEADS.get(arch)
    return {k: v for k, v in sd.items() if not k.startswith(prefixes)} if prefixes else sd


def timm_transforms(arch: str) -> tuple[int, tuple[int, int], tuple, tuple, str]:
    """(resize, crop, mean, std, interpolation) of a timm model's data config (its eval
    transforms: resize to crop / crop_pct, then centre crop; bilinear where the config
    names a mode torchvision's resize lacks)."""
    cfg = _timm().data.resolve_model_data_config(build_meta(arch))
    h, w = (int(s) for s in cfg["input_size"][1:])
    mode = str(cfg.get("interpolation", "bilinear"))
    return (int(math.floor(min(h, w) / cfg.get("crop_pct", 0.875))), (h, w),
            tuple(float(x) for x in cfg["mean"]), tuple(float(x) for x in cfg["std"]),
            mode if mode in INTERPOLATIONS else "bilinear")


def build_meta(arch: str, num_classes: int | None = None, left_out: tuple[str, ...] = (),
               transform_input: bool = False, linear_head: str = "") -> nn.Module:
    """`arch` on the meta device (shapes, no memory), built as `build` builds it. A
    builder that computes with tensors (regnet's widths) cannot run there: it is built
    on the CPU and moved."""
    try:
        with torch.device("meta"):
            return build(arch, num_classes, transform_input, left_out, linear_head)
    except (NotImplementedError, RuntimeError):
        return build(arch, num_classes, transform_input, left_out, linear_head).to("meta")


@functools.cache
def state_dict_keys(arch: str) -> frozenset[str]:
    """The state_dict keys of `arch` (read off a meta-device copy)."""
    return frozenset(build_meta(arch).state_dict())


@functools.cache
def classifier_keys(arch: str) -> tuple[str, ...]:
    """The state_dict keys of `arch`'s classifier head (read off a meta-device copy)."""
    meta = build_meta(arch)
    return tuple(head_keys(meta, default_classes(meta)))


@functools.cache
def head_slot(arch: str) -> HeadSlot | None:
    """Where `arch`'s head ends, when its last layer is a Linear (squeezenet's 1x1
    convolution is not): the keys and input features a lone head in a file must fit,
    and the container it ends (mobilenet's ``classifier``) with what that one reads."""
    weights = [k for k in classifier_keys(arch) if k.endswith(".weight")]
    if not weights:
        return None
    module = weights[-1].rsplit(".", 1)[0]
    meta = build_meta(arch)
    last = meta.get_submodule(module)
    if not isinstance(last, nn.Linear):
        return None
    container, _, _ = module.rpartition(".")
    first = next((m for m in meta.get_submodule(container).children()
                  if not isinstance(m, nn.Dropout)), None) if container else None
    return HeadSlot(f"{module}.weight", f"{module}.bias", last.in_features, container,
                    first.in_features if isinstance(first, nn.Linear) else 0)
