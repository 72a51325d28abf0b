"""hookserve benchmark: the service against the limit, side by side, in one run.

    python bench/run.py            # the full table (make bench)
    python bench/run.py --quick    # smaller models and fewer images (make bench-quick)

Every row is measured in this one process tree, one after the other, so the ratios
are fair on a noisy machine. Servers (hookserve, the raw-bytes gRPC server, the naive
hook server) run as *subprocesses*: client load and server work never share a GIL.
hookserve is started as ``hookserve serve --port 0`` and its port is read from its
"hookserve listening on HOST:PORT" log line. In-process rows (the limits) run in this
process while every server is idle.

Rows (see docs/performance.md):
  a  in-process torchvision forward at the server's batch size (the limit), img/s
  b  hookserve via the SDK, 8 concurrent streams, layer4 avg-pooled: img/s, b/a
  c  VGG features.0 float32 (12.8 MB/image) streamed vs raw gRPC bytes: MB/s, c/raw
  d  layer1-only request time / full-forward request time
  e  one image at a time, resnet18 224 px: p50/p99, service vs in-process, ms added
  f  8 concurrent single-image clients vs 1: throughput ratio
  g  naive hook server (one image per forward, 8 concurrent clients): b/g

Prints a table and writes bench/results/<UTC time>.json (and latest.json).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The client and the servers share 2 cores. With OpenMP's default (active) wait
# policy, each process's torch threads spin for a while after every parallel region
# and take the core the other process needs next: row e measured +11.5 ms "added" at
# p50 that way, +2.1 ms with PASSIVE, which matches the server's own stage timings.
# Set before torch is imported here and inherited by every server process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import hookserve

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
import raw_server  # noqa: E402  (bench/ sibling)

STREAMS = 8


# -- helpers ---------------------------------------------------------------------------
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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


class Proc:
    """A server subprocess whose port is read from its output."""

    def __init__(self, name: str, argv: list[str], port_re: str, timeout: float = 300) -> None:
        self.name = name
        self.lines: list[str] = []
        self._port: queue.Queue = queue.Queue()
        self._re = re.compile(port_re)
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, bufsize=1)
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

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def hookserve_argv(models: list[str], a: argparse.Namespace) -> list[str]:
    exe = Path(sys.executable).with_name("hookserve")
    argv = [str(exe) if exe.exists() else "hookserve", "serve", "--host", "127.0.0.1",
            "--port", "0", "--weights", "random", "--seed", "0", "--device", a.device,
            "--dtype", a.dtype, "--max-batch-size", str(a.batch),
            "--max-batch-delay-ms", str(a.delay_ms)]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    if a.channels_last:
        argv.append("--channels-last")
    for m in models:
        argv += ["--model", m]
    return argv


# -- in-process limits ----------------------------------------------------------------
class Local:
    """torchvision models in this process, as a user would run them without a server."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torchvision  # noqa: F401

        self.torch = torch
        if a.threads:
            torch.set_num_threads(a.threads)
        self.device = torch.device("cuda" if a.device.startswith("cuda") else a.device)
        if a.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = {"float32": torch.float32, "float16": torch.float16,
                      "bfloat16": torch.bfloat16}[a.dtype]
        self.channels_last = a.channels_last
        self._fx: dict = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def extractor(self, arch: str, layer: str):
        import torchvision
        from torchvision.models.feature_extraction import create_feature_extractor

        self.torch.manual_seed(0)
        m = torchvision.models.get_model(arch, weights=None).eval()
        fx = create_feature_extractor(m, {layer: "f"}).to(self.device, self.dtype)
        if self.channels_last:
            fx = fx.to(memory_format=self.torch.channels_last)
        return fx

    def forward_throughput(self, arch: str, layer: str, batch: int, batches: int, *,
                           pool: bool = True) -> float:
        """img/s of the forward pass to `layer` (avg-pooled if `pool`) at `batch`."""
        torch = self.torch
        key = (arch, layer)
        if key not in self._fx:
            self._fx[key] = self.extractor(arch, layer)
        fx = self._fx[key]
        x = torch.randn(batch, 3, 224, 224).to(self.device, self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)

        def run():
            f = fx(x)["f"]
            return (f.mean(dim=(2, 3)) if pool else f.contiguous()).float().cpu()

        with torch.inference_mode():
            run()  # warm-up (kernel selection, allocator)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(batches):
                run()
            self.sync()
            return batch * batches / (time.perf_counter() - t0)

    def latencies(self, arch: str, layer: str, data: list[bytes], address: str,
                  layers) -> tuple[list[float], list[float]]:
        """Row e: one image at a time, in process (decode + normalise + forward + pool)
        and through hookserve (Client.extract, native size), alternating per image."""
        torch = self.torch
        fx = self.extractor(arch, layer)
        mean = torch.tensor([0.485, 0.456, 0.406], device=self.device).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225], device=self.device).view(1, 3, 1, 1)

        def one(b: bytes) -> np.ndarray:
            arr = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
            x = torch.from_numpy(arr.copy()).permute(2, 0, 1)[None].to(self.device)
            x = ((x.float() / 255 - mean) / std).to(self.dtype)
            with torch.inference_mode():
                return fx(x)["f"].mean(dim=(2, 3)).float().cpu().numpy()

        local: list[float] = []
        service: list[float] = []
        with hookserve.Client(address, timeout=600) as c:
            for b in data[:3]:  # warm-up
                one(b)
                c.extract(b, layers, model=arch, native=True)
            for b in data:
                t0 = time.perf_counter()
                one(b)
                local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.extract(b, layers, model=arch, native=True)
                service.append(time.perf_counter() - t0)
        return local, service


