"""Load generators: concurrent hookserve streams and single-image clients, the raw
bytes client and the naive server's client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import raw_server  # bench/ sibling

import hookserve


def streams_throughput(address: str, model: str, layers, data: list[bytes], streams: int,
                       call: str = "extract_many", **opts) -> float:
    """img/s of `streams` concurrent extract_many calls sharing `data` between them
    (`call="attribute_many"`: Attribute streams, `layers` being the one layer)."""
    parts = [data[i::streams] for i in range(streams)]
    clients = [hookserve.Client(address, timeout=600) for _ in range(streams)]

    def run(c: hookserve.Client, part: list[bytes]) -> int:
        n = 0
        for r in getattr(c, call)(part, layers, model=model, **opts):
            r.raise_for_error()
            n += 1
        return n

    try:
        with ThreadPoolExecutor(streams) as pool:
            t0 = time.perf_counter()
            done = sum(pool.map(run, clients, parts))
            dt = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    assert done == len(data)
    return done / dt


def single_image_clients(address: str, model: str, layers, data: list[bytes], clients: int,
                         **opts) -> tuple[float, list[float]]:
    """`clients` threads, each calling extract() one image at a time: (img/s, latencies)."""
    parts = [data[i::clients] for i in range(clients)]
    lat: list[float] = []

    def run(part: list[bytes]) -> None:
        with hookserve.Client(address, timeout=600) as c:
            for b in part:
                t0 = time.perf_counter()
                c.extract(b, layers, model=model, **opts)
                lat.append(time.perf_counter() - t0)

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        list(pool.map(run, parts))
        dt = time.perf_counter() - t0
    return len(data) / dt, lat


def raw_stream_mb_s(address: str, n_images: int, image_bytes: int, chunk: int) -> float:
    with grpc.insecure_channel(address, options=raw_server.OPTIONS) as ch:
        call = ch.unary_stream(raw_server.METHOD)
        for _ in call(raw_server.request(1, image_bytes, chunk)):  # warm-up
            pass
        t0 = time.perf_counter()
        got = sum(len(m) for m in call(raw_server.request(n_images, image_bytes, chunk)))
        dt = time.perf_counter() - t0
    assert got == n_images * image_bytes
    return got / dt / 1e6


def naive_throughput(address: str, data: list[bytes], clients: int) -> float:
    parts = [data[i::clients] for i in range(clients)]
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/bench.Naive/Extract")
        call(data[0], timeout=600)  # warm-up

        def run(part: list[bytes]) -> None:
            for b in part:
                call(b, timeout=600)

        with ThreadPoolExecutor(clients) as pool:
            t0 = time.perf_counter()
            list(pool.map(run, parts))
            return len(data) / (time.perf_counter() - t0)
