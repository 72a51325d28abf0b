"""Reading one input shard's images, each one's cost known before it is paid.

:func:`entries` reads a shard that :mod:`.shard_plan` planned. A reader yields
:class:`Entry` objects in the shard's order. An entry says how many bytes reading it
can cost (`bound`: the exact size from a stat, a tar header, a listing or a Parquet
offset; or a first reservation for an object of unknown size) and reads only when
asked (:meth:`Entry.start`), after the run has reserved those
bytes (:class:`~.limits.ByteBudget`). An input over the per-file cap, a link member, a
cell of the wrong kind: an entry with its error, nothing read.

A container that cannot be opened, or is not read to its proper end (a tar without its
end-of-archive block, a body cut short, a Parquet file that fails mid-way), ends with
an error entry whose id is the container's (``<tar>/``, the Parquet shard's key): its
code (NOT_FOUND, UNAVAILABLE, DATA_LOSS, FAILED_PRECONDITION) is never final, so the
shard gets no done marker.
"""

from __future__ import annotations

import glob
import http.client
import lzma
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from .. import errors
from .inputs import MAX_FILE_BYTES, encode_name, is_image, read_bytes
from .limits import IN_FLIGHT_BYTES, Cap
from .remote import STREAM_ERRORS, NeedMore, is_url, open_stream, read_object, storage_error

#: Extensions of tar shards (compressed ones are decompressed as a stream).
TAR_EXTS = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
#: Bytes first reserved for an object whose size the listing did not give; a larger
#: one is read again with the cap reserved.
FIRST_READ = 4 << 20
#: Objects of a listing shard read at once (each within the byte budget).
AHEAD = 16
_POOL = ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="hookserve-fetch")


class ShardError(Exception):
    """An input cannot be planned or read as asked (missing, unreadable listing, a
    missing column or one of the wrong type): a usage mistake that stops the run."""


def is_tar(name: str) -> bool:
    return name.lower().endswith(TAR_EXTS)


def names_a_tar(spec: str) -> bool:
    """Whether an input names one tar file: a tar's extension, no wildcard, and no
    local folder (a folder named ``x.tar`` is listed as a folder)."""
    return is_tar(spec) and not glob.has_magic(spec) and not os.path.isdir(spec)


def data_loss(what: str) -> errors.HookserveError:
    return errors.HookserveError(what, grpc.StatusCode.DATA_LOSS)


@dataclass
class Entry:
    """One image of a shard: its id, what reading it may cost, and how to read it."""

    id: str
    bound: int = 0
    read: Callable[[], bytes] | None = None
    error: errors.HookserveError | None = None
    #: reads later (a URL fetched on a pool thread) rather than at start()
    deferred: bool = False
    _result: Future | bytes | BaseException | None = field(default=None, repr=False)

    def start(self) -> None:
        """Begin reading (the bytes are reserved). A streamed container's member is
        read now: the container moves on with the next entry."""
        if self.deferred:
            self._result = _POOL.submit(self.read)
            return
        try:
            self._result = self.read()
        except (errors.HookserveError, NeedMore) as exc:
            self._result = exc

    def result(self) -> bytes:
        """The bytes, or the typed error / :class:`~.remote.NeedMore` raised."""
        r = self._result.result() if isinstance(self._result, Future) else self._result
        self._result = None
        if isinstance(r, BaseException):
            raise r
        return r

    def again(self, bound: int) -> Entry:
        """This entry, to be read again with `bound` bytes reserved (after NeedMore,
        which only a URL read raises)."""
        return Entry(self.id, bound, self.read.with_bound(bound), deferred=self.deferred)


