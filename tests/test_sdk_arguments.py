"""The SDK's own argument checks, for every call that takes them: an unknown keyword
names the call's options (and the one likely meant), a model or service that is no
name is a TypeError that says so, a per-image list (ids, targets) must be one and as
long as the images, and closing a client under a running call says so, as the asyncio
client does. Against a real server where a call is made."""

from __future__ import annotations

import asyncio

import pytest

import hookserve
from hookserve.aio import Client as AsyncClient

from conftest import rand_image

IMG = rand_image(32, 32, seed=1)


@pytest.mark.parametrize("call, kwargs, words", [
    ("attribute", {"foo": 1}, "attribute() got an unexpected keyword argument 'foo': its "
                              "options are"),
    ("attribute", {"reduction": "avg"}, "attribute() got an unexpected keyword argument "
                                        "'reduction'"),
    ("attribute", {"targets": [3]}, "'targets' (one image's class is target=)"),
    ("attribute_many", {"target": 3}, "'target' (one class per image: targets=[...])"),
    ("attribute_many", {"sigmaa": 0.1}, "'sigmaa' (did you mean sigma?)"),
    ("extract_many", {"reduce": "avg"}, "'reduce' (did you mean reduction?)"),
    ("extract", {"l2normalize": True}, "'l2normalize' (did you mean l2_normalize?)"),
])
def test_an_unknown_keyword_names_the_calls_options(call, kwargs, words):
    c = hookserve.Client("localhost:1")   # (refused before any call is made)
    many = call.endswith("_many")
    args = ([IMG], "layer4") if many else (IMG, "layer4")
    with pytest.raises(TypeError) as err:
        out = getattr(c, call)(*args, **kwargs)
        if many:
            next(iter(out))
    assert words in str(err.value), str(err.value)
    assert "its options are" in str(err.value)


@pytest.mark.parametrize("call", ["extract", "attribute", "describe", "extract_many",
                                  "health"])
def test_a_model_or_service_that_is_no_name_is_a_type_error(call):
    c = hookserve.Client("localhost:1")
    with pytest.raises(TypeError, match=r"is a (model|service)'s name \(a str"):
        if call == "describe":
            c.describe(5)
        elif call == "health":
            c.health(5)
        elif call == "extract_many":
            next(iter(c.extract_many([IMG], "layer4", model=5)))
        else:
            getattr(c, call)(IMG, "layer4", model=5)


@pytest.mark.parametrize("kwargs, words", [
    ({"ids": "abc"}, r"ids takes one str per image \(a list, say\); got one str"),
    ({"ids": 7}, "ids takes one str per image"),
])
def test_ids_must_be_a_list_of_one_per_image(kwargs, words):
    c = hookserve.Client("localhost:1")
    with pytest.raises(TypeError, match=words):
        next(iter(c.extract_many([IMG] * 3, "layer4", **kwargs)))


def test_targets_must_be_a_list_of_one_per_image():
    c = hookserve.Client("localhost:1")
    with pytest.raises(TypeError, match="targets takes one class index"):
        next(iter(c.attribute_many([IMG] * 3, "layer4", targets=5)))


def test_a_per_image_list_longer_than_the_images_is_an_error_after_the_results(client):
    got = []
    with pytest.raises(ValueError, match="ids has 4 items but there were 3 images"):
        for r in client.extract_many([IMG] * 3, "layer4", ids=["a", "b", "c", "d"],
                                     reduction="avg"):
            got.append(r.raise_for_error())
    assert len(got) == 3   # every image's answer first
    with pytest.raises(ValueError, match="targets has 2 items but there were 1 images"):
        list(client.attribute_many([IMG], "layer4", targets=[1, 2]))
    # an iterator of unknown length is not counted
    assert len(list(client.extract_many([IMG] * 2, "layer4", ids=iter("abc"),
                                        reduction="avg"))) == 2


def test_closing_the_client_under_a_stream_says_so(server):
    c = hookserve.Client(server.address, timeout=60)

    def images():
        for i in range(1000):
            if i == 5:
                c.close()
            yield IMG
    with pytest.raises(hookserve.errors.Cancelled,
                       match="the client was closed while this call ran"):
        for _ in c.extract_many(images(), "layer4", reduction="avg", max_in_flight=2):
            pass


def test_the_asyncio_client_checks_the_same(server):
    async def run():
        async with AsyncClient(server.address, timeout=60) as c:
            with pytest.raises(TypeError, match="'targets' \\(one image's class is target"):
                await c.attribute(IMG, "layer4", targets=[3])
            with pytest.raises(TypeError, match="is a model's name"):
                await c.extract(IMG, "layer4", model=5)
    asyncio.run(run())
