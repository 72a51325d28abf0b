"""`hookserve serve --models models.toml`: the served models declared in one file.

    [[model]]
    name = "resnet50-xray"          # what clients ask for (default: the architecture)
    architecture = "resnet50"       # a torchvision classifier
    weights = "xray.safetensors"    # auto | imagenet | random | PATH (relative to the file)
    labels = "xray-classes.txt"     # optional: one class name a line
    dtype = "float16"               # optional: float32 | float16 | bfloat16 (--dtype)
    device = "cuda:0"               # optional: auto | cpu | cuda:N (--device)
    precision = "fp32"              # optional: fp32 | bf16 | fp16 (--precision; the
                                    # last two autocast, with dtype float32 only)
    transform_input = true          # googlenet, inception_v3 only: the input is
                                    # re-normalised inside the model (default: with
                                    # imagenet weights only, as torchvision does)
    [model.preprocessing]           # optional: each key overrides the weights' transforms()
    resize = 256
    crop = 224                      # or [height, width]
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
    interpolation = "bilinear"      # of the resize: bilinear | bicubic | nearest

The first model is the server's default. Two names may serve one architecture with
different weights. Read with the standard library's ``tomllib``, before torch loads;
a mistake is one line naming the model and the key.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .attribution_spec import Method
from .config import WEIGHT_CHOICES, known_architecture
from .errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
KEYS = {"name", "architecture", "weights", "labels", "dtype", "device", "precision",
        "transform_input", "preprocessing"}
PREPROCESSING_KEYS = {"resize", "crop", "mean", "std", "interpolation"}
#: The resize interpolations a model may have (torchvision's resize has each)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
#: precision.Precision's values (read here before torch loads)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ModelEntry:
    """One served model: from `--models`, or from --model/--weights/--labels."""

    name: str
    arch: str
    weights: str = "auto"
    labels: Path | None = None
    dtype: str | None = None      # None: --dtype
    device: str | None = None     # None: --device
    #: None: --precision (checked with it, in precision.py, once torch is loaded)
    precision: str | None = None
    #: googlenet and inception_v3: whether the model re-normalises its input (None: as
    #: torchvision builds it for the weights, architectures.TRANSFORM_INPUT)
    transform_input: bool | None = None
    #: Preprocessing overrides: resize, crop (h, w), mean, std, the resize's
    #: interpolation (None: the weights').
    resize: int | None = None
    crop: tuple[int, int] | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    interpolation: str | None = None

    def preprocessing_over(self, defaults):
        """The weights' default preprocessing (a `models.Defaults`) with this entry's
        overrides."""
        given = {k: getattr(self, k) for k in PREPROCESSING_KEYS
                 if getattr(self, k) is not None}
        return dataclasses.replace(defaults, **given)


def from_flags(names: list[str], weights: dict[str, str], labels: dict[str, Path]
               ) -> list[ModelEntry]:
    """The entries --model, --weights and --labels declare (each name its architecture)."""
    return [ModelEntry(n, n, weights[n], labels.get(n)) for n in names]


def read_model_file(path: Path, rest: bool = False, max_side: int | None = None
                    ) -> list[ModelEntry]:
    """The models a `--models` file declares; ConfigError in one line on any mistake.
    `rest`: the REST routes are served (--http-port), whose paths cannot carry a '/' in
    a name; `max_side`: --max-input-side, which the file's resize and crop must fit."""
    import tomllib

    try:
        data = path.read_bytes()
        # (a byte-order mark, which some editors write, is no TOML: read past it)
        doc = tomllib.loads(data.decode("utf-8-sig"))
    except OSError as exc:
        raise ConfigError(f"cannot read --models {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--models {path} is no TOML text (byte {exc.start} is not "
                          "UTF-8): name the models file, saved as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--models {path} is not valid TOML: {exc}") from None
    extra = set(doc) - {"model"}
    if extra:
        raise ConfigError(f"--models {path}: unknown table {sorted(extra)[0]!r}; declare each "
                          "model in a [[model]] table")
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"--models {path} declares no model: add a [[model]] table with "
                          "at least an architecture")
    for i, t in enumerate(tables):
        if not isinstance(t, dict):
            raise ConfigError(f"--models {path}: model {i + 1} is {t!r}, not a table: "
                              "declare each model as [[model]] with architecture = "
                              "\"...\" under it"[:400])
    entries = [_entry(t, i, path, rest, max_side) for i, t in enumerate(tables)]
    names = [e.name for e in entries]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"--models {path}: two models are named {n!r}; give each its "
                              "own name")
        base, _, method = n.rpartition(".")
        if base in names and method.upper() in Method.__members__:
            raise ConfigError(f"--models {path}: model {n!r} has the name the Open Inference "
                              f"Protocol gives model {base!r}'s {method} attributions: "
                              "rename it")
    return entries


