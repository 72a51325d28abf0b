"""Shared fixtures: real hookserve servers on 127.0.0.1:0, talked to over the wire.

Servers are configured through the same flag parser as `hookserve serve`, so tests
exercise the real start-up path. Weights are seeded random (no downloads here).
"""

from __future__ import annotations

import io
import shutil
import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from PIL import Image

import hookserve
from hookserve.cli import build_parser
from hookserve_server.app import build

import helpers
from helpers import small_server


class RunningServer:
    """A started server plus what tests need to reach and inspect it."""

    def __init__(self, flags: list[str], *, start: bool = True) -> None:
        args = build_parser().parse_args(
            ["serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *flags])
        self.args = args
        self.engine, self.server, self.telemetry = build(args)
        self.port = self.server.port
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port: int | None = None
        if start:
            self.start()

    def start(self) -> None:
        if self.telemetry is not None and self.args.metrics_port is not None:
            self.metrics_port = self.telemetry.serve(self.args.metrics_port, addr="127.0.0.1")
        self.server.start()

    def client(self, **kw) -> hookserve.Client:
        return hookserve.Client(self.address, **kw)

    def stop(self, grace: float = 5.0) -> None:
        self.server.stop(grace)


DEFAULT_FLAGS = small_server("--max-batch-delay-ms", "2", models=("resnet18", "vgg11"))


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """One shared server with resnet18 (default) and vgg11, random weights, seed 0."""
    s = RunningServer(DEFAULT_FLAGS)
    yield s
    s.stop()


@pytest.fixture
def client(server: RunningServer) -> Iterator[hookserve.Client]:
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """Factory for servers with custom flags; all are stopped at the end of the test."""
    started: list[RunningServer] = []

    def factory(*flags: str, start: bool = True) -> RunningServer:
        s = RunningServer(list(flags) or DEFAULT_FLAGS, start=start)
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop(2.0)


@pytest.fixture
def silent_address() -> Iterator[str]:
    """host:port of a TCP listener that never answers: a call to it can only end at its
    deadline (connections wait in the listen backlog, never accepted)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture(scope="module")
def det_server() -> Iterator[RunningServer]:
    """resnet18, random weights (seed 0), --max-batch-size 1: an image's features do not
    depend on which images shared its batch, so outputs of different runs (1 or 4
    workers, killed and resumed) compare bit for bit."""
    s = RunningServer(small_server("--max-batch-size", "1"))
    yield s
    s.stop(2.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates made for this module (tests/certs.py): a server CA, a client CA and
    a rogue CA, with a server, a client and a rogue certificate of each side."""
    from certs import CA

    d = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, rogue_ca = CA("server", d), CA("clients", d), CA("rogue", d)
    return {
        "dir": d,
        "server_ca": server_ca,
        "client_ca": client_ca,
        "rogue_ca": rogue_ca,
        "server": server_ca.issue("hookserve-server", server=True),
        "client": client_ca.issue("trainer-1", server=False),
        "rogue_client": rogue_ca.issue("intruder", server=False),
        "rogue_server": rogue_ca.issue("fake-server", server=True),
    }


TOKEN = "s3cret-token-4f1c9a"


@pytest.fixture(scope="module")
def token_server(tmp_path_factory) -> Iterator[RunningServer]:
    """resnet18 behind a bearer token (TOKEN), read from an --auth-token-file."""
    f = tmp_path_factory.mktemp("auth") / "token"
    f.write_text(TOKEN + "\n")       # a trailing newline, as editors write it, is ignored
    s = RunningServer(small_server("--max-batch-delay-ms", "2", "--auth-token-file", str(f)))
    yield s
    s.stop(2.0)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 endpoint on loopback (a real S3 API over HTTP), announced the standard
    way (AWS_* environment), with a bucket ``lake``. Skipped without s3fs and moto."""
    import os

    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    if not fs.exists("lake"):  # moto's store is per process: another module made it
        fs.mkdir("lake")
    yield fs
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    srv.stop()


def rand_image(h: int = 64, w: int = 80, seed: int = 0) -> np.ndarray:
    """A smooth-ish random HxWx3 uint8 image (compresses realistically)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BILINEAR)
    noise = rng.integers(-8, 9, (h, w, 3))
    return np.clip(np.asarray(img).astype(int) + noise, 0, 255).astype(np.uint8)


def encode(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed "
                                        "(pip install 'hookserve[cache]')")
    r = helpers.Redis()
    yield r
    r.kill()
