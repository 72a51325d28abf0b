"""Output writers of `hookserve batch`: HDF5, Parquet and a folder of .npy files.

Crash safety (kill -9 at any instant) rests on two rules:

1. A file is only ever made visible by ``os.rename`` of a complete, flushed temporary
   file in the same folder, so a reader sees the old file or the new one, never half.
2. Every image is made durable against a process kill as soon as it is written, by
   appending it to a journal (HDF5, Parquet) or to the index (npy) with one ``write``.
   A torn last record is detected (length + CRC32, or a missing newline) and dropped.

HDF5 and Parquet collect images into immutable *parts*. Each image first goes to a
journal (``.journal-NNNNNN.bin``); every ``checkpoint`` images (or seconds, or 256 MB)
the buffered images are written as ``part-NNNNNN`` (temp file + rename) and the journal
is deleted. On start, a journal without its part is replayed into that part. A part
is never rewritten, so a checkpoint costs the new images only, whatever the output's
size.

- ``.parquet``: the output is a folder of parts, a standard Parquet dataset that
  ``pyarrow.parquet.read_table`` / ``pandas.read_parquet`` read in one call (names
  starting with ``.`` or ``_`` are ignored by those readers).
- ``.h5``: during a run, ``out.h5`` is a small file of HDF5 *virtual datasets* that
  map onto the parts in ``out.h5.parts/`` (rewritten by rename at each checkpoint, so
  always readable). When a run finishes with every image attempted, the parts are
  copied once into a self-contained ``out.h5`` and the folder is removed. A later run
  hard-links that file into a new parts folder as part 0 and goes on from there.
- folder: ``<layer>/<path>.npy`` per image and layer (each written by rename), then
  one line in ``index.jsonl``; an image counts as written only once its line is there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from .batch_inputs import safe_relpath

#: Buffered feature bytes that force a checkpoint, whatever --checkpoint says.
CHECKPOINT_BYTES = 256 << 20
#: Metadata keys that must match for a run to add to an existing output.
_VOLATILE_META = ("hookserve_version", "created")
INSTALL_HINT = "pip install 'hookserve[batch]'"


class OutputError(Exception):
    """The output cannot be used (settings differ, locked by another run, ...)."""


class ShapeMismatch(Exception):
    """An image's features do not fit the output's fixed per-layer shape."""


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


def _need(module: str, fmt: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise OutputError(f"writing {fmt} needs {module.split('.')[0]}:\n    {INSTALL_HINT}"
                          ) from exc


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _replace(tmp: str, final: str) -> None:
    """Make `tmp` visible as `final` atomically (after flushing it to disk)."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def _write_json_atomic(path: str, obj) -> None:
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
    _replace(tmp, path)


def settings_of(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in _VOLATILE_META}


def check_meta(existing: dict, meta: dict, where: str) -> None:
    a, b = settings_of(existing), settings_of(meta)
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise OutputError(
            f"{where} was written with different settings ({', '.join(diff)} differ): "
            "use the same command to resume, or write to a new --out")


def _lock_and_check(folder: str, meta_name: str, meta: dict):
    """Lock an output folder; an existing metadata file must match this run's settings.
    -> (lock, metadata path)."""
    lock = _Lock(os.path.join(folder, ".lock"))
    meta_path = os.path.join(folder, meta_name)
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            check_meta(json.load(fh), meta, meta_path)
    return lock, meta_path


class _Lock:
    """An exclusive flock so two runs never write the same output at once."""

    def __init__(self, path: str) -> None:
        self.fh = open(path, "a+")  # noqa: SIM115 - held for the sink's lifetime
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise OutputError(f"{path} is locked: another hookserve batch is writing this "
                              "output (use a different --out per shard)") from None

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()


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


# -- journal --------------------------------------------------------------------------
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


