"""The peers table: figures side by side, with ratios to hookserve and the floor."""

from __future__ import annotations

import argparse

import numpy as np


def same_answers(targets: list, jpeg: bytes) -> dict:
    """Each target's answer for one image against the first target's (the floor):
    max |difference| / max |floor value| (0 means the same numbers)."""
    outs = {}
    for t in targets:
        extract, close = t.connect()
        try:
            outs[t.name] = np.asarray(extract(jpeg), np.float32).ravel()
        finally:
            close()
    ref = outs[targets[0].name]
    scale = float(np.abs(ref).max()) or 1.0
    return {k: (float(np.abs(v - ref).max()) / scale if v.shape == ref.shape
                else f"shape {v.shape} vs {ref.shape}") for k, v in outs.items()}


def brief(acc: dict) -> str:
    return "; ".join(f"{k} " + ", ".join(f"{n} {xs[-1]:.1f}" for n, xs in v.items())
                     for k, v in acc.items())


def table(R: dict, a: argparse.Namespace) -> str:
    names = list(R["latency"])
    hs = next((n for n in names if n.startswith("hookserve")), "hookserve")
    w = 14
    lines = [f"{'':<34}" + "".join(f"{n:>{w}}" for n in names)]

    def row(label: str, vals: dict, spec: str) -> None:
        lines.append(f"{label:<34}" + "".join(
            f"{format(vals[n], spec) if n in vals else '-':>{w}}" for n in names))

    lat = R["latency"]
    row("p50 ms (resnet50 layer4 avg)", {n: v["p50_ms"] for n, v in lat.items()}, ".1f")
    row("p99 ms", {n: v["p99_ms"] for n, v in lat.items()}, ".1f")
    floor = lat["in-process"]["p50_ms"]
    row("p50 added over in-process, ms", {n: v["p50_ms"] - floor for n, v in lat.items()},
        "+.1f")
    row("p99 / p50", {n: v["p99_ms"] / v["p50_ms"] for n, v in lat.items()}, ".2f")
    row("img/s, 1 client", R["tput1"], ".1f")
    row(f"img/s, 8 clients (floor: batch {a.batch})", R["tput8"], ".1f")
    big = R["bigmap"]
    row(f"MB/s vgg16 features.0 ({big['image_mb']:.1f} MB/img)", big["mb_s"], ".0f")
    if hs in R["tput8"]:
        lines.append("")
        lines.append("ratios, hookserve / column:")
        row("  p50 latency (lower is better)",
            {n: lat[hs]["p50_ms"] / v["p50_ms"] for n, v in lat.items()}, ".2f")
        row("  img/s, 1 client", {n: R["tput1"][hs] / v for n, v in R["tput1"].items()},
            ".2f")
        row("  img/s, 8 clients", {n: R["tput8"][hs] / v for n, v in R["tput8"].items()},
            ".2f")
        row("  MB/s big map", {n: big["mb_s"][hs] / v for n, v in big["mb_s"].items()},
            ".2f")
    if "litserve" in R["tput8"] and len(names) > 3:
        ls = "litserve"
        lines.append("")
        lines.append("ratios, column / litserve:")
        row("  p50 latency (lower is better)",
            {n: v["p50_ms"] / lat[ls]["p50_ms"] for n, v in lat.items()}, ".2f")
        row("  img/s, 1 client", {n: v / R["tput1"][ls] for n, v in R["tput1"].items()},
            ".2f")
        row("  img/s, 8 clients", {n: v / R["tput8"][ls] for n, v in R["tput8"].items()},
            ".2f")
    lines.append("")
    for k, v in R["check"].items():
        lines.append(f"same answer as in-process ({k}), max|diff|/max|ref|: " + ", ".join(
            f"{n} {x:.1e}" if isinstance(x, float) else f"{n} {x}" for n, x in v.items()))
    return "\n".join(lines)
