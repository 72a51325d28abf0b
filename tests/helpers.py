"""What several test modules share, importable (fixtures stay in conftest.py):

- `wait_until`: the one way a test waits for a real condition; `in_threads`: concurrent
  clients, each in a thread, their errors reported;
- `small_server`: the flags of a small, fast test server;
- wire helpers: raw-stub Extract and Attribute calls, the CLI as a subprocess,
  `hookserve serve` as a real process, and readings of a server's own metrics;
- `import_graph` / `import_cycles`: the one import-graph checker of the layout tests;
- `feature_extractor` / `graph_node_names`: torchvision's feature extraction (the
  oracle of several tests), its torch.fx trace run alone in the process.
"""

from __future__ import annotations

import ast
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


# -- waiting ------------------------------------------------------------------------------

def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "",
               *, every: float = 0.01) -> None:
    """Poll a real condition every `every` seconds until it holds; fail after `timeout`
    seconds, naming `what`.

    From asyncio code: `await asyncio.to_thread(wait_until, ...)` keeps the loop running.
    """
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(every)  # polling a condition, not ordering events


def in_threads(fn: Callable[[Any], object], args: Iterable, timeout: float = 120) -> None:
    """Call `fn(a)` for each of `args`, each in a thread of its own, wait for all of them,
    and fail with what any of them raised."""
    errors: list[BaseException] = []

    def run(a) -> None:
        try:
            fn(a)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not [t for t in threads if t.is_alive()], f"threads still running after {timeout}s"
    assert not errors, errors[:3]


# -- servers ------------------------------------------------------------------------------

def small_server(*extra: str, models: Sequence[str] = ("resnet18",)) -> list[str]:
    """`hookserve serve` flags of a small test server: `models` (resnet18 alone by
    default) with seeded random weights (nothing is downloaded), then `extra`."""
    flags = [f for m in models for f in ("--model", m)]
    return [*flags, "--weights", "random", "--seed", "0", *extra]


R18 = small_server()
METRICS = ["--metrics-port", "0"]  # a server whose registry `computed`/`answered` read


def computed(s, model: str = "resnet18") -> int:
    """Images that went through the model's forward pass on server `s`."""
    v = s.telemetry.registry.get_sample_value("hookserve_batch_size_sum", {"model": model})
    return int(v or 0)


def answered(s, code: str = "OK", model: str = "resnet18") -> int:
    """Images server `s` answered with status `code`."""
    v = s.telemetry.registry.get_sample_value("hookserve_images_total",
                                              {"model": model, "code": code})
    return int(v or 0)


