"""What writable result arrays cost: the SDK copies each tensor once out of the received
message into a buffer the array wraps. This measures that copy per MB, against the time
one such tensor takes to arrive over gRPC on loopback (ExtractImage of a layer that fits
one chunk, the case that was read-only and copy-free before).

    .venv/bin/python bench/array_copy.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

import hookserve  # noqa: E402

from conftest import DEFAULT_FLAGS, RunningServer, rand_image  # noqa: E402


def copy_ms_per_mb(mb: float, repeat: int = 50) -> float:
    data = os.urandom(int(mb * 1e6))
    best = min(_timed(lambda: np.frombuffer(bytearray(data), "<f4")) for _ in range(repeat))
    return best * 1e3 / mb


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    per_mb = {mb: copy_ms_per_mb(mb) for mb in (0.8, 2.0, 12.8)}
    for mb, ms in per_mb.items():
        print(f"copy into a writable buffer: {ms:.3f} ms/MB ({mb} MB, best of 50)")
    s = RunningServer(DEFAULT_FLAGS)
    try:
        img = rand_image(224, 224)
        with hookserve.Client(s.address, timeout=120) as c:
            # resnet18 layer1 at 224: 64x56x56 float32 = 0.80 MB, one chunk
            for _ in range(5):
                c.extract(img, ["layer1"], native=True)
            times = [_timed(lambda: c.extract(img, ["layer1"], native=True))
                     for _ in range(30)]
        ms = statistics.median(times) * 1e3
        copy = per_mb[0.8] * 0.8
        print(f"ExtractImage resnet18 layer1 (0.80 MB answer, one chunk): median {ms:.1f} ms;"
              f" its copy {copy:.3f} ms = {100 * copy / ms:.2f}% of the call")
    finally:
        s.stop()


if __name__ == "__main__":
    main()
