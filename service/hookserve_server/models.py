"""Architectures, weights loading, and ServedModel (a model on its device).

The architectures are torchvision's classifiers (``config.ARCHITECTURES``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import nn

from .architectures import (
    DEFAULT_CLASSES,
    NO_HEAD,
    TRANSFORM_INPUT,
    as_built,
    build,
    build_meta,
    check_timm,
    classifier_keys,
    default_classes,
    head_slot,
    is_timm,
    state_dict_keys,
    timm_transforms,
)
from .capture.reduce import DTYPES
from .capture.table import LayerTable, LayerTables, layer_names
from .checkpoints import (  # noqa: F401
    SAVE_HINT,
    classifier_left_out,
    head_classes,
    head_modules,
    linear_head,
    load_into,
    read_state_dict,
)
from .config import ARCHITECTURES, WEIGHT_CHOICES  # noqa: F401  (models.WEIGHT_CHOICES)
from .errors import ConfigError, InvalidArgument
from .layouts import default_cam_layer
from .logs import LOUD
from .precision import Precision
from .spec import DType

log = logging.getLogger("hookserve.models")

#: Seconds without progress before a weights download is given up.
DOWNLOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WeightsInfo:
    source: str          # "imagenet" | "file" | "random"
    name: str            # enum name, file name, or "seed=N"
    digest: str          # "sha256:..."
    pretrained: bool
    verified: bool = False
    #: Outputs of the classifier head the weights carry (NO_HEAD: they carry none).
    num_classes: int = DEFAULT_CLASSES
    #: With NO_HEAD, the modules the weights left out, served as nn.Identity
    left_out: tuple[str, ...] = ()
    #: The head's container the weights hold as one Linear ("classifier"), or ""
    linear_head: str = ""


@dataclass(frozen=True)
class Defaults:
    resize: int
    crop: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"


def state_dict_digest(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over key, dtype, shape and bytes of every tensor, in key order."""
    h = hashlib.sha256()
    for key in sorted(sd):
        t = sd[key].detach().cpu().contiguous()
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def default_weights_enum(arch: str):
    return torchvision.models.get_model_weights(arch).DEFAULT


def defaults_for(arch: str) -> Defaults:
    """The standard transforms of the architecture's default torchvision weights (a
    timm model's: its data config), their resize interpolation included."""
    if is_timm(arch):
        return Defaults(*timm_transforms(arch))
    tf = default_weights_enum(arch).transforms()
    crop = int(tf.crop_size[0])
    return Defaults(
        resize=int(tf.resize_size[0]),
        crop=(crop, crop),
        mean=tuple(float(x) for x in tf.mean),
        std=tuple(float(x) for x in tf.std),
        interpolation=str(tf.interpolation.value),
    )


def imagenet_cache_path(arch: str) -> Path:
    """Where torchvision caches the default weights: $TORCH_HOME/hub/checkpoints/<file>."""
    url = default_weights_enum(arch).url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


class NotObtainable(ConfigError):
    """The ImageNet weights are not cached and could not be downloaded: `--weights auto`
    serves random weights then (a cached file that is damaged stops start-up)."""


def _imagenet_state_dict(arch: str) -> tuple[dict[str, torch.Tensor], str, bool]:
    weights = default_weights_enum(arch)
    path = imagenet_cache_path(arch)
    if not path.is_file():
        log.info("downloading %s weights %s to %s", arch, weights.url, path)
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # a firewalled network must not hang start-up
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as exc:
            why = " ".join(str(exc).split())[:300]
            raise NotObtainable(
                f"ImageNet weights for {arch} are not cached at {path} and could not be "
                f"downloaded ({type(exc).__name__}: {why}). On an offline machine, copy "
                f"{os.path.basename(weights.url)} there (or set TORCH_HOME), or pass "
                "--weights PATH to a state_dict file."
            ) from None
        finally:
            socket.setdefaulttimeout(old)
    # torchvision names files <arch>-<first sha256 hex digits>.pth
    stem = path.stem
    prefix = stem.rsplit("-", 1)[-1] if "-" in stem else ""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:
        raise ConfigError(f"cannot read cached ImageNet weights {path}: {exc.strerror}") \
            from None
    verified = bool(prefix) and h.hexdigest().startswith(prefix)
    sd = read_state_dict(path, arch)
    if not verified:
        log.warning(
            "%s: %s does not match torchvision's published hash prefix %r; "
            "it is loaded, and reported as unverified", arch, path, prefix,
        )
    return sd, f"{type(weights).__name__}.{weights.name}", verified