# -- rows through servers -----------------------------------------------------------
def streams_throughput(address: str, model: str, layers, data: list[bytes], streams: int,
                       **opts) -> float:
    """img/s of `streams` concurrent extract_many calls sharing `data` between them."""
    parts = [data[i::streams] for i in range(streams)]
    clients = [hookserve.Client(address, timeout=600) for _ in range(streams)]

    def run(c: hookserve.Client, part: list[bytes]) -> int:
        n = 0
        for r in c.extract_many(part, layers, model=model, **opts):
            r.raise_for_error()
            n += 1
        return n

    try:
        with ThreadPoolExecutor(streams) as pool:
            t0 = time.perf_counter()
            done = sum(pool.map(run, clients, parts))
            dt = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    assert done == len(data)
    return done / dt


def single_image_clients(address: str, model: str, layers, data: list[bytes], clients: int,
                         **opts) -> tuple[float, list[float]]:
    """`clients` threads, each calling extract() one image at a time: (img/s, latencies)."""
    parts = [data[i::clients] for i in range(clients)]
    lat: list[float] = []

    def run(part: list[bytes]) -> None:
        with hookserve.Client(address, timeout=600) as c:
            for b in part:
                t0 = time.perf_counter()
                c.extract(b, layers, model=model, **opts)
                lat.append(time.perf_counter() - t0)

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        list(pool.map(run, parts))
        dt = time.perf_counter() - t0
    return len(data) / dt, lat


def raw_stream_mb_s(address: str, n_images: int, image_bytes: int, chunk: int) -> float:
    with grpc.insecure_channel(address, options=raw_server.OPTIONS) as ch:
        call = ch.unary_stream(raw_server.METHOD)
        for _ in call(raw_server.request(1, image_bytes, chunk)):  # warm-up
            pass
        t0 = time.perf_counter()
        got = sum(len(m) for m in call(raw_server.request(n_images, image_bytes, chunk)))
        dt = time.perf_counter() - t0
    assert got == n_images * image_bytes
    return got / dt / 1e6


def naive_throughput(address: str, data: list[bytes], clients: int) -> float:
    parts = [data[i::clients] for i in range(clients)]
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/bench.Naive/Extract")
        call(data[0], timeout=600)  # warm-up

        def run(part: list[bytes]) -> None:
            for b in part:
                call(b, timeout=600)

        with ThreadPoolExecutor(clients) as pool:
            t0 = time.perf_counter()
            list(pool.map(run, parts))
            return len(data) / (time.perf_counter() - t0)


