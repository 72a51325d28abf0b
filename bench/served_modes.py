"""hookserve's execution modes served on one device: pooled img/s and one-image latency.

    python -m bench.served_modes --device cuda:0            # resnet50 on a GPU
    python -m bench.served_modes --arch resnet18 --batch 8 --images 64 --modes eager,cl

One `hookserve serve` per mode, started, measured and stopped one after the other
(resnet50 with seeded random weights; `--layer` avg-pooled, 224 px JPEGs, default
preprocessing). For each mode:

  tput      `--streams` SDK streams (`extract_many`) share `--images` images; the
            server batches up to `--batch`: img/s, the mean batch size and the forward
            time per image from the server's own metrics
  latency   one client, one image at a time (`extract`): p50/p99 in ms
  diff      the first image's pooled feature against the first mode's (max |diff| /
            max |first|)

Compiled modes compile their graphs at start-up (`--warm` at batch 1 and `--batch`)
and nothing else (`--compile-after` is set out of reach), so no compile runs while a
mode is measured; the mode is measured once those graphs are ready. Prints a table
and writes bench/results/<UTC time>-modes.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

import hookserve
from bench.common import (  # sets the OpenMP wait first
    HOOKSERVE_PORT_RE,
    Proc,
    hookserve_argv,
    images,
    new_results,
    pct,
    write_results,
)
from bench.served_batches import scrape, sums

#: --modes: name -> `hookserve serve` flags (compiled modes get their --warm entries)
MODES = {
    "eager": ["--memory-format", "contiguous"],
    "cl": ["--memory-format", "channels_last"],
    "compiled": ["--memory-format", "channels_last", "--compile", "auto"],
    "fp16": ["--precision", "fp16", "--memory-format", "contiguous"],
    "fp16-cl": ["--precision", "fp16", "--memory-format", "channels_last"],
    "compiled-fp16": ["--precision", "fp16", "--memory-format", "channels_last",
                      "--compile", "auto"],
    "bf16-cl": ["--precision", "bf16", "--memory-format", "channels_last"],
    "cast-fp16-cl": ["--dtype", "float16", "--memory-format", "channels_last"],
    "compiled-fp16-gpudecode": ["--precision", "fp16", "--memory-format", "channels_last",
                                "--compile", "auto", "--gpu-decode"],
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="the servers' --device")
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--layer", default="layer4")
    ap.add_argument("--modes", default="eager,cl,fp16-cl,compiled-fp16",
                    help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--batch", type=int, default=64, help="server --max-batch-size")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="server --max-batch-delay-ms")
    ap.add_argument("--threads", type=int, default=0, help="server --threads (0: default)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--images", type=int, default=2048, help="throughput images per round")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds (best kept)")
    ap.add_argument("--latency-images", type=int, default=100)
    ap.add_argument("--metrics-port", type=int, default=9477)
    ap.add_argument("--hookserve-arg", action="append", default=[],
                    help="extra `hookserve serve` flag for every mode (repeat)")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def server_argv(a: argparse.Namespace, mode: str) -> list[str]:
    flags = list(MODES[mode])
    if "--compile" in flags:
        for b in sorted({1, a.batch}):
            flags += ["--warm", f"{a.arch}={a.layer}#{b}"]
        flags += ["--compile-after", "1000000000"]
    ns = argparse.Namespace(device=a.device, dtype="float32", batch=a.batch,
                            delay_ms=a.delay_ms, threads=a.threads)
    return hookserve_argv([a.arch], ns, *flags, "--metrics-port", str(a.metrics_port),
                          *a.hookserve_arg)


def throughput(address: str, a: argparse.Namespace, data: list[bytes]) -> float:
    layers = {a.layer: {"reduction": "avg"}}
    errors: list[str] = []

    def stream(part: list[bytes]) -> None:
        with hookserve.Client(address, timeout=600) as c:
            for r in c.extract_many(part, layers, model=a.arch,
                                    max_in_flight=max(2 * a.batch // a.streams, 8)):
                if r.error is not None:
                    errors.append(str(r.error))

    parts = [data[i::a.streams] for i in range(a.streams)]
    threads = [threading.Thread(target=stream, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} images failed, the first: {errors[0]}")
    return len(data) / wall


def measure(a: argparse.Namespace, mode: str, data: list[bytes]) -> dict:
    argv = server_argv(a, mode)
    t0 = time.perf_counter()
    server = Proc(mode, argv, HOOKSERVE_PORT_RE)
    try:
        warm = argv.count("--warm")
        if warm:
            server.wait_lines((f"compiled {a.arch}", "serving it eagerly"), warm)
        ready_s = time.perf_counter() - t0
        layers = {a.layer: {"reduction": "avg"}}
        with hookserve.Client(server.address, timeout=600) as c:
            first = c.extract(data[0], layers, model=a.arch)[a.layer]
            info = c.describe(a.arch).model
            throughput(server.address, a, data[: 4 * a.batch])        # warm-up
            before = scrape(a.metrics_port)
            tput = max(throughput(server.address, a, data) for _ in range(a.rounds))
            after = scrape(a.metrics_port)
            lat = []
            for jpeg in data[: a.latency_images]:
                t = time.perf_counter()
                c.extract(jpeg, layers, model=a.arch)
                lat.append(1e3 * (time.perf_counter() - t))
    finally:
        server.stop()
    s0, s1 = sums(before, a.arch), sums(after, a.arch)
    fwd = s1["forward_seconds"][0] - s0["forward_seconds"][0]
    batches = (s1["forward_seconds"][1] - s0["forward_seconds"][1]) or 1
    size = s1["batch_size"][0] - s0["batch_size"][0]
    events = {}
    for line in after.splitlines():
        if line.startswith("hookserve_compile_events_total{"):
            name = line.split('event="', 1)[1].split('"', 1)[0]
            events[name] = float(line.rsplit(" ", 1)[1])
    return {"mode": mode, "flags": MODES[mode], "ready_s": ready_s,
            "device": info.device, "precision": getattr(info, "precision", ""),
            "img_s": tput, "mean_batch": size / batches,
            "forward_ms_per_image": 1e3 * fwd / max(size, 1),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "compile_events": events, "first": np.asarray(first, np.float32)}


def main() -> int:
    a = parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    res = new_results(a, {})
    data = images(a.images, 224)
    rows = []
    for mode in modes:
        print(f"-- {mode}: {' '.join(server_argv(a, mode)[1:])}", flush=True)
        try:
            r = measure(a, mode, data)
        except Exception as e:   # one mode's failure leaves the others measured
            print(f"   {mode} failed: {type(e).__name__}: {e}", flush=True)
            continue
        ref = rows[0]["first"] if rows else r["first"]
        r["rel_diff"] = float(np.abs(r["first"] - ref).max() / (np.abs(ref).max() or 1.0))
        rows.append(r)
        print(f"   ready {r['ready_s']:.1f} s; {r['img_s']:.1f} img/s, mean batch "
              f"{r['mean_batch']:.1f}, forward {r['forward_ms_per_image']:.3f} ms/img; "
              f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; diff {r['rel_diff']:.1e}; "
              f"compile {r['compile_events'] or '-'}", flush=True)
    print(f"\n{a.arch} {a.layer} avg, {a.device}, --max-batch-size {a.batch}, "
          f"{a.streams} streams x {a.images // a.streams} images, latency over "
          f"{a.latency_images} single images")
    print(f"{'mode':<26}{'img/s':>10}{'x first':>9}{'batch':>7}{'fwd ms/img':>12}"
          f"{'p50 ms':>9}{'p99 ms':>9}{'diff':>10}")
    for r in rows:
        print(f"{r['mode']:<26}{r['img_s']:>10.1f}{r['img_s'] / rows[0]['img_s']:>9.2f}"
              f"{r['mean_batch']:>7.1f}{r['forward_ms_per_image']:>12.3f}"
              f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['rel_diff']:>10.1e}")
    res["rows"] = {r["mode"]: {k: v for k, v in r.items() if k != "first"} for r in rows}
    out = write_results(res, a.out, "-modes")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
