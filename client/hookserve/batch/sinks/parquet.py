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
        need("pyarrow", "Parquet")  # fail at start, not at the first checkpoint
        self.pq = need("pyarrow.parquet", "Parquet")

    def _write_part(self, tmp: str, recs: list[Record]) -> None:
        write_table(tmp, {"path": ("string", [r.path for r in recs]),
                          "sha256": ("string", [r.sha256 for r in recs]),
                          "size": ("int64", [r.size for r in recs]),
                          "mtime_ns": ("int64", [r.mtime_ns for r in recs])},
                    [r.features for r in recs], self.meta)

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


def write_table(path: str, keys: dict[str, tuple[str, list]], features: list[dict],
                meta: dict) -> None:
    """Write one Parquet part: the key columns (name -> (arrow type name, values)),
    then one fixed-size list column per layer (1-D features), and the run's metadata
    under the schema key ``hookserve``. The one layout of every hookserve Parquet part,
    plain runs and sharded runs alike."""
    pa = need("pyarrow", "Parquet")
    pq = need("pyarrow.parquet", "Parquet")
    cols = {name: pa.array(values, getattr(pa, kind)()) for name, (kind, values)
            in keys.items()}
    for layer in features[0]:
        flat = np.concatenate([np.asarray(f[layer]).reshape(-1) for f in features])
        width = int(np.asarray(features[0][layer]).size)
        cols[layer] = pa.FixedSizeListArray.from_arrays(pa.array(flat), width)
    pq.write_table(pa.table(cols).replace_schema_metadata(
        {"hookserve": json.dumps(meta)}), path)
