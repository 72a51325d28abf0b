"""Rows e and f (resnet18, 224 px JPEGs, one image per call).

e: one image at a time, through hookserve (`Client.extract`) and in process (decode +
normalise + forward + pool), alternating per image: p50/p99 and the ms added.
f: 8 concurrent single-image clients against 1: the throughput ratio.
"""

from __future__ import annotations

from clients import single_image_clients
from common import POOLED, Ctx, pct


def run_e(ctx: Ctx) -> None:
    ctx.say("e: resnet18 latency, one image at a time, service and in-process alternating")
    data = ctx.img224[:ctx.p["e_images"]]
    local, srv = ctx.local.latencies("resnet18", "layer4", data,
                                     ctx.servers["hookserve"].address, POOLED)
    e = {"inproc_p50_ms": pct(local, 50) * 1e3, "inproc_p99_ms": pct(local, 99) * 1e3,
         "service_p50_ms": pct(srv, 50) * 1e3, "service_p99_ms": pct(srv, 99) * 1e3,
         "images": len(data)}
    e["added_p50_ms"] = e["service_p50_ms"] - e["inproc_p50_ms"]
    e["added_p99_ms"] = e["service_p99_ms"] - e["inproc_p99_ms"]
    ctx.R["e"] = e


def run_f(ctx: Ctx) -> None:
    ctx.say("f: 8 concurrent single-image clients vs 1 (resnet18)")
    address = ctx.servers["hookserve"].address
    data = ctx.img224[:ctx.p["f_images"]]
    single_image_clients(address, "resnet18", POOLED, data[:16], 8, native=True)
    one, _ = single_image_clients(address, "resnet18", POOLED, data, 1, native=True)
    eight, _ = single_image_clients(address, "resnet18", POOLED, data, 8, native=True)
    ctx.R["f"] = {"one_img_s": one, "eight_img_s": eight, "ratio": eight / one,
                  "images": len(data)}
