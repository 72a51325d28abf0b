"""Single-image latency of hookserve variants side by side: one server per variant
(its own environment and flags), rounds of one image at a time alternating between
them, every other server paused (SIGSTOP) while one is measured. Prints each
variant's p25/p50/p75 after every round and at the end, and writes
bench/results/<time>-served-ab.json.

    .venv/bin/python -m bench.served_ab \\
        --variant default --variant 'spin1ms:GOMP_SPINCOUNT=100000' \\
        --variant 'bind:OMP_PROC_BIND=close,OMP_PLACES=cores'

A variant is NAME[:VAR=VALUE,...][:FLAG ...]: environment variables for its server,
then extra `hookserve serve` flags (space-separated). Two variants with the same
settings measure the method's own spread (an A/A run). Every server runs resnet50
with `--compile auto --memory-format channels_last --warm resnet50=layer4#1` unless
`--eager`; the rounds start once every compile is done.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import hookserve
from bench.common import (
    HOOKSERVE_PORT_RE,
    Proc,
    clock,
    hookserve_argv,
    images,
    new_results,
    pct,
    write_results,
)

COMPILED = ["--compile", "auto", "--memory-format", "channels_last",
            "--warm", "resnet50=layer4#1"]


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    """NAME[:VAR=VALUE,...][:FLAGS] -> (name, environment, flags)."""
    name, _, rest = text.partition(":")
    env_text, _, flags = rest.partition(":")
    if env_text.startswith("-"):   # NAME:FLAGS, no environment
        env_text, flags = "", rest
    env = dict(kv.split("=", 1) for kv in env_text.split(",") if "=" in kv)
    return name, env, flags.split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME[:VAR=VALUE,...][:FLAGS] (repeat; see the module doc)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=30, help="images per round")
    ap.add_argument("--eager", action="store_true", help="no compiled graphs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.device, a.dtype, a.batch, a.delay_ms = "cpu", "float32", 8, 5.0
    say = clock()
    res = new_results(a, {})
    variants = [parse_variant(v) for v in a.variant]
    procs: list[Proc] = []
    try:
        for name, env, flags in variants:
            say(f"starting {name}")
            p = Proc(name, hookserve_argv(["resnet50"], a, *([] if a.eager else COMPILED),
                                          *flags), HOOKSERVE_PORT_RE,
                     env={**os.environ, **env})
            if not a.eager:
                p.wait_lines(("compiled resnet50", "serving it eagerly"), 1)
            p.pause()
            procs.append(p)
        data = images(16, 224)
        layers = {"layer4": {"reduction": "avg"}}
        times: dict[str, list[float]] = {p.name: [] for p in procs}
        for r in range(a.rounds):
            order = procs if r % 2 == 0 else procs[::-1]
            for p in order:
                p.resume()
                with hookserve.Client(p.address, timeout=600) as c:
                    for k in range(3):   # warm the connection and the caches
                        c.extract(data[k], layers, model="resnet50")
                    for k in range(a.per_round):
                        t = time.perf_counter()
                        c.extract(data[k % len(data)], layers, model="resnet50")
                        times[p.name].append(time.perf_counter() - t)
                p.pause()
            say(f"round {r}: " + ", ".join(f"{n} p50 {pct(x, 50) * 1e3:.2f} ms"
                                           for n, x in times.items()))
    finally:
        for p in procs:
            p.stop()
    for n, x in times.items():
        res["rows"][n] = {q: pct(x, q) * 1e3 for q in (25, 50, 75)} | {"images": len(x)}
        print(f"{n}: p25 {pct(x, 25) * 1e3:.2f}  p50 {pct(x, 50) * 1e3:.2f}  "
              f"p75 {pct(x, 75) * 1e3:.2f} ms ({len(x)} images)")
    path = write_results(res, Path(a.out) if a.out else None, "-served-ab",
                         "served-ab-latest.json")
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
