"""Architectures, weights loading, and ServedModel (a model on its device).

Adding a torchvision architecture is one line in ``ARCHITECTURES``.
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

from .capture.reduce import DTYPES
from .capture.table import LayerInfo, LayerTables, layer_names
from .errors import ConfigError
from .spec import DType

log = logging.getLogger("hookserve.models")

#: Served architectures: any name ``torchvision.models.get_model`` knows works here.
ARCHITECTURES: tuple[str, ...] = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg13", "vgg16", "vgg19",
    "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn",
)

WEIGHT_CHOICES = ("auto", "imagenet", "random")
#: Seconds without progress before a weights download is given up.
DOWNLOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WeightsInfo:
    source: str          # "imagenet" | "file" | "random"
    name: str            # enum name, file name, or "seed=N"
    digest: str          # "sha256:..."
    pretrained: bool
    verified: bool = False


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
    """The standard transforms of the architecture's default torchvision weights."""
    tf = default_weights_enum(arch).transforms()
    crop = int(tf.crop_size[0])
    return Defaults(
        resize=int(tf.resize_size[0]),
        crop=(crop, crop),
        mean=tuple(float(x) for x in tf.mean),
        std=tuple(float(x) for x in tf.std),
        interpolation=str(tf.interpolation.value),
    )


def _file_state_dict(path: Path, arch: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConfigError(f"weights file {path} does not exist (for model {arch})")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"could not load {path} as a state_dict with weights_only=True: {exc}. "
            "Save weights with torch.save(model.state_dict(), path)."
        ) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"{path} does not hold a state_dict (a dict of tensors)")
    if obj and all(k.startswith("module.") for k in obj):  # saved from DataParallel
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def _load_into(model: nn.Module, sd: dict[str, torch.Tensor], where: str, arch: str) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    wrong = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}"
             for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatches (e.g. {'; '.join(wrong[:3])})")
        raise ConfigError(
            f"{where} does not match architecture {arch}: " + "; ".join(parts)
            + ". Is it the state_dict of a torchvision " + arch + "?"
        )
    model.load_state_dict(sd, strict=True)


def imagenet_cache_path(arch: str) -> Path:
    """Where torchvision caches the default weights: $TORCH_HOME/hub/checkpoints/<file>."""
    url = default_weights_enum(arch).url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def _imagenet_state_dict(arch: str) -> tuple[dict[str, torch.Tensor], str, bool]:
    weights = default_weights_enum(arch)
    path = imagenet_cache_path(arch)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s weights %s to %s", arch, weights.url, path)
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # a firewalled network must not hang start-up
        try:
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as exc:
            raise ConfigError(
                f"ImageNet weights for {arch} are not cached at {path} and could not be "
                f"downloaded ({type(exc).__name__}: {exc}). On an offline machine, copy "
                f"{os.path.basename(weights.url)} there (or set TORCH_HOME), or pass "
                "--weights PATH to a state_dict file."
            ) from None
        finally:
            socket.setdefaulttimeout(old)
    # torchvision names files <arch>-<first sha256 hex digits>.pth
    stem = path.stem
    prefix = stem.rsplit("-", 1)[-1] if "-" in stem else ""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    verified = bool(prefix) and h.hexdigest().startswith(prefix)
    if not verified:
        log.warning(
            "%s: %s does not match torchvision's published hash prefix %r; "
            "it is loaded, and reported as unverified", arch, path, prefix,
        )
    sd = _file_state_dict(path, arch)
    return sd, f"{type(weights).__name__}.{weights.name}", verified


def build_model(arch: str, weights: str, seed: int = 0) -> tuple[nn.Module, WeightsInfo]:
    """Build `arch` on the CPU with `weights` = auto | imagenet | random | PATH."""
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}"
        )
    torch.manual_seed(seed)
    model = torchvision.models.get_model(arch, weights=None)
    if weights in ("imagenet", "auto"):
        try:
            sd, name, verified = _imagenet_state_dict(arch)
        except ConfigError as exc:
            if weights == "imagenet":
                raise
            log.warning(
                "\n" + "!" * 78 + "\n%s: NO PRETRAINED WEIGHTS. Serving RANDOM weights "
                "(seed=%d): features are meaningless for real use.\nReason: %s\n" + "!" * 78,
                arch, seed, exc,
            )
            weights = "random"
        else:
            _load_into(model, sd, f"cached ImageNet weights for {arch}", arch)
            return model, WeightsInfo("imagenet", name, state_dict_digest(model.state_dict()),
                                      True, verified)
    if weights == "random":
        return model, WeightsInfo("random", f"seed={seed}",
                                  state_dict_digest(model.state_dict()), False)
    path = Path(weights).expanduser()
    sd = _file_state_dict(path, arch)
    _load_into(model, sd, f"weights file {path}", arch)
    return model, WeightsInfo("file", path.name, state_dict_digest(model.state_dict()), True)


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
                 channels_last: bool = False) -> None:
        self.name = name
        self.arch = arch
        self.weights = weights
        self.device = device
        self.dtype = DType[dtype.upper()]
        self.torch_dtype = DTYPES[self.dtype]
        self.channels_last = channels_last
        self.defaults = defaults_for(arch)
        module.eval().requires_grad_(False)
        module.to(device=device, dtype=self.torch_dtype)
        if channels_last:
            module.to(memory_format=torch.channels_last)
        self.module = module
        self.modules: dict[str, nn.Module] = dict(module.named_modules())
        self.mean = torch.tensor(self.defaults.mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(self.defaults.std, device=device).view(1, 3, 1, 1)
        self.tables = LayerTables(name, arch, self.torch_dtype)
        #: layer name -> (module path, call index)
        self.layer_index = layer_names(self.layer_table(*self.defaults.crop))

    def layer_table(self, height: int, width: int) -> dict[str, LayerInfo]:
        """Every hookable layer at input HxW, in execution order (capture/table.py)."""
        return self.tables.at(height, width)
