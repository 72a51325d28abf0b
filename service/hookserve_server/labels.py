"""Class names: `--labels MODEL=PATH` (a text file, one class a line), or the ImageNet
category names that torchvision's weights carry.

Torch-free at import: start-up checks the flag before torch loads; torchvision is
imported only for the ImageNet names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from .errors import ConfigError

T = TypeVar("T")


def labels_per_model(models: list[str], specs: Iterable[str]) -> dict[str, Path]:
    """`--labels` values -> {model: path}. 'MODEL=PATH' names the model; a bare PATH is
    allowed when one model is served. Every file must exist."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or name not in models:
            if len(models) != 1 or (sep and not Path(spec).expanduser().is_file()):
                raise ConfigError(f"--labels {spec}: write MODEL=PATH with MODEL among "
                                  f"--model {', '.join(models)}")
            name, value = models[0], spec
        if name in out:
            raise ConfigError(f"--labels gives {name} twice")
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"--labels {spec}: {path} is not a file (one class name a "
                              "line)")
        out[name] = path
    return out


def read_labels(path: Path) -> tuple[str, ...]:
    """One class name a line, in class-index order; trailing blank lines ignored."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark is no name)
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"cannot read --labels file {path}: {why}") from None
    lines = [line.strip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    if "" in lines:
        raise ConfigError(f"--labels file {path}: line {lines.index('') + 1} is empty "
                          "(one class name a line)")
    return tuple(lines)


def imagenet_labels(arch: str) -> tuple[str, ...]:
    """The category names of torchvision's default weights for `arch`."""
    import torchvision

    meta = torchvision.models.get_model_weights(arch).DEFAULT.meta
    return tuple(meta.get("categories") or ())


def model_labels(model: str, arch: str, source: str, num_classes: int,
                 path: Path | None) -> tuple[str, ...]:
    """A served model's class names: the `--labels` file, else the ImageNet names for
    torchvision's own weights, else none. A count that differs from the head's is a
    ConfigError."""
    if path is None:
        names = imagenet_labels(arch) if source == "imagenet" else ()
        return names if len(names) == num_classes else ()
    if num_classes == 0:   # a model served without its head
        raise ConfigError(f"--labels {model}={path}: the weights of {model} hold no "
                          "classifier head, so it has no classes to name: drop the labels "
                          "or serve weights with a head")
    names = read_labels(path)
    if len(names) != num_classes:
        raise ConfigError(f"--labels {model}={path} has {len(names)} class names but the "
                          f"weights of {model} have {num_classes} classes: give one name a "
                          "line, one line per class")
    return names


def named(score: T, labels: tuple[str, ...]) -> T:
    """A score (with `class_index` and `label`) with its class name filled in."""
    return dataclasses.replace(score, label=labels[score.class_index]) if labels else score
