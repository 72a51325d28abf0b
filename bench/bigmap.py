"""Row c: a big feature map (VGG features.0 float32, 12.8 MB per 224 px image)
streamed by hookserve, against the raw-bytes server moving the same bytes in the same
2 MiB messages, and the in-process compute rate of the model up to features.0."""

from __future__ import annotations

import time

from clients import raw_stream_mb_s
from common import Ctx

import hookserve


def run(ctx: Ctx) -> None:
    vgg, rounds = ctx.p["vgg"], ctx.rounds
    hs, raw = ctx.servers["hookserve"], ctx.servers["raw"]
    ctx.say(f"c: {vgg} features.0 float32 via hookserve | raw bytes | in-process compute")
    n = ctx.p["c_images"] // rounds
    with hookserve.Client(hs.address, timeout=600) as c:
        per_image = c.describe(vgg, 224).layer("features.0").bytes_per_image

        def stream(k: int) -> float:
            t0 = time.perf_counter()
            got = 0
            for r in c.extract_many(ctx.img224[:k], "features.0", model=vgg, native=True):
                got += r.raise_for_error()["features.0"].nbytes
            assert got == k * per_image
            return got / (time.perf_counter() - t0) / 1e6

        stream(4)
        acc = {"hookserve": 0.0, "raw": 0.0, "compute": 0.0}
        for _ in range(rounds):
            mb = n * per_image / 1e6
            acc["hookserve"] += mb / stream(n)
            acc["raw"] += mb / raw_stream_mb_s(raw.address, n, per_image, 2 << 20)
            # The compute alone: the model to features.0, in process, same batch as
            # the server forms (its per-stream window), bytes it produces.
            window = min(64, (256 << 20) // per_image)
            img_s = ctx.local.forward_throughput(vgg, "features.0", window,
                                                 max(1, n // window), pool=False)
            acc["compute"] += mb / (img_s * per_image / 1e6)
    total = n * rounds * per_image / 1e6
    c_row = {"mb_s": total / acc["hookserve"], "raw_mb_s": total / acc["raw"],
             "compute_mb_s": total / acc["compute"], "image_mb": per_image / 1e6,
             "images": n * rounds, "model": vgg}
    c_row["c_over_raw"] = c_row["mb_s"] / c_row["raw_mb_s"]
    # Compute and transport share the same cores here: the best a pipeline can do on
    # them is about the harmonic combination of the two rates.
    c_row["bound_mb_s"] = 1 / (1 / c_row["raw_mb_s"] + 1 / c_row["compute_mb_s"])
    ctx.R["c"] = c_row
