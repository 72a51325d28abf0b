"""Output formats of `hookserve batch`, one per module: :mod:`.h5`, :mod:`.parquet`,
:mod:`.npy`. The crash-safe writing they share (atomic rename, journal, parts, resume,
lock) is :mod:`.durable`; the Record and Sink interface are :mod:`.base`.

A new format is a module here with a :class:`~.base.Sink` subclass (usually a
:class:`~.durable.PartSink` that implements ``_write_part`` and ``_read_part``) and a
``peek_done(out)``, plus one line in :func:`make_sink` and :func:`peek_done`.
"""

from __future__ import annotations

import os

from .base import OutputError, Record, ShapeMismatch, Sink
from .durable import journal_append, journal_read

__all__ = ["OutputError", "Record", "ShapeMismatch", "Sink", "journal_append",
           "journal_read", "make_sink", "peek_done", "format_of", "unknown_format"]


#: The --out suffixes and their formats; no suffix also names a folder of .npy files.
FORMATS = {".h5": "h5", ".hdf5": "h5", ".parquet": "parquet", ".npy": "npy"}


def format_of(out: str) -> str:
    """'h5', 'parquet' or 'npy' (a folder), by the extension of `out`."""
    ext = os.path.splitext(out.rstrip("/"))[1].lower()
    return FORMATS.get(ext, "npy")


def unknown_format(out: str) -> str | None:
    """Why `out` names no output format (one line), or None. Known: a suffix of
    :data:`FORMATS`, or a folder of .npy files: no suffix, a trailing ``/``, or an
    existing folder."""
    ext = os.path.splitext(out.rstrip("/"))[1]
    if not ext or ext.lower() in FORMATS or out.endswith("/") or os.path.isdir(out):
        return None
    return (f"--out {out}: {ext} is not an output format; name it NAME.h5 (or .hdf5), "
            "NAME.parquet, or a folder of .npy files (NAME.npy, no suffix, or end it with /)")


def owned_paths(out: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """What a local run writing to `out` owns, as absolute paths: (files, folders
    whose every file). A file output owns itself and its parts; a folder output its
    index, settings, lock and temporary files, not a file of the user's beside them."""
    o = os.path.abspath(out.rstrip("/") or out)
    if format_of(out) != "npy":
        return frozenset({o, o + ".parts"}), (o, o + ".parts")
    from .npy import OWN_FILES, TMP_DIR
    return frozenset({o, *(os.path.join(o, n) for n in OWN_FILES)}), (
        os.path.join(o, TMP_DIR),)


def make_sink(out: str, meta: dict, **kw) -> Sink:
    """The sink for `out`'s extension: .h5/.hdf5, .parquet, anything else a folder."""
    consolidate = kw.pop("consolidate", True)
    fmt = format_of(out)
    if fmt == "h5":
        from .h5 import H5Sink
        return H5Sink(out, meta, consolidate=consolidate, **kw)
    if fmt == "parquet":
        from .parquet import ParquetSink
        return ParquetSink(out.rstrip("/"), meta, **kw)
    from .npy import NpySink
    return NpySink(out, meta, **kw)


def peek_done(out: str) -> dict:
    """The paths an existing output holds (empty when there is none), read without
    taking its lock."""
    fmt = format_of(out)
    if fmt == "h5":
        if not os.path.exists(out):
            return {}
        from .h5 import peek_done as peek
    elif fmt == "parquet":
        if not os.path.isdir(out):
            return {}
        from .parquet import peek_done as peek
    else:
        from .npy import peek_done as peek
    return peek(out)
