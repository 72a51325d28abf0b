"""Planning the input shards of sharded runs: the shard is the unit of work.

Planning (:func:`plan_shards`) costs one listing per input, never a request per image:

- a ``.tar`` (or ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``; local or URL,
  brace-expanded: ``shards/{000000..000127}.tar``) is one WebDataset shard. Its members
  with an image extension are its images, read as a stream (never unpacked to disk);
  other members (``.json``, ``.txt``, ``.cls``) are skipped. An image's id is
  ``<tar>/<member name>``, e.g. ``s3://b/shards/000007.tar/000070012.jpg``.
- a ``.parquet`` file with ``--image-column`` (binary, or Hugging Face's
  ``struct<bytes, path>``) is one shard; a file over ``--shard-bytes`` with several row
  groups gives one shard per row group (key ``<file>#rg=<k>``). Ids come from
  ``--id-column``, or are ``<file>#<row>`` (the row number within the file).
- any other folder, prefix, glob or file is listed once, and its image files are cut
  into ``--listing-shards`` shards by a hash of each file's name (key
  ``<input>#<b>/<B>``), so adding files never moves an existing one to another shard;
  the shards a file joins or leaves (or, where the listing gives sizes: object stores,
  whose file changes size) are done again (:attr:`Shard.members`).
  Their ids are their paths or URLs (a local name that is not valid UTF-8 is encoded
  as :func:`~.inputs.encode_name` says). A file named by several inputs is listed once.

``--shard I/N`` keeps the shards whose key hashes to I modulo N
(:func:`~.inputs.shard_of`, the hash a local run gives each path). Reading a shard is
:func:`.readers.entries`.
"""

from __future__ import annotations

import functools
import glob as _glob
import hashlib
import os
from dataclasses import dataclass, field

from .defaults import DEFAULTS
from .inputs import (
    encode_name,
    is_image,
    listed_paths,
    name_digest,
    shard_of,
)
from .readers import ShardError, is_tar, names_a_tar, open_seekable
from .remote import expand_braces, file_url_spelled, filesystem, is_url, walk_files


@dataclass(frozen=True)
class Shard:
    """One unit of work: `key` names it stably (it is hashed for --shard and for the
    output part's name)."""

    key: str
    kind: str                       # "tar" | "parquet" | "files"
    source: str = ""                # the tar or Parquet file, or the listed input
    row_group: int | None = None    # a Parquet shard of one row group
    files: tuple[str, ...] = field(default=(), compare=False)  # kind == "files"
    #: sizes the listing gave (-1: unknown), parallel to `files`
    sizes: tuple[int, ...] = field(default=(), compare=False)
    #: False when the input's listing missed a folder: `files` may lack some
    whole: bool = field(default=True, compare=False)

    @property
    def sid(self) -> str:
        """16 hex digits naming this shard's output part and marker."""
        return name_digest(self.key).hex()

    @functools.cached_property   # (read several times a run: computed once)
    def members(self) -> str | None:
        """A listing shard's files and their listed sizes, as a digest its done marker
        records: a file added, removed or resized since makes the marker stale. None
        for a tar or Parquet shard (its file names it), and for a listing that missed a
        folder (its marker is then trusted as it is)."""
        if self.kind != "files" or not self.whole:
            return None
        h = hashlib.sha256()
        for name, size in sorted(zip(map(encode_name, self.files),
                                     self.sizes or (-1,) * len(self.files), strict=True)):
            h.update(f"{name}\t{size}\n".encode())
        return h.hexdigest()


def key_input(spec: str) -> str:
    """An input as shard keys name it: one spelling per input (``imgs``, ``imgs/`` and
    ``./imgs`` list the same files under the same ids, so they are one input)."""
    if is_url(spec):
        scheme, _, rest = file_url_spelled(spec).partition("://")
        return f"{scheme}://{rest.rstrip('/')}" if rest.strip("/") else spec
    return os.path.normpath(spec)


def key_source(key: str) -> str:
    """The input a listing shard's key names, or the tar or Parquet file of any other."""
    base, sep, rest = key.rpartition("#")
    if sep and (rest.startswith("rg=") or (rest.count("/") == 1
                                           and rest.replace("/", "").isdigit())):
        return base
    return key


def select(shards: list[Shard], shard: tuple[int, int] | None) -> list[Shard]:
    if shard is None:
        return shards
    i, n = shard
    return [s for s in shards if shard_of(s.key, n) == i]


def _parquet_shards(path: str, size: int, opts: dict, shard_bytes: int) -> list[Shard]:
    if size <= shard_bytes:
        return [Shard(path, "parquet", path)]
    from .sinks.base import need

    pq = need("pyarrow.parquet", "reading Parquet")
    with open_seekable(path, opts) as fh:
        n = pq.ParquetFile(fh).metadata.num_row_groups
    if n <= 1:
        return [Shard(path, "parquet", path)]
    return [Shard(f"{path}#rg={k}", "parquet", path, k) for k in range(n)]


@dataclass
class PlanReport:
    """What planning saw of each input beyond its shards: inputs that listed no file,
    and inputs whose listing missed a folder (unreadable, or gone while listed): for
    these, files not listed now may well still exist."""

    empty: list[str] = field(default_factory=list)
    #: input -> the first folder below it that could not be listed, and why
    partial: dict[str, str] = field(default_factory=dict)


