"""What a tar or Parquet shard's file is now: its size and its version (the
modification time of a local file; the ETag, generation or modification time of an
object), recorded in the shard's done marker so that a file rewritten since its shard
was done is done again (:meth:`.shard_output.ShardOutput.done`).

A tar's size alone does not tell: tar pads to 10 KiB records, so a member added or
swapped often leaves the size as it was. A local file replaced by one of the same size
and the same modification time (``cp -p``, ``rsync -t``) is not noticed.

Costs: one ``stat`` per local file; one metadata request per remote file (32 at a
time), a ``HEAD`` for ``http(s)://``. A file that cannot be looked at gets no stamp:
its marker is then trusted as it is, and reading the shard reports the real failure.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from .remote import STORE_TIMEOUT, filesystem, http_open, is_http, is_url

#: Object metadata that changes when an object is rewritten, in order of preference
#: (S3's ETag, GCS's generation, then modification times).
VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "last_modified",
                "mtime", "updated", "created")


def stamps(sources: Iterable[str], opts: dict) -> dict[str, str]:
    """Source (path or URL) -> ``"<size>:<version>"``, for each source that could be
    looked at."""
    srcs = sorted(set(sources))
    remote = [s for s in srcs if is_url(s)]
    out = {s: v for s in srcs if not is_url(s) and (v := _local(s)) is not None}
    if remote:
        with ThreadPoolExecutor(min(32, len(remote))) as pool:
            found = pool.map(lambda u: _http(u, opts) if is_http(u) else _remote(u, opts),
                             remote)
            out.update((u, v) for u, v in zip(remote, found, strict=True) if v is not None)
    return out


def _local(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}"


def _http(url: str, opts: dict) -> str | None:
    timeout = STORE_TIMEOUT["seconds"] or 60
    try:
        with http_open(url, timeout, opts.get("headers"), method="HEAD") as resp:
            size = resp.headers.get("Content-Length")
            version = resp.headers.get("ETag") or resp.headers.get("Last-Modified")
    except Exception:  # noqa: BLE001 - no stamp; reading the shard reports the failure
        return None
    return f"{size}:{_plain(version)}" if size is not None and version else None


def _plain(version: object) -> str:
    """One spelling of a version, whichever call gave it: an ETag without its quotes
    (some stores quote it in one call and not another), a time as seconds."""
    if isinstance(version, datetime.datetime):
        return f"{version.timestamp():.6f}"
    if isinstance(version, float):
        return f"{version:.6f}"
    return str(version).strip('"')


def _remote(url: str, opts: dict) -> str | None:
    try:
        fs, path = filesystem(url, opts)
        info = fs.info(path)
    except Exception:  # noqa: BLE001 - no stamp (see the module doc)
        return None
    version = next((info[k] for k in VERSION_KEYS if info.get(k) is not None), None)
    size = info.get("size")
    return None if version is None or size is None else f"{size}:{_plain(version)}"
