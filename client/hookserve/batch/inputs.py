"""Input discovery for `hookserve batch`: directories, globs, list files, CSV/Parquet.

Listing (:func:`discover`), sharding (:func:`select_shard`) and reading an image's
bytes (:func:`read_bytes`) are the three things the run needs from its inputs; a new
input kind adds its listing here and, if its images are not local files, its reader.

Every input becomes a path string. The string is the image's identity everywhere: it
is sent as the image id, written to the output's `path` column, hashed for
`--shard`, and compared on resume. Paths are normalised (``os.path.normpath``),
de-duplicated and sorted, so the order is the same on every run of the same command.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import os
from collections.abc import Iterable, Iterator

#: Extensions picked up when walking a directory (case-insensitive).
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
#: A file with one of these extensions is read as a list of paths, not as an image.
LIST_EXTS = frozenset({".txt", ".lst"})
TABLE_EXTS = frozenset({".csv", ".tsv", ".parquet"})


class InputError(Exception):
    """The inputs cannot be listed (a missing path, a missing column...)."""


def _walk(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if os.path.splitext(name)[1].lower() in IMAGE_EXTS:
                yield os.path.join(dirpath, name)


def _list_file(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#"):
                yield line


def _table(path: str, column: str) -> list[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise InputError("reading a Parquet input list needs pyarrow:\n"
                             "    pip install 'hookserve[batch]'") from exc
        schema = pq.read_schema(path)
        if column not in schema.names:
            raise InputError(f"{path}: no column {column!r} (columns: "
                             f"{', '.join(schema.names)}); choose one with --path-column")
        return [str(v) for v in pq.read_table(path, columns=[column]).column(column).to_pylist()
                if v is not None]
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t" if ext == ".tsv" else ",")
        if reader.fieldnames is None or column not in reader.fieldnames:
            raise InputError(f"{path}: no column {column!r} (columns: "
                             f"{', '.join(reader.fieldnames or [])}); choose one with "
                             "--path-column")
        return [row[column] for row in reader if row.get(column)]


def discover(specs: Iterable[str], *, path_column: str = "path",
             root: str | None = None) -> list[str]:
    """All image paths named by `specs`, normalised, de-duplicated and sorted.

    - a directory: every file below it with an image extension (:data:`IMAGE_EXTS`);
    - a ``.txt``/``.lst`` file: one path per line (blank lines and ``#`` comments skipped);
    - a ``.csv``/``.tsv``/``.parquet`` file: the `path_column` column;
    - a pattern with ``*``, ``?`` or ``[``: every file it matches (``**`` recurses);
    - any other existing file: that image.

    Relative paths read from list and table files are joined to `root` when given
    (otherwise they are relative to the working directory).
    """
    found: set[str] = set()
    for spec in specs:
        listed: Iterable[str]
        if os.path.isdir(spec):
            found.update(os.path.normpath(p) for p in _walk(spec))
            continue
        if os.path.isfile(spec):
            ext = os.path.splitext(spec)[1].lower()
            if ext in LIST_EXTS:
                listed = _list_file(spec)
            elif ext in TABLE_EXTS:
                listed = _table(spec, path_column)
            else:
                found.add(os.path.normpath(spec))
                continue
            for p in listed:
                if root and not os.path.isabs(p):
                    p = os.path.join(root, p)
                found.add(os.path.normpath(p))
            continue
        if glob.has_magic(spec):
            found.update(os.path.normpath(p) for p in glob.glob(spec, recursive=True)
                         if os.path.isfile(p))
            continue
        raise InputError(f"no such file or directory: {spec}")
    return sorted(found)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= I < N")
    return i, n


def shard_of(path: str, n: int) -> int:
    """The shard (0..n-1) a path belongs to: a hash of the path string, so adding or
    removing other files never moves an image to another shard."""
    h = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(h, "big") % n


def select_shard(paths: list[str], shard: tuple[int, int] | None) -> list[str]:
    if shard is None or shard[1] == 1:
        return paths
    i, n = shard
    return [p for p in paths if shard_of(p, n) == i]


def read_bytes(path: str) -> bytes:
    """An input image's encoded bytes (raises OSError when it cannot be read)."""
    with open(path, "rb") as fh:
        return fh.read()
