"""Input shards for sharded runs: the shard is the unit of work.

Planning (:func:`plan_shards`) costs one listing per input, never a request per image:

- a ``.tar`` (local or URL, brace-expanded: ``shards/{000000..000127}.tar``) is one
  WebDataset shard. Its members with an image extension are its images, read as a
  stream (never unpacked to disk); other members (``.json``, ``.txt``, ``.cls``) are
  skipped. An image's id is ``<tar>/<member name>``, e.g.
  ``s3://b/shards/000007.tar/000070012.jpg``.
- a ``.parquet`` file with ``--image-column`` (binary, or Hugging Face's
  ``struct<bytes, path>``) is one shard; a file over ``--shard-bytes`` with several row
  groups gives one shard per row group (key ``<file>#rg=<k>``). Ids come from
  ``--id-column``, or are ``<file>#<row>`` (the row number within the file).
- any other folder, prefix, glob or file is listed once, and its image files are cut
  into ``--listing-shards`` shards by a hash of each file's name (key
  ``<input>#<b>/<B>``), so adding files never moves an existing one to another shard.
  Their ids are their paths or URLs (a local name that is not valid UTF-8 is encoded
  as :func:`~.inputs.encode_name` says).

``--shard I/N`` keeps the shards whose key hashes (BLAKE2b) to I modulo N.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from .. import errors
from .inputs import IMAGE_EXTS, LIST_EXTS, MAX_FILE_BYTES, encode_name, list_file, read_bytes
from .remote import expand_braces, filesystem, is_url, walk_files


class ShardError(Exception):
    """An input cannot be planned (missing, unreadable listing, missing column)."""


@dataclass(frozen=True)
class Shard:
    """One unit of work: `key` names it stably (it is hashed for --shard and for the
    output part's name)."""

    key: str
    kind: str                       # "tar" | "parquet" | "files"
    source: str = ""                # the tar or Parquet file, or the listed input
    row_group: int | None = None    # a Parquet shard of one row group
    files: tuple[str, ...] = field(default=(), compare=False)  # kind == "files"

    @property
    def sid(self) -> str:
        """16 hex digits naming this shard's output part and marker."""
        return hashlib.blake2b(self.key.encode("utf-8", "surrogateescape"),
                               digest_size=8).hexdigest()


def key_hash(key: str, n: int) -> int:
    h = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(h, "big") % n


def select(shards: list[Shard], shard: tuple[int, int] | None) -> list[Shard]:
    if shard is None:
        return shards
    i, n = shard
    return [s for s in shards if key_hash(s.key, n) == i]


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _parquet_shards(path: str, size: int, opts: dict, shard_bytes: int) -> list[Shard]:
    if size <= shard_bytes:
        return [Shard(path, "parquet", path)]
    import pyarrow.parquet as pq

    with _open(path, opts) as fh:
        n = pq.ParquetFile(fh).metadata.num_row_groups
    if n <= 1:
        return [Shard(path, "parquet", path)]
    return [Shard(f"{path}#rg={k}", "parquet", path, k) for k in range(n)]


def _listing(spec: str, opts: dict) -> list[tuple[str, int]]:
    """(path or URL, size) of every file the input names, from one listing."""
    if is_url(spec):
        fs, path = filesystem(spec, opts)
        if _glob.has_magic(path):
            return sorted((fs.unstrip_protocol(p), int(i.get("size") or 0))
                          for p, i in fs.glob(path, detail=True).items()
                          if i.get("type", "file") == "file")
        try:
            return list(walk_files(spec, opts))
        except FileNotFoundError:
            raise ShardError(f"no such file or folder: {spec}") from None
    if os.path.isdir(spec):
        out = []
        for dirpath, dirnames, filenames in os.walk(spec):
            dirnames.sort()
            for name in sorted(filenames):
                out.append((os.path.normpath(os.path.join(dirpath, name)), -1))
        return out
    if _glob.has_magic(spec):
        return [(os.path.normpath(p), -1) for p in sorted(_glob.glob(spec, recursive=True))
                if not os.path.isdir(p)]
    if os.path.lexists(spec):
        return [(os.path.normpath(spec), -1)]
    raise ShardError(f"no such file or directory: {spec}")


def plan_shards(specs: list[str], *, image_column: str | None = None,
                listing_shards: int = 64, shard_bytes: int = 256 << 20,
                storage_options: dict | None = None) -> list[Shard]:
    """Every input shard the inputs name, sorted by key (see the module doc)."""
    opts = storage_options or {}
    shards: dict[str, Shard] = {}
    for spec0 in specs:
        for spec in expand_braces(spec0):
            if spec.lower().endswith(".tar") and not _glob.has_magic(spec):
                shards.setdefault(spec, Shard(spec, "tar", spec))  # named: no request
                continue
            files: list[str] = []
            from_list = os.path.splitext(spec)[1].lower() in LIST_EXTS and os.path.isfile(spec)
            if from_list:
                listed = [(p, -1) for p in list_file(spec)]  # paths or URLs, one a line
            elif is_url(spec) and _is_image(spec) and not _glob.has_magic(spec):
                listed = [(spec, -1)]  # one image: no listing (http has none)
            else:
                listed = _listing(spec, opts)
            for path, size in listed:
                low = path.lower()
                if low.endswith(".tar"):
                    shards.setdefault(path, Shard(path, "tar", path))
                elif image_column and low.endswith(".parquet"):
                    if size < 0:
                        size = os.path.getsize(path)
                    for s in _parquet_shards(path, size, opts, shard_bytes):
                        shards.setdefault(s.key, s)
                elif _is_image(path) or path == spec or from_list:
                    files.append(path)
            if not files:
                continue
            buckets: dict[int, list[str]] = {}
            for f in files:
                buckets.setdefault(key_hash(encode_name(f), listing_shards), []).append(f)
            for b, members in buckets.items():
                key = f"{encode_name(spec)}#{b}/{listing_shards}"
                shards[key] = Shard(key, "files", spec, files=tuple(members))
    return [shards[k] for k in sorted(shards)]


def shard_from_key(key: str, storage_options: dict | None = None, *,
                   image_column: str | None = None, listing_shards: int = 64) -> Shard:
    """The shard a key names (what :func:`plan_shards` printed or stored)."""
    base, sep, rest = key.rpartition("#")
    if sep and rest.startswith("rg="):
        return Shard(key, "parquet", base, int(rest[3:]))
    if key.lower().endswith(".tar"):
        return Shard(key, "tar", key)
    if key.lower().endswith(".parquet") and image_column:
        return Shard(key, "parquet", key)
    if sep and "/" in rest:
        b, n = (int(x) for x in rest.split("/"))
        for s in plan_shards([base], image_column=image_column, listing_shards=n,
                             storage_options=storage_options):
            if s.key == key:
                return s
        return Shard(key, "files", base)  # an empty bucket
    return Shard(key, "files", key, files=(key,))


# ------------------------------------------------------------------ reading a shard
def _open(path: str, opts: dict):
    if is_url(path):
        fs, p = filesystem(path, opts)
        return fs.open(p, "rb")
    return open(path, "rb")  # noqa: SIM115 - closed by the caller


def entries(shard: Shard, *, opts: dict | None = None, image_column: str | None = None,
            id_column: str | None = None, max_bytes: int = MAX_FILE_BYTES
            ) -> Iterator[tuple[str, bytes | errors.HookserveError]]:
    """(id, encoded bytes) per image of the shard, in a stable order; an image that
    cannot be read yields (id, typed error) instead, and the iteration goes on."""
    opts = opts or {}
    if shard.kind == "tar":
        yield from _tar_entries(shard.source, opts, max_bytes)
    elif shard.kind == "parquet":
        yield from _parquet_entries(shard, opts, image_column, id_column)
    else:
        for i in range(0, len(shard.files), FETCH):
            chunk = shard.files[i:i + FETCH]
            fetched: dict = {}
            for scheme in {f.split("://", 1)[0] for f in chunk if is_url(f)}:
                fetched.update(_fetch_urls([f for f in chunk if f.startswith(scheme + "://")],
                                           opts, max_bytes))
            for f in chunk:
                try:
                    data = fetched[f] if is_url(f) else read_bytes(f, max_bytes)
                    if isinstance(data, errors.HookserveError):
                        raise data
                except errors.HookserveError as exc:
                    yield encode_name(f), exc
                    continue
                yield encode_name(f), data


#: Objects of a listing shard fetched at once (concurrent GETs where the store allows).
FETCH = 32


def _fetch_urls(urls: list[str], opts: dict, max_bytes: int) -> dict:
    """url -> bytes or typed error, for URLs of one scheme, fetched concurrently (one
    GET each, no HEAD)."""
    if not urls:
        return {}
    fs, _ = filesystem(urls[0], opts)
    paths = {fs._strip_protocol(u): u for u in urls}
    try:
        got = fs.cat(list(paths), on_error="return")
    except Exception as exc:  # noqa: BLE001 - the store failed as a whole: every url fails
        got = dict.fromkeys(paths, exc)
    out = {}
    for p, u in paths.items():
        data = got.get(p, FileNotFoundError(p))
        if isinstance(data, FileNotFoundError):
            data = errors.NotFound("cannot read: it vanished after the listing")
        elif isinstance(data, BaseException):
            data = errors.Unavailable(f"cannot read: {data}")
        elif len(data) > max_bytes:
            data = errors.InvalidArgument(f"{len(data)} bytes, over the per-file cap of "
                                          f"{max_bytes} (raise --max-file-bytes)")
        out[u] = data
    return out


def _tar_entries(path: str, opts: dict, max_bytes: int):
    name = "?"
    try:
        with _open(path, opts) as fh, tarfile.open(fileobj=fh, mode="r|*") as tf:
            for m in tf:
                name = m.name
                if not _is_image(m.name) or not m.isfile():
                    continue
                mid = f"{path}/{m.name}"
                if m.size > max_bytes:
                    yield mid, errors.InvalidArgument(
                        f"member is {m.size} bytes, over the per-file cap of {max_bytes} "
                        "(raise --max-file-bytes)")
                    continue
                src = tf.extractfile(m)
                yield mid, src.read() if src is not None else b""
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield f"{path}/", errors.HookserveError(
            f"the tar is unreadable after member {name!r}: {exc}; the members before it "
            "were kept", grpc.StatusCode.DATA_LOSS)


def _parquet_entries(shard: Shard, opts: dict, image_column: str | None,
                     id_column: str | None):
    import pyarrow.parquet as pq

    if not image_column:
        raise ShardError("a Parquet shard needs --image-column")
    with _open(shard.source, opts) as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        for col in (image_column, id_column):
            if col and col not in names:
                raise ShardError(f"{shard.source}: no column {col!r} (columns: "
                                 f"{', '.join(names)}); choose one with --image-column / "
                                 "--id-column")
        groups = [shard.row_group] if shard.row_group is not None else None
        row = sum(pf.metadata.row_group(k).num_rows for k in range(shard.row_group or 0))
        cols = [image_column] + ([id_column] if id_column else [])
        for batch in pf.iter_batches(batch_size=256, row_groups=groups, columns=cols):
            images = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if id_column else [None] * len(images)
            for img, rid in zip(images, ids, strict=True):
                iid = str(rid) if rid is not None else f"{shard.source}#{row}"
                row += 1
                if isinstance(img, dict):  # Hugging Face Image: {"bytes", "path"}
                    img = img.get("bytes")
                yield iid, (bytes(img) if img is not None else errors.InvalidArgument(
                    f"column {image_column!r} is empty in this row"))
