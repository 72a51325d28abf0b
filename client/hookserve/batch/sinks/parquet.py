"""The ``.parquet`` output: a folder of parts, a standard Parquet dataset that
``pyarrow.parquet.read_table`` / ``pandas.read_parquet`` read in one call (names starting
with ``.`` or ``_`` are ignored by those readers). One row per image: path, sha256,
size, mtime_ns, and a fixed-size list column per layer (so features must be 1-D)."""

from __future__ import annotations

import json
import os

import numpy as np

from .base import OutputError, Record, need
from .durable import PartSink


class ParquetSink(PartSink):
    """A Parquet dataset folder: one row per image, one fixed-size list column per layer."""

    ext = "parquet"
    flat_only = True

    def __init__(self, out: str, meta: dict, **kw) -> None:
        if os.path.isfile(out):
            raise OutputError(f"{out} is a file; a .parquet output is a folder of parts")
        super().__init__(out, meta, out, **kw)
        self.pa = need("pyarrow", "Parquet")
        self.pq = need("pyarrow.parquet", "Parquet")

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



def peek_done(out: str) -> dict:
    """The paths an existing Parquet output holds, read without taking its lock."""
    import pyarrow.parquet as pq

    return dict.fromkeys(pq.read_table(out, columns=["path"]).column("path").to_pylist())
