"""Rows a, b, g: pooled layer4 throughput, alternating in rounds.

a: the in-process forward at the server's batch size (the limit); b: hookserve via the
SDK, 8 concurrent streams; g: the naive hook server, 8 concurrent clients.
"""

from __future__ import annotations

from clients import naive_throughput, streams_throughput
from common import POOLED, STREAMS, Ctx


def run(ctx: Ctx, rows: set[str]) -> None:
    a, p, R, arch = ctx.a, ctx.p, ctx.R, ctx.p["arch"]
    hs, naive = ctx.servers["hookserve"], ctx.servers.get("naive")
    rounds = ctx.rounds
    ctx.say(f"a/b/g: {arch} layer4 avg: in-process batch {a.batch} | hookserve "
            f"{STREAMS} streams | naive server {STREAMS} clients; {rounds} rounds")
    b_part = ctx.img256[:p["b_images"] // rounds]
    g_part = ctx.img256[:p["g_images"] // rounds]
    acc = {k: [0, 0.0] for k in "abg"}
    if "b" in rows:
        streams_throughput(hs.address, arch, POOLED, ctx.img256[:STREAMS * 2], STREAMS)
    for r in range(rounds):
        if rows & set("ab"):
            n = a.batch * max(1, p["a_batches"] // rounds)
            acc["a"][0] += n
            acc["a"][1] += n / ctx.local.forward_throughput(
                arch, "layer4", a.batch, max(1, p["a_batches"] // rounds))
        if "b" in rows:
            acc["b"][0] += len(b_part)
            acc["b"][1] += len(b_part) / streams_throughput(
                hs.address, arch, POOLED, b_part, STREAMS)
        if "g" in rows:
            acc["g"][0] += len(g_part)
            acc["g"][1] += len(g_part) / naive_throughput(naive.address, g_part, STREAMS)
        ctx.say(f"  round {r + 1}: " + ", ".join(
            f"{k} {n / t:.1f} img/s" for k, (n, t) in acc.items() if n))
    thr = {k: n / t for k, (n, t) in acc.items() if n}
    if "a" in thr:
        R["a"] = {"img_s": thr["a"], "model": arch, "batch": a.batch, "images": acc["a"][0]}
    if "b" in thr:
        R["b"] = {"img_s": thr["b"], "b_over_a": thr["b"] / thr["a"] if "a" in thr else None,
                  "streams": STREAMS, "images": acc["b"][0]}
    if "g" in thr:
        R["g"] = {"img_s": thr["g"], "images": acc["g"][0],
                  "b_over_g": thr["b"] / thr["g"] if "b" in thr else None}
