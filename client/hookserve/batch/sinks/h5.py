"""The ``.h5`` output: one HDF5 file, a dataset per layer [N, ...] plus paths, sha256,
size and mtime_ns.

During a run, ``out.h5`` is a small file of HDF5 *virtual datasets* that map onto the
parts in ``out.h5.parts/`` (rewritten by rename at each checkpoint, so always
readable). When a run finishes with every image attempted, the parts are copied once
into a self-contained ``out.h5`` and the folder is removed. A later run hard-links that
file into a new parts folder as part 0 and goes on from there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys

import numpy as np

from .base import OutputError, Record, check_meta, need
from .durable import PartSink, fsync_dir, written

#: HDF5 files whose write failed, kept from being freed until the process ends.
_FAILED: list = []


def _quiet_hdf5_frees():
    """While an HDF5 file is written (and, once its write failed, for good), the
    library's complaints as it frees the objects of a file whose write failed (h5py
    prints them through sys.excepthook and sys.unraisablehook) are not printed: the
    run reports the failure itself, in one line. -> what puts the hooks back."""
    def ours(exc: BaseException | None) -> bool:
        return isinstance(exc, RuntimeError) and "decrement id ref count" in str(exc)
    unraisable, excepthook = sys.unraisablehook, sys.excepthook
    sys.unraisablehook = lambda u: None if ours(u.exc_value) else unraisable(u)
    sys.excepthook = lambda t, v, tb: None if ours(v) else excepthook(t, v, tb)

    def restore() -> None:
        sys.unraisablehook, sys.excepthook = unraisable, excepthook
    return restore


class H5Sink(PartSink):
    """One HDF5 file: a dataset per layer [N, ...], plus paths, sha256, size, mtime_ns."""

    ext = "h5"

    def __init__(self, out: str, meta: dict, *, consolidate: bool = True, **kw) -> None:
        # The lock lives beside out.h5: consolidation removes the parts folder, and the
        # lock must outlast it (a second run is refused as locked until then).
        folder, name = os.path.split(os.path.abspath(out))
        super().__init__(out, meta, out + ".parts",
                         lock_path=os.path.join(folder, f".{name}.lock"), **kw)
        self.h5py = need("h5py", "HDF5")
        self.consolidate = consolidate

    def open(self) -> None:
        h5py = self.h5py
        if os.path.isdir(self.out):
            raise OutputError(f"{self.out} is a folder; an .h5 output is a file: choose "
                              "another --out (a folder output ends in / or has no suffix)")
        self.take_lock()  # before a finished file's parts folder is made again
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
                fsync_dir(self.dir)
            elif layout != "virtual":
                raise OutputError(f"{self.out} exists and was not written by hookserve "
                                  "batch: move it away or choose another --out")
        super().open()

    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        with self._new_file(tmp) as f:
            self._fill(f, recs)

    @contextlib.contextmanager
    def _new_file(self, tmp: str):
        """An HDF5 file written whole; one whose write failed is never closed nor freed
        (the library would write again, fail, and crash the process as it frees it):
        the run stops (`batch.command.run`), and the next one removes it."""
        restore = _quiet_hdf5_frees()   # (the first failure may come as an object is freed)
        f = self.h5py.File(tmp, "w")
        try:
            yield f
            f.close()
        except BaseException:
            _FAILED.append(f)
            self.unfreeable = True
            raise
        restore()

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
        written(tmp, self.out, lambda t: self._write_virtual(t, fields, total, rel))

    def _write_virtual(self, tmp: str, fields: list, total: int, rel: str) -> None:
        h5py = self.h5py
        with self._new_file(tmp) as f:
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

    def _finished(self, complete: bool) -> None:
        if complete and self.consolidate:
            self._consolidate()

    def _consolidate(self) -> None:
        """Copy every part into one self-contained file (once, at the end of a run)."""
        tmp = os.path.join(os.path.dirname(os.path.abspath(self.out)),
                           f".tmp-{os.path.basename(self.out)}")
        written(tmp, self.out, self._copy_parts)   # (failed: the parts stay, for the next)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _copy_parts(self, tmp: str) -> None:
        h5py = self.h5py
        total = sum(n for _, n in self.parts)
        with self._new_file(tmp) as f:
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



def peek_done(out: str) -> dict:
    """The paths an existing HDF5 output holds, read without taking its lock."""
    import h5py

    with h5py.File(out, "r") as f:
        return dict.fromkeys(p.decode() if isinstance(p, bytes) else p for p in f["paths"][:])
