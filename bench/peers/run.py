"""hookserve beside LitServe and a KServe v2 gRPC model server, in one run.

    make bench-peers                       # installs the peers, then runs this
    .venv/bin/python -m bench.peers.run    # if they are installed already

The same work for every server: a torchvision model with seeded random weights, a
forward hook on one layer, early stop, a reduction (bench/peers/hooked.py; hookserve
does this itself), hookserve's default preprocessing of a 224 px JPEG (resize and
centre crop as the model's default torchvision weights: resnet50 232/224, vgg16
256/224; ImageNet normalisation); every answer is checked against the floor's.
Servers run as subprocesses with the same torch thread count and the same OpenMP wait
(GOMP_SPINCOUNT=10000, hookserve's default; bench/common.py); the in-process floor
runs in this process while they idle.
Rows that are compared alternate (per image for latency, per round for throughput),
so drift in the machine's load hits every column. While one server (or the floor) is
measured, the other servers are paused (SIGSTOP to their process groups, SIGCONT when
their turn comes): an idle LitServe's polling loop takes 15% of a core, which would
otherwise come out of whichever column is running (--no-pause measures with every
server running).

  latency   resnet50 layer4 avg, one client, one image at a time: p50/p99 (ms)
  tput-1    the same, img/s with 1 client
  tput-8    8 concurrent clients, one image per call: img/s (floor: in-process batch 8)
  bigmap    vgg16 features.0 float32 (12.8 MB/image), --big-clients clients: MB/s
  cpu       CPU ms per image during tput-8: each server's process tree (workers it
            forked included) and the bench process (the clients)

Prints a table with ratios and writes bench/results/<UTC time>-peers.json and
bench/results/peers-latest.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import (  # sets the OpenMP wait first
    HOOKSERVE_PORT_RE,
    Proc,
    clock,
    hookserve_argv,
    images,
    new_results,
    pct,
    stat_cpu,
    write_results,
)
from bench.peers import callers, report
from bench.peers.hooked import Hooked

ROOT = Path(__file__).resolve().parents[2]

WORK = {"pooled": ("resnet50", "layer4", "avg"), "big": ("vgg16", "features.0", "none")}
#: --modes: hookserve execution modes, each its own server (docs/performance.md)
#: the layer sets a compiled mode compiles at start-up: the pooled work at each batch
#: bucket 8 clients make, the big work at the buckets --big-clients make
WARM = [x for b in (1, 2, 4, 8) for x in ("--warm", f"resnet50=layer4#{b}")] + [
    x for b in (1, 2) for x in ("--warm", f"vgg16=features.0#{b}")]
MODES = {
    "default": [],
    "eager": ["--memory-format", "contiguous"],
    "cl": ["--memory-format", "channels_last"],
    "compiled": ["--memory-format", "channels_last", "--compile", "auto", *WARM],
    "bf16": ["--precision", "bf16", "--memory-format", "channels_last"],
    "compiled-bf16": ["--precision", "bf16", "--memory-format", "channels_last",
                      "--compile", "auto", *WARM],
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2,
                    help="torch intra-op threads in every server and the floor")
    ap.add_argument("--batch", type=int, default=8,
                    help="hookserve --max-batch-size and LitServe max_batch_size")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="hookserve --max-batch-delay-ms")
    ap.add_argument("--litserve-batch-timeout", type=float, default=0.001,
                    help="LitServe batch_timeout, seconds (it waits this long for a batch "
                         "to fill even when one request is alone)")
    ap.add_argument("--latency-images", type=int, default=60)
    ap.add_argument("--tput-images", type=int, default=48, help="per round, per server")
    ap.add_argument("--big-images", type=int, default=16, help="per server")
    ap.add_argument("--big-clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="hookserve,litserve,kserve",
                    help="servers beside the floor, comma-separated")
    ap.add_argument("--modes", default="default",
                    help="hookserve execution modes, one server each, comma-separated: "
                         f"{', '.join(MODES)} (columns hookserve-MODE; default: one "
                         "server with the default flags, column hookserve)")
    ap.add_argument("--hookserve-arg", action="append", default=[],
                    help="extra `hookserve serve` flag (repeat), e.g. --hookserve-arg=--x")
    ap.add_argument("--kserve-python", default=str(ROOT / ".venv-kserve/bin/python"),
                    help="python of the venv that has kserve (it pins protobuf < 7)")
    ap.add_argument("--no-pause", action="store_true",
                    help="keep every server running while another is measured")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.device, a.dtype = "cpu", "float32"
    return a


def start(a: argparse.Namespace, which: set[str], say) -> tuple[dict, dict]:
    """Start the servers; return (procs, {"pooled"|"big": [caller, ...]})."""
    spec: list[str] = []
    for arch, layer, reduce in WORK.values():
        spec += ["--model", arch, "--layer", layer, "--reduce", reduce]
    procs: dict[str, Proc] = {}
    use: dict[str, list] = {k: [] for k in WORK}
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for mode in modes if "hookserve" in which else ():
        name = "hookserve" if modes == ["default"] else f"hookserve-{mode}"
        say(f"starting {name}")
        procs[name] = p = Proc(name, hookserve_argv(
            [w[0] for w in WORK.values()], a, *MODES[mode], *a.hookserve_arg),
            HOOKSERVE_PORT_RE)
        for k, (arch, layer, reduce) in WORK.items():
            use[k].append(callers.HookserveCaller(p.address, arch, layer, reduce, name))
        warm = MODES[mode].count("--warm")
        if warm:
            say(f"  {name}: waiting for its {warm} start-up compiles (it serves meanwhile)")
            t0 = time.perf_counter()
            p.wait_lines(("compiled resnet50", "compiled vgg16", "serving it eagerly"), warm)
            a.compile_seconds = time.perf_counter() - t0
    if "litserve" in which:
        say("starting LitServe")
        procs["litserve"] = p = Proc("litserve", [
            sys.executable, "-m", "bench.peers.litserve_server", *spec, "--threads",
            str(a.threads), "--max-batch-size", str(a.batch), "--batch-timeout",
            str(a.litserve_batch_timeout)], r"PORT (\d+)", cwd=ROOT)
        for k, (arch, _, _) in WORK.items():
            use[k].append(callers.LitServeCaller(p.port, arch))
        use["pooled"][-1].wait_ready()
    if "kserve" in which:
        say("starting the KServe model server")
        pb = callers.load_v2_protos(a.kserve_python)
        procs["kserve"] = p = Proc("kserve", [
            a.kserve_python, "-m", "bench.peers.kserve_server", *spec, "--threads",
            str(a.threads)], r"PORT (\d+)", cwd=ROOT)
        for k, (arch, _, _) in WORK.items():
            use[k].append(callers.KServeCaller(p.address, arch, pb))
        use["pooled"][-1].wait_ready()
    return procs, use


class Focus:
    """Runs one server at a time: `on(name)` resumes that server and pauses the one
    that ran before; `on(None)` (the in-process floor) pauses them all; `off()` resumes
    every server. A no-op when `enabled` is false."""

    def __init__(self, procs: dict[str, Proc], enabled: bool) -> None:
        self.procs, self.enabled = procs, enabled
        self.running = set(procs)

    def on(self, name: str | None) -> None:
        if not self.enabled:
            return
        for other in self.running - {name}:
            self.procs[other].pause()
        if name in self.procs and name not in self.running:
            self.procs[name].resume()
        self.running = {name} & set(self.procs)

    def off(self) -> None:
        for name in set(self.procs) - self.running:
            self.procs[name].resume()
        self.running = set(self.procs)


def latencies(targets: list, data: list[bytes], focus: Focus) -> dict[str, list[float]]:
    """One image at a time, each image to every target in turn."""
    conns = [(t.name, *t.connect()) for t in targets]
    lat: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for i, b in enumerate(data):
            for name, extract, _ in conns[i % len(conns):] + conns[:i % len(conns)]:
                focus.on(name)
                t0 = time.perf_counter()
                extract(b)
                lat[name].append(time.perf_counter() - t0)
    finally:
        focus.off()
        for _, _, close in conns:
            close()
    return lat


def throughput(target, data: list[bytes], clients: int) -> float:
    """img/s of `clients` threads, each with its own connection, one image per call."""
    parts = [data[i::clients] for i in range(clients)]
    conns = [target.connect() for _ in range(clients)]
    for extract, _ in conns:
        extract(data[0])  # connect, warm

    def run(i: int) -> None:
        extract = conns[i][0]
        for b in parts[i]:
            extract(b)

    try:
        with ThreadPoolExecutor(clients) as pool:
            t0 = time.perf_counter()
            list(pool.map(run, range(clients)))
            return len(data) / (time.perf_counter() - t0)
    finally:
        for _, close in conns:
            close()


def cpu_seconds(proc: Proc | None) -> float:
    """CPU time (user + system) of every process in `proc`'s session: the server and
    any workers it forked (Proc starts each server in a session of its own); with no
    proc, this process (the bench's client threads)."""
    if proc is None:
        t = os.times()
        return t.user + t.system
    stats = (stat_cpu(p) for p in Path("/proc").glob("[0-9]*/stat"))
    return sum(cpu for cpu, session in filter(None, stats) if session == proc.p.pid)


def floor_batched(hooked: Hooked, data: list[bytes], batch: int) -> float:
    """The in-process floor for many clients: decode `batch` images, one forward."""
    t0 = time.perf_counter()
    for i in range(0, len(data), batch):
        hooked.extract(data[i:i + batch])
    return len(data) / (time.perf_counter() - t0)


def main() -> int:
    a = parse_args()
    which = {w.strip() for w in a.only.split(",") if w.strip()}
    res = new_results(a, {"work": WORK})
    R = res["rows"]
    say = clock()
    floors = {k: Hooked(*w, threads=a.threads) for k, w in WORK.items()}
    import torch

    res["machine"].update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    img = images(max(a.latency_images, a.tput_images, a.big_images), 224)
    procs: dict[str, Proc] = {}
    try:
        procs, use = start(a, which, say)
        pooled = [callers.FloorCaller(floors["pooled"]), *use["pooled"]]
        big = [callers.FloorCaller(floors["big"]), *use["big"]]
        say("same answer check (image 0) and warm-up")
        R["check"] = {"pooled": report.same_answers(pooled, img[0]),
                      "big": report.same_answers(big, img[0])}
        focus = Focus(procs, not a.no_pause)
        latencies(pooled, img[:3], focus)
        say(f"latency: {a.latency_images} images, one at a time, targets interleaved")
        lat = latencies(pooled, img[:a.latency_images], focus)
        R["latency"] = {k: {"p50_ms": pct(v, 50) * 1e3, "p99_ms": pct(v, 99) * 1e3,
                            "mean_ms": sum(v) / len(v) * 1e3} for k, v in lat.items()}
        acc: dict[str, dict[str, list[float]]] = {"tput1": {}, "tput8": {}}
        cpu_ms: dict[str, dict[str, float]] = {}  # CPU ms per image at 8 clients
        for r in range(a.rounds):
            part = img[:a.tput_images]
            for t in pooled:
                focus.on(t.name)
                acc["tput1"].setdefault(t.name, []).append(throughput(t, part, 1))
                server = procs.get(t.name)
                c0, s0 = cpu_seconds(None), cpu_seconds(server)
                acc["tput8"].setdefault(t.name, []).append(
                    floor_batched(floors["pooled"], part, a.batch)
                    if isinstance(t, callers.FloorCaller) else throughput(t, part, 8))
                c1, s1 = cpu_seconds(None), cpu_seconds(server)
                cpu = cpu_ms.setdefault(t.name, {"server": 0.0, "client": 0.0, "n": 0})
                cpu["server"] += (s1 - s0) * 1e3 if server else 0.0
                cpu["client"] += (c1 - c0) * 1e3
                cpu["n"] += len(part)
            focus.off()
            say(f"  round {r + 1}: " + report.brief(acc))
        for k, v in acc.items():
            R[k] = {name: len(xs) / sum(1 / x for x in xs) for name, xs in v.items()}
        R["cpu_ms_per_image_tput8"] = {
            name: {"server": c["server"] / c["n"], "client": c["client"] / c["n"]}
            for name, c in cpu_ms.items()}
        say(f"big map: vgg16 features.0, {a.big_images} images, {a.big_clients} clients")
        mb = floors["big"].extract(img[:1]).nbytes / 1e6
        mb_s = {}
        for t in big:
            focus.on(t.name)
            mb_s[t.name] = mb * throughput(
                t, img[:a.big_images], 1 if isinstance(t, callers.FloorCaller) else a.big_clients)
        focus.off()
        R["bigmap"] = {"image_mb": mb, "mb_s": mb_s}
    finally:
        for p in procs.values():
            p.stop()
    res["seconds"] = time.perf_counter() - say.t0
    res["compile_wait_s"] = getattr(a, "compile_seconds", None)
    print()
    print(report.table(R, a))
    print("\nCPU ms per image at 8 clients (server process tree; bench process, i.e. the "
          "clients, or the whole in-process floor):")
    for name, c in R["cpu_ms_per_image_tput8"].items():
        print(f"  {name:<12} server {c['server']:7.1f}   client {c['client']:7.1f}   "
              f"total {c['server'] + c['client']:7.1f}")
    out = write_results(res, a.out, "-peers", latest="peers-latest.json")
    print(f"\nwrote {out} ({res['seconds']:.0f} s, load {res['machine']['loadavg_start']} "
          f"-> {res['machine']['loadavg_end']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
