"""Many clients against one hookserve server, and what its batches did.

    .venv/bin/python -m bench.served_batches --mode compiled
    .venv/bin/python -m bench.served_batches --mode compiled --images 240 --clients 8 \
        --hookserve-arg=--preprocess-workers --hookserve-arg=1

One server started as `bench.peers.run` starts the server of the same `--mode` (its
models, flags and start-up compiles; resnet50 `layer4` avg is asked for, 224 px
JPEGs, `--max-batch-size 8`, 2 threads, on 127.0.0.1); `--clients` threads each send
one image at a time with the SDK. Prints the
images per second and, from the server's own metrics over the run: the batches and
their sizes, forward milliseconds per batch and per image, preprocessing per image,
the queue wait, the compiled-graph events, and the server's CPU time per image: its
two busiest threads (the model's thread and its OpenMP worker) and all the others
(gRPC, preprocessing, compiles). This is the view behind the 8-client
column of `bench.peers.run`: where a served forward pass spends its time when
batches form under load (for example a batch of 5 padded to 8, or run as 4 + 1).
"""

from __future__ import annotations

import argparse
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from bench.common import (  # sets the OpenMP wait first
    HOOKSERVE_PORT_RE,
    Proc,
    hookserve_argv,
    images,
    stat_cpu,
)
from bench.peers.callers import HookserveCaller
from bench.peers.run import MODES, WORK

HISTOGRAMS = ("forward_seconds", "preprocess_seconds", "batch_size", "queue_wait_seconds")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        return r.read().decode()


def series(text: str, name: str, model: str) -> list[tuple[str, float]]:
    """(labels, value) of each `name` sample that is `model`'s or has no model label."""
    out = []
    for labels, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        if "model=" not in labels or f'model="{model}"' in labels:
            out.append((labels, float(value)))
    return out


def sums(text: str, model: str) -> dict[str, tuple[float, float]]:
    """Each histogram's (sum, count) for `model`."""
    return {name: (sum(v for _, v in series(text, f"hookserve_{name}_sum", model)),
                   sum(v for _, v in series(text, f"hookserve_{name}_count", model)))
            for name in HISTOGRAMS}


def sizes(text: str, model: str) -> dict[str, float]:
    """The batch-size histogram's cumulative buckets for `model`."""
    out: dict[str, float] = {}
    for labels, v in series(text, "hookserve_batch_size_bucket", model):
        le = re.search(r'le="([^"]+)"', labels).group(1)
        out[le] = out.get(le, 0.0) + v
    return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process `pid` so far (/proc, Linux)."""
    stats = {int(t): stat_cpu(f"/proc/{pid}/task/{t}/stat")
             for t in os.listdir(f"/proc/{pid}/task")}
    return {t: st[0] for t, st in stats.items() if st is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="compiled")
    ap.add_argument("--images", type=int, default=240)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--metrics-port", type=int, default=9466)
    ap.add_argument("--hookserve-arg", action="append", default=[],
                    help="extra `hookserve serve` flag (repeat)")
    a = ap.parse_args()
    ns = argparse.Namespace(device="cpu", dtype="float32", batch=8, delay_ms=5.0, threads=2)
    argv = hookserve_argv([w[0] for w in WORK.values()], ns, *MODES[a.mode],
                          "--metrics-port", str(a.metrics_port), *a.hookserve_arg)
    server = Proc(a.mode, argv, HOOKSERVE_PORT_RE)
    try:
        if "--warm" in argv:   # measured once the start-up compiles are done
            server.wait_lines(("compiled resnet50", "compiled vgg16", "serving it eagerly"),
                              argv.count("--warm"))
        data = images(a.images, 224)
        caller = HookserveCaller(server.address, "resnet50", "layer4", "avg")
        conns = [caller.connect() for _ in range(a.clients)]
        for extract, _ in conns:
            extract(data[0])
        parts = [data[i::a.clients] for i in range(a.clients)]
        before, cpu0 = scrape(a.metrics_port), thread_cpu(server.p.pid)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(lambda i: [conns[i][0](b) for b in parts[i]], range(a.clients)))
        wall = time.perf_counter() - t0
        after, cpu1 = scrape(a.metrics_port), thread_cpu(server.p.pid)
        for _, close in conns:
            close()
    finally:
        server.stop()
    s0, s1 = sums(before, "resnet50"), sums(after, "resnet50")
    d = {k: (s1[k][0] - s0[k][0], s1[k][1] - s0[k][1]) for k in HISTOGRAMS}
    batches = d["forward_seconds"][1] or 1
    h0, h1 = sizes(before, "resnet50"), sizes(after, "resnet50")
    print(f"{a.mode}, {a.clients} clients, {a.images} images: {a.images / wall:.1f} img/s")
    print(f"  batches {batches:.0f}, mean size {d['batch_size'][0] / batches:.2f}; "
          "cumulative sizes " + ", ".join(f"<={k}: {h1[k] - h0.get(k, 0):.0f}"
                                        for k in ("1.0", "2.0", "4.0", "8.0") if k in h1))
    print(f"  forward {1e3 * d['forward_seconds'][0] / batches:.1f} ms a batch, "
          f"{1e3 * d['forward_seconds'][0] / a.images:.1f} ms an image; "
          f"busy {d['forward_seconds'][0] / wall:.2f} of the wall time")
    pre, wait = d["preprocess_seconds"], d["queue_wait_seconds"]
    print(f"  preprocess {1e3 * pre[0] / max(pre[1], 1):.2f} ms an image; "
          f"queue wait {1e3 * wait[0] / max(wait[1], 1):.1f} ms")
    used = sorted((cpu1[t] - cpu0.get(t, 0.0) for t in cpu1), reverse=True)
    print(f"  server CPU {1e3 * sum(used) / a.images:.1f} ms an image: the two busiest "
          f"threads {1e3 * used[0] / a.images:.1f} and "
          f"{1e3 * (used[1] if len(used) > 1 else 0) / a.images:.1f}, "
          f"the other {max(len(used) - 2, 0)} {1e3 * sum(used[2:]) / a.images:.1f}")
    events = re.findall(r'hookserve_compile_events_total{event="(\w+)"} (\S+)', after)
    print("  compiled-graph events: " + (", ".join(f"{k} {float(v):.0f}" for k, v in events)
                                        or "none (--compile off)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
