"""Class names: `--labels MODEL=PATH` (a text file, one class a line, ``index,name``
lines, or JSON), or the ImageNet category names that torchvision's weights carry.

Torch-free at import: start-up checks the flag before torch loads; torchvision is
imported only for the ImageNet names.
"""

from __future__ import annotations

import dataclasses
import json
import re
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


#: "index,name" (or a tab): a line of a CSV of class indices and names
_INDEXED = re.compile(r"^(\d+)\s*[,\t]\s*(.*)$")


def read_labels(path: Path, what: str = "--labels file") -> tuple[str, ...]:
    """Class names in class-index order: one a line (trailing blank lines ignored), or
    ``index,name`` lines numbered from 0, or JSON: a list of names, or an object from
    indices to names (``{"0": "tench"}``, or ``{"0": ["n01440764", "tench"]}`` as in
    imagenet_class_index.json)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --labels file {path}: {exc.strerror}") from None
    # (a byte-order mark is no name: UTF-8's, or UTF-16's as Windows tools save it)
    utf16 = raw.startswith((b"\xff\xfe", b"\xfe\xff"))
    try:
        text = raw.decode("utf-16" if utf16 else "utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 (byte {exc.start} is "
                          f"{raw[exc.start:exc.start + 1]!r}): save it as UTF-8") from None
    first = text.lstrip()
    if first[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            # a plain file whose first name starts so ("[background]"), unless it is
            # JSON by its name or its first line ("[" alone)
            if path.suffix.lower() == ".json" or first.split("\n", 1)[0].strip() in "[{":
                raise ConfigError(f"{what} {path} is not valid JSON ({exc.msg}, line "
                                  f"{exc.lineno} column {exc.colno}): fix it, or give one "
                                  "class name a line") from None
            data = None
        if isinstance(data, (list, dict)):
            return _json_labels(path, data, what)
    # (lines end at \n, \r\n or \r only: str.splitlines also splits at U+2028 and the
    # like, which a class name may hold)
    lines = [line.strip() for line in
             text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    if "" in lines:
        raise ConfigError(f"{what} {path}: line {lines.index('') + 1} is empty "
                          "(one class name a line)")
    tables = []   # (header rows, (index, name) rows): a CSV of index,name, with or
    for head in (0, 1):   # without a header row
        found = [_INDEXED.match(line) for line in lines[head:]]
        if len(lines) > head and all(m and m.group(2) for m in found) and \
                (not head or "," in lines[0] or "\t" in lines[0]):
            tables.append((head, [(int(m.group(1)), m.group(2)) for m in found if m]))
    for _head, rows in tables:   # numbered 0, 1, 2... in order
        if all(index == i for i, (index, _name) in enumerate(rows)):
            return tuple(_unquoted(name.strip()) for _index, name in rows)
    for head, rows in tables:   # in another order: by index, or refused
        if len(rows) >= 2:
            return _by_index(path, what, rows, head)
    return tuple(lines)


def _by_index(path: Path, what: str, rows: list[tuple[int, str]], head: int
              ) -> tuple[str, ...]:
    """``index,name`` rows in any order, each index 0..N-1 once; else a ConfigError
    naming the first line that breaks it (a CSV numbered from 1, with a gap, a repeat)."""
    n, seen = len(rows), set()
    for k, (index, _name) in enumerate(rows):
        if not 0 <= index < n or index in seen:
            why = "again" if index in seen else f"outside 0 to {n - 1}"
            raise ConfigError(f"{what} {path}: its lines are index,name, and line "
                              f"{head + k + 1} gives index {index} {why}: number the "
                              f"{n} classes 0 to {n - 1}, each once")
        seen.add(index)
    names = dict(rows)
    return tuple(_unquoted(names[i].strip()) for i in range(n))


def _unquoted(name: str) -> str:
    """A CSV field as a CSV export writes it, read back: ``"tench, Tinca tinca"`` is
    tench, Tinca tinca (quotes doubled inside: one)."""
    if len(name) >= 2 and name[0] == name[-1] == '"':
        return name[1:-1].replace('""', '"')
    return name


def _json_labels(path: Path, data: list | dict, what: str) -> tuple[str, ...]:
    hint = ('a list of names, or an object from class indices to names ({"0": "tench", '
            '...} or {"0": ["n01440764", "tench"], ...})')
    if isinstance(data, dict):
        if sorted(data, key=lambda k: (len(k), k)) != [str(i) for i in range(len(data))]:
            raise ConfigError(f"{what} {path}: the keys of its JSON object must be "
                              f"the class indices 0 to {len(data) - 1}: give {hint}")
        data = [data[str(i)] for i in range(len(data))]
    names = [v[-1] if isinstance(v, list) and v else v for v in data] \
        if isinstance(data, list) else None
    if names is None or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"{what} {path}: its JSON is not {hint}")
    return tuple(n.strip() for n in names)


def imagenet_labels(arch: str) -> tuple[str, ...]:
    """The category names of torchvision's default weights for `arch`."""
    import torchvision

    meta = torchvision.models.get_model_weights(arch).DEFAULT.meta
    return tuple(meta.get("categories") or ())


def model_labels(model: str, arch: str, source: str, num_classes: int,
                 path: Path | None, in_file: str = "") -> tuple[str, ...]:
    """A served model's class names: the `--labels` file (or the `labels` of its entry
    in the model file `in_file`), else the ImageNet names for torchvision's own
    weights, else none. A count that differs from the head's is a ConfigError."""
    if path is None:
        names = imagenet_labels(arch) if source == "imagenet" else ()
        return names if len(names) == num_classes else ()
    given = f"model {model} in {in_file}: labels {path}" if in_file \
        else f"--labels {model}={path}"
    if num_classes == 0:   # a model served without its head
        raise ConfigError(f"{given}: the weights of {model} hold no "
                          "classifier head, so it has no classes to name: drop the labels "
                          "or serve weights with a head")
    names = read_labels(path, f"model {model} in {in_file}: labels file" if in_file
                        else "--labels file")
    if len(names) != num_classes:
        raise ConfigError(f"{given} has {len(names)} class "
                          f"name{'s' if len(names) != 1 else ''} but the weights of "
                          f"{model} have {num_classes} classes: give one name per class, "
                          "one a line (or as JSON, or index,name lines)")
    return names


def named(score: T, labels: tuple[str, ...]) -> T:
    """A score (with `class_index` and `label`) with its class name filled in."""
    return dataclasses.replace(score, label=labels[score.class_index]) if labels else score
