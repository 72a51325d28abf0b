"""SDK address handling: a server that answered UNAVAILABLE is skipped while others are up."""

from __future__ import annotations

import hookserve

from helpers import R18

FLAGS = tuple(R18)


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


def test_same_path_twice_is_not_a_duplicate_id(client, tmp_path):
    from conftest import encode, rand_image

    p = tmp_path / "a.png"
    p.write_bytes(encode(rand_image(32, 32)))
    rs = list(client.extract_many([p, p], ["conv1"], native=True))
    assert [r.ok for r in rs] == [True, True] and [r.id for r in rs] == [str(p)] * 2


def test_fewer_ids_than_images_is_a_clear_error(client):
    import pytest

    from conftest import rand_image

    with pytest.raises(ValueError, match="ids has fewer items than images"):
        list(client.extract_many([rand_image(32, 32)] * 2, ["conv1"], ids=["only-one"]))
