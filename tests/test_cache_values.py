"""What the shared tier reads back is the answer its key asks for, or a miss; and Redis's
own refusals are told apart from outages (a real redis-server, conftest's fixture).

- A value in Redis with a well-formed header of another shape, columns, kind or field
  types is never served (it was served as the answer, marked cached, or ended the
  whole stream with INTERNAL) and never reaches the local tier; nor is an Attribute
  answer whose numbers or labels its wire fields cannot hold.
- A Redis at its maxmemory (the default noeviction policy) refuses writes, and lookups
  go on: the values it holds are still hits (each refused write skipped lookups for a
  second).
- Two models whose class names differ only in where a newline falls do not share an
  Attribute answer.
- Flags that would leave the shared tier never working are refused at start-up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import encode, rand_image
from helpers import CACHE_BASE, events, one, shared_server


def _poison(db, key: bytes, head: dict, data: bytes) -> None:
    raw = json.dumps(head).encode()
    db.set(key, len(raw).to_bytes(4, "little") + raw + data)


BAD_LAYER_VALUES = [   # (header, data) under a `layer4` avg key: (512,) float32
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [1], "columns": []}, bytes(4)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [16, 32], "columns": []}, bytes(2048)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [], "columns": []}, bytes(4)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [512], "columns": ["mean", "std"]},
     bytes(2048)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [512], "columns": [1, 2]}, bytes(2048)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [True, 512], "columns": []}, bytes(2048)),
    ({"name": "layer4", "dtype": "FLOAT32", "shape": [512], "columns": [], "top5": [],
      "targets": []}, bytes(2048)),   # an Attribute answer's kind
]


def test_a_value_of_another_shape_or_kind_is_never_served(make_server, redis_server):
    import redis

    s = shared_server(make_server, redis_server, "--cache-bytes", "16MiB")
    db = redis.Redis(port=redis_server.port)
    imgs = [rand_image(40, 40, seed=900 + i) for i in range(len(BAD_LAYER_VALUES) + 1)]
    with s.client(timeout=120) as c:
        want = [one(c, im, ["layer4"], reduction="avg").features["layer4"] for im in imgs]
    assert s.engine.cache.shared.flush()
    keys = db.keys("hookserve:*")
    assert len(keys) == len(imgs)
    # each key but one now holds a damaged value; a second server (its own local tier
    # empty) reads them all from Redis
    for key, (head, data) in zip(sorted(keys), BAD_LAYER_VALUES, strict=False):
        _poison(db, key, head, data)
    fresh = shared_server(make_server, redis_server, "--cache-bytes", "16MiB")
    with fresh.client(timeout=120) as c:
        results = list(c.extract_many(imgs, ["layer4"], reduction="avg"))
        again = list(c.extract_many(imgs, ["layer4"], reduction="avg"))
    assert [r.error for r in results] == [None] * len(imgs)   # the stream went on
    for r, r2, w in zip(results, again, want, strict=True):
        np.testing.assert_array_equal(r.features["layer4"], w)
        np.testing.assert_array_equal(r2.features["layer4"], w)   # the local tier's copy
    assert sum(bool(r.cached) for r in results) == 1   # the one key left alone
    assert events(fresh, "shared")["error"] == len(BAD_LAYER_VALUES)
    db.close()


def test_an_attribute_key_holding_a_layers_value_is_a_miss(make_server, redis_server):
    import redis

    s = shared_server(make_server, redis_server)
    img = rand_image(40, 40, seed=950)
    with s.client(timeout=120) as c:
        want = c.attribute(img, "layer4", method="grad_cam")
        assert s.engine.cache.shared.flush()
        db = redis.Redis(port=redis_server.port)
        (key,) = db.keys("hookserve:*")
        n = int(np.prod(want.map.shape))
        _poison(db, key, {"name": "layer4", "dtype": "FLOAT32", "shape": list(want.map.shape),
                          "columns": []}, bytes(4 * n))
        got = c.attribute(img, "layer4", method="grad_cam")
        assert not got.cached
        np.testing.assert_array_equal(got.map, want.map)
        assert s.engine.cache.shared.flush()
        # a well-formed answer with a label of the wrong type: a miss too
        raw = db.get(key)
        k = int.from_bytes(raw[:4], "little")
        head = json.loads(raw[4:4 + k])
        head["top5"][0][3] = 7
        _poison(db, key, head, raw[4 + k:])
        assert not c.attribute(img, "layer4", method="grad_cam").cached
    db.close()


@pytest.mark.parametrize("where,value", [
    (("targets", 0, 0), 10**30),          # a class index over uint32
    (("top5", 0, 0), 2**32),
    (("top5", 0, 1), 10**400),            # a logit no float holds
    (("targets", 0, 4), -(10**400)),      # a map_min
    (("top5", 0, 3), "\ud800"),           # a label that is not UTF-8
], ids=["target-index", "top5-index", "logit", "map-min", "label"])
def test_an_attribute_value_that_could_not_be_sent_is_a_miss(make_server, redis_server,
                                                              where, value):
    """Fields that parse but that the answer's wire fields cannot hold: each a miss
    recomputed (each ended the whole call with INTERNAL, every image of it lost)."""
    import redis

    s = shared_server(make_server, redis_server)
    imgs = [rand_image(40, 40, seed=960 + i) for i in range(3)]
    with s.client(timeout=120) as c:
        want = [c.attribute(im, "layer4", method="grad_cam") for im in imgs]
        assert s.engine.cache.shared.flush()
        db = redis.Redis(port=redis_server.port)
        for key in db.keys("hookserve:*"):
            raw = db.get(key)
            k = int.from_bytes(raw[:4], "little")
            head = json.loads(raw[4:4 + k])
            field, i, j = where
            head[field][i][j] = value
            _poison(db, key, head, raw[4 + k:])
        got = [r.raise_for_error() for r in
               c.attribute_many(imgs, "layer4", method="grad_cam")]
    assert [g.cached for g in got] == [False] * len(imgs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.map, w.map)
        assert g.target == w.target
    assert events(s, "shared")["error"] >= len(imgs)
    db.close()


def test_a_full_redis_refuses_writes_and_still_answers_lookups(make_server, redis_server):
    import redis

    s = shared_server(make_server, redis_server)
    old = [rand_image(36, 36, seed=960 + i) for i in range(4)]
    with s.client(timeout=120) as c:
        for im in old:
            one(c, im, ["fc"])
        assert s.engine.cache.shared.flush()
        db = redis.Redis(port=redis_server.port)
        db.config_set("maxmemory", 1)   # full, and the default policy: noeviction
        hits = 0
        for i, im in enumerate(old):
            one(c, rand_image(36, 36, seed=970 + i), ["fc"])   # its write is refused
            assert s.engine.cache.shared.flush()
            hits += bool(one(c, im, ["fc"]).cached)
        db.config_set("maxmemory", 0)
        db.close()
    assert hits == len(old)
    assert events(s, "shared")["error"] >= len(old)   # the refused writes, counted


def test_class_names_that_differ_only_by_a_newline_do_not_share_answers(
        make_server, redis_server, tmp_path):
    import torch
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=2)
    torch.save(net.state_dict(), tmp_path / "w.pt")
    (tmp_path / "x.json").write_text(json.dumps(["a\nb", "c"]))
    (tmp_path / "y.json").write_text(json.dumps(["a", "b\nc"]))
    (tmp_path / "m.toml").write_text(
        "".join(f'[[model]]\nname = "{n}"\narchitecture = "resnet18"\nweights = "w.pt"\n'
                f'labels = "{n}.json"\n' for n in ("x", "y")))
    s = make_server("--models", str(tmp_path / "m.toml"), "--cache-bytes", "16MiB",
                    "--max-batch-delay-ms", "1")
    img = encode(rand_image(40, 40, seed=980))
    with s.client(timeout=120) as c:
        first = c.attribute(img, "layer4", model="x", top_k=2)
        second = c.attribute(img, "layer4", model="y", top_k=2)
    assert not second.cached
    assert {t.label for t in first.top5} == {"a\nb", "c"}
    assert {t.label for t in second.top5} == {"a", "b\nc"}


@pytest.mark.parametrize("flags, words", [
    (("--cache-timeout-ms", "nan"), "--cache-timeout-ms nan must be a positive number"),
    (("--cache-timeout-ms", "inf"), "--cache-timeout-ms inf must be a positive number"),
    (("--cache-ttl-seconds", "99999999999999999"), "more than Redis takes"),
    (("--cache-url", "redis://127.0.0.1:0"), "the port is 1 to 65535"),
    (("--cache-url", "redis://"), "name the host"),
    (("--cache-url", "unix://"), "name the socket"),
    (("--cache-url", "redis://user:secret@127.0.0.1:6379/0", "--cache-max-value-bytes",
      "3GiB"), "or --cache-max-value-bytes"),
    # at the default value size the queue is its fixed 32 MiB: only --cache-bytes helps
    (("--cache-url", "redis://127.0.0.1:6379", "--max-buffer-bytes", "100MiB",
      "--cache-bytes", "50MiB"), "or lower --cache-bytes\n"),
])
def test_cache_flags_that_could_never_work_are_refused(make_server, flags, words):
    from hookserve_server.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        make_server(*CACHE_BASE, *flags)
    assert words in str(err.value) + "\n" and "secret" not in str(err.value)


def test_a_database_redis_does_not_have_is_refused_at_start(make_server, redis_server):
    from hookserve_server.errors import ConfigError

    url = redis_server.url.rsplit("/", 1)[0] + "/99999"
    with pytest.raises(ConfigError, match="Redis refuses it: DB index is out of range"):
        make_server(*CACHE_BASE, "--cache-url", url)


@pytest.mark.parametrize("opts", [
    dict(layer="layer4", method="grad_cam"),
    dict(layer="layer3", method="grad_cam", upsample=False, top_k=2),
    dict(layer="layer2:input", method="layer_cam", top_k=3),
    dict(layer=None, method="gradient"),
    dict(layer=None, method="integrated_gradients", steps=4, top_k=2),
], ids=lambda o: f"{o['method']}-{o.get('top_k', 1)}")
def test_every_attribute_answer_read_back_is_served(make_server, redis_server, opts):
    """The shape the cache expects of each kind of map is the one computed: a fresh
    server (no local tier) is answered from Redis, bit for bit."""
    s = shared_server(make_server, redis_server)
    img = rand_image(48, 40, seed=990)
    with s.client(timeout=120) as c:
        want = c.attribute(img, **opts)
    assert s.engine.cache.shared.flush()
    fresh = shared_server(make_server, redis_server)
    with fresh.client(timeout=120) as c:
        got = c.attribute(img, **opts)
    assert got.cached
    np.testing.assert_array_equal(got.map, want.map)
    assert events(fresh, "shared")["error"] == 0


def test_every_layer_answer_read_back_is_served(make_server, redis_server):
    """Each reduction, dtype, an `:input` layer and native geometry: the shape the
    cache expects is the one computed, so a fresh server is answered from Redis."""
    from hookserve import Layer

    layers = [Layer("layer1", reduction="stats"), Layer("layer2:input", reduction="max"),
              Layer("layer3", dtype="float16"), Layer("layer4", reduction="flatten"),
              Layer("fc", l2_normalize=True), Layer("conv1")]
    img = rand_image(50, 38, seed=995)
    s = shared_server(make_server, redis_server)
    fresh = shared_server(make_server, redis_server)
    for native in (False, True):
        with s.client(timeout=120) as c:
            want = one(c, img, layers, native=native)
        assert s.engine.cache.shared.flush()
        with fresh.client(timeout=120) as c:
            got = one(c, img, layers, native=native)
        assert sorted(got.cached) == sorted(la.name for la in layers)
        for name, arr in want.features.items():
            np.testing.assert_array_equal(got.features[name], arr)
    assert events(fresh, "shared")["error"] == 0
