"""Ray Data adapter: extract features inside ``Dataset.map_batches`` actors.

    import ray
    from hookserve.ray import HookserveMapper

    ds = ray.data.read_parquet("s3://bucket/images/")          # a column `image` of bytes
    feats = ds.map_batches(
        HookserveMapper,
        fn_constructor_kwargs={"target": "dns:///hookserve:50051",
                               "layers": ["layer4"], "reduction": "avg"},
        concurrency=8, batch_size=64)
    feats.write_parquet("s3://bucket/features/")

Each actor builds its own :class:`hookserve.Client` in ``__init__`` (a Client holds
channels and is never pickled; only the constructor arguments travel). A batch's rows
carry either encoded image bytes (column ``image``, or ``image_column=``; a Hugging Face
``{"bytes": ..., "path": ...}`` struct works too) or a path or fsspec URL (column
``path``, or ``path_column=``; URLs need ``fsspec`` and the store's extra, e.g.
``hookserve[s3]``).

The output is the input batch plus one column per layer (named like the layer) and
``ok`` (bool), ``error_code`` (a gRPC status name, ``""`` when ok) and
``error_message``. A failed image is a row with ``ok=False``, never an exception, so one
bad image does not fail a Ray task: a null cell, a cell that is not image bytes (an
integer, text), a path that is not text, an input over the per-file cap (refused from
its length or size before it is read or copied; the cap is `max_file_bytes` lowered to
what the server accepts), a file or URL that cannot be read, and a failure of the whole
call each give such rows. When every layer's shape is fixed (a fixed input size, or
under ``native`` or a resize without a crop, reductions that do not follow the image's
size: ``avg``, ``max``, ``stats``; the shapes come from :func:`hookserve.tables.reduced_shape`)
each column is one ``[rows, *shape]`` array, and a failed row holds NaN (zeros for
``bfloat16``, which arrives as uint16 bit patterns); otherwise each column holds one
array per row and ``None`` for failed rows.

Ray itself is not imported here: install it with ``pip install 'hookserve[ray]'``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import errors
from .batch.inputs import MAX_FILE_BYTES
from .batch.limits import Cap, file_cap
from .client import Client
from .tables import DTYPES, REDUCTIONS, follows_size, numpy_dtype, reduced_shape

__all__ = ["HookserveMapper", "read_bytes"]

#: Per-file read cap for the ``path`` column (bytes); larger files become error rows
#: (the default of `hookserve batch --max-file-bytes`).
DEFAULT_MAX_FILE_BYTES = MAX_FILE_BYTES


def read_bytes(path: str, storage_options: dict | None = None,
               max_bytes: int | Cap = DEFAULT_MAX_FILE_BYTES, timeout: float = 60.0) -> bytes:
    """The bytes of a local regular file or a URL (``s3://``, ``gs://``, ``https://``...).

    Local files are read as `hookserve batch` reads them (only regular files, opened
    non-blocking: a FIFO or a device fails instead of hanging); anything over
    `max_bytes` is refused from its size, unread; a URL is read with at most
    `max_bytes` + 1 bytes asked for (http(s): streamed, each read timing out after
    `timeout` seconds). Raises a typed :class:`hookserve.HookserveError`.
    """
    from .batch.inputs import read_bytes as read_local
    from .batch.remote import NeedMore, is_url, read_object

    cap = max_bytes if isinstance(max_bytes, Cap) else Cap(max_bytes, "max_file_bytes")
    if not is_url(path):
        return read_local(path, cap.limit, cap=cap)
    try:
        return read_object(path, storage_options or {}, cap, cap.limit, timeout)
    except NeedMore:  # cannot happen with the cap reserved; kept typed all the same
        raise errors.InvalidArgument(f"{path}: over the per-file cap") from None


class HookserveMapper:
    """A callable class for ``Dataset.map_batches``: one Client per actor.

    Args:
        target: server address(es), as for :class:`hookserve.Client`.
        layers: layer names (or :class:`hookserve.Layer` objects).
        reduction, dtype, l2_normalize, native, resize, crop, model: as for
            :meth:`Client.extract_many`.
        image_column: column with encoded image bytes (default ``image``).
        path_column: column with paths or URLs, used when `image_column` is absent.
        storage_options: fsspec options for URLs in `path_column`.
        max_in_flight: images sent and not yet answered per batch's stream.
        max_file_bytes: per-file cap for image cells and `path_column` reads, lowered to
            what the server accepts.
        client_kwargs: further :class:`hookserve.Client` arguments (token, TLS, timeout).
    """

    def __init__(self, target: str | Sequence[str], layers: Sequence[Any], *,
                 reduction: str = "none", dtype: str = "float32", l2_normalize: bool = False,
                 native: bool = False, resize: int | None = None,
                 crop: int | tuple[int, int] | None = None, model: str | None = None,
                 image_column: str = "image", path_column: str = "path",
                 storage_options: dict | None = None, max_in_flight: int = 32,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 client_kwargs: dict | None = None) -> None:
        self.client = Client(target, **(client_kwargs or {}))
        self.timeout = self.client.timeout or 60.0
        self.layers = list(layers)
        self.opts = {"model": model, "reduction": reduction, "dtype": dtype,
                     "l2_normalize": l2_normalize, "native": native, "resize": resize,
                     "crop": crop}
        self.image_column = image_column
        self.path_column = path_column
        self.storage_options = storage_options
        self.max_in_flight = max_in_flight
        self.names = [getattr(la, "name", la) for la in self.layers]
        desc = self.client.describe(model, crop)
        #: the per-file cap: max_file_bytes, lowered to what the server accepts
        self.cap = file_cap(max_file_bytes, [desc.max_message_bytes], "max_file_bytes")
        self.shapes = self._fixed_shapes(desc, reduction, native or bool(resize and not crop))
        #: what a failed row holds in a fixed-shape column: NaN, or 0 for bfloat16 (bits)
        self.np_dtype = numpy_dtype(dtype if dtype in DTYPES else "float32")
        self.fill = np.nan if self.np_dtype.kind == "f" else 0

    def _fixed_shapes(self, desc, reduction: str, sized: bool) -> dict[str, tuple] | None:
        """Each layer's shape for every image, from DescribeModel and the reduction's
        shape rule; None when it varies (`sized`: the input keeps each image's size,
        and a reduction that follows it does too)."""
        shapes = {}
        for la in self.layers:
            name = getattr(la, "name", la)
            red = getattr(la, "reduction", None) or reduction
            if red not in REDUCTIONS or (sized and follows_size(red)):
                return None
            shapes[name] = reduced_shape(red, desc.shape_of(name), desc.layout_of(name))
        return shapes

    # -- one batch ---------------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        as_pandas = hasattr(batch, "to_dict") and hasattr(batch, "columns")
        cols = ({c: batch[c].to_numpy() for c in batch.columns} if as_pandas
                else dict(batch))
        n = len(next(iter(cols.values()))) if cols else 0
        sources, failed = self._sources(cols, n)
        feats: list[dict | None] = [None] * n
        errs: list[errors.HookserveError | None] = list(failed)
        todo = [i for i in range(n) if errs[i] is None]
        try:
            for r in self.client.extract_many(
                    (sources[i] for i in todo), self.layers, ids=(str(i) for i in todo),
                    max_in_flight=self.max_in_flight, **self.opts):
                i = int(r.id)
                feats[i], errs[i] = r.features, r.error
        except Exception as exc:  # noqa: BLE001 - the whole call failed: every open row fails
            if not isinstance(exc, errors.HookserveError):
                exc = errors.Internal(f"the call failed: {type(exc).__name__}: {exc}")
            for i in todo:
                if feats[i] is None and errs[i] is None:
                    errs[i] = exc
        out = dict(cols)
        out.update(self._columns(feats, n))
        out["ok"] = np.array([e is None for e in errs], dtype=bool)
        out["error_code"] = np.array(["" if e is None else e.code.name for e in errs],
                                     dtype=object)
        out["error_message"] = np.array(["" if e is None else e.message for e in errs],
                                        dtype=object)
        if as_pandas:
            import pandas as pd

            return pd.DataFrame({k: (list(v) if getattr(v, "ndim", 1) > 1 else v)
                                 for k, v in out.items()})
        return out

    def _sources(self, cols: dict, n: int) -> tuple[list, list]:
        """Per row: what to send (bytes), and a local error for rows that cannot be read.
        Each cell is checked (kind, then length against the cap) before it is copied."""
        sources: list[Any] = [None] * n
        failed: list[errors.HookserveError | None] = [None] * n
        if self.image_column in cols:
            for i, v in enumerate(cols[self.image_column]):
                try:
                    sources[i] = self._cell(i, v)
                except errors.HookserveError as exc:
                    failed[i] = exc
        elif self.path_column in cols:
            for i, p in enumerate(cols[self.path_column]):
                try:
                    if not isinstance(p, (str, os.PathLike)):
                        raise errors.InvalidArgument(
                            f"row {i}: column {self.path_column!r} holds "
                            f"{type(p).__name__}, not a path or URL")
                    sources[i] = read_bytes(os.fspath(p), self.storage_options, self.cap,
                                            self.timeout)
                except errors.HookserveError as exc:
                    failed[i] = exc
        else:
            raise KeyError(f"the batch has neither an {self.image_column!r} nor a "
                           f"{self.path_column!r} column (columns: {', '.join(cols)}); "
                           "pass image_column= or path_column=")
        return sources, failed

    def _cell(self, i: int, v: Any) -> bytes:
        """One image cell as bytes, or the typed error that makes its row."""
        if isinstance(v, dict):  # Hugging Face Image feature: {"bytes", "path"}
            v = v.get("bytes")
        if v is None:
            raise errors.InvalidArgument(f"row {i}: column {self.image_column!r} is empty")
        if isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 1:
            v = memoryview(v)
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise errors.InvalidArgument(
                f"row {i}: column {self.image_column!r} holds {type(v).__name__}, not "
                "image bytes")
        size = v.nbytes if isinstance(v, memoryview) else len(v)
        self.cap.check(size, f"row {i}'s image")
        return v if isinstance(v, bytes) else bytes(v)

    def _columns(self, feats: list[dict | None], n: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.names:
            if self.shapes is not None:
                col = np.full((n, *self.shapes[name]), self.fill, dtype=self.np_dtype)
                for i, f in enumerate(feats):
                    if f is not None:
                        col[i] = f[name]
            else:
                col = np.empty(n, dtype=object)
                for i, f in enumerate(feats):
                    col[i] = None if f is None else np.asarray(f[name])
            out[name] = col
        return out
