"""The Open Inference Protocol's ModelInfer beside hookserve's own ExtractImage and
Extract, side by side in one run: resnet50, `layer4` average-pooled, 224 px JPEGs,
one image per call.

    python bench/oip.py                     # 40 images alone, 64 at 8 clients
    python bench/oip.py --images 80 --eight-images 128

One hookserve server (a subprocess, random weights) serves resnet50. Callers:

  oip            tritonclient.grpc `infer` (IMAGE BYTES [1], output layer4,
                 reduction=avg): ModelInfer
  extract_image  `hookserve.Client.extract`: the ExtractImage RPC
  extract        `hookserve.Client.extract_many` over one image: an Extract stream

one image at a time, the three alternating image by image (p50/p99 latency, and
each p50 over ExtractImage's), then each alone with 8 concurrent clients (img/s, and
the ratio to ExtractImage's). Writes bench/results/<UTC time>-oip.json (and
latest-oip.json). Needs tritonclient (the oip-clients extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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

MODEL, LAYER = "resnet50", "layer4"


def oip_caller(address: str):
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    out = grpcclient.InferRequestedOutput(LAYER)
    out._output.parameters["reduction"].string_param = "avg"

    def call(img: bytes):
        inp = grpcclient.InferInput("IMAGE", [1], "BYTES")
        inp.set_data_from_numpy(np.array([img], dtype=np.object_))
        got = client.infer(MODEL, [inp], outputs=[out]).as_numpy(LAYER)
        assert got.shape == (1, 2048)
    return call, client.close


def sdk_caller(address: str, stream: bool):
    client = hookserve.Client(address, timeout=600)

    def call(img: bytes):
        if stream:
            (r,) = client.extract_many([img], LAYER, model=MODEL, reduction="avg")
            r.raise_for_error()
        else:
            assert client.extract(img, LAYER, model=MODEL, reduction="avg")[LAYER].shape \
                == (2048,)
    return call, client.close


CALLERS = {"oip": oip_caller,
           "extract_image": lambda a: sdk_caller(a, stream=False),
           "extract": lambda a: sdk_caller(a, stream=True)}


def alternating(address: str, data: list[bytes]) -> dict:
    """One image at a time, the callers taking turns per image."""
    made = {name: make(address) for name, make in CALLERS.items()}
    lat: dict[str, list[float]] = {name: [] for name in CALLERS}
    try:
        for call, _ in made.values():  # warm each connection
            call(data[0])
        for img in data:
            for name, (call, _) in made.items():
                t0 = time.perf_counter()
                call(img)
                lat[name].append(time.perf_counter() - t0)
    finally:
        for _, close in made.values():
            close()
    out = {name: {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3}
           for name, xs in lat.items()}
    base = out["extract_image"]["p50_ms"]
    for row in out.values():
        row["p50_over_extract_image"] = row["p50_ms"] / base
    return out


def concurrent(address: str, name: str, data: list[bytes], clients: int) -> float:
    parts = [data[i::clients] for i in range(clients)]

    def run(part: list[bytes]) -> None:
        call, close = CALLERS[name](address)
        try:
            for img in part:
                call(img)
        finally:
            close()

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        list(pool.map(run, parts))
        return len(data) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=40, help="images per caller, alone")
    p.add_argument("--eight-images", type=int, default=64,
                   help="images per caller with 8 clients")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    say = clock()
    res = new_results(a, {"model": MODEL, "layer": LAYER, "reduction": "avg", "side": 224})
    data = images(max(a.images, a.eight_images), 224)
    server = Proc("hookserve", hookserve_argv([MODEL], a), HOOKSERVE_PORT_RE)
    try:
        say(f"one image at a time, {a.images} images per caller, alternating")
        res["rows"]["one"] = alternating(server.address, data[:a.images])
        eight = {}
        concurrent(server.address, "extract_image", data[:16], 8)  # warm the pool
        for name in CALLERS:
            say(f"8 clients: {name}")
            eight[name] = {"img_s": concurrent(server.address, name,
                                               data[:a.eight_images], 8)}
        for row in eight.values():
            row["over_extract_image"] = row["img_s"] / eight["extract_image"]["img_s"]
        res["rows"]["eight"] = eight
    finally:
        server.stop()
    for phase, rows in res["rows"].items():
        for name, row in rows.items():
            say(f"{phase:5} {name:14} " + "  ".join(f"{k}={v:.3f}" for k, v in row.items()))
    say(f"wrote {write_results(res, a.out, '-oip', 'latest-oip.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