# ----------------------------------------------------------------------- listed files
def file_entries(files: tuple[str, ...], sizes: dict[str, int], opts: dict, cap: Cap,
                 timeout: float) -> Iterator[Entry]:
    """Local files (stat first: the size is the reservation) and URLs (the listing's
    size, or :data:`FIRST_READ`), each refused from its size when over the cap."""
    for f in files:
        fid = encode_name(f)
        if is_url(f):
            size = sizes.get(f, -1)
            if size > cap.limit:
                yield Entry(fid, error=cap.refuse(size, "the object"))
                continue
            bound = size if size >= 0 else min(FIRST_READ, cap.limit)
            yield Entry(fid, bound, _UrlRead(f, opts, cap, bound, timeout), deferred=True)
            continue
        try:
            st = os.stat(f)
        except OSError:
            st = None  # read_bytes names the problem
        if st is not None and st.st_size > cap.limit:
            yield Entry(fid, error=cap.refuse(st.st_size))
            continue
        expect = (st.st_size, st.st_mtime_ns) if st is not None else None
        yield Entry(fid, st.st_size if st is not None else 0,
                    lambda f=f, expect=expect: read_bytes(f, cap.limit, expect, cap))


@dataclass
class _UrlRead:
    url: str
    opts: dict
    cap: Cap
    bound: int
    timeout: float

    def __call__(self) -> bytes:
        return read_object(self.url, self.opts, self.cap, self.bound, self.timeout)

    def with_bound(self, bound: int) -> _UrlRead:
        return _UrlRead(self.url, self.opts, self.cap, bound, self.timeout)


# ------------------------------------------------------------------------------- tars
def tar_entries(path: str, opts: dict, cap: Cap, timeout: float) -> Iterator[Entry]:
    """The image members of a (compressed) tar, streamed. Members with an image
    extension are the images; other regular members are skipped; a link or any other
    non-regular member named like an image gets an error entry. The archive must end
    with its end-of-archive block, else a DATA_LOSS entry ``<tar>/`` ends the shard."""
    class Info(tarfile.TarInfo):  # remembers the last header block read
        last = b""

        @classmethod
        def frombuf(cls, buf, encoding, errors_):
            Info.last = buf
            return super().frombuf(buf, encoding, errors_)

    name = None
    try:
        fh = open_stream(path, opts, timeout)
    except Exception as exc:  # noqa: BLE001 - every store's errors become typed ones
        yield Entry(f"{path}/", error=storage_error(exc, f"the tar {path}"))
        return
    try:
        with fh, tarfile.open(fileobj=fh, mode="r|*", tarinfo=Info) as tf:
            for m in tf:
                name = m.name
                if not is_image(m.name):
                    continue
                # a member's name may hold any bytes: escaped like a file's (a URL's own
                # escapes are its own, so there the member alone)
                mid = (f"{path}/{encode_name(m.name)}" if is_url(path)
                       else encode_name(f"{path}/{m.name}"))
                if not m.isreg():
                    kind = ("a symlink" if m.issym() else "a hard link" if m.islnk()
                            else "a directory" if m.isdir() else "not a regular file")
                    target = f" to {m.linkname!r}" if m.issym() or m.islnk() else ""
                    yield Entry(mid, error=errors.InvalidArgument(
                        f"the member is {kind}{target}: only regular members are read"))
                    continue
                if m.size > cap.limit:
                    yield Entry(mid, error=cap.refuse(m.size, "the member"))
                    continue
                yield Entry(mid, m.size, _member_reader(tf, m))
        ended = len(Info.last) == tarfile.BLOCKSIZE and not Info.last.strip(b"\0")
        if not ended:
            after = f"after member {name!r}" if name else "before its first member"
            yield Entry(f"{path}/", error=data_loss(
                f"the tar ends {after} without its end-of-archive block (cut short?); "
                "the members before were kept, the shard stays open"))
    except Exception as exc:  # noqa: BLE001 - a broken archive, or the store failing
        after = f"after member {name!r}" if name else "before its first member"
        if isinstance(exc, (tarfile.TarError, zlib.error, lzma.LZMAError, EOFError,
                            ValueError, http.client.HTTPException)):
            err = data_loss(f"the tar is unreadable {after}: {exc}")
        else:
            err = storage_error(exc, f"the tar {path} {after}")
        yield Entry(f"{path}/", error=err)


