"""One-image Extract latency alone and while an Integrated Gradients stream runs, side
by side in one run, for one or more --attribution-pass-cost values.

    python bench/attribution_fairness.py                        # pass costs 3, 8, 16, 32
    python bench/attribution_fairness.py --pass-costs 8 --extracts 100 --ig-images 12

Per pass cost, one hookserve server (a subprocess, as in bench/run.py) serves
resnet18. Each round runs three phases back to back:

  alone   `--extracts` one-image Extract calls (Client.extract, i.e. ExtractImage: a
          256 px JPEG, default preprocessing, layer4 avg-pooled), one at a time;
  ig      one client streams Integrated Gradients (`--steps`) over `--ig-images` of the
          same JPEGs (224 px model input), two images in flight: IG img/s alone;
  beside  the same IG stream again, and Extract calls one at a time from the moment
          its first map arrives until its last: Extract latency beside IG, and IG
          img/s beside the Extracts.

It reports Extract p50/p99/max per phase and IG images/s alone and beside, and writes
bench/results/<UTC time>-attribution-fairness.json (and
latest-attribution-fairness.json). Before Attribute batches ran in passes, an
Extract waited for a whole Attribute batch: up to `--max-batch-size` images x
(steps + 1) points.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path

from common import (  # bench/ siblings; common sets the OpenMP wait first
    HOOKSERVE_PORT_RE,
    Proc,
    clock,
    hookserve_argv,
    images,
    new_results,
    pct,
    write_results,
)

import hookserve

LAYER = {"layer4": {"reduction": "avg"}}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pass-costs", default="3,8,16,32",
                    help="comma-separated --attribution-pass-cost values, one server each")
    ap.add_argument("--extracts", type=int, default=40, help="Extract calls per phase")
    ap.add_argument("--steps", type=int, default=32, help="Integrated Gradients steps")
    ap.add_argument("--ig-images", type=int, default=6, help="images of each IG stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32, help="server --max-batch-size")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="server --max-batch-delay-ms")
    ap.add_argument("--threads", type=int, default=0, help="server --threads (0: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    return ap.parse_args()


def ig_stream(address: str, data: list[bytes], steps: int, first: threading.Event
              ) -> float:
    """Integrated Gradients over `data` on one stream, two images in flight: img/s.
    Sets `first` when the first map has arrived."""
    with hookserve.Client(address, timeout=3600) as c:
        t0 = time.perf_counter()
        for r in c.attribute_many(data, None, "integrated_gradients", steps=steps,
                                  max_in_flight=2):
            r.raise_for_error()
            first.set()
        return len(data) / (time.perf_counter() - t0)


def extract_latencies(address: str, data: list[bytes], n: int | None = None,
                      until: threading.Event | None = None) -> list[float]:
    """One-image Extract calls one at a time: `n` of them, or until `until` is set."""
    lat = []
    with hookserve.Client(address, timeout=600) as c:
        for b in itertools.cycle(data):
            if len(lat) == n or (until is not None and until.is_set()):
                return lat
            t0 = time.perf_counter()
            c.extract(b, LAYER, model="resnet18")
            lat.append(time.perf_counter() - t0)
    return lat


def beside(address: str, work: list[bytes], data: list[bytes], steps: int
           ) -> tuple[list[float], float]:
    """An IG stream over `work`, and Extract calls from its first map to its last:
    (Extract latencies, IG img/s)."""
    first, over = threading.Event(), threading.Event()
    rate: list[float] = []

    def stream() -> None:
        try:
            rate.append(ig_stream(address, work, steps, first))
        finally:
            first.set()
            over.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    first.wait()
    lat = extract_latencies(address, data, until=over)
    t.join()
    return lat, rate[0]


def one_server(a: argparse.Namespace, cost: int, data: list[bytes], say) -> dict:
    say(f"pass cost {cost}: starting hookserve")
    hs = Proc("hookserve", hookserve_argv(["resnet18"], a, "--attribution-pass-cost",
                                          str(cost)), HOOKSERVE_PORT_RE)
    lat: dict[str, list[float]] = {"alone": [], "beside": []}
    ig: dict[str, list[float]] = {"alone": [], "beside": []}
    work = data[:a.ig_images]
    try:
        extract_latencies(hs.address, data, 8)       # warm-up: both paths
        ig_stream(hs.address, data[:1], a.steps, threading.Event())
        for r in range(a.rounds):
            lat["alone"] += extract_latencies(hs.address, data, a.extracts)
            ig["alone"].append(ig_stream(hs.address, work, a.steps, threading.Event()))
            box = beside(hs.address, work, data, a.steps)
            lat["beside"] += box[0]
            ig["beside"].append(box[1])
            say(f"  round {r + 1}: Extract p50 {pct(lat['alone'], 50) * 1e3:.0f} ms alone, "
                f"{pct(lat['beside'], 50) * 1e3:.0f} ms beside IG; IG "
                f"{ig['alone'][-1]:.2f} img/s alone, {box[1]:.2f} beside")
    finally:
        hs.stop()
    row = {"pass_cost": cost, "extracts_alone": len(lat["alone"]),
           "extracts_beside": len(lat["beside"])}
    for k, v in lat.items():
        row[f"extract_{k}_p50_ms"] = pct(v, 50) * 1e3
        row[f"extract_{k}_p99_ms"] = pct(v, 99) * 1e3
        row[f"extract_{k}_max_ms"] = max(v) * 1e3
    for k, v in ig.items():
        row[f"ig_{k}_img_s"] = len(v) * len(work) / sum(len(work) / x for x in v)
    return row


def main() -> int:
    a = parse_args()
    say = clock()
    costs = [int(c) for c in a.pass_costs.split(",")]
    res = new_results(a, {})
    data = images(16, 256)
    rows = [one_server(a, c, data, say) for c in costs]
    res["rows"]["fairness"] = rows
    print(f"\nresnet18 {a.device} {a.dtype}, ExtractImage (layer4 avg, 224 px) one at a time; "
          f"IG {a.steps} steps, {a.ig_images} images a stream, 2 in flight")
    print(f"{'pass cost':>9} | {'Extract alone p50/p99 ms':>24} | "
          f"{'beside IG p50/p99/max ms':>24} | {'IG img/s beside/alone':>21}")
    for r in rows:
        print(f"{r['pass_cost']:>9} | "
              f"{r['extract_alone_p50_ms']:>11.0f} / {r['extract_alone_p99_ms']:<10.0f} | "
              f"{r['extract_beside_p50_ms']:>7.0f} / {r['extract_beside_p99_ms']:.0f} / "
              f"{r['extract_beside_max_ms']:<6.0f} | "
              f"{r['ig_beside_img_s']:>9.2f} / {r['ig_alone_img_s']:<9.2f}")
    path = write_results(res, a.out, "-attribution-fairness",
                         latest="latest-attribution-fairness.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