def build_model(arch: str, weights: str, seed: int = 0, transform_input: bool | None = None
                ) -> tuple[nn.Module, WeightsInfo]:
    """Build `arch` on the CPU with `weights` = auto | imagenet | random | PATH.
    `transform_input` (googlenet, inception_v3): whether the model re-normalises its
    input; None: as torchvision builds it for those weights (ImageNet's only)."""
    if transform_input is not None and arch not in TRANSFORM_INPUT:
        raise ConfigError(f"{arch}: transform_input applies to "
                          f"{' and '.join(TRANSFORM_INPUT)} only; remove it")
    if is_timm(arch):
        check_timm(arch)
        if weights == "imagenet":
            raise ConfigError(f"{arch}: timm models take their weights from a file "
                              "(--weights PATH); hookserve downloads none")
        if weights == "auto":
            log.warning("%s: NO PRETRAINED WEIGHTS: timm weights come from a file "
                        "(--weights PATH), so serving RANDOM weights (seed=%d): features "
                        "are meaningless for real use", arch, seed, extra=LOUD)
            weights = "random"
    elif arch not in ARCHITECTURES:
        raise ConfigError(
            f"unknown architecture {arch!r}: `hookserve models --available` lists them")
    torch.manual_seed(seed)
    if weights in ("imagenet", "auto"):
        try:
            sd, name, verified = _imagenet_state_dict(arch)
        except NotObtainable as exc:
            if weights == "imagenet":
                raise
            log.warning("%s: NO PRETRAINED WEIGHTS: serving RANDOM weights (seed=%d), "
                        "features are meaningless for real use. Reason: %s", arch, seed,
                        exc, extra=LOUD)
            weights = "random"
        else:
            model = build(arch, transform_input=transform_input is not False
                          and arch in TRANSFORM_INPUT)
            load_into(model, as_built(arch, sd), f"cached ImageNet weights for {arch}",
                      arch)
            return model, WeightsInfo("imagenet", name, state_dict_digest(model.state_dict()),
                                      True, verified)
    if weights == "random":
        model = build(arch, transform_input=bool(transform_input))
        return model, WeightsInfo("random", f"seed={seed}",
                                  state_dict_digest(model.state_dict()), False,
                                  num_classes=default_classes(model))
    path = Path(weights).expanduser()
    sd = as_built(arch, read_state_dict(path, arch, state_dict_keys(arch),
                                                  head_slot(arch)))
    head = classifier_keys(arch)
    classes = head_classes(sd, list(head))
    if classes == 0:
        raise ConfigError(f"weights file {path}: its classifier head has no outputs (0 "
                          "classes): save the model with its fine-tuned head, or without a "
                          "head to serve the backbone's features")
    left_out: tuple[str, ...] = ()
    replaced = "" if classes is not None else linear_head(build_meta(arch), sd,
                                                          head_modules(head))
    if replaced:   # the classifier fine-tuned as one Linear
        classes = int(sd[f"{replaced}.weight"].shape[0])
        log.info("%s: weights file %s holds its classifier as one Linear (%s): serving "
                 "it in place of torchvision's %s", arch, path, replaced, replaced)
    if classes is None:   # the head's last layer left out, or the classifier holding it
        left_out = classifier_left_out(state_dict_keys(arch) - set(head), sd,
                                       head_modules(head)) or head_modules(head)
    # a fine-tuned head: as many outputs as the checkpoint's; none in the file: no head
    if transform_input is None and arch in TRANSFORM_INPUT:
        log.warning("%s: weights file %s is served without re-normalising the input inside "
                    "the model (transform_input=False, as torchvision's get_model(%r, "
                    "weights=None) builds it); a model fine-tuned from torchvision's "
                    "ImageNet weights ran with transform_input=True: say "
                    "transform_input = true for it in --models", arch, path, arch)
    model = build(arch, NO_HEAD if classes is None else classes, bool(transform_input),
                  left_out=left_out, linear_head=replaced)
    _head_bias_as_saved(model, sd, head_modules(head))
    load_into(model, sd, f"weights file {path}", arch, head)
    if classes is None:
        classes = NO_HEAD
        log.info("%s: weights file %s holds no classifier head (%s): serving the backbone, "
                 "with %s giving the features the head would read; Attribute needs a head",
                 arch, path, ", ".join(head), " and ".join(left_out))
    return model, WeightsInfo("file", path.name, state_dict_digest(model.state_dict()), True,
                              num_classes=classes, left_out=left_out, linear_head=replaced)


