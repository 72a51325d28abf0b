"""Scale-out: one client balancing over two real servers on loopback.

Which server answered is read from each server's own Prometheus endpoint, the way an
operator would see it. Both servers hold resnet18 with the same seeded weights, so any
server's answer for an image must be the same.
"""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hookserve

from conftest import encode, rand_image
from helpers import R18

FLAGS = (*R18, "--max-batch-delay-ms", "2", "--metrics-port", "0")
LAYER = "layer3"  # 64x64 native input -> 256x4x4 floats: cheap to compute and compare


def answered(server) -> float:
    """Images this server has answered OK (hookserve_images_total), from /metrics."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples
               if s.name == "hookserve_images_total" and s.labels.get("code") == "OK")


@pytest.fixture
def pair(make_server):
    return make_server(*FLAGS), make_server(*FLAGS)


@pytest.fixture(scope="module")
def images():
    return [encode(rand_image(64, 64, seed=100 + i)) for i in range(24)]


def test_address_list_spreads_calls_and_fails_over(pair, images):
    a, b = pair
    with hookserve.Client([a.address, b.address], timeout=60) as c:
        for img in images[:6]:
            c.extract(img, LAYER, native=True)
        # the calls land on both: the SDK rotates calls over the addresses
        na, nb = answered(a), answered(b)
        assert na > 0 and nb > 0 and na + nb == 6
        a.stop(0)
        for img in images[6:10]:  # new calls go to the one still up
            assert c.extract(img, LAYER, native=True)[LAYER].shape == (256, 4, 4)
        assert answered(a) == na
        assert answered(b) == nb + 4


def test_ipv4_uri_balances_with_round_robin(pair, images):
    # gRPC's own client-side balancing: one channel, a resolver that returns two
    # addresses and the round_robin policy (what dns:/// does with a headless Service).
    a, b = pair
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    with hookserve.Client(target, timeout=60) as c:
        # round_robin only picks connected backends; the second may connect a moment
        # after the first, so call until both have answered (bounded).
        for i in range(40):
            c.extract(images[i % len(images)], LAYER, native=True)
            if answered(a) and answered(b):
                break
        assert answered(a) > 0 and answered(b) > 0
        a.stop(0)
        nb = answered(b)
        for img in images[:4]:
            c.extract(img, LAYER, native=True)
        assert answered(b) == nb + 4


def test_no_image_lost_when_a_server_stops_mid_stream(pair, images):
    a, b = pair
    with b.client(timeout=60) as ref_client:
        reference = [r.raise_for_error()[LAYER]
                     for r in ref_client.extract_many(images, LAYER, native=True)]
    base = {id(a): answered(a), id(b): answered(b)}
    stopped = None
    results = []
    with hookserve.Client([a.address, b.address], timeout=120, max_in_flight=4) as c:
        for r in c.extract_many(images, LAYER, native=True):
            results.append(r)
            if len(results) == 6:
                # Stop the server that carries this stream, with no grace: its
                # unanswered images must be re-sent to the other one.
                stopped = a if answered(a) > base[id(a)] else b
                assert answered(stopped) - base[id(stopped)] >= 6
                stopped.stop(0)
    assert stopped is not None
    survivor = b if stopped is a else a
    assert [r.index for r in results] == list(range(len(images)))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for r, ref in zip(results, reference, strict=True):
        np.testing.assert_allclose(r.features[LAYER], ref, rtol=1e-5, atol=1e-5)
    # the survivor really did the rest of the work
    assert answered(survivor) - base[id(survivor)] >= len(images) - (
        answered(stopped) - base[id(stopped)])
