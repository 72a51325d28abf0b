"""KServe's own clients, `InferenceGRPCClient` and `InferenceRESTClient` from the kserve
package as published, against a real server on 127.0.0.1 (resnet18, random weights,
small images, a token, the REST port on).

kserve pins protobuf < 7, so it cannot live in hookserve's venv: the clients run in a
subprocess of another venv's python (tests/kserve_clients.py), and their answers come
back as .npz files to compare with the SDK's here. That python is
$HOOKSERVE_KSERVE_PYTHON, else .venv-kserve/bin/python (`make test-kserve` creates it);
skipped when neither exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import RunningServer, encode, rand_image
from helpers import small_server

pytest.importorskip("starlette", reason="pip install hookserve[http]")
pytest.importorskip("uvicorn", reason="pip install hookserve[http]")

ROOT = Path(__file__).resolve().parents[1]
KSERVE_PYTHON = Path(os.environ.get("HOOKSERVE_KSERVE_PYTHON")
                     or ROOT / ".venv-kserve" / "bin" / "python")
if not os.access(KSERVE_PYTHON, os.X_OK):
    pytest.skip(f"no python with kserve at {KSERVE_PYTHON}: run `make test-kserve`, or "
                "set HOOKSERVE_KSERVE_PYTHON", allow_module_level=True)

TOKEN = "kserve-s3cret"
LAYERS = {"layer4": {"reduction": "avg"},
          "layer2.0.relu_1": {"reduction": "max", "dtype": "float16"}}
IMAGES = [encode(rand_image(40 + 8 * i, 48, seed=i)) for i in range(3)]
PIXELS = np.stack([rand_image(32, 32, seed=s) for s in (5, 6)])


@pytest.fixture(scope="module")
def kserve_run(tmp_path_factory):
    """The server, what the KServe clients saw (result.json) and the folder of their
    answers (.npz)."""
    tmp = tmp_path_factory.mktemp("kserve")
    (tmp / "token").write_text(TOKEN + "\n")
    s = RunningServer(small_server("--max-batch-delay-ms", "2", "--http-port", "0",
                                   "--auth-token-file", str(tmp / "token")))
    try:
        paths = []
        for i, img in enumerate(IMAGES):
            paths.append(str(tmp / f"{i}.png"))
            Path(paths[-1]).write_bytes(img)
        np.save(tmp / "pixels.npy", PIXELS)
        job = {"grpc": s.address, "rest": f"http://127.0.0.1:{s.server.http.port}",
               "token": TOKEN, "model": "resnet18", "images": paths,
               "pixels": str(tmp / "pixels.npy"), "layers": LAYERS}
        (tmp / "job.json").write_text(json.dumps(job))
        out = tmp / "out"
        out.mkdir()
        run = subprocess.run([str(KSERVE_PYTHON), str(ROOT / "tests" / "kserve_clients.py"),
                              str(tmp / "job.json"), str(out)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        yield s, json.loads((out / "result.json").read_text()), out, job
    finally:
        s.stop(2.0)


def sdk(server: RunningServer, image, layer: str, params: dict) -> np.ndarray:
    with server.client(timeout=120, token=TOKEN) as c:
        return c.extract(image, layer, **params)[layer]


@pytest.mark.parametrize("side", ["grpc", "rest"])
def test_health_and_metadata(kserve_run, side):
    result = kserve_run[1]
    r = result[side]
    assert (r["live"], r["ready"], r["model_ready"]) == (True, True, True)
    assert r["unknown_model_ready"] is False
    assert set(r["metadata"]["inputs"]) == {"IMAGE", "INPUT__0"}
    assert r["metadata"]["outputs"]["fc"] == [-1, 1000]
    assert r["metadata"]["outputs"]["layer4"][0] == -1


@pytest.mark.parametrize("case", ["grpc_raw", "grpc_typed", "rest_binary"])
def test_image_bytes_equal_the_sdk(kserve_run, case):
    """IMAGE BYTES for 3 images, 2 layers with their reductions (and a dtype): each
    image's answer equals the SDK's, over raw and typed gRPC contents and REST's
    binary-data extension."""
    server, _, out, _ = kserve_run
    got = np.load(out / f"{case}.npz")
    for name, params in LAYERS.items():
        assert got[name].shape[0] == len(IMAGES)
        for i, img in enumerate(IMAGES):
            want = sdk(server, img, name, params)
            assert got[name][i].dtype == want.dtype
            np.testing.assert_array_equal(got[name][i], want)


@pytest.mark.parametrize("case", ["grpc_pixels", "rest_pixels"])
def test_pixels_equal_the_sdk(kserve_run, case):
    """INPUT__0 as UINT8 elements (typed contents on gRPC; JSON integers on REST, the
    answers asked back as binary data)."""
    server, _, out, _ = kserve_run
    got = np.load(out / f"{case}.npz")
    for name, params in LAYERS.items():
        for i, px in enumerate(PIXELS):
            np.testing.assert_array_equal(got[name][i], sdk(server, px, name, params))


def test_errors_and_token(kserve_run):
    result = kserve_run[1]
    g, r = result["grpc"], result["rest"]
    assert g["unknown_layer"][0] == "INVALID_ARGUMENT"
    assert "unknown layer 'no.such.layer'" in g["unknown_layer"][1]
    assert r["unknown_layer"][0] == 400
    assert "unknown layer 'no.such.layer'" in r["unknown_layer"][1]
    assert "unknown layer 'no.such.layer'" in r["unknown_layer"][2]  # as the client says
    assert g["no_token"][0] == "UNAUTHENTICATED"
    assert r["no_token"][0] == 401 and "Authorization: Bearer" in r["no_token"][1]


def test_the_docs_kserve_example_runs(kserve_run, tmp_path):
    """docs/oip.md's KServe example as written (its fence is `python kserve`, so
    test_oip_docs.py, in hookserve's venv, leaves it to this test); only the addresses,
    the image paths and the token are this test's."""
    server, _, _, job = kserve_run
    doc = (ROOT / "docs" / "oip.md").read_text()
    (code,) = re.findall(r"```python kserve\n(.*?)```", doc, re.S)
    code = (code.replace("localhost:8001", server.address)
            .replace("localhost:8000", f"127.0.0.1:{server.server.http.port}"))
    script = tmp_path / "example.py"
    script.write_text(f"paths = {job['images']!r}\ntoken = {TOKEN!r}\n" + code)
    run = subprocess.run([str(KSERVE_PYTHON), str(script)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
