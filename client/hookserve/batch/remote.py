"""Inputs and outputs that live elsewhere: fsspec URLs (``s3://``, ``gs://``,
``memory://``...) and ``http(s)://``, brace expansion, ``--storage-option``, bounded
reads of one object, and the output location a sharded run writes its parts and
markers to.

fsspec and the store's driver are imported only when a URL is used
(``pip install 'hookserve[s3]'`` or ``'hookserve[gcs]'``). S3 credentials and the
endpoint come from the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ``AWS_PROFILE``...), which s3fs reads itself.

``http(s)://`` objects are read with the standard library, streamed, with a read
timeout (``--timeout``) and the per-file cap checked on the Content-Length before the
body and on every chunk after it. Every failure to reach or read an object becomes a
typed error (:func:`storage_error`): NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE, or
FAILED_PRECONDITION for a missing extra, each of which a rerun can fix.
"""

from __future__ import annotations

import http.client
import json
import os
import posixpath
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from .. import errors

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)\}")
_ALT = re.compile(r"\{([^{}]*,[^{}]*)\}")


def is_url(spec: str) -> bool:
    """A URL with a scheme (``file://`` counts too); plain paths are not."""
    return bool(_URL.match(spec))


def file_url_spelled(spec: str) -> str:
    """A ``file://`` URL with its path normalised (it is the local file system, where
    ``//``, ``/./`` and ``/../`` spell one folder); any other input as given."""
    if not spec.startswith("file://") or not spec[7:]:
        return spec
    path = posixpath.normpath(spec[7:])
    return "file://" + ("/" + path.lstrip("/") if path.startswith("/") else path)


def expand_braces(spec: str) -> list[str]:
    """``shards/{000000..000002}.tar`` -> three names (zero-padding kept);
    ``{a,b}`` -> two. Expansions nest and combine, left to right."""
    found = [m for m in (_RANGE.search(spec), _ALT.search(spec)) if m]
    if not found:
        return [spec]
    m = min(found, key=lambda m: m.start())  # the leftmost group varies slowest
    if m.re is _RANGE:
        lo, hi = int(m.group(1)), int(m.group(2))
        width = len(m.group(1)) if m.group(1).lstrip("-").startswith("0") else 0
        step = 1 if hi >= lo else -1
        alts = [str(n).zfill(width) for n in range(lo, hi + step, step)]
    else:
        alts = m.group(1).split(",")
    out = []
    for alt in alts:
        out += expand_braces(spec[:m.start()] + alt + spec[m.end():])
    return out


def parse_storage_options(items: list[str] | None) -> dict:
    """``KEY=VALUE`` strings -> fsspec keyword arguments. A value is read as JSON when
    it parses (``true``, ``3``, ``{"endpoint_url": ...}``), else kept as a string."""
    opts: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option must look like KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


class MissingExtra(ImportError):
    """A URL's store needs a package that is not installed; the message says which
    ``pip install`` fixes it."""


