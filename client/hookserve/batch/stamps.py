"""What a tar or Parquet shard's file is now: its size and its version (the
modification time and inode of a local file, the store's ETag, generation or
modification time of an object), recorded in the shard's done marker so that a file
rewritten since its shard was done is done again (:meth:`.shard_output.ShardOutput.done`).

A tar's size alone does not tell: tar pads to 10 KiB records, so a member added or
swapped often leaves the size as it was.

Costs: one ``stat`` per local file; per remote folder, one listing when it holds many
shard files, else one metadata request per file; a ``HEAD`` per ``http(s)://`` file
(which has no listing). A file that cannot be looked at gets no stamp: its marker is
then trusted as it is, and reading the shard reports the real failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .remote import STORE_TIMEOUT, filesystem, http_open, is_http, is_url

#: Object metadata that changes when an object is rewritten, in order of preference
#: (S3's ETag, GCS's generation, then modification times).
VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "last_modified",
                "mtime", "updated", "created")
#: A remote folder holding at least this many shard files is listed once.
LIST_FROM = 8


def stamps(sources: Iterable[str], opts: dict) -> dict[str, str]:
    """Source (path or URL) -> ``"<size>:<version>"``, for each source that could be
    looked at."""
    out: dict[str, str] = {}
    by_folder: dict[str, list[str]] = {}
    for src in sorted(set(sources)):
        if is_http(src):
            stamp = _http(src, opts)
        elif is_url(src):
            by_folder.setdefault(src.rsplit("/", 1)[0], []).append(src)
            continue
        else:
            stamp = _local(src)
        if stamp is not None:
            out[src] = stamp
    for folder, urls in by_folder.items():
        out.update(_remote(folder, urls, opts))
    return out


def _local(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _http(url: str, opts: dict) -> str | None:
    timeout = STORE_TIMEOUT["seconds"] or 60
    try:
        with http_open(url, timeout, opts.get("headers"), method="HEAD") as resp:
            size = resp.headers.get("Content-Length")
            version = resp.headers.get("ETag") or resp.headers.get("Last-Modified")
    except Exception:  # noqa: BLE001 - no stamp; reading the shard reports the failure
        return None
    return f"{size}:{version}" if size is not None and version else None


def _of(info: dict) -> str | None:
    version = next((info[k] for k in VERSION_KEYS if info.get(k) is not None), None)
    size = info.get("size")
    return None if version is None or size is None else f"{size}:{version}"


def _remote(folder: str, urls: list[str], opts: dict) -> dict[str, str]:
    try:
        fs, _ = filesystem(folder, opts)
    except ImportError:
        return {}
    infos: dict[str, dict] = {}
    if len(urls) >= LIST_FROM:
        try:
            infos = {fs._strip_protocol(i["name"]): i
                     for i in fs.ls(fs._strip_protocol(folder), detail=True)}
        except Exception:  # noqa: BLE001 - fall back to a request per file
            infos = {}
    out = {}
    for url in urls:
        path = fs._strip_protocol(url)
        info = infos.get(path)
        if info is None:
            try:
                info = fs.info(path)
            except Exception:  # noqa: BLE001 - no stamp (see the module doc)
                continue
        stamp = _of(info)
        if stamp is not None:
            out[url] = stamp
    return out