#: A tar member is read in pieces of this size into one buffer of its size: a streamed
#: tar's own read of a whole member holds it two or three times over.
MEMBER_PIECE = 1 << 20


def _member_reader(tf: tarfile.TarFile, m: tarfile.TarInfo) -> Callable[[], bytearray]:
    def read() -> bytearray:
        data, n = bytearray(m.size), 0
        try:
            src = tf.extractfile(m)
            while src is not None and n < m.size:
                piece = src.read(min(MEMBER_PIECE, m.size - n))
                if not piece:
                    break
                data[n:n + len(piece)] = piece
                n += len(piece)
        except (tarfile.TarError, zlib.error, *STREAM_ERRORS) as exc:
            raise data_loss(f"the member could not be read: {exc}") from None
        if n != m.size:
            raise data_loss(f"the member is cut short: {n} of {m.size} bytes")
        return data
    return read


# ---------------------------------------------------------------------------- Parquet
def _binary(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    view = getattr(pa.types, "is_binary_view", lambda _: False)
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_fixed_size_binary(t) or view(t))


def check_columns(source: str, schema, image_column: str, id_column: str | None) -> str:
    """The column types, checked once per file before any row is read; -> the path of
    the image bytes leaf (``image`` or ``image.bytes``). Raises ShardError (a usage
    mistake: one line, exit code 2) naming the column."""
    import pyarrow as pa

    names = schema.names
    for col in (image_column, id_column):
        if col and col not in names:
            raise ShardError(f"{source}: no column {col!r} (columns: {', '.join(names)}); "
                             "choose one with --image-column / --id-column")
    t = schema.field(image_column).type
    leaf = image_column
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        t, leaf = t.field("bytes").type, f"{image_column}.bytes"  # Hugging Face Image
    if not _binary(t):
        raise ShardError(f"{source}: column {image_column!r} is {schema.field(image_column).type}"
                         ", not image bytes: --image-column must name a binary column or a "
                         "Hugging Face struct<bytes, path>")
    if id_column:
        t = schema.field(id_column).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
                or _binary(t)):
            raise ShardError(f"{source}: column {id_column!r} is {t}, not text or integers: "
                             "--id-column must name a column of ids")
    return leaf


def open_seekable(path: str, opts: dict):
    """A local file or an fsspec URL, opened for seeking reads (Parquet)."""
    if is_url(path):
        from .remote import filesystem
        fs, p = filesystem(path, opts)
        return fs.open(p, "rb")
    return open(path, "rb")  # noqa: SIM115 - closed by the caller


def _read_failure(exc: BaseException, what: str) -> errors.HookserveError:
    if isinstance(exc, OSError) or not isinstance(exc, Exception):
        return storage_error(exc, what)
    return data_loss(f"{what} is unreadable: {exc}")


def parquet_entries(shard, opts: dict, image_column: str, id_column: str | None,
                    cap: Cap, max_group_bytes: int) -> Iterator[Entry]:
    """The rows of a Parquet shard (a file, or one of its row groups). Before a row
    group is read, the uncompressed size of the columns it needs (from the footer) must
    be within `max_group_bytes`; they are read with dictionaries kept (a repeated cell
    is not expanded), and each cell's length is checked against the cap before its
    bytes are copied out, one cell at a time, when it is sent."""
    from .sinks.base import need

    pq = need("pyarrow.parquet", "reading Parquet")
    try:
        fh = open_seekable(shard.source, opts)
    except Exception as exc:  # noqa: BLE001 - every store's errors become typed ones
        yield Entry(shard.key, error=storage_error(exc, shard.source))
        return
    with fh:
        try:
            meta = pq.ParquetFile(fh).metadata
            schema = meta.schema.to_arrow_schema()
        except Exception as exc:  # noqa: BLE001
            yield Entry(shard.key, error=_read_failure(exc, shard.source))
            return
        leaves = [check_columns(shard.source, schema, image_column, id_column)]
        leaves += [id_column] if id_column else []
        pf = pq.ParquetFile(fh, metadata=meta, read_dictionary=leaves)
        groups = [shard.row_group] if shard.row_group is not None else \
            range(meta.num_row_groups)
        row = sum(meta.row_group(k).num_rows for k in range(shard.row_group or 0))
        for k in groups:
            yield from _row_group(pf, shard, k, row, leaves, cap, max_group_bytes)
            row += meta.row_group(k).num_rows


