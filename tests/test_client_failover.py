"""SDK address handling: a server that answered UNAVAILABLE is skipped while others are up."""

from __future__ import annotations

import hookserve

FLAGS = ("--model", "resnet18", "--weights", "random")


def test_dead_address_is_skipped_after_one_failure(make_server):
    a, b = make_server(*FLAGS), make_server(*FLAGS)
    b.stop(0)
    failures = 0
    with hookserve.Client([a.address, b.address], retries=0, timeout=10) as c:
        for _ in range(12):
            try:
                assert c.list_models()[0].name == "resnet18"
            except hookserve.Unavailable:
                failures += 1
    # Round-robin without skipping would fail every second call.
    assert failures <= 1


def test_retries_move_to_the_live_address(make_server):
    a, b = make_server(*FLAGS), make_server(*FLAGS)
    a.stop(0)
    with hookserve.Client([a.address, b.address], retries=2, timeout=10) as c:
        for _ in range(6):
            assert c.describe().model.name == "resnet18"


def test_all_addresses_down_raises_unavailable_after_retries():
    with hookserve.Client(["127.0.0.1:9", "127.0.0.1:10"], retries=2, retry_backoff=0.01,
                          timeout=5) as c:
        try:
            c.list_models()
        except hookserve.Unavailable as exc:
            assert exc.code.name == "UNAVAILABLE"
        else:
            raise AssertionError("expected Unavailable")