def _listing(spec: str, opts: dict, report: PlanReport | None = None
             ) -> list[tuple[str, int]]:
    """(path or URL, size) of every file the input names, from one listing; a folder
    below it that cannot be listed is left out, and noted in `report`."""
    if is_url(spec):
        fs, path = filesystem(spec, opts)
        if _glob.has_magic(path):
            # each match spelled like the URL given (memory://b/x, not memory:///b/x),
            # as a folder's listing spells it
            head = spec[:len(spec) - len(path)] if spec.endswith(path) else None
            return sorted((head + p if head is not None else fs.unstrip_protocol(p),
                           int(i.get("size") or 0))
                          for p, i in fs.glob(path, detail=True).items()
                          if i.get("type", "file") == "file")
        try:
            return list(walk_files(spec, opts))
        except FileNotFoundError:
            raise ShardError(f"no such file or folder: {spec}") from None
    if os.path.isdir(spec):
        out = []
        def unlistable(exc: OSError) -> None:
            if report is not None:
                report.partial.setdefault(spec, f"{exc.filename}: {exc.strerror or exc}")
        for dirpath, dirnames, filenames in os.walk(spec, onerror=unlistable):
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
                listing_shards: int = DEFAULTS["listing_shards"],
                shard_bytes: int = DEFAULTS["shard_bytes"],
                storage_options: dict | None = None, path_column: str = "path",
                report: PlanReport | None = None, root: str | None = None) -> list[Shard]:
    """Every input shard the inputs name, sorted by key (see the module doc). A list
    (.txt/.lst) or path table (.csv/.tsv/.parquet, its `path_column`) names paths and
    URLs, one shard per hash bucket of them; its relative paths are below `root` when
    given (else the working directory), each spelled one way (`inputs.listed_paths`)."""
    if listing_shards < 1:
        raise ValueError(f"listing_shards must be at least 1, got {listing_shards}")
    opts = storage_options or {}
    shards: dict[str, Shard] = {}
    taken: set[str] = set()  # files already in a listing shard: each is listed once
    for spec0 in specs:
        for spec in expand_braces(file_url_spelled(spec0)):
            if names_a_tar(spec):
                tar = key_input(spec)
                shards.setdefault(tar, Shard(tar, "tar", tar))  # named: no request
                continue
            files: dict[str, int] = {}
            names = listed_paths(spec, path_column, image_column, root)
            # a list names files, and a glob means every file it matches, images or not
            from_list = names is not None or _glob.has_magic(spec)
            if names is not None:
                listed = [(p, -1) for p in names]  # paths or URLs
            elif is_url(spec) and is_image(spec) and not _glob.has_magic(spec):
                listed = [(spec, -1)]  # one image: no listing (http has none)
            else:
                listed = _listing(spec, opts, report)
            if not listed and report is not None:
                report.empty.append(spec)
            for path, size in listed:
                if is_tar(path):
                    shards.setdefault(path, Shard(path, "tar", path))
                elif image_column and path.lower().endswith(".parquet"):
                    if size < 0:
                        size = os.path.getsize(path)
                    for s in _parquet_shards(path, size, opts, shard_bytes):
                        shards.setdefault(s.key, s)
                elif (is_image(path) or path == spec or from_list) and path not in taken:
                    taken.add(path)
                    files[path] = size
            buckets: dict[int, list[str]] = {}
            for f in files:
                buckets.setdefault(shard_of(encode_name(f), listing_shards), []).append(f)
            for b, members in buckets.items():
                key = f"{encode_name(key_input(spec))}#{b}/{listing_shards}"
                shards[key] = Shard(key, "files", spec, files=tuple(members),
                                    sizes=tuple(files[f] for f in members),
                                    whole=report is None or spec not in report.partial)
    return [shards[k] for k in sorted(shards)]


def vanished(specs: list[str], shards: list[Shard], listing_shards: int,
             report: PlanReport) -> list[Shard]:
    """The listing shards these inputs could have and have no file in now (every file
    that hashed to them was removed): their rows, if an earlier run wrote any, are no
    longer the input's. Inputs that listed no file, or whose listing missed a folder
    (`report`), keep theirs: an empty mount point or an unreadable folder is more
    likely a mistake than a deletion. Tar and Parquet inputs have no listing shards."""
    planned = {s.key for s in shards}
    keep = {*report.empty, *report.partial}
    gone = []
    for spec0 in specs:
        for spec in expand_braces(spec0):
            if spec in keep or names_a_tar(spec):
                continue
            for b in range(listing_shards):
                key = f"{encode_name(key_input(spec))}#{b}/{listing_shards}"
                if key not in planned:
                    gone.append(Shard(key, "files", spec))
    return gone


def shard_from_key(key: str, storage_options: dict | None = None, *,
                   image_column: str | None = None,
                   listing_shards: int = DEFAULTS["listing_shards"],
                   path_column: str = "path", root: str | None = None) -> Shard:
    """The shard a key names (what :func:`plan_shards` printed or stored; `root` as
    it was given to that)."""
    base, sep, rest = key.rpartition("#")
    if sep and rest.startswith("rg="):
        return Shard(key, "parquet", base, int(rest[3:]))
    if is_tar(key):
        return Shard(key, "tar", key)
    if key.lower().endswith(".parquet") and image_column:
        return Shard(key, "parquet", key)
    if sep and "/" in rest and rest.replace("/", "").isdigit():
        b, n = (int(x) for x in rest.split("/"))
        for s in plan_shards([base], image_column=image_column, listing_shards=n,
                             storage_options=storage_options, path_column=path_column,
                             root=root):
            if s.key == key:
                return s
        return Shard(key, "files", base)  # an empty bucket
    return Shard(key, "files", key, files=(key,))
