"""The Ray Data adapter (hookserve.ray.HookserveMapper) against a real server.

The mapper's own behaviour (columns, failed rows, paths) is tested by calling it on a
batch directly, in the fast suite. The `ray`-marked tests run it inside Ray Data
(`ray.init(num_cpus=2)`, actors in their own processes): `make test-ray`.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from hookserve.ray import HookserveMapper

from conftest import encode, rand_image
from helpers import R18

LAYERS = ["layer4", "fc"]


def _images(n: int) -> list[bytes]:
    return [encode(rand_image(40 + i % 5, 48, seed=i)) for i in range(n)]


def _reference(client, images: list[bytes]) -> dict[str, np.ndarray]:
    out = {name: [] for name in LAYERS}
    for r in client.extract_many(images, LAYERS, reduction="avg"):
        for name in LAYERS:
            out[name].append(r.raise_for_error()[name])
    return {k: np.stack(v) for k, v in out.items()}


def test_mapper_adds_layer_and_status_columns(server, client):
    images = _images(6)
    bad = b"\x89PNG\r\n\x1a\n not really"
    batch = {"image": np.array(images[:3] + [bad] + images[3:], dtype=object),
             "key": np.arange(7)}
    m = HookserveMapper(server.address, LAYERS, reduction="avg")
    out = m(batch)
    assert list(out["key"]) == list(range(7))  # input columns are kept
    assert list(out["ok"]) == [True] * 3 + [False] + [True] * 3
    assert list(out["error_code"]) == [""] * 3 + ["INVALID_ARGUMENT"] + [""] * 3
    assert out["error_message"][3] and not out["error_message"][0]
    ref = _reference(client, images)
    for name in LAYERS:
        col = out[name]
        assert col.shape == (7, *ref[name].shape[1:]) and col.dtype == np.float32
        # the server batches images differently on each call: allow float rounding
        np.testing.assert_allclose(np.delete(col, 3, axis=0), ref[name], rtol=1e-4, atol=1e-4)
        assert np.isnan(col[3]).all()


def test_column_shapes_follow_the_reduction_table(server, client):
    """A module's input and a per-layer reduction: each column's shape is the one the
    reduction gives (stats: [C, 5]), fixed even under --native when the reduction
    does not follow the image's size; a reduction that does gives one array per row."""
    from hookserve import Layer

    images = [encode(rand_image(64, 80, seed=1)), encode(rand_image(72, 56, seed=2))]
    layers = [Layer("layer2:input", "stats"), Layer("layer4", "avg")]
    out = HookserveMapper(server.address, layers, native=True)({"image": images})
    assert list(out["ok"]) == [True, True]
    assert out["layer2:input"].shape == (2, 64, 5)   # layer1's 64 channels, 5 columns
    assert out["layer4"].shape == (2, 512)
    ref = list(client.extract_many(images, layers, native=True))
    for i, r in enumerate(ref):
        for name, arr in r.raise_for_error().items():
            np.testing.assert_allclose(out[name][i], arr, rtol=1e-4, atol=1e-4)
    varies = HookserveMapper(server.address, [Layer("layer4", "flatten")], native=True)
    col = varies({"image": [images[0], encode(rand_image(160, 128, seed=3))]})["layer4"]
    assert col.dtype == object and col[0].shape != col[1].shape


def test_mapper_reads_paths_and_pandas(server, tmp_path):
    pd = pytest.importorskip("pandas")
    images = _images(2)
    paths = []
    for i, data in enumerate(images):
        p = tmp_path / f"{i}.png"
        p.write_bytes(data)
        paths.append(str(p))
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)  # a FIFO must fail as a row, not hang the actor
    rows = pd.DataFrame({"path": [paths[0], str(tmp_path / "missing.jpg"), str(fifo),
                                  paths[1]]})
    out = HookserveMapper(server.address, ["fc"], reduction="avg")(rows)
    assert isinstance(out, pd.DataFrame)
    assert list(out["ok"]) == [True, False, False, True]
    assert list(out["error_code"]) == ["", "NOT_FOUND", "INVALID_ARGUMENT", ""]
    assert "FIFO" in out["error_message"][2]
    assert len(out["fc"][0]) == 1000


