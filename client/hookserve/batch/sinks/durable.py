"""Crash-safe writing, shared by every output format of `hookserve batch`.

Crash safety (kill -9 at any instant) rests on two rules:

1. A file is only ever made visible by ``os.rename`` of a complete, flushed temporary
   file in the same folder (:func:`replace`), so a reader sees the old file or the
   new one, never half.
2. Every image is made durable against a process kill as soon as it is written, by
   appending it to a journal (HDF5, Parquet: :func:`journal_append`) or to the index
   (npy) with one ``write``. A torn last record is detected (length + CRC32, or a
   missing newline) and dropped.

:class:`PartSink` collects images into immutable *parts* (HDF5, Parquet). Each image
first goes to a journal (``.journal-NNNNNN.bin``); every ``checkpoint`` images (or
seconds, or 256 MB) the buffered images are written as ``part-NNNNNN`` (temp file +
rename) and the journal is deleted. On start (resume), the parts already there say
which images are done, and a journal without its part is replayed into that part. A
part is never rewritten, so a checkpoint costs the new images only, whatever the
output's size. An output folder is held under an exclusive lock (:class:`Lock`) while
a run writes it, until the run has closed it (HDF5's consolidation included: its lock
file, ``.<out>.lock``, lies beside the output, since consolidation removes the parts
folder).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import struct
import time
import zlib

import numpy as np

from ..errors import one_line
from .base import OutputError, Record, Sink, check_meta

#: Buffered feature bytes that force a checkpoint, whatever --checkpoint says.
CHECKPOINT_BYTES = 256 << 20


#: What a full disk or a size limit reports: freeing space is what to do.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def write_failed(out: str, exc: BaseException) -> OutputError:
    """A failed write to output `out` as the one line that stops the run: what failed,
    and what to do (the HDF5 library reports the errno in its RuntimeError's text)."""
    text = str(exc)
    code = exc.errno if isinstance(exc, OSError) else None
    # (HDF5: "errno = 27, error message = '...'"; Arrow: "[errno 27] File too large")
    said = (re.search(r"errno = (\d+), error message = '([^']+)'", text)
            or re.search(r"\[errno (\d+)\] ([^\n;]+)", text))
    if said:   # (the system's own words, not the library's around them)
        code, why = int(said.group(1)), said.group(2).strip()
    else:
        why = (exc.strerror if isinstance(exc, OSError) and exc.strerror
               else " ".join(text.split())[:200])
    fix = "free space (or lift the limit)" if code in _NO_ROOM else "fix that"
    return OutputError(f"cannot write {out}: {why}: {fix} and run the same command again; "
                       "the images written so far are kept")


def written(tmp: str, final: str, write) -> None:
    """`write(tmp)`, then `tmp` renamed over `final`; a write that fails (a full disk)
    leaves no `tmp` behind."""
    try:
        write(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    replace(tmp, final)


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace(tmp: str, final: str) -> None:
    """Make `tmp` visible as `final` atomically (after flushing it to disk)."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def write_json_atomic(path: str, obj) -> None:
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
    replace(tmp, path)


def check_meta_file(meta_path: str, meta: dict) -> str:
    """An existing metadata file must match this run's settings. -> its path."""
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            check_meta(json.load(fh), meta, meta_path)
    return meta_path


def lock_and_check(folder: str, meta_name: str, meta: dict):
    """Lock an output folder; an existing metadata file must match this run's settings.
    -> (lock, metadata path)."""
    lock = Lock(os.path.join(folder, ".lock"))
    return lock, check_meta_file(os.path.join(folder, meta_name), meta)


class Lock:
    """An exclusive flock so two runs never write the same output at once."""

    def __init__(self, path: str) -> None:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.fh = open(path, "a+")  # noqa: SIM115 - held for the sink's lifetime
        except OSError as exc:
            raise OutputError(f"cannot write the output's lock file {path}: "
                              f"{exc.strerror or exc}: choose another --out") from None
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise OutputError(f"{path} is locked: another hookserve batch is writing this "
                              "output (use a different --out per shard)") from None

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()


_JMAGIC = b"HSJ1"
_JHEAD = struct.Struct("<4sIQ")  # magic, header length, payload length


def journal_append(fh, rec: Record) -> None:
    """Append one record in a single write: magic, lengths, JSON header, raw arrays, CRC."""
    layers = [[k, a.dtype.str, list(a.shape)] for k, a in rec.features.items()]
    header = json.dumps({"path": rec.path, "sha256": rec.sha256, "size": rec.size,
                         "mtime_ns": rec.mtime_ns, "layers": layers}).encode()
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in rec.features.values())
    crc = zlib.crc32(payload, zlib.crc32(header))
    fh.write(_JHEAD.pack(_JMAGIC, len(header), len(payload)) + header + payload
             + struct.pack("<I", crc))
    fh.flush()  # into the OS: a killed process loses nothing written so far


def journal_read(path: str) -> list[Record]:
    """Every complete record; stops at the first torn or corrupt one."""
    out: list[Record] = []
    with open(path, "rb") as fh:
        data = fh.read()
    pos = 0
    while pos + _JHEAD.size <= len(data):
        magic, hlen, plen = _JHEAD.unpack_from(data, pos)
        end = pos + _JHEAD.size + hlen + plen + 4
        if magic != _JMAGIC or end > len(data):
            break
        h0 = pos + _JHEAD.size
        header, payload = data[h0:h0 + hlen], data[h0 + hlen:h0 + hlen + plen]
        (crc,) = struct.unpack_from("<I", data, end - 4)
        if zlib.crc32(payload, zlib.crc32(header)) != crc:
            break
        h = json.loads(header)
        feats, off = {}, 0
        for name, dt, shape in h["layers"]:
            dtype = np.dtype(dt)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            feats[name] = np.frombuffer(payload, dtype, offset=off,
                                        count=n // dtype.itemsize).reshape(shape)
            off += n
        out.append(Record(h["path"], h["sha256"], h["size"], h["mtime_ns"], feats))
        pos = end
    return out


# -- part-based outputs (HDF5, Parquet) -------------------------------------------------
_PART = re.compile(r"^part-(\d{6,})\.(h5|parquet)$")
_JOURNAL = re.compile(r"^\.journal-(\d{6,})\.bin$")


class PartSink(Sink):
    ext = ""

    def __init__(self, out: str, meta: dict, parts_dir: str, lock_path: str | None = None,
                 **kw) -> None:
        super().__init__(out, meta, **kw)
        self.dir = parts_dir
        #: the exclusive lock's file (in the parts folder unless a subclass removes that
        #: folder while it works, as HDF5's consolidation does)
        self.lock_path = lock_path or os.path.join(parts_dir, ".lock")
        self.parts: list[tuple[str, int]] = []  # (file name, rows), in order
        self.buffer: list[Record] = []
        self.buffer_bytes = 0
        self.seq = 0
        self.journal = None
        self.since = time.monotonic()
        self.lock: Lock | None = None
        #: a write that failed (a full disk): nothing more is written, see `close`
        self.broken: OutputError | None = None

    # subclass hooks
    #: Set once a failed write left a file the process cannot free (HDF5's)
    unfreeable = False

    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        raise NotImplementedError

    def _read_part(self, path: str) -> tuple[dict, list[tuple[str, int, int, str]],
                                              dict[str, tuple[tuple[int, ...], str]]]:
        """-> (metadata, [(path, size, mtime_ns, sha256)], layer shapes)."""
        raise NotImplementedError

    def _published(self) -> None:
        """Called after the set of parts changed (HDF5 rewrites its virtual file)."""

    def take_lock(self) -> None:
        """Hold the output's lock (OutputError when another run holds it)."""
        if self.lock is None:
            self.lock = Lock(self.lock_path)

    def open(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.take_lock()
        meta_path = check_meta_file(os.path.join(self.dir, "_hookserve.json"), self.meta)
        names = sorted(os.listdir(self.dir))
        for name in names:
            if name.startswith(".tmp-"):  # a part or master that never got renamed
                os.unlink(os.path.join(self.dir, name))
        for name in names:
            m = _PART.match(name)
            if not m or m.group(2) != self.ext:
                continue
            try:
                meta, rows, shapes = self._read_part(os.path.join(self.dir, name))
            except Exception as exc:  # noqa: BLE001 - a part cut or overwritten by hand
                raise OutputError(
                    f"{os.path.join(self.dir, name)} cannot be read ({one_line(exc)}): "
                    "move it away (its images are then extracted again) or choose "
                    "another --out") from None
            check_meta(meta, self.meta, os.path.join(self.dir, name))
            self._adopt_shapes(shapes, name)
            for p, size, mtime, sha in rows:
                self._done[p] = (size, mtime, sha)
            self.parts.append((name, len(rows)))
            self.seq = max(self.seq, int(m.group(1)) + 1)
        for name in names:  # journals whose part never got written: replay them
            m = _JOURNAL.match(name)
            if not m:
                continue
            jpath = os.path.join(self.dir, name)
            n = int(m.group(1))
            if f"part-{n:06d}.{self.ext}" in {p for p, _ in self.parts}:
                os.unlink(jpath)  # killed after the rename, before the unlink
                continue
            recs = [r for r in journal_read(jpath) if r.path not in self._done]
            for r in recs:
                self.check_shapes(r)
                self._done[r.path] = (r.size, r.mtime_ns, r.sha256)
            if recs:
                with self._writing():   # (a rerun on a disk still full: one line)
                    self._commit(recs, n)
            os.unlink(jpath)
            self.seq = max(self.seq, n + 1)
        with self._writing():
            write_json_atomic(meta_path, self.meta)
            self._published()

    def _adopt_shapes(self, shapes: dict, where: str) -> None:
        for layer, sd in shapes.items():
            if layer in self.shapes and self.shapes[layer] != sd:
                raise OutputError(f"{where}: layer {layer} is {sd}, other parts hold "
                                  f"{self.shapes[layer]}")
            self.shapes[layer] = sd

    def add(self, rec: Record) -> None:
        self.check_shapes(rec)
        with self._writing():
            if self.journal is None:
                self.journal = open(  # noqa: SIM115 - closed at the checkpoint
                    os.path.join(self.dir, f".journal-{self.seq:06d}.bin"), "ab")
            journal_append(self.journal, rec)
        self.buffer.append(rec)
        self.buffer_bytes += rec.nbytes
        self._done[rec.path] = (rec.size, rec.mtime_ns, rec.sha256)
        if (len(self.buffer) >= self.checkpoint_n or self.buffer_bytes >= CHECKPOINT_BYTES
                or time.monotonic() - self.since >= self.checkpoint_secs):
            self.checkpoint(force=True)

    def checkpoint(self, force: bool = False) -> None:
        if not self.buffer:
            self.since = time.monotonic()
            return
        if not force and time.monotonic() - self.since < self.checkpoint_secs:
            return
        n = self.seq
        with self._writing():
            self._commit(self.buffer, n)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, f".journal-{n:06d}.bin"))
        self.seq = n + 1
        self.buffer, self.buffer_bytes, self.since = [], 0, time.monotonic()
        with self._writing():
            self._published()

    def _commit(self, recs: list[Record], n: int) -> None:
        name = f"part-{n:06d}.{self.ext}"
        written(os.path.join(self.dir, f".tmp-{name}"), os.path.join(self.dir, name),
                lambda tmp: self._write_part(tmp, recs))
        self.parts.append((name, len(recs)))

    @contextlib.contextmanager
    def _writing(self):
        """A write to the output: one that fails (no space left, a file size limit, an
        I/O error) breaks the sink. Its error says what to do; `close` then writes
        nothing more: the journal keeps every image written, for the next run. (The
        HDF5 library's own failure comes as RuntimeError, holding the errno's text.)"""
        if self.broken is not None:
            raise self.broken
        try:
            yield
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "errno" not in str(exc):
                raise
            self.broken = write_failed(self.out, exc)
            # an HDF5 file whose write failed cannot be freed: the command ends the
            # process at once (`batch.command.cli_run`)
            self.broken.exit_now = self.unfreeable   # type: ignore[attr-defined]
            raise self.broken from None

    def _finished(self, complete: bool) -> None:
        """Called at close, after the last checkpoint, with the lock still held."""

    def close(self, complete: bool) -> None:
        try:
            if self.broken is not None:   # write nothing more: the journal holds the rest
                if self.journal is not None:
                    with contextlib.suppress(OSError):
                        self.journal.close()
                    self.journal = None
                return
            self.checkpoint(force=True)
            with self._writing():
                self._finished(complete)
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None