# -- the run ----------------------------------------------------------------------------
def plan(quick: bool) -> dict:
    if quick:
        return dict(arch="resnet18", vgg="vgg11", a_batches=3, b_images=96, c_images=16,
                    d_images=32, e_images=20, f_images=32, g_images=32)
    return dict(arch="resnet50", vgg="vgg16", a_batches=4, b_images=192, c_images=48,
                d_images=64, e_images=60, f_images=64, g_images=48)


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "grpcio": grpc.__version__}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer images")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (server and limit)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--channels-last", action="store_true")
    # 8, not the server's default 32: on the 2-core dev CPU resnet50 runs 13-15 img/s
    # at batch 1-8 but 9-11 at batch 32 (docs/performance.md); use 64-256 on a GPU.
    ap.add_argument("--batch", type=int, default=8, help="server --max-batch-size and row a")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="server --max-batch-delay-ms")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in the servers and the in-process limit (0: default)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="a/b/g and c/raw alternate in this many rounds (drift hits both)")
    ap.add_argument("--only", default="abcdefg", help="rows to run, e.g. 'abg'")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/)")
    a = ap.parse_args()
    p = plan(a.quick)
    rows = set(a.only)
    arch, vgg = p["arch"], p["vgg"]
    res: dict = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                 "quick": a.quick, "machine": machine(),
                 "config": {**{k: str(v) if isinstance(v, Path) else v
                               for k, v in vars(a).items()}, **p},
                 "rows": {}}
    res["machine"]["loadavg_start"] = os.getloadavg()
    R = res["rows"]
    t_start = time.perf_counter()
    local = Local(a)
    res["machine"]["torch_threads"] = local.torch.get_num_threads()
    res["machine"]["torch"] = local.torch.__version__

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    img256 = images(max(p["b_images"], p["g_images"], p["d_images"]), 256)
    img224 = images(max(p["c_images"], p["e_images"], p["f_images"]), 224)
    pooled = {"layer4": {"reduction": "avg"}}
    rounds = max(1, a.rounds)

    # Every server starts first and idles while it is not measured, so rows that are
    # compared can alternate round by round: noise from other load hits both sides.
    models = list(dict.fromkeys([arch, vgg, "resnet18"]))
    say(f"starting hookserve ({', '.join(models)}), raw and naive servers")
    procs: list[Proc] = []
    try:
        hs = Proc("hookserve", hookserve_argv(models, a), r"hookserve listening on \S+:(\d+)")
        procs.append(hs)
        if "c" in rows:
            raw = Proc("raw", [sys.executable, str(BENCH / "raw_server.py")], r"PORT (\d+)")
            procs.append(raw)
        if "g" in rows:
            argv = [sys.executable, str(BENCH / "naive_server.py"), "--model", arch,
                    "--layer", "layer4", "--device", local.device.type]
            if a.threads:
                argv += ["--threads", str(a.threads)]
            naive = Proc("naive", argv, r"PORT (\d+)")
            procs.append(naive)

        if rows & set("abg"):
            say(f"a/b/g: {arch} layer4 avg: in-process batch {a.batch} | hookserve "
                f"{STREAMS} streams | naive server {STREAMS} clients; {rounds} rounds")
            b_part = img256[:p["b_images"] // rounds]
            g_part = img256[:p["g_images"] // rounds]
            acc = {k: [0, 0.0] for k in "abg"}
            if "b" in rows:
                streams_throughput(hs.address, arch, pooled, img256[:STREAMS * 2], STREAMS)
            for r in range(rounds):
                if rows & set("ab"):
                    n = a.batch * max(1, p["a_batches"] // rounds)
                    acc["a"][0] += n
                    acc["a"][1] += n / local.forward_throughput(
                        arch, "layer4", a.batch, max(1, p["a_batches"] // rounds))
                if "b" in rows:
                    acc["b"][0] += len(b_part)
                    acc["b"][1] += len(b_part) / streams_throughput(
                        hs.address, arch, pooled, b_part, STREAMS)
                if "g" in rows:
                    acc["g"][0] += len(g_part)
                    acc["g"][1] += len(g_part) / naive_throughput(naive.address, g_part,
                                                                  STREAMS)
                say(f"  round {r + 1}: " + ", ".join(
                    f"{k} {n / t:.1f} img/s" for k, (n, t) in acc.items() if n))
            thr = {k: n / t for k, (n, t) in acc.items() if n}
            if "a" in thr:
                R["a"] = {"img_s": thr["a"], "model": arch, "batch": a.batch,
                          "images": acc["a"][0]}
            if "b" in thr:
                R["b"] = {"img_s": thr["b"], "b_over_a": thr["b"] / thr["a"] if "a" in thr
                          else None, "streams": STREAMS, "images": acc["b"][0]}
            if "g" in thr:
                R["g"] = {"img_s": thr["g"], "images": acc["g"][0],
                          "b_over_g": thr["b"] / thr["g"] if "b" in thr else None}

        if "c" in rows:
            say(f"c: {vgg} features.0 float32 via hookserve | raw bytes | in-process compute")
            n = p["c_images"] // rounds
            with hookserve.Client(hs.address, timeout=600) as c:
                per_image = c.describe(vgg, 224).layer("features.0").bytes_per_image

                def stream(k: int) -> float:
                    t0 = time.perf_counter()
                    got = 0
                    for r in c.extract_many(img224[:k], "features.0", model=vgg, native=True):
                        got += r.raise_for_error()["features.0"].nbytes
                    assert got == k * per_image
                    return got / (time.perf_counter() - t0) / 1e6

                stream(4)
                acc_c = {"hookserve": 0.0, "raw": 0.0, "compute": 0.0}
                for _ in range(rounds):
                    mb = n * per_image / 1e6
                    acc_c["hookserve"] += mb / stream(n)
                    acc_c["raw"] += mb / raw_stream_mb_s(raw.address, n, per_image, 2 << 20)
                    # The compute alone: the model to features.0, in process, same batch
                    # as the server forms (its per-stream window), bytes it produces.
                    window = min(64, (256 << 20) // per_image)
                    batches = max(1, n // window)
                    img_s = local.forward_throughput(vgg, "features.0", window, batches,
                                                     pool=False)
                    acc_c["compute"] += mb / (img_s * per_image / 1e6)
            total = n * rounds * per_image / 1e6
            R["c"] = {"mb_s": total / acc_c["hookserve"], "raw_mb_s": total / acc_c["raw"],
                      "compute_mb_s": total / acc_c["compute"],
                      "image_mb": per_image / 1e6, "images": n * rounds, "model": vgg}
            R["c"]["c_over_raw"] = R["c"]["mb_s"] / R["c"]["raw_mb_s"]
            # Compute and transport share the same cores here: the best a pipeline
            # can do on them is about the harmonic combination of the two rates.
            R["c"]["bound_mb_s"] = 1 / (1 / R["c"]["raw_mb_s"] + 1 / R["c"]["compute_mb_s"])

        if "d" in rows:
            say(f"d: {arch} layer1-only vs full forward")
            n = p["d_images"]
            with hookserve.Client(hs.address, timeout=600) as c:
                def timed(layers) -> float:
                    t0 = time.perf_counter()
                    for r in c.extract_many(img256[:n], layers, model=arch):
                        r.raise_for_error()
                    return time.perf_counter() - t0

                timed({"layer1": {"reduction": "avg"}})  # warm-up (batch shapes)
                t_l1 = t_full = 0.0
                for _ in range(rounds):
                    t_l1 += timed({"layer1": {"reduction": "avg"}})
                    t_full += timed(["fc"])
            R["d"] = {"layer1_s": t_l1, "full_s": t_full, "ratio": t_l1 / t_full,
                      "images": n * rounds, "model": arch}

        if "e" in rows:
            say("e: resnet18 latency, one image at a time, service and in-process alternating")
            data = img224[:p["e_images"]]
            e_local, e_srv = local.latencies("resnet18", "layer4", data, hs.address, pooled)
            e = {"inproc_p50_ms": pct(e_local, 50) * 1e3, "inproc_p99_ms": pct(e_local, 99) * 1e3,
                 "service_p50_ms": pct(e_srv, 50) * 1e3, "service_p99_ms": pct(e_srv, 99) * 1e3,
                 "images": len(data)}
            e["added_p50_ms"] = e["service_p50_ms"] - e["inproc_p50_ms"]
            e["added_p99_ms"] = e["service_p99_ms"] - e["inproc_p99_ms"]
            R["e"] = e

        if "f" in rows:
            say("f: 8 concurrent single-image clients vs 1 (resnet18)")
            data = img224[:p["f_images"]]
            single_image_clients(hs.address, "resnet18", pooled, data[:16], 8, native=True)
            one_c, _ = single_image_clients(hs.address, "resnet18", pooled, data, 1, native=True)
            eight, _ = single_image_clients(hs.address, "resnet18", pooled, data, 8, native=True)
            R["f"] = {"one_img_s": one_c, "eight_img_s": eight, "ratio": eight / one_c,
                      "images": len(data)}
    finally:
        for proc in procs:
            proc.stop()

    res["machine"]["loadavg_end"] = os.getloadavg()
    res["seconds"] = time.perf_counter() - t_start
    print()
    print(table(R, arch, vgg))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = a.out or RESULTS / f"{stamp}{'-quick' if a.quick else ''}.json"
    out.write_text(json.dumps(res, indent=2))
    (RESULTS / "latest.json").write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out} ({res['seconds']:.0f} s, load {res['machine']['loadavg_start']} "
          f"-> {res['machine']['loadavg_end']})")
    return 0


def table(R: dict, arch: str, vgg: str) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [f"{'row':<4}{'what':<52}{'figure':<34}{'target':<12}"]

    def row(k, what, fig, target=""):
        lines.append(f"{k:<4}{what:<52}{fig:<34}{target:<12}")

    if "a" in R:
        row("a", f"in-process {arch} forward, batch {R['a']['batch']} (limit)",
            f"{f(R['a']['img_s'])} img/s")
    if "b" in R:
        row("b", f"hookserve SDK, {STREAMS} streams, {arch} layer4 avg",
            f"{f(R['b']['img_s'])} img/s, b/a {f(R['b']['b_over_a'], '.2f')}", ">= 0.90")
    if "c" in R:
        row("c", f"{vgg} features.0 f32 ({R['c']['image_mb']:.1f} MB/img) vs raw",
            f"{f(R['c']['mb_s'], '.0f')} vs {f(R['c'].get('raw_mb_s'), '.0f')} MB/s, "
            f"{f(R['c'].get('c_over_raw'), '.2f')}", ">= 0.70")
        row("", "  compute alone (in-process) | shared-core bound",
            f"{f(R['c']['compute_mb_s'], '.0f')} | {f(R['c']['bound_mb_s'], '.0f')} MB/s")
    if "d" in R:
        row("d", f"{arch} layer1-only / full forward (time)",
            f"{f(R['d']['layer1_s'], '.2f')} / {f(R['d']['full_s'], '.2f')} s = "
            f"{f(R['d']['ratio'], '.2f')}", "<= 0.35")
    if "e" in R:
        e = R["e"]
        row("e", "latency resnet18 224px, p50 / p99 (service | local)",
            f"{e['service_p50_ms']:.1f}/{e['service_p99_ms']:.1f} | "
            f"{e['inproc_p50_ms']:.1f}/{e['inproc_p99_ms']:.1f} ms", "")
        row("", "  added at p50 / p99",
            f"{e['added_p50_ms']:+.1f} / {e['added_p99_ms']:+.1f} ms", "<= 10 ms")
    if "f" in R:
        row("f", "8 single-image clients vs 1 (resnet18 224px)",
            f"{f(R['f']['eight_img_s'])} vs {f(R['f']['one_img_s'])} img/s = "
            f"{f(R['f']['ratio'], '.2f')}x")
    if "g" in R:
        row("g", f"naive hook server, {arch}, 1 image/forward",
            f"{f(R['g']['img_s'])} img/s, b/g {f(R['g'].get('b_over_g'), '.2f')}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