def test_mapper_whole_call_failure_is_rows_not_an_exception(make_server):
    s = make_server()
    m = HookserveMapper(s.address, ["fc"], reduction="avg",
                        client_kwargs={"retries": 0, "timeout": 5})
    s.stop(0)
    out = m({"image": np.array(_images(2), dtype=object)})
    assert list(out["ok"]) == [False, False]
    assert set(out["error_code"]) == {"UNAVAILABLE"}


def _column(values: list) -> np.ndarray:
    col = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        col[i] = v
    return col


def test_every_bad_cell_is_a_row_not_an_exception(make_server, tmp_path):
    """Cells that are not image bytes (an integer would become a gigabyte of zeros as
    bytes), empty cells, a cell over what the server accepts, paths that are not
    text, and a call that fails with something other than a HookserveError."""
    s = make_server(*R18, "--max-message-bytes", "100000")
    m = HookserveMapper(s.address, ["fc"], reduction="avg")
    good = _images(1)[0]
    cells = [good, 10**9, "text", None, {"path": "x.png"}, [1, 2], np.int64(7),
             os.urandom(100_000), bytearray(good), np.frombuffer(good, np.uint8)]
    out = m({"image": _column(cells)})
    assert list(out["ok"]) == [True] + [False] * 7 + [True, True]
    assert list(out["error_code"][1:8]) == ["INVALID_ARGUMENT"] * 7
    assert "holds int, not image bytes" in out["error_message"][1]
    assert "is empty" in out["error_message"][3] and "is empty" in out["error_message"][4]
    assert "per-file cap" in out["error_message"][7] and \
        "--max-message-bytes" in out["error_message"][7]
    p = tmp_path / "0.png"
    p.write_bytes(good)
    out = m({"path": _column([str(p), 123, None, p])})
    assert list(out["ok"]) == [True, False, False, True]
    assert "holds int, not a path" in out["error_message"][1]
    m.client.close()  # the call now raises ValueError: rows, not an exception
    out = m({"image": _column([good, good])})
    assert list(out["ok"]) == [False, False] and set(out["error_code"]) == {"INTERNAL"}


def test_mapper_pickles_without_a_client(server):
    """Ray ships the class and its constructor kwargs, never a Client."""
    kwargs = {"target": server.address, "layers": LAYERS, "reduction": "avg"}
    assert pickle.loads(pickle.dumps((HookserveMapper, kwargs)))[0] is HookserveMapper


# ------------------------------------------------------------------ inside Ray Data
@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray", reason="pip install 'hookserve[ray]' (make test-ray)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.mark.ray
def test_ray_data_map_batches_equals_the_sdk(server, client, ray_session):
    ray = ray_session
    images = _images(24)
    rows = [{"image": b, "n": i} for i, b in enumerate(images)]
    rows[5]["image"] = b"corrupt"
    ds = ray.data.from_items(rows).map_batches(
        HookserveMapper,
        fn_constructor_kwargs={"target": server.address, "layers": LAYERS,
                               "reduction": "avg"},
        concurrency=2, batch_size=5)
    got = sorted(ds.take_all(), key=lambda r: r["n"])
    assert [r["n"] for r in got] == list(range(24))  # every row once
    assert [r["ok"] for r in got] == [i != 5 for i in range(24)]
    assert got[5]["error_code"] == "INVALID_ARGUMENT"
    keep = [i for i in range(24) if i != 5]
    ref = _reference(client, [images[i] for i in keep])
    for name in LAYERS:
        np.testing.assert_allclose(np.stack([got[i][name] for i in keep]), ref[name],
                                   rtol=1e-4, atol=1e-4)
