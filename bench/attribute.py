"""Attribute against Extract on the same layer, side by side in one run.

    python bench/attribute.py                       # resnet18 layer4: grad_cam vs avg extract
    python bench/attribute.py --model resnet50 --streams 4 --images 128
    python bench/attribute.py --precision           # + bf16 server vs float32 maps

One hookserve server (a subprocess, as in bench/run.py) serves the model; the bench
alternates, round after round, `--streams` concurrent extract_many streams asking for
`layer4` avg-pooled and the same number of attribute_many streams asking for
Grad-CAM at `layer4`, on the same 256x256 JPEGs (default preprocessing: resize 256,
crop 224). Each side's img/s is total images / total time over the rounds, so drift
in the machine's load hits both. The ratio attribute/extract is the cost of the
gradient: Grad-CAM at layer4 is a full forward (to the logits, not only to layer4),
the backward from the logit to layer4, and more memory per image.

`--precision` also starts a bfloat16 server and reports, over the same images, how
far its Grad-CAM maps are from the float32 server's (the tolerances in
docs/attribution.md).

Prints a table and writes bench/results/<UTC time>-attribute.json and
bench/results/latest-attribute.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from clients import streams_throughput  # bench/ siblings; common sets OMP_WAIT_POLICY
from common import (
    HOOKSERVE_PORT_RE,
    Proc,
    clock,
    hookserve_argv,
    images,
    new_results,
    write_results,
)

import hookserve


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--layer", default="layer4",
                    help='the layer of both sides; "" for an input-space --method (Extract '
                         'then asks for fc, the full forward)')
    ap.add_argument("--method", default="grad_cam")
    ap.add_argument("--images", type=int, default=64, help="images per side per round")
    ap.add_argument("--streams", type=int, default=2, help="concurrent streams per side")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8, help="server --max-batch-size")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="server --max-batch-delay-ms")
    ap.add_argument("--threads", type=int, default=0, help="server --threads (0: torch's)")
    ap.add_argument("--precision", action="store_true",
                    help="also compare a bfloat16 server's maps with this one's")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    return ap.parse_args()


def map_errors(a: hookserve.Attribution, b: hookserve.Attribution) -> dict:
    """How far map `b` is from the reference `a`: error relative to a's peak, and
    whether the hottest cell and the predicted class agree."""
    peak = float(np.abs(a.map).max()) or 1.0
    return {"max_rel": float(np.abs(a.map - b.map).max()) / peak,
            "mean_rel": float(np.abs(a.map - b.map).mean()) / peak,
            "argmax_same": bool(a.map.argmax() == b.map.argmax()),
            "target_same": a.target == b.target}


def precision(a: argparse.Namespace, ref: Proc, data: list[bytes], say) -> dict:
    say("precision: bfloat16 server vs this one, same images, targets fixed to the "
        "reference's prediction")
    bf = Proc("hookserve-bf16", hookserve_argv(
        [a.model], argparse.Namespace(**{**vars(a), "dtype": "bfloat16"})), HOOKSERVE_PORT_RE)
    try:
        with hookserve.Client(ref.address, timeout=600) as c32, \
                hookserve.Client(bf.address, timeout=600) as c16:
            want = list(c32.attribute_many(data, a.layer, a.method, model=a.model))
            got = list(c16.attribute_many(data, a.layer, a.method, model=a.model,
                                          targets=[w.target for w in want]))
            free = list(c16.attribute_many(data, a.layer, a.method, model=a.model))
    finally:
        bf.stop()
    errs = [map_errors(w.raise_for_error(), g.raise_for_error())
            for w, g in zip(want, got, strict=True)]
    return {"images": len(errs),
            "max_rel_worst": max(e["max_rel"] for e in errs),
            "max_rel_median": float(np.median([e["max_rel"] for e in errs])),
            "mean_rel_median": float(np.median([e["mean_rel"] for e in errs])),
            "peak_cell_agrees": sum(e["argmax_same"] for e in errs) / len(errs),
            "predicted_class_agrees": sum(w.target == f.target for w, f in
                                          zip(want, free, strict=True)) / len(errs)}


def main() -> int:
    a = parse_args()
    say = clock()
    res = new_results(a, {})
    data = images(a.images, 256)
    say(f"starting hookserve ({a.model}, {a.device}, {a.dtype}, batch {a.batch})")
    hs = Proc("hookserve", hookserve_argv([a.model], a), HOOKSERVE_PORT_RE)
    try:
        extract = {a.layer or "fc": {"reduction": "avg"}}
        # warm-up: both paths, batch shapes and allocator pools
        streams_throughput(hs.address, a.model, extract, data[:a.streams * 2], a.streams)
        streams_throughput(hs.address, a.model, a.layer, data[:a.streams * 2], a.streams,
                           call="attribute_many", method=a.method)
        t = {"extract": 0.0, "attribute": 0.0}
        for r in range(a.rounds):
            t["extract"] += len(data) / streams_throughput(
                hs.address, a.model, extract, data, a.streams)
            t["attribute"] += len(data) / streams_throughput(
                hs.address, a.model, a.layer, data, a.streams, call="attribute_many",
                method=a.method)
            say(f"  round {r + 1}: " + ", ".join(
                f"{k} {len(data) * (r + 1) / v:.1f} img/s" for k, v in t.items()))
        n = len(data) * a.rounds
        row = {"model": a.model, "layer": a.layer, "method": a.method, "images": n,
               "streams": a.streams, "extract_img_s": n / t["extract"],
               "attribute_img_s": n / t["attribute"]}
        row["attribute_over_extract"] = row["attribute_img_s"] / row["extract_img_s"]
        res["rows"]["attribute"] = row
        if a.precision:
            res["rows"]["precision"] = precision(a, hs, data[:16], say)
    finally:
        hs.stop()
    print(f"\n{a.model} {a.layer or 'input'}, {a.streams} streams x {n} images, "
          f"{a.device} {a.dtype}:")
    print(f"  Extract  ({a.layer or 'fc'} avg)   {row['extract_img_s']:7.1f} img/s")
    print(f"  Attribute ({a.method})  {row['attribute_img_s']:7.1f} img/s"
          f"   = {row['attribute_over_extract']:.2f} x Extract")
    if "precision" in res["rows"]:
        p = res["rows"]["precision"]
        print(f"  bf16 vs {a.dtype} maps over {p['images']} images: max error "
              f"{p['max_rel_median']:.3f} (median) / {p['max_rel_worst']:.3f} (worst) of the "
              f"map's peak; peak cell agrees {p['peak_cell_agrees']:.0%}, predicted class "
              f"{p['predicted_class_agrees']:.0%}")
    path = write_results(res, a.out, "-attribute", latest="latest-attribute.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