class _PartSink(Sink):
    ext = ""

    def __init__(self, out: str, meta: dict, parts_dir: str, **kw) -> None:
        super().__init__(out, meta, **kw)
        self.dir = parts_dir
        self.parts: list[tuple[str, int]] = []  # (file name, rows), in order
        self.buffer: list[Record] = []
        self.buffer_bytes = 0
        self.seq = 0
        self.journal = None
        self.since = time.monotonic()
        self.lock: _Lock | None = None

    # subclass hooks
    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        raise NotImplementedError

    def _read_part(self, path: str) -> tuple[dict, list[tuple[str, int, int, str]],
                                              dict[str, tuple[tuple[int, ...], str]]]:
        """-> (metadata, [(path, size, mtime_ns, sha256)], layer shapes)."""
        raise NotImplementedError

    def _published(self) -> None:
        """Called after the set of parts changed (HDF5 rewrites its virtual file)."""

    def open(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.lock, meta_path = _lock_and_check(self.dir, "_hookserve.json", self.meta)
        names = sorted(os.listdir(self.dir))
        for name in names:
            if name.startswith(".tmp-"):  # a part or master that never got renamed
                os.unlink(os.path.join(self.dir, name))
        for name in names:
            m = _PART.match(name)
            if not m or m.group(2) != self.ext:
                continue
            meta, rows, shapes = self._read_part(os.path.join(self.dir, name))
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
                self._commit(recs, n)
            os.unlink(jpath)
            self.seq = max(self.seq, n + 1)
        _write_json_atomic(meta_path, self.meta)
        self._published()

    def _adopt_shapes(self, shapes: dict, where: str) -> None:
        for layer, sd in shapes.items():
            if layer in self.shapes and self.shapes[layer] != sd:
                raise OutputError(f"{where}: layer {layer} is {sd}, other parts hold "
                                  f"{self.shapes[layer]}")
            self.shapes[layer] = sd

    def add(self, rec: Record) -> None:
        self.check_shapes(rec)
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
        self._commit(self.buffer, n)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, f".journal-{n:06d}.bin"))
        self.seq = n + 1
        self.buffer, self.buffer_bytes, self.since = [], 0, time.monotonic()
        self._published()

    def _commit(self, recs: list[Record], n: int) -> None:
        name = f"part-{n:06d}.{self.ext}"
        tmp = os.path.join(self.dir, f".tmp-{name}")
        self._write_part(tmp, recs)
        _replace(tmp, os.path.join(self.dir, name))
        self.parts.append((name, len(recs)))

    def close(self, complete: bool) -> None:
        self.checkpoint(force=True)
        if self.lock is not None:
            self.lock.release()


class ParquetSink(_PartSink):
    """A Parquet dataset folder: one row per image, one fixed-size list column per layer."""

    ext = "parquet"
    flat_only = True

    def __init__(self, out: str, meta: dict, **kw) -> None:
        if os.path.isfile(out):
            raise OutputError(f"{out} is a file; a .parquet output is a folder of parts")
        super().__init__(out, meta, out, **kw)
        self.pa = _need("pyarrow", "Parquet")
        self.pq = _need("pyarrow.parquet", "Parquet")

    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        pa = self.pa
        cols = {
            "path": pa.array([r.path for r in recs], pa.string()),
            "sha256": pa.array([r.sha256 for r in recs], pa.string()),
            "size": pa.array([r.size for r in recs], pa.int64()),
            "mtime_ns": pa.array([r.mtime_ns for r in recs], pa.int64()),
        }
        for layer in recs[0].features:
            flat = np.concatenate([r.features[layer].reshape(-1) for r in recs])
            width = recs[0].features[layer].shape[0]
            cols[layer] = pa.FixedSizeListArray.from_arrays(pa.array(flat), width)
        table = pa.table(cols).replace_schema_metadata(
            {"hookserve": json.dumps(self.meta)})
        self.pq.write_table(table, tmp)

    def _read_part(self, path: str):
        pf = self.pq.ParquetFile(path)
        md = pf.schema_arrow.metadata or {}
        meta = json.loads(md.get(b"hookserve", b"{}"))
        t = pf.read(columns=["path", "sha256", "size", "mtime_ns"])
        rows = list(zip(t.column("path").to_pylist(), t.column("size").to_pylist(),
                        t.column("mtime_ns").to_pylist(), t.column("sha256").to_pylist(),
                        strict=True))
        shapes = {}
        for f in pf.schema_arrow:
            if f.name not in ("path", "sha256", "size", "mtime_ns"):
                dt = np.dtype(f.type.value_type.to_pandas_dtype()).newbyteorder("<")
                shapes[f.name] = ((f.type.list_size,), dt.str)
        return meta, rows, shapes


