"""Input discovery for `hookserve batch`: directories, globs, list files, CSV/Parquet.

Listing (:func:`discover`), sharding (:func:`select_shard`) and reading an image's
bytes (:func:`read_bytes`) are the three things the run needs from its inputs; a new
input kind adds its listing here and, if its images are not local files, its reader.

Every input becomes a path string. The string is the image's identity everywhere: it
is sent as the image id, written to the output's `path` column, hashed for
`--shard`, and compared on resume. Paths are normalised (``os.path.normpath``),
de-duplicated and sorted, so the order is the same on every run of the same command.

A file name that is not valid UTF-8 (any name a POSIX filesystem allows) cannot be
written as text as it is: its id is :func:`encode_name` of it, where each byte that does
not decode, and each ``%``, becomes ``%XX``; :func:`decode_name` gives the bytes back.
Valid UTF-8 names are their own ids, unless they hold what escaping writes (``%25``,
``%80`` to ``%FF``): those are escaped too, so no two names share an id.

Only regular files are read (:func:`read_bytes`): a FIFO, socket or device, a file that
vanished or changed since it was listed, or one over ``--max-file-bytes`` fails alone,
with its own error row, and never blocks the run.
"""

from __future__ import annotations

import csv
import errno
import glob
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Iterator

from .. import errors
from .remote import file_url_spelled, is_url

#: Extensions picked up when walking a directory (case-insensitive).
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
#: A file with one of these extensions is read as a list of paths, not as an image.
LIST_EXTS = frozenset({".txt", ".lst"})
TABLE_EXTS = frozenset({".csv", ".tsv", ".parquet"})
#: Default of --max-file-bytes: a larger input file fails alone instead of being read.
MAX_FILE_BYTES = 256 << 20


class InputError(Exception):
    """The inputs cannot be listed (a missing path, a missing column...)."""


def is_image(name: str) -> bool:
    """Whether a file name has an image extension (:data:`IMAGE_EXTS`)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _walk(root: str, unlisted: list[tuple[str, str, str]] | None = None
          ) -> Iterator[str]:
    """The image files below `root`; a folder that cannot be listed goes to `unlisted`
    as (its path, a gRPC code name, why)."""
    def unlistable(exc: OSError) -> None:
        if unlisted is not None:
            code = ("PERMISSION_DENIED" if exc.errno in (errno.EACCES, errno.EPERM)
                    else "UNAVAILABLE")
            unlisted.append((os.path.normpath(exc.filename or root), code,
                             exc.strerror or str(exc)))
    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):
        dirnames.sort()
        for name in filenames:
            if os.path.splitext(name)[1].lower() in IMAGE_EXTS:
                yield os.path.join(dirpath, name)


def list_file(path: str) -> Iterator[str]:
    """The paths (or URLs) of a list file, one a line; blank lines and # comments skipped."""
    # surrogateescape: a listed name that is not valid UTF-8 is kept, not a crash
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#"):
                yield line


def listed_paths(spec: str, path_column: str = "path",
                 image_column: str | None = None, root: str | None = None
                 ) -> list[str] | None:
    """The paths or URLs a local list (.txt/.lst) or path table (.csv/.tsv/.parquet,
    its `path_column`) names; None when `spec` is neither (a Parquet file is a table
    of images, not of paths, when `image_column` is given). A relative path is joined
    to `root` when given, and every path is normalised (``./a/../b.png`` is
    ``b.png``), so a file has one id however a list spells it; a ``file://`` URL's path
    is normalised the same way (`file_url_spelled`), other URLs are kept as given."""
    ext = os.path.splitext(spec)[1].lower()
    if not os.path.isfile(spec) or (image_column and ext == ".parquet"):
        return None
    if ext in LIST_EXTS:
        names: Iterable[str] = list_file(spec)
    elif ext in TABLE_EXTS:
        names = _table(spec, path_column)
    else:
        return None
    return [file_url_spelled(p) if is_url(p) else os.path.normpath(os.path.join(root or "", p))
            for p in names]


