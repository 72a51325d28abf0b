"""Where one image's time goes through hookserve: a per-stage split, and a check that
the server's own stage metrics add up to what the client sees.

    .venv/bin/python -m bench.stages                  # resnet50 layer4 avg, 40 images
    .venv/bin/python -m bench.stages --model resnet18 --images 60
    .venv/bin/python -m bench.stages --model resnet18 --layer conv1 --side 32 --native
                                      # (almost no compute: the service's own overhead)

One client sends one 224 px JPEG at a time (`Client.extract`, i.e. the ExtractImage
RPC; `--rpc stream`: a one-image Extract stream; default preprocessing, layer4 avg)
to hookserve started under bench/trace_server.py (probes on the server's
own functions, one JSON line per call), alternating with the same work in process
(decode + hooked forward, bench/peers/hooked.py) so both see the same machine
(`--no-floor`: hookserve alone, each image following the last one's answer rather
than the in-process forward pass, which leaves the caches cold). Prints the median of
each stage, the decode and forward stages in parts (with a compiled graph: the graph
alone, and what the server does around it), the server's Prometheus stage histograms (sum/count
over the run) against the client's mean, and writes bench/results/stages-*.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

import hookserve
from bench.common import (
    BENCH,
    HOOKSERVE_PORT_RE,
    Proc,
    clock,
    hookserve_argv,
    images,
    new_results,
    write_results,
)
from bench.peers.hooked import Hooked  # the same work, in process

#: (label, from probe, to probe); "client_send"/"client_done" are the client's clock.
STAGES = [
    ("client SDK + gRPC in (to the handler)", "client_send", "call_start"),
    ("handler: spec and image parsed", "call_start", "request_parsed"),
    ("plan, reserve, admit, submit", "request_parsed", "submit"),
    ("hop to the preprocess pool", "submit", "prepare_start"),
    ("decode + resize + crop", "prepare_start", "prepare_end"),
    ("queue: to the device thread", "prepare_end", "batch_taken"),
    ("device thread: batch checks", "batch_taken", "forward_start"),
    ("forward (stack, normalise, hooks, reduce)", "forward_start", "forward_end"),
    ("hand out the answer", "forward_end", "completer"),
    ("back to the handler thread", "completer", "result_seen"),
    ("encode tensor message", "result_seen", "encoded"),
    ("messages to gRPC (stream: + status)", "encoded", "answer_out"),
    ("gRPC out + SDK decode (to the client)", "answer_out", "client_done"),
]
#: Two stages in parts (not summed again): the decode stage's, and the forward's when
#: a compiled graph answers (an eager forward has no graph probes: those rows are nan).
SUBSTAGES = [
    ("decode + resize + crop: decode", "dec_start", "dec_end"),
    ("decode + resize + crop: resize + crop", "geo_start", "geo_end"),
    ("forward: stack and normalise", "forward_start", "stacked"),
    ("forward: plan, graph lookup, input layout", "stacked", "graph_start"),
    ("forward: the compiled graph", "graph_start", "graph_end"),
    ("forward: reduce, rows, metric", "graph_end", "forward_end"),
]
METRICS = ["hookserve_preprocess_seconds", "hookserve_queue_wait_seconds",
           "hookserve_forward_seconds", "hookserve_serialize_seconds"]


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each stage histogram on the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out: dict[str, list[float]] = {m: [0.0, 0.0] for m in METRICS}
    for line in text.decode().splitlines():
        m = re.match(r"(\w+)_(sum|count)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)][0 if m.group(2) == "sum" else 1] += float(m.group(3))
    return {k: (s, c) for k, (s, c) in out.items()}


def first(events: list, name: str, after: float = 0.0) -> float | None:
    return next((t for n, t in events if n == name and t >= after), None)


def split(calls: list[list], client: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Per stage, the ms each image spent in it (images with every probe only)."""
    per: dict[str, list[float]] = {label: [] for label, _, _ in STAGES + SUBSTAGES}
    for events, (t_send, t_done) in zip(calls, client, strict=True):
        ev = [("client_send", t_send), *events, ("client_done", t_done)]
        t_img = [t for n, t in ev if n == "request_parsed"]
        times = {"client_send": t_send, "client_done": t_done, "call_start": ev[1][1],
                 "request_parsed": t_img[-1] if t_img else None}
        for label, a, b in STAGES:
            ta = times.get(a) or first(ev, a)
            tb = times.get(b) or first(ev, b, ta or 0.0)
            if ta is not None and tb is not None:
                per[label].append((tb - ta) * 1e3)
                times[b] = tb
        for label, a, b in SUBSTAGES:
            ta, tb = first(ev, a), first(ev, b)
            if ta is not None and tb is not None and tb >= ta:
                per[label].append((tb - ta) * 1e3)
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--layer", default="layer4")
    ap.add_argument("--side", type=int, default=224, help="JPEG side, px")
    ap.add_argument("--native", action="store_true",
                    help="no resize/crop (the in-process side still resizes and crops)")
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--rpc", choices=["image", "stream"], default="image",
                    help="ExtractImage (Client.extract) or a one-image Extract stream")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--no-floor", action="store_true",
                    help="do not run the in-process column: each image then follows the "
                         "last one's answer, not another forward pass over the cores' caches")
    ap.add_argument("--hookserve-arg", action="append", default=[],
                    help="extra `hookserve serve` flag (repeat)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.device, a.dtype = "cpu", "float32"
    res = new_results(a, {})
    say = clock()
    data = images(a.images + 3, a.side)
    floor = Hooked(a.model, a.layer, "avg", a.threads)
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    argv = hookserve_argv([a.model], a, "--metrics-port", "0", *a.hookserve_arg)
    argv = [sys.executable, str(BENCH / "trace_server.py"), str(trace), *argv[1:]]
    say("starting hookserve under bench/trace_server.py")
    srv = Proc("hookserve", argv, HOOKSERVE_PORT_RE)
    client: list[tuple[float, float]] = []
    local: list[float] = []
    try:
        mport = int(next(re.search(r"metrics on http://\S+:(\d+)", ln).group(1)
                         for ln in srv.lines if "metrics on" in ln))
        layers = {a.layer: {"reduction": "avg"}}
        opts = {"native": True} if a.native else {}
        with hookserve.Client(srv.address, timeout=600) as c:
            def extract(b: bytes) -> None:
                if a.rpc == "image":
                    c.extract(b, layers, model=a.model, **opts)
                else:
                    list(c.extract_many([b], layers, model=a.model, **opts))

            for b in data[:3]:  # warm-up
                extract(b)
                floor.extract([b])
            before = scrape(mport)
            say(f"{a.images} images, one at a time"
                + ("" if a.no_floor else ", alternating with in-process"))
            for b in data[3:]:
                if not a.no_floor:
                    t0 = time.perf_counter()
                    floor.extract([b])
                    local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                extract(b)
                client.append((t0, time.perf_counter()))
            after = scrape(mport)
    finally:
        srv.stop()
    calls = [json.loads(line) for line in trace.read_text().splitlines()][-len(client):]
    per = split(calls, client)
    lat = [(d - s) * 1e3 for s, d in client]
    R = res["rows"]
    R["client_ms"] = {"median": median(lat), "mean": sum(lat) / len(lat)}
    R["inproc_ms"] = ({"median": median(local) * 1e3, "mean": sum(local) / len(local) * 1e3}
                      if local else None)
    R["stages_median_ms"] = {k: median(v) if v else None for k, v in per.items()}
    R["stages_mean_ms"] = {k: sum(v) / len(v) if v else None for k, v in per.items()}
    n = after["hookserve_forward_seconds"][1] - before["hookserve_forward_seconds"][1]
    R["metrics_mean_ms"] = {k: (after[k][0] - before[k][0]) / max(1.0, after[k][1] - before[k][1])
                            * 1e3 for k in METRICS}
    R["metrics_images"] = n
    print()
    print(table(R))
    res["seconds"] = time.perf_counter() - say.t0
    out = write_results(res, a.out, "-stages", latest="stages-latest.json")
    print(f"\nwrote {out}")
    return 0


def table(R: dict) -> str:
    lines = [f"{'stage (one image, ms)':<46}{'median':>9}{'mean':>9}"]
    total = 0.0
    for label, _, _ in STAGES:
        med, mean = R["stages_median_ms"][label], R["stages_mean_ms"][label]
        total += mean or 0.0
        lines.append(f"{label:<46}{med if med is not None else float('nan'):>9.2f}"
                     f"{mean if mean is not None else float('nan'):>9.2f}")
    lines.append(f"{'sum of stages':<46}{'':>9}{total:>9.2f}")
    subs = [(label, R["stages_median_ms"].get(label), R["stages_mean_ms"].get(label))
            for label, _, _ in SUBSTAGES]
    if any(med is not None for _, med, _ in subs):
        lines.append("in parts:")
        for label, med, mean in subs:
            lines.append(f"{label:<46}{med if med is not None else float('nan'):>9.2f}"
                         f"{mean if mean is not None else float('nan'):>9.2f}")
    c, p = R["client_ms"], R["inproc_ms"]
    lines.append(f"{'client latency':<46}{c['median']:>9.2f}{c['mean']:>9.2f}")
    if p is not None:   # (--no-floor: no in-process column)
        lines.append(f"{'in process (decode + hooked forward)':<46}{p['median']:>9.2f}"
                     f"{p['mean']:>9.2f}")
        lines.append(f"{'added by the service':<46}{c['median'] - p['median']:>9.2f}"
                     f"{c['mean'] - p['mean']:>9.2f}")
    lines.append("")
    lines.append(f"server metrics, mean per observation over {R['metrics_images']:.0f} "
                 "forward passes (ms):")
    m = R["metrics_mean_ms"]
    for k in METRICS:
        lines.append(f"  {k:<44}{m[k]:>9.2f}")
    s = sum(m.values())
    lines.append(f"  {'sum (the rest is hops, gRPC and the SDK)':<44}{s:>9.2f}"
                 f"   client mean {c['mean']:.2f}, unaccounted {c['mean'] - s:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