def _row_group(pf, shard, k: int, row: int, leaves: list[str], cap: Cap,
               limit: int) -> Iterator[Entry]:
    md = pf.metadata.row_group(k)
    paths = [md.column(j) for j in range(md.num_columns)]
    cost = {leaf: sum(c.total_uncompressed_size for c in paths if c.path_in_schema == leaf)
            for leaf in leaves}
    over = [leaf for leaf in leaves if cost[leaf] > limit]
    image = leaves[0].split(".")[0]
    ids: list = [None] * md.num_rows
    cells = None
    try:
        if len(leaves) > 1 and not over:
            ids = pf.read_row_group(k, columns=[leaves[1]]).column(0).to_pylist()
        if not over:
            cells = _cells(pf.read_row_group(k, columns=[leaves[0]]).column(0))
    except Exception as exc:  # noqa: BLE001 - a file that fails mid-way
        yield Entry(shard.key, error=_read_failure(exc, f"row group {k} of {shard.source}"))
        return
    refused = errors.ResourceExhausted(
        f"row group {k} holds {cost[over[0]]} bytes of column {over[0]!r} uncompressed, "
        f"over --max-in-flight-bytes ({limit}): raise it, or write the file with smaller "
        "row groups; not read") if over else None
    for i, rid in enumerate(ids):
        if isinstance(rid, bytes):
            rid = encode_name(rid.decode("utf-8", "surrogateescape"))
        iid = str(rid) if rid is not None else f"{shard.source}#{row + i}"
        buf = next(cells) if cells is not None else None
        if refused is not None:
            yield Entry(iid, error=refused)
        elif buf is None:
            yield Entry(iid, error=errors.InvalidArgument(
                f"column {image!r} is empty in this row"))
        elif buf.size > cap.limit:
            yield Entry(iid, error=cap.refuse(buf.size, "the cell"))
        else:
            yield Entry(iid, buf.size, buf.to_pybytes)


def _cells(col) -> Iterator:
    """Each row's cell as an Arrow buffer (no copy), or None for a null. A struct
    column (Hugging Face's) gives its ``bytes`` child."""
    import pyarrow as pa

    for chunk in col.chunks:
        if pa.types.is_struct(chunk.type):
            chunk = chunk.flatten()[chunk.type.get_field_index("bytes")]
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        if pa.types.is_dictionary(chunk.type):
            values = chunk.dictionary
            index = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
        else:
            values, index = chunk, None
        for i in range(len(chunk)):
            if not valid[i]:
                yield None
            else:
                yield values[int(index[i]) if index is not None else i].as_buffer()


def entries(shard, *, opts: dict | None = None, image_column: str | None = None,
            id_column: str | None = None, cap: Cap | None = None, timeout: float = 60.0,
            max_group_bytes: int = IN_FLIGHT_BYTES) -> Iterator[Entry]:
    """A :class:`~.shard_plan.Shard`'s images as :class:`Entry` objects, in a stable
    order; one that cannot be read is an entry with its typed error, and the iteration
    goes on. Nothing is read before the caller starts an entry."""
    opts = opts or {}
    cap = cap or Cap(MAX_FILE_BYTES)
    if shard.kind == "tar":
        return tar_entries(shard.source, opts, cap, timeout)
    if shard.kind == "parquet":
        if not image_column:
            raise ShardError("a Parquet shard needs --image-column")
        return parquet_entries(shard, opts, image_column, id_column, cap, max_group_bytes)
    sizes = dict(zip(shard.files, shard.sizes, strict=False))  # none from a bare key
    return file_entries(shard.files, sizes, opts, cap, timeout)