class H5Sink(_PartSink):
    """One HDF5 file: a dataset per layer [N, ...], plus paths, sha256, size, mtime_ns."""

    ext = "h5"

    def __init__(self, out: str, meta: dict, *, consolidate: bool = True, **kw) -> None:
        super().__init__(out, meta, out + ".parts", **kw)
        self.h5py = _need("h5py", "HDF5")
        self.consolidate = consolidate

    def open(self) -> None:
        h5py = self.h5py
        if os.path.exists(self.out):
            try:
                with h5py.File(self.out, "r") as f:
                    layout = f.attrs.get("hookserve_layout", "")
                    existing = json.loads(f.attrs.get("hookserve", "{}"))
            except OSError as exc:
                raise OutputError(f"{self.out} exists and is not a readable HDF5 file "
                                  f"({exc}): move it away or choose another --out") from None
            if layout == "single":
                # A finished output. Any parts folder beside it is a leftover of the
                # consolidation (killed before it was removed): the file supersedes it.
                check_meta(existing, self.meta, self.out)
                if os.path.isdir(self.dir):
                    shutil.rmtree(self.dir)
                os.makedirs(self.dir)
                base = os.path.join(self.dir, "part-000000.h5")
                try:  # the finished file becomes part 0, without copying its data
                    os.link(self.out, base)
                except OSError:
                    shutil.copyfile(self.out, base + ".copy")
                    os.replace(base + ".copy", base)
                _fsync_dir(self.dir)
            elif layout != "virtual":
                raise OutputError(f"{self.out} exists and was not written by hookserve "
                                  "batch: move it away or choose another --out")
        super().open()

    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        with self.h5py.File(tmp, "w") as f:
            self._fill(f, recs)

    def _attrs(self, f, layout: str) -> None:
        f.attrs["hookserve"] = json.dumps(self.meta)
        f.attrs["hookserve_layout"] = layout
        for key in ("model", "dtype", "hookserve_version"):
            f.attrs[key] = str(self.meta.get(key, ""))
        f.attrs["weights_digest"] = self.meta.get("weights", {}).get("digest", "")
        f.attrs["layers"] = [layer["name"] for layer in self.meta.get("layers", [])]

    def _layer_attrs(self, ds, layer: str) -> None:
        for spec in self.meta.get("layers", []):
            if spec["name"] == layer:
                ds.attrs["reduction"] = spec["reduction"]
                ds.attrs["l2_normalize"] = spec["l2_normalize"]
        ds.attrs["dtype"] = self.meta.get("dtype", "")
        if self.meta.get("dtype") == "bfloat16":
            ds.attrs["note"] = ("bfloat16 bit patterns stored as uint16: "
                                "hookserve.bfloat16_to_float32(a) widens them")

    @staticmethod
    def _chunks(shape: tuple[int, ...], itemsize: int, n: int) -> tuple[int, ...]:
        per = max(1, int(np.prod(shape, dtype=np.int64)) * itemsize)
        rows = max(1, min(max(n, 1), (1 << 20) // per))  # about 1 MiB per chunk
        return (rows, *shape)

    def _fill(self, f, recs: list[Record]) -> None:
        h5py = self.h5py
        n = len(recs)
        self._attrs(f, "single")
        f.create_dataset("paths", data=[r.path for r in recs], dtype=h5py.string_dtype())
        f.create_dataset("sha256", data=np.array([r.sha256.encode() for r in recs], "S64"))
        f.create_dataset("size", data=np.array([r.size for r in recs], np.int64))
        f.create_dataset("mtime_ns", data=np.array([r.mtime_ns for r in recs], np.int64))
        for layer, arr in recs[0].features.items():
            ds = f.create_dataset(layer, shape=(n, *arr.shape), dtype=arr.dtype,
                                  chunks=self._chunks(arr.shape, arr.dtype.itemsize, n))
            for i, r in enumerate(recs):
                ds[i] = r.features[layer]
            self._layer_attrs(ds, layer)

    def _read_part(self, path: str):
        with self.h5py.File(path, "r") as f:
            meta = json.loads(f.attrs.get("hookserve", "{}"))
            paths = [p.decode() if isinstance(p, bytes) else p for p in f["paths"][:]]
            rows = list(zip(paths, f["size"][:].tolist(), f["mtime_ns"][:].tolist(),
                            [s.decode() for s in f["sha256"][:]], strict=True))
            shapes = {k: (tuple(f[k].shape[1:]), f[k].dtype.str) for k in f.keys()
                      if k not in ("paths", "sha256", "size", "mtime_ns")}
        return meta, rows, shapes

    def _published(self) -> None:
        """Rewrite out.h5 as virtual datasets over the parts (small: no feature data)."""
        h5py = self.h5py
        total = sum(n for _, n in self.parts)
        rel = os.path.basename(self.dir)
        tmp = os.path.join(os.path.dirname(os.path.abspath(self.out)),
                           f".tmp-{os.path.basename(self.out)}")
        fields = [("paths", h5py.string_dtype(), ()), ("sha256", np.dtype("S64"), ()),
                  ("size", np.dtype(np.int64), ()), ("mtime_ns", np.dtype(np.int64), ())]
        fields += [(k, np.dtype(dt), shape) for k, (shape, dt) in self.shapes.items()]
        with h5py.File(tmp, "w") as f:
            self._attrs(f, "virtual")
            f.attrs["parts"] = rel
            for name, dt, shape in fields:
                lay = h5py.VirtualLayout(shape=(total, *shape), dtype=dt)
                start = 0
                for pname, n in self.parts:
                    # Relative source names resolve against the folder of out.h5, so
                    # the pair can be moved together.
                    lay[start:start + n] = h5py.VirtualSource(
                        f"{rel}/{pname}", name, shape=(n, *shape))
                    start += n
                ds = f.create_virtual_dataset(name, lay)
                if name in self.shapes:
                    self._layer_attrs(ds, name)
        _replace(tmp, self.out)

    def close(self, complete: bool) -> None:
        super().close(complete)
        if complete and self.consolidate:
            self._consolidate()

    def _consolidate(self) -> None:
        """Copy every part into one self-contained file (once, at the end of a run)."""
        h5py = self.h5py
        total = sum(n for _, n in self.parts)
        tmp = os.path.join(os.path.dirname(os.path.abspath(self.out)),
                           f".tmp-{os.path.basename(self.out)}")
        with h5py.File(tmp, "w") as f:
            self._attrs(f, "single")
            sources = [h5py.File(os.path.join(self.dir, p), "r") for p, _ in self.parts]
            try:
                names = ["paths", "sha256", "size", "mtime_ns", *self.shapes]
                for name in names:
                    if name == "paths":
                        dt, shape = h5py.string_dtype(), ()
                    elif name in self.shapes:
                        shape, dt = self.shapes[name]
                    else:
                        ref = {"sha256": "S64"}.get(name, np.int64)
                        dt, shape = np.dtype(ref), ()
                    itemsize = np.dtype(dt).itemsize if name in self.shapes else 8
                    ds = f.create_dataset(name, shape=(total, *shape), dtype=dt,
                                          chunks=self._chunks(shape, itemsize, total)
                                          if total else None)
                    start = 0
                    for src, (_, n) in zip(sources, self.parts, strict=True):
                        step = max(1, (64 << 20) // max(1, itemsize * int(
                            np.prod(shape, dtype=np.int64))))
                        for i in range(0, n, step):  # bounded memory per copy
                            j = min(n, i + step)
                            ds[start + i:start + j] = src[name][i:j]
                        start += n
                    if name in self.shapes:
                        self._layer_attrs(ds, name)
            finally:
                for s in sources:
                    s.close()
        _replace(tmp, self.out)
        shutil.rmtree(self.dir, ignore_errors=True)