def _entry(t: dict[str, Any], i: int, path: Path, rest: bool = False,
           max_side: int | None = None) -> ModelEntry:
    where = f"--models {path}: model {t.get('name') or i + 1}"
    unknown = set(t) - KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (keys: "
                          f"{', '.join(sorted(KEYS))})")
    arch = t.get("architecture")
    if arch is None:
        raise ConfigError(f"{where}: no architecture: add architecture = \"resnet50\" (or "
                          "another: `hookserve models --available` lists them)")
    if not isinstance(arch, str) or not known_architecture(arch):
        raise ConfigError(f"{where}: architecture {arch!r} is not a torchvision classifier "
                          "(`hookserve models --available` lists them)")
    name = _string(t.get("name", arch), "name", where)
    odd = next((c for c in name if c == "/" and rest
                or unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if odd is not None:   # (Cf: a format character, as a right-to-left override)
        what = ("which the REST routes (--http-port: /v2/models/<name>) cannot carry"
                if odd == "/" else "a control or format character")
        fix = "give it a name without it" if "name" in t else 'give it a name = "..."'
        raise ConfigError(f"{where}: name {name!r} holds {odd!r}, {what}: {fix}")
    weights = _string(t.get("weights", "auto"), "weights", where)
    if weights not in WEIGHT_CHOICES:
        weights = str(_file(weights, "weights", where, path))
    labels = _file(_string(t["labels"], "labels", where), "labels", where, path) \
        if "labels" in t else None
    dtype = t.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    device = _string(t["device"], "device", where) if "device" in t else None
    prec = _string(t["precision"], "precision", where) if "precision" in t else None
    if prec is not None and prec.lower() not in PRECISIONS:
        raise ConfigError(f"{where}: precision {prec!r}: use one of {', '.join(PRECISIONS)}")
    transform = t.get("transform_input")
    if transform is not None and not isinstance(transform, bool):
        raise ConfigError(f"{where}: transform_input {transform!r}: use true or false")
    pre = t.get("preprocessing", {})
    if not isinstance(pre, dict) or set(pre) - PREPROCESSING_KEYS:
        raise ConfigError(f"{where}: preprocessing takes the keys "
                          f"{', '.join(sorted(PREPROCESSING_KEYS))}")
    entry = ModelEntry(name, arch, weights, labels, dtype, device, prec, transform,
                       resize=_side(pre["resize"], "resize", where) if "resize" in pre else None,
                       crop=_crop(pre["crop"], where) if "crop" in pre else None,
                       mean=_triple(pre["mean"], "mean", where) if "mean" in pre else None,
                       std=_triple(pre["std"], "std", where) if "std" in pre else None,
                       interpolation=_interpolation(pre.get("interpolation"), where))
    for key, side in (("resize", entry.resize or 0), ("crop", max(entry.crop or (0,)))):
        if max_side and side > max_side:   # (said before any weights load)
            raise ConfigError(f"{where}: preprocessing.{key} = {side} is over "
                              f"--max-input-side {max_side}: lower it, or raise "
                              "--max-input-side")
    return entry


def _interpolation(value: Any, where: str) -> str | None:
    if value is not None and value not in INTERPOLATIONS:
        raise ConfigError(f"{where}: preprocessing.interpolation {value!r}: use one of "
                          f"{', '.join(INTERPOLATIONS)}")
    return value


def _string(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {key} must be a non-empty string")
    return value


def _file(value: str, key: str, where: str, path: Path) -> Path:
    """A file named in the model file: relative paths are from the file's folder."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else path.parent / p
    if not p.is_file():
        raise ConfigError(f"{where}: {key} {value!r} is not a file ({p})")
    return p


def _side(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: preprocessing.{key} must be a positive integer "
                          f"(pixels), got {value!r}")
    return value


def _crop(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, list) and len(value) == 2:
        return (_side(value[0], "crop", where), _side(value[1], "crop", where))
    side = _side(value, "crop", where)
    return (side, side)


def _triple(value: Any, key: str, where: str) -> tuple[float, float, float]:
    ok = (isinstance(value, list) and len(value) == 3
          and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
          and all(math.isfinite(v) and (v > 0 or key == "mean") for v in value))
    if not ok:
        raise ConfigError(f"{where}: preprocessing.{key} must be three finite numbers "
                          f"(R, G, B){', each above 0' if key == 'std' else ''}, got {value!r}")
    if any(abs(v) > 1 for v in value):   # (mmcv and detectron write 0-255)
        raise ConfigError(f"{where}: preprocessing.{key} {value!r} is on the 0-255 scale; "
                          "hookserve scales pixels to 0-1 first, as torchvision does: divide "
                          f"by 255 ({[round(v / 255, 4) for v in value]})")
    return tuple(float(v) for v in value)  # type: ignore[return-value]
