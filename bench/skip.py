"""Row d: compute skipping. One stream of images asking for `layer1` (avg) against
the same images asking for `fc` (the full forward): total time ratio."""

from __future__ import annotations

import time

from common import Ctx

import hookserve


def run(ctx: Ctx) -> None:
    arch, n = ctx.p["arch"], ctx.p["d_images"]
    ctx.say(f"d: {arch} layer1-only vs full forward")
    with hookserve.Client(ctx.servers["hookserve"].address, timeout=600) as c:
        def timed(layers) -> float:
            t0 = time.perf_counter()
            for r in c.extract_many(ctx.img256[:n], layers, model=arch):
                r.raise_for_error()
            return time.perf_counter() - t0

        timed({"layer1": {"reduction": "avg"}})  # warm-up (batch shapes)
        t_l1 = t_full = 0.0
        for _ in range(ctx.rounds):
            t_l1 += timed({"layer1": {"reduction": "avg"}})
            t_full += timed(["fc"])
    ctx.R["d"] = {"layer1_s": t_l1, "full_s": t_full, "ratio": t_l1 / t_full,
                  "images": n * ctx.rounds, "model": arch}
