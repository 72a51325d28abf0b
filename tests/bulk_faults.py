"""Fault injection for the bulk tests: tars built here, an fsspec memory filesystem
that fails, cuts or delays, a local http server with misbehaving URLs, and a reader
of sharded outputs. Nothing here stands in for grpc or torch: the tests run the real
client against real servers; only the inputs misbehave."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from hookserve.cli import main

#: Small, fast extraction flags for the bulk tests.
OPTS = ["--resize", "32", "--crop", "32", "--no-progress", "--layers", "fc"]


def run_batch(server, inputs: list[str], out, *extra: str) -> int:
    """`hookserve batch INPUTS --out OUT` against `server`, with :data:`OPTS`."""
    return main(["batch", *inputs, "--out", str(out), "--server", server.address, *OPTS,
                 *extra])


def tar_bytes(members: list[tuple[str, bytes]], *,
              links: dict[str, tuple[str, str]] | None = None, mode: str = "w") -> bytes:
    """A tar (mode "w:gz" for a .tar.gz) of regular members, plus link members
    (name -> ("sym" | "hard", target))."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


class FaultyFS(MemoryFileSystem):
    """``faulty://``: an in-memory store whose objects can fail to open (a given number
    of times, as a network error or as not found), be cut short (once), or be slow."""

    protocol = "faulty"
    store: dict = {}
    pseudo_dirs = [""]
    #: path -> {"fail": n, "error": exception class, "cut": nbytes, "delay": seconds}
    faults: dict[str, dict] = {}
    opened: list[str] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("faulty://"))

    def _fault(self, path: str):
        path = self._strip_protocol(path)
        self.opened.append(path)
        f = self.faults.get(path, {})
        if f.get("delay"):
            time.sleep(f["delay"])  # the fault itself: a slow store
        if f.get("fail", 0) > 0:
            f["fail"] -= 1
            raise f.get("error", ConnectionError)(f"injected failure reading {path}")
        return f.pop("cut", None)  # a cut body happens once

    def _open(self, path, mode="rb", **kw):
        cut = self._fault(path) if "r" in mode else None
        fh = super()._open(path, mode, **kw)
        if cut is not None:
            return io.BytesIO(fh.read()[:cut])
        return fh

    def cat_file(self, path, start=None, end=None, **kw):
        cut = self._fault(path)
        data = super().cat_file(path, start, end, **kw)
        return data[:cut] if cut is not None else data

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.faults.clear()
        cls.opened.clear()


fsspec.register_implementation("faulty", FaultyFS, clobber=True)


class Web:
    """A local http server (a thread) with misbehaving URLs:

    - ``/f/<name>``: the bytes in :attr:`files` (``/f/<name>?cut=N`` cuts the body
      after N bytes while announcing the whole length); a name in :attr:`gates` waits
      for its event before it answers; a HEAD gives its length and an ETag (a digest
      of the bytes, as web servers and object stores give);
    - ``/big``: announces a 10 GB body, sends none; ``/endless``: a body with no length
      that never ends; ``/hang``: never answers; anything else: 404.
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.gates: dict[str, threading.Event] = {}
        self.stop = threading.Event()
        web = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):  # noqa: N802 - the http.server API
                data = web.files.get(self.path[3:]) if self.path.startswith("/f/") \
                    else None
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')  # noqa: S324
                self.end_headers()

            def do_GET(self):  # noqa: N802 - the http.server API
                path, _, query = self.path.partition("?")
                try:
                    if path.startswith("/f/") and path[3:] in web.files:
                        gate = web.gates.get(path[3:])
                        if gate is not None:
                            gate.wait(60)
                        data = web.files[path[3:]]
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        cut = int(query[4:]) if query.startswith("cut=") else len(data)
                        self.wfile.write(data[:cut])
                    elif path == "/big":
                        self.send_response(200)
                        self.send_header("Content-Length", str(10 << 30))
                        self.end_headers()
                        web.stop.wait(30)
                    elif path == "/endless":
                        self.send_response(200)
                        self.end_headers()
                        while not web.stop.is_set():
                            self.wfile.write(b"\0" * 65536)
                    elif path == "/hang":
                        web.stop.wait(60)
                    else:
                        self.send_error(404)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def read_out(root: str, fs=None) -> tuple[list[str], dict[str, str]]:
    """(row ids of every part, {error id: code}) of a sharded Parquet output."""
    import pyarrow.parquet as pq

    names = [os.path.basename(n) for n in (fs.ls(root, detail=False) if fs
                                            else os.listdir(root))]
    ids: list[str] = []
    for n in sorted(names):
        if n.startswith("part-"):
            t = pq.read_table(f"{root}/{n}", filesystem=fs) if fs else \
                pq.read_table(os.path.join(root, n))
            ids += t.column("id").to_pylist()
    codes: dict[str, str] = {}
    for n in sorted(names):
        if n.startswith("_errors-"):
            text = fs.cat(f"{root}/{n}").decode() if fs else \
                open(os.path.join(root, n), encoding="utf-8").read()
            codes.update({r["id"]: r["code"] for r in csv.DictReader(io.StringIO(text))})
    return ids, codes


def markers(root: str, fs=None) -> dict[str, dict]:
    """The done markers of a sharded output: shard key -> marker."""
    names = [os.path.basename(n) for n in (fs.ls(root, detail=False) if fs
                                            else os.listdir(root))]
    out = {}
    for n in names:
        if n.startswith("_done-"):
            text = fs.cat(f"{root}/{n}") if fs else open(os.path.join(root, n), "rb").read()
            m = json.loads(text)
            out[m["shard"]] = m
    return out
