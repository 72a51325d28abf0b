"""Shared helpers for the benchmarks: test images, percentiles, server subprocesses,
the hookserve command line, machine facts and the results file.

Importing this module sets ``GOMP_SPINCOUNT=10000`` (unless a wait policy is set
already) for this process and every server it starts; import it before torch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The client and the servers share 2 cores. With libgomp's default wait (a ~3 ms
# spin) each process's torch threads spin after every parallel region and take the
# core the other process needs next: row e measured +11.5 ms "added" at p50 that way,
# +2.1 ms with OMP_WAIT_POLICY=PASSIVE. But PASSIVE makes every region start with a
# wake-up: resnet50 batch 1 took 89-98 ms against 61-78 ms with a ~0.1 ms spin. So
# every process of the bench (this one, hookserve, the peers) gets the short spin that
# `hookserve serve` sets by default (service/hookserve_server/openmp.py), unless a wait
# policy is in the environment already. Set before torch is imported here; inherited.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
STREAMS = 8
POOLED = {"layer4": {"reduction": "avg"}}


def jpeg(seed: int, side: int) -> bytes:
    """A smooth random RGB image as JPEG (compresses like a photo, unlike noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((side, side), Image.BILINEAR)
    arr = np.clip(np.asarray(img).astype(int) + rng.integers(-8, 9, (side, side, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def images(n: int, side: int) -> list[bytes]:
    distinct = [jpeg(s, side) for s in range(min(n, 16))]
    return [distinct[i % len(distinct)] for i in range(n)]


def stat_cpu(path: str | Path) -> tuple[float, int] | None:
    """(CPU seconds, user + system, and the session id) from a /proc/.../stat file of a
    process or thread (Linux); None once it has ended."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after the command: utime and stime are fields 14 and 15 of stat, the session 6
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[3])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


class Proc:
    """A server subprocess whose port is read from its output."""

    def __init__(self, name: str, argv: list[str], port_re: str, timeout: float = 300,
                 env: dict | None = None, cwd: str | Path | None = None) -> None:
        self.name = name
        self.lines: list[str] = []
        self._port: queue.Queue = queue.Queue()
        self._re = re.compile(port_re)
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, bufsize=1, env=env, cwd=cwd,
                                  # its own process group: stop() signals the whole group,
                                  # so servers that fork workers (LitServe) leave no orphans
                                  start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            port = self._port.get(timeout=timeout)
        except queue.Empty:
            port = None
        if port is None:
            self.stop()
            tail = "".join(self.lines[-20:])
            raise RuntimeError(f"{name} did not start (rc={self.p.poll()}):\n{tail}")
        self.port = port
        self.address = f"127.0.0.1:{port}"

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)
            m = self._re.search(line)
            if m:
                self._port.put(int(m.group(1)))
        self._port.put(None)

    def wait_lines(self, words: tuple[str, ...], n: int, timeout: float = 3600) -> int:
        """Until `n` output lines hold one of `words` (or the process ended)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.p.poll() is None:
            seen = sum(any(w in line for w in words) for line in self.lines)
            if seen >= n:
                return seen
            time.sleep(0.5)   # polling a log, not synchronising threads
        return sum(any(w in line for w in words) for line in self.lines)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        """SIGSTOP the server's process group (its workers too): while another server is
        measured, an idle one's polling loop takes no CPU from it."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group after `pause()`."""
        self._signal_group(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after 30 s."""
        self.resume()  # a paused group would not handle SIGTERM
        self._signal_group(signal.SIGTERM)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)  # workers left behind by the leader, if any
        self.p.wait()


HOOKSERVE_PORT_RE = r"hookserve listening on \S+:(\d+)"


def hookserve_exe() -> str:
    """The `hookserve` command of this Python's venv, else the one on PATH."""
    exe = Path(sys.executable).with_name("hookserve")
    return str(exe) if exe.exists() else "hookserve"


def hookserve_argv(models: list[str], a: argparse.Namespace, *extra: str) -> list[str]:
    """`hookserve serve` on 127.0.0.1:0 with random seeded weights and the bench's flags."""
    argv = [hookserve_exe(), "serve", "--host", "127.0.0.1",
            "--port", "0", "--weights", "random", "--seed", "0", "--device", a.device,
            "--dtype", a.dtype, "--max-batch-size", str(a.batch),
            "--max-batch-delay-ms", str(a.delay_ms), *extra]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    if getattr(a, "channels_last", False):
        argv.append("--channels-last")
    for m in models:
        argv += ["--model", m]
    return argv


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "grpcio": grpc.__version__,
            "loadavg_start": os.getloadavg()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                / 2**30, 1)
    except (OSError, ValueError):
        pass
    return info


def new_results(a: argparse.Namespace, plan: dict) -> dict:
    """The JSON skeleton every benchmark writes: command, machine, config, rows."""
    return {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": machine(),
            "config": {**{k: str(v) if isinstance(v, Path) else v
                          for k, v in vars(a).items()}, **plan},
            "rows": {}}


def clock():
    """A `say(msg)` that prefixes the seconds since it was made."""
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    say.t0 = t0  # type: ignore[attr-defined]
    return say


def write_results(res: dict, out: Path | None, tag: str, latest: str = "latest.json") -> Path:
    """Write bench/results/<UTC time><tag>.json (or `out`) and bench/results/`latest`."""
    res["machine"]["loadavg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out or RESULTS / f"{stamp}{tag}.json"
    text = json.dumps(res, indent=2)
    path.write_text(text)
    (RESULTS / latest).write_text(text)
    return path


class Ctx:
    """What every row of `bench/run.py` shares: flags, plan, the in-process limit, the
    running servers, the test images, the results dict and the clock."""

    def __init__(self, a: argparse.Namespace, plan: dict, local, servers: dict, say,
                 rows: dict) -> None:
        self.a, self.p, self.local, self.servers, self.say, self.R = (
            a, plan, local, servers, say, rows)
        self.rounds = max(1, a.rounds)
        self.img256 = images(max(plan["b_images"], plan["g_images"], plan["d_images"]), 256)
        self.img224 = images(max(plan["c_images"], plan["e_images"], plan["f_images"]), 224)