def _table(path: str, column: str) -> list[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise InputError("reading a Parquet input list needs pyarrow: "
                             "pip install 'hookserve[batch]'") from exc
        try:
            schema = pq.read_schema(path)
        except (OSError, ValueError) as exc:   # (pyarrow's ArrowInvalid is a ValueError)
            if isinstance(exc, OSError) and exc.strerror:   # (unreadable, not a table)
                raise InputError(f"cannot read {path}: {exc.strerror}") from None
            raise InputError(f"{path} is no Parquet table ({' '.join(str(exc).split())[:160]})"
                             ": name a Parquet file, or a list with one path a line (.txt)"
                             ) from None
        if column not in schema.names:
            raise InputError(f"{path}: no column {column!r} (columns: "
                             f"{', '.join(schema.names)}); choose one with --path-column")
        return [str(v) for v in pq.read_table(path, columns=[column]).column(column).to_pylist()
                if v is not None and str(v) != ""]   # (an empty cell names nothing, as in a CSV)
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        reader = csv.DictReader(fh, delimiter="\t" if ext == ".tsv" else ",")
        if reader.fieldnames is None or column not in reader.fieldnames:
            raise InputError(f"{path}: no column {column!r} (columns: "
                             f"{', '.join(reader.fieldnames or [])}); choose one with "
                             "--path-column")
        return [row[column] for row in reader if row.get(column)]


def discover(specs: Iterable[str], *, path_column: str = "path",
             root: str | None = None,
             unlisted: list[tuple[str, str, str]] | None = None) -> list[str]:
    """All image paths named by `specs`, normalised, de-duplicated and sorted.

    - a directory: every file below it with an image extension (:data:`IMAGE_EXTS`);
      one that cannot be listed (a folder without read permission) goes to `unlisted`
      as (its path, a gRPC code name, why);
    - a ``.txt``/``.lst`` file: one path per line (blank lines and ``#`` comments skipped);
    - a ``.csv``/``.tsv``/``.parquet`` file: the `path_column` column;
    - a pattern with ``*``, ``?`` or ``[``: every file it matches (``**`` recurses);
    - any other existing file: that image.

    Relative paths read from list and table files are joined to `root` when given
    (otherwise they are relative to the working directory).
    """
    found: set[str] = set()
    for spec in specs:
        listed: Iterable[str]
        if os.path.isdir(spec):
            found.update(os.path.normpath(p) for p in _walk(spec, unlisted))
            continue
        if os.path.isfile(spec):
            listed = listed_paths(spec, path_column, root=root)
            found.update([os.path.normpath(spec)] if listed is None else listed)
            continue
        if glob.has_magic(spec):
            # not only regular files: a FIFO or socket matched gets its own error row
            found.update(os.path.normpath(p) for p in glob.glob(spec, recursive=True)
                         if not os.path.isdir(p))
            continue
        if os.path.lexists(spec):  # a FIFO, socket, device, dangling link: an error row
            found.add(os.path.normpath(spec))
            continue
        raise InputError(f"no such file or directory: {spec}")
    return sorted(found)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= I < N")
    return i, n


def name_digest(name: str) -> bytes:
    """The one hash of a name (a path, a URL, a shard's key): 8 bytes of BLAKE2b of its
    UTF-8 (surrogate escapes kept), the same on every machine and run."""
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest()


def shard_of(name: str, n: int) -> int:
    """The shard (0..n-1) a path (or a shard's key) belongs to: a hash of the string,
    so adding or removing other files never moves an image to another shard."""
    return int.from_bytes(name_digest(name), "big") % n


def select_shard(paths: list[str], shard: tuple[int, int] | None) -> list[str]:
    if shard is None or shard[1] == 1:
        return paths
    i, n = shard
    return [p for p in paths if shard_of(p, n) == i]


_SURROGATE = re.compile("[%\udc80-\udcff]")
#: What escaping writes: "%25" for a "%", "%80" to "%FF" for a byte that does not decode.
_ESCAPES = re.compile("%(25|[89A-F][0-9A-F])")


def encode_name(path: str) -> str:
    """The id of a path (as ``os`` functions return it): the path itself when it is
    valid UTF-8 and holds nothing escaping writes (``%25``, or ``%80`` to ``%FF``);
    otherwise each byte that does not decode and each ``%`` as ``%XX``. An escaped id
    always holds one of those, an unescaped one never: two names never share an id.
    A URL (valid UTF-8) is its own id: its ``%XX`` are the URL's own escapes."""
    try:
        path.encode("utf-8")
        if not _ESCAPES.search(path) or is_url(path):
            return path
    except UnicodeEncodeError:
        pass
    return _SURROGATE.sub(lambda m: "%25" if m.group() == "%" else
                          f"%{ord(m.group()) - 0xDC00:02X}", path)


def legacy_id(path: str) -> str | None:
    """The id earlier versions gave `path`, where it differs from today's: a valid
    UTF-8 name holding ``%25`` or ``%80`` to ``%FF`` was its own id (a resumed run
    finds its row under that id)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return path if _ESCAPES.search(path) and not is_url(path) else None


def decode_name(image_id: str) -> bytes:
    """The file name bytes an id stands for (the inverse of :func:`encode_name`)."""
    if not _ESCAPES.search(image_id):
        return os.fsencode(image_id)
    return os.fsencode(_ESCAPES.sub(lambda m: "%" if m.group(1) == "25" else
                                    chr(0xDC00 + int(m.group(1), 16)), image_id))


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR,
          "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR,
          "a directory"))


def not_regular(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO", ...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def read_bytes(path: str, max_bytes: int = MAX_FILE_BYTES,
               expect: tuple[int, int] | None = None, cap=None) -> bytes:
    """An input image's encoded bytes. Only a regular file is read: it is opened
    non-blocking (a FIFO with no writer cannot hang the run) and checked on the open
    descriptor; one over `max_bytes` is refused from its size, unread (`cap`, a
    :class:`~.limits.Cap`, names what sets the limit). `expect` is (size, mtime_ns)
    from the listing: a file changed since then fails. Raises a typed
    :class:`hookserve.HookserveError` naming the problem.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise read_error(exc, path) from None
    try:
        st = os.fstat(fd)
        what = not_regular(st.st_mode)
        if what:
            raise errors.InvalidArgument(f"{what}, not a regular file: only regular files "
                                         "are read")
        if st.st_size > max_bytes:
            if cap is not None:
                raise cap.refuse(st.st_size)
            raise errors.InvalidArgument(f"the file is {st.st_size} bytes, over the per-file "
                                         f"cap of {max_bytes} bytes (--max-file-bytes); it "
                                         "was not read")
        if expect is not None and (st.st_size, st.st_mtime_ns) != expect:
            raise errors.FailedPrecondition("the file changed between listing and reading "
                                            "(size or mtime differ): run again to read it")
        # Reads of the whole size (and one byte more, to see growth): no chunks to join,
        # so a file costs its size once.
        want = min(st.st_size, max_bytes) + 1
        parts, n = [], 0
        while n < want:
            b = os.read(fd, want - n)
            if not b:
                break
            parts.append(b)
            n += len(b)
    except OSError as exc:
        raise read_error(exc, path) from None
    finally:
        os.close(fd)
    if n != st.st_size:
        raise errors.FailedPrecondition(f"the file changed while it was read ({n} bytes "
                                        f"read, {st.st_size} listed): run again to read it")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_error(exc: OSError, path: str) -> errors.HookserveError:
    """Why the local file `path` could not be read, typed: a symbolic link to nothing
    (or in a loop) is the input's own failure, final, where a missing file may be there
    on a rerun."""
    msg = f"cannot read: {exc.strerror or exc}"
    if exc.errno in (errno.ENOENT, errno.ELOOP) and os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return errors.InvalidArgument(
            f"a symbolic link to {target[:200]}, which "
            + ("loops back" if exc.errno == errno.ELOOP else "does not exist")
            + ": fix or remove the link")
    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
        return errors.NotFound(msg)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return errors.PermissionDenied(msg)
    if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):
        return errors.InvalidArgument(msg + ": only regular files are read")
    return errors.Unavailable(msg) if exc.errno == errno.EIO else errors.NotFound(msg)
