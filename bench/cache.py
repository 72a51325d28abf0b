"""The answer cache: a stream where half the images repeat, with and without the cache;
the latency of a hit over ExtractImage; two replicas sharing Redis.

    python bench/cache.py [--images 200] [--rounds 3] [--model resnet18]

Two `hookserve serve` processes with the same flags, one with `--cache-bytes 256MiB`,
are fed the same stream in alternating rounds (each round its own images, so nothing
carries over from one round to the next): the img/s ratio. Then one image's hit
latency (p50, p99) over `Client.extract` against the same call without the cache. With
`redis-server` on PATH, two more servers share one Redis: the second's hit rate on the
images the first answered. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import time

from common import HOOKSERVE_PORT_RE, POOLED, Proc, hookserve_exe, jpeg, pct

import hookserve


def stream(round_: int, n: int) -> list[bytes]:
    """n images, half of them repeats of the other half, in a shuffled order."""
    unique = [jpeg(10_000 * (round_ + 1) + i, 224) for i in range(n // 2)]
    order = unique + unique
    random.Random(round_).shuffle(order)
    return order


def serve(a, *extra: str) -> Proc:
    argv = [hookserve_exe(), "serve", "--host", "127.0.0.1",
            "--port", "0", "--weights", "random", "--seed", "0", "--device", "cpu",
            "--model", a.model, *extra]
    return Proc("hookserve", argv, HOOKSERVE_PORT_RE)


def img_s(address: str, model: str, images: list[bytes]) -> tuple[float, int]:
    with hookserve.Client(address, timeout=600) as c:
        t0 = time.perf_counter()
        cached = 0
        for r in c.extract_many(images, POOLED, model=model):
            r.raise_for_error()
            cached += r.from_cache
        return len(images) / (time.perf_counter() - t0), cached


def latencies(address: str, model: str, image: bytes, n: int) -> list[float]:
    with hookserve.Client(address, timeout=600) as c:
        c.extract(image, POOLED, model=model)  # the answer is cached from here on
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.extract(image, POOLED, model=model)
            out.append(time.perf_counter() - t0)
        return out


def replicas(a) -> dict | None:
    if shutil.which("redis-server") is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        flags = ("--cache-url", url, "--cache-timeout-ms", "1000")
        one, two = serve(a, *flags), serve(a, *flags)
        try:
            images = [jpeg(90_000 + i, 224) for i in range(a.images // 2)]
            img_s(one.address, a.model, images)
            import redis as redis_client

            db = redis_client.Redis(port=port)
            end = time.monotonic() + 30
            while db.dbsize() < len(images) and time.monotonic() < end:
                time.sleep(0.05)  # the first server's background writes reach Redis
            _, cached = img_s(two.address, a.model, images)
            return {"images": len(images), "second_replica_hits": cached,
                    "hit_rate": cached / len(images)}
        finally:
            one.stop()
            two.stop()
    finally:
        redis.kill()
        redis.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--latency-calls", type=int, default=300)
    a = p.parse_args()
    plain, cached = serve(a), serve(a, "--cache-bytes", "256MiB")
    try:
        img_s(plain.address, a.model, stream(99, 32))  # warm both (batch shapes)
        img_s(cached.address, a.model, stream(99, 32))
        rates = {"no_cache": [], "cache": []}
        for r in range(a.rounds):
            images = stream(r, a.images)
            rates["no_cache"].append(img_s(plain.address, a.model, images)[0])
            rates["cache"].append(img_s(cached.address, a.model, images)[0])
        one = jpeg(77, 224)
        hit = latencies(cached.address, a.model, one, a.latency_calls)
        miss = latencies(plain.address, a.model, one, a.latency_calls // 5)
    finally:
        plain.stop()
        cached.stop()
    nc, c = sum(rates["no_cache"]), sum(rates["cache"])
    out = {
        "stream": {"images": a.images, "repeated": a.images // 2, "rounds": a.rounds,
                   "no_cache_img_s": nc / a.rounds, "cache_img_s": c / a.rounds,
                   "ratio": c / nc},
        "one_image_extract": {"hit_p50_ms": pct(hit, 50) * 1e3, "hit_p99_ms": pct(hit, 99) * 1e3,
                              "no_cache_p50_ms": pct(miss, 50) * 1e3},
        "replicas": replicas(a),
        "model": a.model,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