def install_hint(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    extra = {"gs": "gcs", "gcs": "gcs"}.get(scheme, "s3")
    return f"pip install 'hookserve[{extra}]'"


#: The running command's --timeout, applied to object-store calls (S3: botocore's
#: connect and read timeouts, unless --storage-option config_kwargs sets them).
STORE_TIMEOUT: dict[str, float | None] = {"seconds": None}


def set_store_timeout(seconds: float | None) -> None:
    STORE_TIMEOUT["seconds"] = seconds


def filesystem(url: str, storage_options: dict | None = None):
    """-> (fsspec filesystem, path within it) for a URL. Raises :class:`MissingExtra`
    when fsspec or the store's driver is not installed."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise MissingExtra(f"{url}: URLs need fsspec and the store's driver: "
                           f"{install_hint(url)}") from None
    opts = dict(storage_options or {})
    timeout = STORE_TIMEOUT["seconds"]
    if timeout and url.split("://", 1)[0].lower() in ("s3", "s3a"):
        config = opts.get("config_kwargs", {})
        if isinstance(config, dict):
            opts["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                     **config}
    try:
        return url_to_fs(url, **opts)
    except ImportError as exc:  # e.g. s3fs missing for s3://
        raise MissingExtra(f"{url}: {exc}: {install_hint(url)}") from None


def storage_error(exc: BaseException, what: str) -> errors.HookserveError:
    """The typed error of a failed read of `what` (every one a rerun may fix)."""
    if isinstance(exc, errors.HookserveError):
        return exc
    if isinstance(exc, ImportError):
        return errors.FailedPrecondition(f"cannot read {what}: {exc}")
    if isinstance(exc, FileNotFoundError):
        return errors.NotFound(f"cannot read {what}: not found")
    if isinstance(exc, PermissionError):
        return errors.PermissionDenied(f"cannot read {what}: permission denied ({exc})")
    if isinstance(exc, urllib.error.HTTPError):
        if exc.code == 404 or exc.code == 410:
            return errors.NotFound(f"cannot read {what}: HTTP {exc.code}")
        if exc.code in (401, 403):
            return errors.PermissionDenied(f"cannot read {what}: HTTP {exc.code}")
        return errors.Unavailable(f"cannot read {what}: HTTP {exc.code} {exc.reason}")
    if isinstance(exc, TimeoutError):
        return errors.Unavailable(f"cannot read {what}: timed out ({exc or 'no data'})")
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return errors.Unavailable(f"cannot read {what}: {text}")


class NeedMore(Exception):
    """The object is larger than the bytes reserved for it: reserve `bound` and read
    it again."""

    def __init__(self, bound: int) -> None:
        super().__init__(bound)
        self.bound = bound


def http_open(url: str, timeout: float, headers: dict | None = None,
              method: str = "GET"):
    """A streamed GET (the response is a file object), or a HEAD; every socket read
    times out after `timeout` seconds."""
    req = urllib.request.Request(url, method=method,
                                 headers={"User-Agent": "hookserve-batch", **(headers or {})})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - http(s) only


def read_object(url: str, opts: dict, cap, bound: int, timeout: float) -> bytes:
    """The bytes of one object, reading at most `bound` + 1 of them. Over the cap: the
    cap's error (final); over `bound` but within the cap: :class:`NeedMore`. Any other
    failure: a typed error from :func:`storage_error`."""
    try:
        if is_http(url):
            return _read_http(url, opts, cap, bound, timeout)
        fs, path = filesystem(url, opts)
        try:
            data = fs.cat_file(path, start=0, end=bound + 1)  # one ranged GET
        except OSError as exc:  # 416, "range not satisfiable": the object is empty
            text = str(exc).lower()
            if isinstance(exc, FileNotFoundError) or not (
                    "not satisfiable" in text or "invalidrange" in text):
                raise
            data = b""
    except (errors.HookserveError, NeedMore):
        raise
    except Exception as exc:  # noqa: BLE001 - every store's errors become typed ones
        raise storage_error(exc, url) from None
    if len(data) > bound:
        if bound >= cap.limit:
            raise cap.refuse(len(data), "the object (at least)")
        raise NeedMore(cap.limit)
    return data


def _read_http(url: str, opts: dict, cap, bound: int, timeout: float) -> bytes:
    deadline = time.monotonic() + 10 * timeout  # a body that trickles in ends too
    with http_open(url, timeout, opts.get("headers")) as resp:
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit():
            if int(length) > cap.limit:
                raise cap.refuse(int(length), "the object")
            if int(length) > bound:
                raise NeedMore(cap.limit)
        chunks, n = [], 0
        while n <= bound:
            b = resp.read(min(1 << 20, bound + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the body took over {10 * timeout:g} s")
        if n > bound:
            if bound >= cap.limit:
                raise cap.refuse(n, "the object (at least)")
            raise NeedMore(cap.limit)
        if length is not None and length.isdigit() and n != int(length):
            raise errors.Unavailable(f"cannot read {url}: the body ended after {n} of "
                                     f"{length} bytes")
    return b"".join(chunks)


def open_stream(url: str, opts: dict, timeout: float):
    """A file object to read a container (a tar) from its start, streamed. Raises
    what the store raises (see :func:`storage_error`)."""
    if is_http(url):
        return http_open(url, timeout, opts.get("headers"))
    if is_url(url):
        fs, p = filesystem(url, opts)
        return fs.open(p, "rb")
    return open(url, "rb")  # noqa: SIM115 - closed by the caller


#: What a streamed container read can raise besides OSError (a cut http body).
STREAM_ERRORS = (OSError, EOFError, http.client.HTTPException)


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


class Location:
    """A folder that parts, markers and errors files are written to: local, or any
    fsspec URL. Every file appears whole or not at all: a local file is written to a
    hidden temporary name and renamed; a remote one is built locally and uploaded with
    one PUT (object stores show an object only once its upload completed)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.remote = is_url(url) and not url.startswith("file://")
        if self.remote:
            self.fs, self.path = filesystem(self.url, storage_options)
            self.path = self.path.rstrip("/")
        else:
            self.fs = None
            self.path = self.url[len("file://"):] if url.startswith("file://") else self.url

    def names(self) -> set[str]:
        """The file names directly in the folder (one listing); empty when it is absent."""
        if not self.remote:
            try:
                return set(os.listdir(self.path))
            except FileNotFoundError:
                return set()
        try:
            return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False,
                                                                          refresh=True)}
        except FileNotFoundError:
            return set()

    def listing(self) -> dict[str, int]:
        """Every file below the folder (relative name -> size), from one listing."""
        if not self.remote:
            out = {}
            for root, _, files in os.walk(self.path):
                for f in files:
                    full = os.path.join(root, f)
                    try:
                        out[os.path.relpath(full, self.path).replace(os.sep, "/")] = \
                            os.path.getsize(full)
                    except OSError:
                        continue
            return out
        try:
            found = self.fs.find(self.path, detail=True)
        except FileNotFoundError:
            return {}
        n = len(self.path) + 1
        return {p[n:]: int(i.get("size") or 0) for p, i in found.items()
                if p.startswith(self.path + "/") and i.get("type", "file") == "file"}

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """name -> its bytes, or None when it cannot be read (remote: one concurrent
        batch of GETs)."""
        if not self.remote:
            out: dict[str, bytes | None] = {}
            for name in names:
                try:
                    with open(os.path.join(self.path, name), "rb") as fh:
                        out[name] = fh.read()
                except OSError:
                    out[name] = None
            return out
        strip = self.fs._strip_protocol
        got = self.fs.cat([join(self.path, n) for n in names], on_error="return") \
            if names else {}
        got = {strip(k): v for k, v in got.items()}
        return {n: (v if isinstance(v, bytes) else None)
                for n in names for v in [got.get(strip(join(self.path, n)))]}

    def delete(self, name: str) -> None:
        """Remove a file or a folder of files; nothing when it is absent."""
        try:
            if not self.remote:
                full = os.path.join(self.path, *name.split("/"))
                if os.path.isdir(full):
                    shutil.rmtree(full)
                else:
                    os.unlink(full)
            else:
                self.fs.rm(join(self.path, name), recursive=True)
        except FileNotFoundError:
            pass

    def read_text(self, name: str) -> str | None:
        try:
            if not self.remote:
                with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                    return fh.read()
            with self.fs.open(join(self.path, name), "rb") as fh:
                return fh.read().decode("utf-8")
        except FileNotFoundError:
            return None

    def put_file(self, local: str, name: str) -> None:
        """Publish the local file `local` as `name` (moved when local, uploaded once
        otherwise)."""
        if not self.remote:
            dest = os.path.join(self.path, *name.split("/"))
            folder, base = os.path.split(dest)
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{base}.tmp-{os.getpid()}")
            shutil.copyfile(local, tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
            return
        self.fs.put_file(local, join(self.path, name))

    def put_text(self, name: str, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", delete=False,
                                         suffix=".tmp") as fh:
            fh.write(text)
        try:
            self.put_file(fh.name, name)
        finally:
            os.unlink(fh.name)

    def put_tree(self, local_dir: str, prefix: str) -> None:
        """Publish every file under `local_dir` below `prefix`/ (each one whole)."""
        for root, _, files in os.walk(local_dir):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(root, f), local_dir).replace(os.sep, "/")
                self.put_file(os.path.join(root, f), f"{prefix}/{rel}")

    def __str__(self) -> str:
        return self.url


def walk_files(url: str, storage_options: dict | None = None) -> Iterator[tuple[str, int]]:
    """(URL, size) of every file below a remote folder or prefix: one listing (paged by
    the store), no request per object."""
    fs, path = filesystem(url, storage_options)
    base, root = url.rstrip("/"), path.rstrip("/")
    for p, info in sorted(fs.find(path, detail=True).items()):
        if info.get("type", "file") == "file":
            # spelled like the URL given (memory://b/x, not memory:///b/x)
            full = base + p[len(root):] if p.startswith(root + "/") else \
                base if p == root else fs.unstrip_protocol(p)
            yield full, int(info.get("size") or 0)
