"""Inputs and outputs that live elsewhere: fsspec URLs (``s3://``, ``gs://``,
``http(s)://``, ``memory://``...), brace expansion, ``--storage-option``, and the
output location a sharded run writes its parts and markers to.

fsspec and the store's driver are imported only when a URL is used
(``pip install 'hookserve[s3]'`` or ``'hookserve[gcs]'``). S3 credentials and the
endpoint come from the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ``AWS_PROFILE``...), which s3fs reads itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)\}")
_ALT = re.compile(r"\{([^{}]*,[^{}]*)\}")


def is_url(spec: str) -> bool:
    """A URL with a scheme (``file://`` counts too); plain paths are not."""
    return bool(_URL.match(spec))


def expand_braces(spec: str) -> list[str]:
    """``shards/{000000..000002}.tar`` -> three names (zero-padding kept);
    ``{a,b}`` -> two. Expansions nest and combine, left to right."""
    found = [m for m in (_RANGE.search(spec), _ALT.search(spec)) if m]
    if not found:
        return [spec]
    m = min(found, key=lambda m: m.start())  # the leftmost group varies slowest
    if m.re is _RANGE:
        lo, hi = int(m.group(1)), int(m.group(2))
        width = len(m.group(1)) if m.group(1).lstrip("-").startswith("0") else 0
        step = 1 if hi >= lo else -1
        alts = [str(n).zfill(width) for n in range(lo, hi + step, step)]
    else:
        alts = m.group(1).split(",")
    out = []
    for alt in alts:
        out += expand_braces(spec[:m.start()] + alt + spec[m.end():])
    return out


def parse_storage_options(items: list[str] | None) -> dict:
    """``KEY=VALUE`` strings -> fsspec keyword arguments. A value is read as JSON when
    it parses (``true``, ``3``, ``{"endpoint_url": ...}``), else kept as a string."""
    opts: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option must look like KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def filesystem(url: str, storage_options: dict | None = None):
    """-> (fsspec filesystem, path within it) for a URL."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise OSError(f"{url}: URLs need fsspec and the store's driver: "
                      "pip install 'hookserve[s3]' (or 'hookserve[gcs]')") from exc
    try:
        return url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:  # e.g. s3fs missing for s3://
        raise OSError(f"{url}: {exc}; pip install 'hookserve[s3]' (or 'hookserve[gcs]')"
                      ) from exc


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


class Location:
    """A folder that parts, markers and errors files are written to: local, or any
    fsspec URL. Every file appears whole or not at all: a local file is written to a
    hidden temporary name and renamed; a remote one is built locally and uploaded with
    one PUT (object stores show an object only once its upload completed)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.remote = is_url(url) and not url.startswith("file://")
        if self.remote:
            self.fs, self.path = filesystem(self.url, storage_options)
            self.path = self.path.rstrip("/")
        else:
            self.fs = None
            self.path = self.url[len("file://"):] if url.startswith("file://") else self.url

    def names(self) -> set[str]:
        """The file names directly in the folder (one listing); empty when it is absent."""
        if not self.remote:
            try:
                return set(os.listdir(self.path))
            except FileNotFoundError:
                return set()
        try:
            return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False,
                                                                          refresh=True)}
        except FileNotFoundError:
            return set()

    def read_text(self, name: str) -> str | None:
        try:
            if not self.remote:
                with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                    return fh.read()
            with self.fs.open(join(self.path, name), "rb") as fh:
                return fh.read().decode("utf-8")
        except FileNotFoundError:
            return None

    def put_file(self, local: str, name: str) -> None:
        """Publish the local file `local` as `name` (moved when local, uploaded once
        otherwise)."""
        if not self.remote:
            dest = os.path.join(self.path, *name.split("/"))
            folder, base = os.path.split(dest)
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{base}.tmp-{os.getpid()}")
            shutil.copyfile(local, tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
            return
        self.fs.put_file(local, join(self.path, name))

    def put_text(self, name: str, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", delete=False,
                                         suffix=".tmp") as fh:
            fh.write(text)
        try:
            self.put_file(fh.name, name)
        finally:
            os.unlink(fh.name)

    def put_tree(self, local_dir: str, prefix: str) -> None:
        """Publish every file under `local_dir` below `prefix`/ (each one whole)."""
        for root, _, files in os.walk(local_dir):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(root, f), local_dir).replace(os.sep, "/")
                self.put_file(os.path.join(root, f), f"{prefix}/{rel}")

    def __str__(self) -> str:
        return self.url


def walk_files(url: str, storage_options: dict | None = None) -> Iterator[tuple[str, int]]:
    """(URL, size) of every file below a remote folder or prefix: one listing (paged by
    the store), no request per object."""
    fs, path = filesystem(url, storage_options)
    base, root = url.rstrip("/"), path.rstrip("/")
    for p, info in sorted(fs.find(path, detail=True).items()):
        if info.get("type", "file") == "file":
            # spelled like the URL given (memory://b/x, not memory:///b/x)
            full = base + p[len(root):] if p.startswith(root + "/") else \
                base if p == root else fs.unstrip_protocol(p)
            yield full, int(info.get("size") or 0)
