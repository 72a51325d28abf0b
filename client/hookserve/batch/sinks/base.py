"""What every output format of `hookserve batch` shares: the Record (one image's row),
the Sink interface, the metadata check, and the errors a sink raises."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

#: Metadata keys that must match for a run to add to an existing output.
_VOLATILE_META = ("hookserve_version", "created")
INSTALL_HINT = "pip install 'hookserve[batch]'"


class OutputError(Exception):
    """The output cannot be used (settings differ, locked by another run, ...)."""


class ShapeMismatch(Exception):
    """An image's answer does not fit this output: its features the output's fixed
    per-layer shape, or its name a file in a folder output. The image's own failure
    (a row of the errors file); the run goes on."""


@dataclass
class Record:
    """One image's row: identity plus features (layer -> array)."""

    path: str
    sha256: str
    size: int
    mtime_ns: int
    features: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.features.values())


def need(module: str, fmt: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        what = fmt if " " in fmt else f"writing {fmt}"
        raise OutputError(f"{what} needs {module.split('.')[0]}: {INSTALL_HINT}") from exc


def settings_of(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in _VOLATILE_META}


def check_meta(existing: dict, meta: dict, where: str) -> None:
    a, b = settings_of(existing), settings_of(meta)
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        said = "; ".join(f"{k}: it holds {_shown(a.get(k))}, this run asks "
                         f"{_shown(b.get(k))}" for k in diff[:3])
        raise OutputError(
            f"{where} was written with different settings ({said}"
            + (f"; {len(diff) - 3} more differ" if len(diff) > 3 else "")
            + "): use the same command to resume, or write to a new --out")


def _shown(value) -> str:
    """A setting's value in a refusal, cut to a readable length."""
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


class Sink:
    """Base: the operations `hookserve batch` uses on an output."""

    #: Whether every layer must be 1-D (Parquet).
    flat_only = False
    #: Whether every image of a layer must have the same shape.
    fixed_shape = True

    def __init__(self, out: str, meta: dict, *, checkpoint: int = 1024,
                 checkpoint_secs: float = 60.0) -> None:
        self.out = out
        self.meta = meta
        self.checkpoint_n = max(1, checkpoint)
        self.checkpoint_secs = checkpoint_secs
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self._done: dict[str, tuple[int, int, str]] = {}

    def done(self) -> dict[str, tuple[int, int, str]]:
        """path -> (size, mtime_ns, sha256) of every image already written."""
        return self._done

    def check_shapes(self, rec: Record) -> None:
        """Raise ShapeMismatch unless `rec` fits the shapes of earlier images."""
        for layer, arr in rec.features.items():
            got = (tuple(arr.shape), arr.dtype.str)
            if self.flat_only and arr.ndim != 1:
                raise ShapeMismatch(
                    f"layer {layer} has shape {arr.shape}; Parquet takes 1-D features: use "
                    "--reduction avg|max|flatten, or write .h5 or a folder")
            want = self.shapes.get(layer)
            if want is None:
                if self.fixed_shape:
                    self.shapes[layer] = got
            elif want != got:
                raise ShapeMismatch(
                    f"layer {layer} has shape {got[0]} {got[1]} but this output holds "
                    f"{want[0]} {want[1]}: images of different sizes (--native, or "
                    "--resize without --crop) need a reduction or a folder output")

    def add(self, rec: Record) -> None:
        raise NotImplementedError

    def checkpoint(self, force: bool = False) -> None:
        """Make the images added so far visible in the output (HDF5 and Parquet)."""

    def close(self, complete: bool) -> None:
        raise NotImplementedError