def _head_bias_as_saved(model: nn.Module, sd: dict, head: tuple[str, ...]) -> None:
    """A head Linear with a bias where torchvision's has none (maxvit's), or none where
    torchvision's has one (a bias-free linear probe), is rebuilt as the file holds it."""
    for path in head:
        mod = model.get_submodule(path) if f"{path}.weight" in sd else None
        if isinstance(mod, nn.Linear) and (f"{path}.bias" in sd) != (mod.bias is not None):
            model.set_submodule(path, nn.Linear(mod.in_features, mod.out_features,
                                                bias=f"{path}.bias" in sd))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"invalid device {device!r}: use auto, cpu or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device} requested but CUDA is not available")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported device {device!r}: use auto, cpu or cuda:N")
    return dev


class ServedModel:
    """A model on its device, eval mode, no grad, with its layer table.

    Only the inference worker runs ``module``; describing layers uses a separate
    copy on the ``meta`` device, so shapes cost no real compute and never touch the
    served model.
    """

    def __init__(self, name: str, arch: str, module: nn.Module, weights: WeightsInfo,
                 device: torch.device, dtype: str = "float32",
                 channels_last: bool = False, labels: tuple[str, ...] = (),
                 defaults: Defaults | None = None,
                 precision: Precision = Precision.FP32) -> None:
        self.name = name
        self.arch = arch
        self.weights = weights
        #: Class names in index order (labels.py); () when the classes have none.
        self.labels = labels
        #: sha256 of the class names, each length-prefixed (a name may hold a newline),
        #: for the answer cache's key (cache/key.py)
        self.labels_digest = hashlib.sha256(b"".join(
            len(b).to_bytes(8, "little") + b
            for b in (x.encode("utf-8", "surrogatepass") for x in labels))).digest()
        self.device = device
        self.dtype = DType[dtype.upper()]
        self.torch_dtype = DTYPES[self.dtype]
        self.channels_last = channels_last
        #: what the Extract forward pass computes in (precision.py)
        self.precision = precision
        #: The preprocessing in force: the weights' transforms(), or the model file's.
        self.defaults = defaults or defaults_for(arch)
        module.eval().requires_grad_(False)
        module.to(device=device, dtype=self.torch_dtype)
        if channels_last:
            module.to(memory_format=torch.channels_last)
        self.module = module
        #: googlenet, inception_v3: the input is re-normalised inside the model
        self.transform_input = bool(getattr(module, "transform_input", False))
        self.modules: dict[str, nn.Module] = dict(module.named_modules())
        self.mean = torch.tensor(self.defaults.mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(self.defaults.std, device=device).view(1, 3, 1, 1)
        self.tables = LayerTables(name, arch, self.torch_dtype, weights.num_classes,
                                  weights.left_out, self.transform_input,
                                  weights.linear_head)
        default_table = self.layer_table(*self.defaults.crop)
        if default_table.stopped:   # the whole model must run at its own input size
            raise InvalidArgument(default_table.stopped)
        #: layer name -> (module path, call index)
        self.layer_index = layer_names(default_table)
        self.tables.trace_node_names(self.layer_index)
        #: The layer the CAM methods explain when none is named.
        self.default_cam_layer = default_cam_layer(arch, default_table, self.modules)

    @property
    def has_head(self) -> bool:
        """Whether the model has a classifier head (NO_HEAD: its weights file had none)."""
        return self.weights.num_classes != NO_HEAD

    def layer_table(self, height: int, width: int) -> LayerTable:
        """Every hookable layer at input HxW, in execution order (capture/table.py); at
        an input too small for the whole model, those before the module that cannot
        run (`stopped` says which)."""
        return self.tables.at(height, width)
