"""hookserve benchmark: the service against the limit, side by side, in one run.

    python bench/run.py            # the full table (make bench)
    python bench/run.py --quick    # smaller models and fewer images (make bench-quick)

Every row is measured in this one process tree, one after the other, so the ratios
are fair on a noisy machine. Servers (hookserve, the raw-bytes gRPC server, the naive
hook server) run as *subprocesses*: client load and server work never share a GIL.
hookserve is started as ``hookserve serve --port 0`` and its port is read from its
"hookserve listening on HOST:PORT" log line. In-process rows (the limits) run in this
process while every server is idle.

Rows (see docs/performance.md), one file each:
  a  in-process torchvision forward at the server's batch size (the limit), img/s
  b  hookserve via the SDK, 8 concurrent streams, layer4 avg-pooled: img/s, b/a
  c  VGG features.0 float32 (12.8 MB/image) streamed vs raw gRPC bytes: MB/s, c/raw
  d  layer1-only request time / full-forward request time
  e  one image at a time, resnet18 224 px: p50/p99, service vs in-process, ms added
  f  8 concurrent single-image clients vs 1: throughput ratio
  g  naive hook server (one image per forward, 8 concurrent clients): b/g

a, b, g: throughput.py; c: bigmap.py; d: skip.py; e, f: latency.py; shared helpers:
common.py, clients.py, local.py. The peers comparison is bench/peers/run.py.

Prints a table and writes bench/results/<UTC time>.json (and latest.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import bigmap
import latency
import skip
import throughput
from common import (
    BENCH,
    HOOKSERVE_PORT_RE,
    STREAMS,
    Ctx,
    Proc,
    clock,
    hookserve_argv,
    new_results,
    write_results,
)
from local import Local


def plan(quick: bool) -> dict:
    if quick:
        return dict(arch="resnet18", vgg="vgg11", a_batches=3, b_images=96, c_images=16,
                    d_images=32, e_images=20, f_images=32, g_images=32)
    return dict(arch="resnet50", vgg="vgg16", a_batches=4, b_images=192, c_images=48,
                d_images=64, e_images=60, f_images=64, g_images=48)


def parse_args() -> argparse.Namespace:
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
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    p = plan(a.quick)
    rows = set(a.only)
    arch, vgg = p["arch"], p["vgg"]
    res = new_results(a, p)
    res["quick"] = a.quick
    say = clock()
    local = Local(a)
    res["machine"]["torch_threads"] = local.torch.get_num_threads()
    res["machine"]["torch"] = local.torch.__version__

    # Every server starts first and idles while it is not measured, so rows that are
    # compared can alternate round by round: noise from other load hits both sides.
    models = list(dict.fromkeys([arch, vgg, "resnet18"]))
    say(f"starting hookserve ({', '.join(models)}), raw and naive servers")
    servers: dict[str, Proc] = {}
    try:
        servers["hookserve"] = Proc("hookserve", hookserve_argv(models, a), HOOKSERVE_PORT_RE)
        if "c" in rows:
            servers["raw"] = Proc("raw", [sys.executable, str(BENCH / "raw_server.py")],
                                  r"PORT (\d+)")
        if "g" in rows:
            argv = [sys.executable, str(BENCH / "naive_server.py"), "--model", arch,
                    "--layer", "layer4", "--device", local.device.type]
            if a.threads:
                argv += ["--threads", str(a.threads)]
            servers["naive"] = Proc("naive", argv, r"PORT (\d+)")
        ctx = Ctx(a, p, local, servers, say, res["rows"])
        if rows & set("abg"):
            throughput.run(ctx, rows)
        if "c" in rows:
            bigmap.run(ctx)
        if "d" in rows:
            skip.run(ctx)
        if "e" in rows:
            latency.run_e(ctx)
        if "f" in rows:
            latency.run_f(ctx)
    finally:
        for proc in servers.values():
            proc.stop()

    res["seconds"] = time.perf_counter() - say.t0
    print()
    print(table(res["rows"], arch, vgg))
    out = write_results(res, a.out, "-quick" if a.quick else "")
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
