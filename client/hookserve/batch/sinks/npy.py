"""The folder output: ``<layer>/<path>.npy`` per image and layer (each written in
``.tmp/``, which the next run empties, then renamed into place), then one line in
``index.jsonl``; an image counts as written only once its line is there. Feature
shapes may differ from image to image."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil

import numpy as np

from .base import OutputError, Record, ShapeMismatch, Sink
from .durable import Lock, lock_and_check, write_failed, write_json_atomic

_TMP = itertools.count()  # this process's temporary names
#: The folder of temporary files inside the output (no layer is named so: layer names
#: never start with a dot).
TMP_DIR = ".tmp"
#: The files a folder output holds besides its layers' folders.
OWN_FILES = ("index.jsonl", "hookserve.json", ".lock")
#: What a file name alone can make impossible: the image fails, the run goes on.
_NAME_ERRORS = frozenset({errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTDIR, errno.EISDIR})


class NpySink(Sink):
    """A folder: ``<layer>/<path>.npy`` per image and layer, ``index.jsonl``, metadata."""

    fixed_shape = False

    def __init__(self, out: str, meta: dict, **kw) -> None:
        super().__init__(out, meta, **kw)
        self.index_path = os.path.join(out, "index.jsonl")
        self.index = None
        self.lock: Lock | None = None
        self.names: dict[str, str] = {}
        #: the temporary files of the image being written (emptied when a run opens)
        self.tmp_dir = os.path.join(out, TMP_DIR)
        #: a write that failed (a full disk): the run stops
        self.broken: OutputError | None = None

    def open(self) -> None:
        if os.path.isfile(self.out):
            raise OutputError(f"{self.out} is a file; a folder output needs a folder")
        if os.path.exists(os.path.join(self.out, "_hookserve.json")):
            raise OutputError(f"{self.out} holds a sharded run's output (_hookserve.json), "
                              "one array per layer and shard: run with --sharded to add to "
                              "it, or give this run another --out")
        os.makedirs(self.out, exist_ok=True)
        self.lock, meta_path = lock_and_check(self.out, "hookserve.json", self.meta)
        write_json_atomic(meta_path, self.meta)
        # Files a killed run was writing: only a run holding the lock writes here.
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        os.makedirs(self.tmp_dir, exist_ok=True)
        if os.path.exists(self.index_path):
            with open(self.index_path, "rb+") as fh:
                data = fh.read()
                keep = data.rfind(b"\n") + 1
                if keep != len(data):  # a torn last line: that image was not written
                    fh.truncate(keep)
            for n, line in enumerate(data[:keep].splitlines(), 1):
                row = _row(line, self.index_path, n)
                self._done[row["path"]] = (row["size"], row["mtime_ns"], row["sha256"])
                self.names[row["name"]] = row["path"]
        self.index = open(self.index_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()

    def name_for(self, path: str) -> str:
        name = safe_relpath(path)
        other = self.names.get(name)
        if other is not None and other != path:
            raise ShapeMismatch(f"file name {name!r} is already used by {other!r} (a folder "
                                "output names files by path, '..' as '__'): write these "
                                "inputs to a .parquet or .h5 output, which keep each path "
                                "whole")
        return name

    def add(self, rec: Record) -> None:
        self.check_shapes(rec)
        name = self.name_for(rec.path)
        files: dict[str, str] = {}
        for layer, arr in rec.features.items():
            rel = f"{layer}/{name}.npy"
            final = os.path.join(self.out, rel)
            # Written in the one folder of temporary files (no final name is in it,
            # and the next run empties it), then renamed into place.
            tmp = os.path.join(self.tmp_dir, f"{os.getpid()}-{next(_TMP)}")
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                with open(tmp, "wb") as fh:
                    np.save(fh, arr, allow_pickle=False)
                os.replace(tmp, final)
            except OSError as exc:
                self._undo(files, tmp)
                if exc.errno not in _NAME_ERRORS:   # (a full disk stops the run)
                    self.broken = write_failed(self.out, exc)
                    raise self.broken from None
                raise ShapeMismatch(
                    f"cannot store its answer as {rel} in {self.out}: {exc.strerror}: "
                    "write these inputs to a .parquet or .h5 output, which keep each path "
                    "whole") from None
            files[layer] = rel
        line = json.dumps({"path": rec.path, "sha256": rec.sha256, "size": rec.size,
                           "mtime_ns": rec.mtime_ns, "name": name, "files": files})
        fd = self.index.fileno()   # (unbuffered: nothing of a failed line is left)
        end = os.fstat(fd).st_size
        try:
            data = memoryview(line.encode() + b"\n")   # the commit: one line
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:   # (a full disk: the line is cut off, its files removed)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            self._undo(files)
            self.broken = write_failed(self.out, exc)
            raise self.broken from None
        self.names[name] = rec.path
        self._done[rec.path] = (rec.size, rec.mtime_ns, rec.sha256)

    def _undo(self, files: dict[str, str], tmp: str | None = None) -> None:
        """Remove what an image that cannot be stored left: the files of its layers
        already renamed into place (no index line names them), and its temporary file."""
        for p in (*(os.path.join(self.out, rel) for rel in files.values()),
                  *([tmp] if tmp else [])):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def close(self, complete: bool) -> None:
        if self.index is not None:
            try:
                os.fsync(self.index.fileno())
            except OSError as exc:
                if self.broken is None:
                    self.broken = write_failed(self.out, exc)
                    raise self.broken from None
            finally:
                self.index.close()
        if self.lock is not None:   # (only the run holding the lock touches .tmp/)
            with contextlib.suppress(OSError):
                os.rmdir(self.tmp_dir)
            self.lock.release()


#: What each line of index.jsonl holds (besides the files).
_ROW_KEYS = ("path", "sha256", "size", "mtime_ns", "name")


def _row(line: bytes, index: str, n: int) -> dict:
    """Line `n` of a folder output's index, or OutputError naming it."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        why = f"it is no JSON: {exc}"
    else:
        missing = [k for k in _ROW_KEYS if k not in row] if isinstance(row, dict) else []
        why = ("it is no JSON object" if not isinstance(row, dict)
               else f"it lacks {', '.join(missing)}" if missing else "")
    if why:
        raise OutputError(f"{index} line {n} is damaged ({why}): remove that line (its "
                          "image is then extracted again), or write to a new --out")
    return row


def safe_relpath(path: str) -> str:
    """A relative file name for `path` inside an output folder: no leading '/', no '..'."""
    p = os.path.normpath(path)
    drive, p = os.path.splitdrive(p)
    parts = [("__" if part == ".." else part) for part in p.replace("\\", "/").split("/")
             if part not in ("", ".")]
    if drive:
        parts.insert(0, drive.rstrip(":") or "_")
    return "/".join(parts) or "_"


def peek_done(out: str) -> dict:
    """The paths an existing folder output holds, read without taking its lock."""
    index = os.path.join(out, "index.jsonl")
    if not os.path.exists(index):
        return {}
    with open(index, "rb") as fh:
        return {_row(line, index, n)["path"]: True
                for n, line in enumerate(fh, 1) if line.endswith(b"\n")}