class ServeProcess:
    """`hookserve serve` as a real process; its stderr JSON log is pumped to a queue."""

    def __init__(self, *flags: str, env: dict[str, str | None] | None = None) -> None:
        cmd = [sys.executable, "-m", "hookserve", "serve", "--device", "cpu",
               "--host", "127.0.0.1", "--port", "0", *flags]
        base = dict(os.environ, PYTHONUNBUFFERED="1")
        for k, v in (env or {}).items():  # None removes a variable
            base.pop(k, None) if v is None else base.__setitem__(k, v)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=base)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = self._wait_port(120)
        self.address = f"127.0.0.1:{self.port}"

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def _wait_port(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if "hookserve listening on" in line:
                msg = json.loads(line)["msg"]
                return int(msg.split("listening on ")[1].split(" ")[0].rsplit(":", 1)[1])
        raise AssertionError("server did not start:\n" + "".join(self.log[-20:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def hs(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `hookserve` CLI as a subprocess."""
    return subprocess.run([sys.executable, "-m", "hookserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# -- deployment files ---------------------------------------------------------------------

#: gRPC probes are GA from 1.27; the newest schema bundled with kubernetes-validate.
K8S_VERSIONS = ("1.27.0", "1.37.0")


def tool(name: str) -> str:
    """A command-line tool of the dev extra: the venv's, else PATH's; skips without it."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def kubernetes_validate(files: list[str], version: str) -> None:
    """Every manifest in `files` passes kubernetes-validate --strict for `version`."""
    p = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, *files],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("passed") == len(files), p.stdout


def serve_flags() -> set[str]:
    """Every option string of `hookserve serve`."""
    from hookserve.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {s for a in serve._actions for s in a.option_strings}


def env_names() -> set[str]:
    """The HOOKSERVE_* variable of each `hookserve serve` flag."""
    return {"HOOKSERVE_" + f[2:].upper().replace("-", "_") for f in serve_flags()
            if f.startswith("--") and not f.startswith("--no-") and f != "--help"}


# -- the wire, by raw stubs ---------------------------------------------------------------

NATIVE = pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE)


def extract_raw(server, layers: list[pb.LayerRequest], arr: np.ndarray, model: str = ""
                ) -> dict[str, tuple[np.ndarray, list[str]]]:
    """One image through Extract by raw stubs: layer -> (array, column names)."""
    h, w = arr.shape[:2]
    reqs = [pb.ExtractRequest(spec=pb.ExtractionSpec(model=model, layers=layers,
                                                     preprocessing=NATIVE)),
            pb.ExtractRequest(image=pb.Image(id="a", raw=pb.RawImage(
                pixels=arr.tobytes(), height=h, width=w)))]
    with grpc.insecure_channel(server.address) as ch:
        msgs = list(pb_grpc.FeatureExtractorStub(ch).Extract(iter(reqs), timeout=120))
    assert msgs[-1].status.code == 0, msgs[-1].status.message
    chunks: dict[str, list] = {}
    for m in msgs[:-1]:
        chunks.setdefault(m.tensor.layer, []).append(m.tensor)
    dt = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT16: "<f2"}
    return {name: (np.frombuffer(b"".join(c.data for c in cs), dt[cs[0].dtype])
                   .reshape(tuple(cs[0].shape)), list(cs[0].columns))
            for name, cs in chunks.items()}


def image_req(arr: np.ndarray, i: int, target: int | None = None) -> pb.AttributeRequest:
    h, w = arr.shape[:2]
    img = pb.Image(id=f"img{i}", raw=pb.RawImage(pixels=arr.tobytes(), height=h, width=w))
    return pb.AttributeRequest(image=pb.AttributeImage(image=img, target_class=target))


def answers(msgs) -> list[dict]:
    """Group Attribute response messages per image: summary, map (numpy), status."""
    out: dict[int, dict] = {}
    for m in msgs:
        a = out.setdefault(m.image_index, {"id": m.image_id, "chunks": []})
        kind = m.WhichOneof("payload")
        if kind == "summary":
            a["summary"] = m.summary
        elif kind == "map":
            a["chunks"].append(m.map)
        else:
            a["status"] = m.status
    for a in out.values():
        c = a.pop("chunks")
        if c:
            data = b"".join(x.data for x in c)
            assert len(data) == c[0].total_bytes
            a["map"] = np.frombuffer(data, "<f4").reshape(tuple(c[0].shape))
            a["layer"] = c[0].layer
    return [out[i] for i in sorted(out)]


def attribute(server, spec: pb.AttributionSpec, images, targets=None) -> list[dict]:
    """One Attribute call by raw stubs; its answers per image."""
    targets = targets or [None] * len(images)
    reqs = [pb.AttributeRequest(spec=spec)] + [
        image_req(a, i, t) for i, (a, t) in enumerate(zip(images, targets, strict=True))]
    with grpc.insecure_channel(server.address) as ch:
        msgs = list(pb_grpc.FeatureExtractorStub(ch).Attribute(iter(reqs), timeout=120))
    return answers(msgs)


def call_error(server, spec: pb.AttributionSpec, images=(), targets=None) -> grpc.RpcError:
    """The error an Attribute call ends with (it must end with one)."""
    with pytest.raises(grpc.RpcError) as err:
        attribute(server, spec, list(images), targets)
    return err.value


def ok(a: dict) -> dict:
    assert a["status"].code == 0, a["status"].message
    return a


def numpy_stats(t: np.ndarray) -> np.ndarray:
    """REDUCTION_STATS computed with numpy: mean, std, min, max, zero fraction per row."""
    flat = t.reshape(t.shape[0], -1) if t.ndim > 1 else t.reshape(1, -1)
    return np.stack([flat.mean(1), flat.std(1), flat.min(1), flat.max(1),
                     (flat == 0).mean(1)], axis=1)


# -- import graph -------------------------------------------------------------------------

def package_modules(root: Path, package: str, skip: Iterable[str] = ()) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `root`; path parts
    in `skip` (such as generated code) are left out."""
    skip = set(skip)
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        if skip & set(rel.parts):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def module_imports(name: str, path: Path, known: Iterable[str] = ()) -> set[str]:
    """Every module `name` imports, anywhere in the file: under `if TYPE_CHECKING:` and
    inside functions too. `from pkg import x` names `pkg.x` when that is in `known`,
    else `pkg`; relative imports are resolved."""
    known = set(known)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            found.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                         for a in node.names)
    return found


def import_graph(root: Path, package: str, skip: Iterable[str] = ()) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (type-checking ones too)."""
    known = package_modules(root, package, skip)
    return {name: {m for m in module_imports(name, path, known) if m in known} - {name}
            for name, path in known.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each set of modules that import one another in a circle (strongly connected
    components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


# Import circles allowed to exist, each a sorted tuple of module names, as
# `import_cycles` gives them. None exists today. This list must only shrink: a new circle
# fails the layout tests, and a listed one that is gone fails them too until it is
# removed from here.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def assert_no_new_cycles(graph: dict[str, set[str]]) -> None:
    """Fail on an import circle not in KNOWN_CYCLES, and on a listed circle of this
    graph's package that no longer exists (so that the list shrinks)."""
    found = set(import_cycles(graph))
    new = sorted(found - KNOWN_CYCLES)
    assert not new, "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    mine = {c for c in KNOWN_CYCLES if c[0] in graph}
    gone = sorted(mine - found)
    assert not gone, f"no longer a cycle, remove from tests/helpers.py KNOWN_CYCLES: {gone}"


# -- the answer cache: counts from a server's metrics, a real redis-server ----------

CACHE_BASE = small_server("--max-batch-size", "1", "--max-batch-delay-ms", "1", *METRICS)


def sample(server, name: str, **labels) -> float:
    return server.telemetry.registry.get_sample_value(name, labels) or 0.0


def forwards(server) -> float:
    """Images that went through a forward pass so far."""
    return sample(server, "hookserve_batch_size_sum", model="resnet18")


def events(server, tier: str = "local") -> dict[str, float]:
    return {e: sample(server, "hookserve_cache_events_total", tier=tier, event=e)
            for e in ("hit", "miss", "coalesced", "eviction", "error", "store")}


class Counting:
    """Forwards and cache events of one server since it was made."""

    def __init__(self, server, tier: str = "local") -> None:
        self.server, self.tier = server, tier
        self.f0, self.e0 = forwards(server), events(server, tier)

    @property
    def forwards(self) -> float:
        return forwards(self.server) - self.f0

    def __getattr__(self, event: str) -> float:
        return events(self.server, self.tier)[event] - self.e0[event]


def one(client, image, layers, **kw):
    """One image through extract_many (its Result carries `cached`), errors raised."""
    (r,) = client.extract_many([image], layers, **kw)
    r.raise_for_error()
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A redis-server process on loopback, no persistence."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                return False

        wait_until(up, 20, "redis-server to take connections", every=0.05)
        client.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def shared_server(make_server, redis_server, *flags: str) :
    # A generous timeout: this machine is shared; the killed-Redis test sets its own.
    return make_server(*CACHE_BASE, "--cache-url", redis_server.url, "--cache-timeout-ms", "2000",
                       *flags)


def feature_extractor(model, nodes):
    """torchvision's `create_feature_extractor`, traced alone in the process as the
    server's own traces are (capture/tracing.py): no compile of a server in this
    process meets the torch.fx trace."""
    from torchvision.models.feature_extraction import create_feature_extractor

    from hookserve_server.capture.tracing import tracing

    with tracing():
        return create_feature_extractor(model, nodes)


def graph_node_names(model) -> list[str]:
    """torchvision's eval-mode node names of `model`, traced alone (as above)."""
    from torchvision.models.feature_extraction import get_graph_node_names

    from hookserve_server.capture.tracing import tracing

    with tracing():
        return get_graph_node_names(model)[1]