class NpySink(Sink):
    """A folder: ``<layer>/<path>.npy`` per image and layer, ``index.jsonl``, metadata."""

    fixed_shape = False

    def __init__(self, out: str, meta: dict, **kw) -> None:
        super().__init__(out, meta, **kw)
        self.index_path = os.path.join(out, "index.jsonl")
        self.index = None
        self.lock: _Lock | None = None
        self.names: dict[str, str] = {}

    def open(self) -> None:
        if os.path.isfile(self.out):
            raise OutputError(f"{self.out} is a file; a folder output needs a folder")
        os.makedirs(self.out, exist_ok=True)
        self.lock, meta_path = _lock_and_check(self.out, "hookserve.json", self.meta)
        _write_json_atomic(meta_path, self.meta)
        if os.path.exists(self.index_path):
            with open(self.index_path, "rb+") as fh:
                data = fh.read()
                keep = data.rfind(b"\n") + 1
                if keep != len(data):  # a torn last line: that image was not written
                    fh.truncate(keep)
            for line in data[:keep].splitlines():
                row = json.loads(line)
                self._done[row["path"]] = (row["size"], row["mtime_ns"], row["sha256"])
                self.names[row["name"]] = row["path"]
        self.index = open(self.index_path, "ab")  # noqa: SIM115 - closed in close()

    def name_for(self, path: str) -> str:
        name = safe_relpath(path)
        other = self.names.get(name)
        if other is not None and other != path:
            raise ShapeMismatch(f"file name {name!r} is already used by {other!r}")
        return name

    def add(self, rec: Record) -> None:
        self.check_shapes(rec)
        name = self.name_for(rec.path)
        files = {}
        for layer, arr in rec.features.items():
            rel = f"{layer}/{name}.npy"
            final = os.path.join(self.out, rel)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}")
            np.save(tmp, arr, allow_pickle=False)
            os.replace(tmp, final)
            files[layer] = rel
        line = json.dumps({"path": rec.path, "sha256": rec.sha256, "size": rec.size,
                           "mtime_ns": rec.mtime_ns, "name": name, "files": files})
        self.index.write(line.encode() + b"\n")  # the commit: one write, one line
        self.index.flush()
        self.names[name] = rec.path
        self._done[rec.path] = (rec.size, rec.mtime_ns, rec.sha256)

    def close(self, complete: bool) -> None:
        if self.index is not None:
            self.index.flush()
            os.fsync(self.index.fileno())
            self.index.close()
        if self.lock is not None:
            self.lock.release()


def make_sink(out: str, meta: dict, **kw) -> Sink:
    """The sink for `out`'s extension: .h5/.hdf5, .parquet, anything else a folder."""
    ext = os.path.splitext(out.rstrip("/"))[1].lower()
    consolidate = kw.pop("consolidate", True)
    if ext in (".h5", ".hdf5"):
        return H5Sink(out, meta, consolidate=consolidate, **kw)
    if ext == ".parquet":
        return ParquetSink(out.rstrip("/"), meta, **kw)
    return NpySink(out, meta, **kw)
