"""The Open Inference Protocol's REST routes (`--http-port`) with tritonclient.http as
published and with curl, against a real server on 127.0.0.1 (resnet18, random
weights). Answers must equal the SDK's; errors carry the right status and message.
Skipped without the http extra or tritonclient."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import struct
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

import hookserve

from conftest import RunningServer, encode, rand_image
from helpers import METRICS, ServeProcess, computed, small_server, wait_until

pytest.importorskip("starlette", reason="pip install hookserve[http]")
pytest.importorskip("uvicorn", reason="pip install hookserve[http]")
httpclient = pytest.importorskip("tritonclient.http",
                                 reason="pip install hookserve[oip-clients]")
from tritonclient.utils import InferenceServerException  # noqa: E402

R18 = small_server("--max-batch-delay-ms", "2", "--http-port", "0")
IMAGES = [encode(rand_image(40 + 8 * i, 48, seed=i)) for i in range(3)]


@pytest.fixture(scope="module")
def http_server():
    s = RunningServer(R18)
    yield s
    s.stop(2.0)


@pytest.fixture
def rest(http_server):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{http_server.server.http.port}")
    yield c
    c.close()


def image_input(images: list[bytes]):
    t = httpclient.InferInput("IMAGE", [len(images)], "BYTES")
    t.set_data_from_numpy(np.array(images, dtype=np.object_))
    return t


def output(name: str, **params):
    o = httpclient.InferRequestedOutput(name)
    o._parameters.update(params)  # tritonclient.http's way to set output parameters
    return o


def sdk(server, image, layer, **params):
    with hookserve.Client(server.address, timeout=120) as c:
        return c.extract(image, layer, **params)[layer]


def test_health_and_metadata(rest):
    assert rest.is_server_live() and rest.is_server_ready()
    assert rest.is_model_ready("resnet18") and not rest.is_model_ready("resnet99")
    assert rest.get_server_metadata()["name"] == "hookserve"
    m = rest.get_model_metadata("resnet18")
    assert {t["name"] for t in m["inputs"]} == {"IMAGE", "INPUT__0"}
    assert {t["name"]: t["shape"] for t in m["outputs"]}["fc"] == [-1, 1000]
    assert all(i["optional"] for i in rest.get_model_config("resnet18")["input"])


def test_infer_binary_equals_the_sdk(rest, http_server):
    layers = {"layer3.1.conv2": {}, "layer4": {"reduction": "avg"},
              "layer2.0.relu_1": {"reduction": "max", "dtype": "float16"}}
    res = rest.infer("resnet18", [image_input(IMAGES)],
                     outputs=[output(n, **p) for n, p in layers.items()])
    for name, params in layers.items():
        got = res.as_numpy(name)
        for i, img in enumerate(IMAGES):
            np.testing.assert_array_equal(got[i], sdk(http_server, img, name, **params))
    top = rest.infer("resnet18", [image_input(IMAGES[:1])],
                     outputs=[httpclient.InferRequestedOutput("fc", class_count=5)])
    assert top.as_numpy("fc").shape == (1, 5)


def test_json_pixels_and_json_outputs(rest, http_server):
    """INPUT__0 as JSON integers, the answer as JSON numbers (no binary data)."""
    pixels = np.stack([rand_image(32, 32, seed=s) for s in (5, 6)])
    t = httpclient.InferInput("INPUT__0", list(pixels.shape), "UINT8")
    t.set_data_from_numpy(pixels, binary_data=False)
    res = rest.infer("resnet18", [t], outputs=[
        output("layer4", reduction="avg", binary_data=False),
        httpclient.InferRequestedOutput("fc", binary_data=False, class_count=3)])
    got = res.as_numpy("layer4")
    for i in range(2):
        np.testing.assert_allclose(got[i], sdk(http_server, pixels[i], "layer4",
                                               reduction="avg"), rtol=1e-6)
    assert res.as_numpy("fc").shape == (2, 3)
    assert res.get_output("layer4")["data"]  # sent as JSON


def test_errors(rest):
    with pytest.raises(InferenceServerException) as err:
        rest.infer("resnet18", [image_input([IMAGES[0], b"junk"])])
    assert err.value.status() == "400" and "IMAGE[1]" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        rest.infer("resnet18", [image_input(IMAGES[:1])], outputs=[output("nope")])
    assert err.value.status() == "400" and "unknown layer 'nope'" in err.value.message()


def post(url: str, body: bytes | None, method: str = "POST") -> tuple[int, dict]:
    """(HTTP status, the JSON body) of one REST call, errors included."""
    req = urllib.request.Request(url, body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


LONE = "\ud800"   # legal in JSON, no UTF-8 text: an error that repeats it must still go out


@pytest.mark.parametrize("where", ["datatype", "input parameter", "output parameter",
                                   "bytes element", "input name", "layer"])
def test_a_lone_surrogate_anywhere_is_a_400_with_a_json_error(http_server, where):
    image = {"name": "IMAGE", "datatype": "BYTES", "shape": [1],
             "data": [{"b64": base64.b64encode(IMAGES[0]).decode()}]}
    out = {"name": "layer4"}
    if where == "datatype":
        image["datatype"] = LONE
    elif where == "input parameter":
        image["parameters"] = {"shared_memory_" + LONE: 1}
    elif where == "output parameter":
        out["parameters"] = {LONE: 1}
    elif where == "bytes element":
        image["data"] = [LONE]
    elif where == "input name":
        image["name"] = LONE
    else:
        out["name"] = LONE
    body = json.dumps({"inputs": [image], "outputs": [out]}).encode()
    code, answer = post(f"http://127.0.0.1:{http_server.server.http.port}"
                        "/v2/models/resnet18/infer", body)
    assert code == 400, (code, answer)
    assert answer["error"]
    # and the server goes on
    assert post(f"http://127.0.0.1:{http_server.server.http.port}/v2/health/ready",
                None, "GET")[0] == 200


@pytest.mark.parametrize("path", ["/v2/", "/v2/health/live/", "/v2/models/resnet18/",
                                  "/v2/models/resnet18/infer/"])
def test_a_path_with_a_slash_too_many_is_no_route(http_server, path):
    code, answer = post(f"http://127.0.0.1:{http_server.server.http.port}{path}",
                        b"{}" if path.endswith("infer/") else None,
                        "POST" if path.endswith("infer/") else "GET")
    assert code == 404 and "no route" in answer["error"], (code, answer)


def curl(*args: str) -> tuple[int, bytes]:
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], check=True,
                         capture_output=True, timeout=120).stdout
    body, _, code = out.rpartition(b"\n")
    return int(code), body


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_json_and_base64(http_server):
    base = f"http://127.0.0.1:{http_server.server.http.port}"
    assert curl(f"{base}/v2/health/live") == (200, b'{"live":true}')
    request = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                           "data": [{"b64": base64.b64encode(IMAGES[0]).decode()}]}],
               "outputs": [{"name": "layer4", "parameters": {"reduction": "avg"}}]}
    code, body = curl("-H", "Content-Type: application/json", "-d", json.dumps(request),
                      f"{base}/v2/models/resnet18/infer")
    assert code == 200
    out = json.loads(body)["outputs"][0]
    assert out["shape"] == [1, 512] and out["datatype"] == "FP32"
    np.testing.assert_array_equal(np.array(out["data"], np.float32),
                                  sdk(http_server, IMAGES[0], "layer4", reduction="avg"))
    code, body = curl("-d", "{not json", f"{base}/v2/models/resnet18/infer")
    assert code == 400 and "not JSON" in json.loads(body)["error"]


def test_token_and_body_limit(tmp_path):
    token = tmp_path / "token"
    token.write_text("rest-s3cret\n")
    s = RunningServer([*R18, "--auth-token-file", str(token), "--max-message-bytes",
                       "200000"])
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{s.server.http.port}")
        assert c.is_server_live()  # health stays open, as on gRPC
        with pytest.raises(InferenceServerException) as err:
            c.infer("resnet18", [image_input(IMAGES[:1])])
        assert err.value.status() == "401"
        auth = {"Authorization": "Bearer rest-s3cret"}
        res = c.infer("resnet18", [image_input(IMAGES[:1])], headers=auth)
        assert res.as_numpy("fc").shape == (1, 1000)
        with pytest.raises(InferenceServerException) as err:
            c.infer("resnet18", [image_input([b"x" * 300_000])], headers=auth)
        assert err.value.status() == "429" and "--max-message-bytes" in err.value.message()
        c.close()
    finally:
        s.stop(2.0)


def test_hookserve_serve_process_with_both_front_doors():
    """A real `hookserve serve --http-port 0`: tritonclient over gRPC and REST, then
    SIGTERM drains and the process exits 0."""
    import queue
    import signal

    import tritonclient.grpc as grpcclient

    proc = ServeProcess(*small_server("--http-port", "0"))
    try:
        line = ""
        while "REST routes on" not in line:
            try:
                line = json.loads(proc.lines.get(timeout=30))["msg"]
            except queue.Empty:
                raise AssertionError("".join(proc.log[-20:])) from None
        http_port = int(line.split("REST routes on ")[1].split(" ")[0].rsplit(":", 1)[1])
        g = grpcclient.InferenceServerClient(proc.address)
        inp = grpcclient.InferInput("IMAGE", [1], "BYTES")
        inp.set_data_from_numpy(np.array(IMAGES[:1], dtype=np.object_))
        via_grpc = g.infer("resnet18", [inp]).as_numpy("fc")
        h = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        via_rest = h.infer("resnet18", [image_input(IMAGES[:1])]).as_numpy("fc")
        np.testing.assert_array_equal(via_grpc, via_rest)
        h.close()
        g.close()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0
    finally:
        proc.kill()


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_rest_over_tls(tmp_path):
    """--tls-cert/--tls-key cover the REST routes too: curl trusting the CA gets an
    answer; plaintext gets none."""
    from certs import CA
    ca = CA("server", tmp_path)
    cert = ca.issue("hookserve-server", server=True)
    s = RunningServer([*R18, "--tls-cert", str(cert.cert_path),
                       "--tls-key", str(cert.key_path)])
    try:
        port = s.server.http.port
        code, body = curl("--cacert", str(ca.path), f"https://127.0.0.1:{port}/v2/health/live")
        assert (code, json.loads(body)) == (200, {"live": True})
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                              f"http://127.0.0.1:{port}/v2/health/live"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout != "200"
    finally:
        s.stop(2.0)


@pytest.mark.parametrize("body, batch, n", [("binary", "1", 60), ("json", "8", 128)])
def test_a_client_that_goes_away_cancels_its_infer(body, batch, n):
    """A REST client disconnects while its images are at the model: the call is
    cancelled, the images not yet at the model are dropped (the model's image counter
    stops short), and the call counts as failed, not answered (one whose session ended
    quietly under the cancel was counted as answered, with the images that were)."""
    s = RunningServer([*R18, *METRICS, "--max-batch-size", batch])
    try:
        images = [encode(rand_image(64, 64, seed=100 + i)) for i in range(n)]
        out = [{"name": "layer4", "parameters": {"reduction": "avg"}}]
        if body == "binary":
            raw = b"".join(struct.pack("<I", len(b)) + b for b in images)
            head = json.dumps({
                "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [n],
                            "parameters": {"binary_data_size": len(raw)}}],
                "outputs": out}).encode()
            kind, extra, data = (b"application/octet-stream",
                                 b"Inference-Header-Content-Length: %d\r\n" % len(head),
                                 head + raw)
        else:
            data = json.dumps({
                "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [n],
                            "data": [{"b64": base64.b64encode(b).decode()} for b in images]}],
                "outputs": out}).encode()
            kind, extra = b"application/json", b""
        counts = s.server.http.inference.counts
        base = computed(s)
        conn = socket.create_connection(("127.0.0.1", s.server.http.port), timeout=60)
        conn.sendall(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: hookserve\r\n"
                     b"Content-Type: %s\r\n%sContent-Length: %d\r\n\r\n"
                     % (kind, extra, len(data)) + data)
        wait_until(lambda: computed(s) > base, what="the first image to reach the model")
        conn.close()
        wait_until(lambda: counts.of("resnet18").fail + counts.of("resnet18").success,
                   what="the call to end")
        wait_until(lambda: s.engine.queued == 0, what="its queued images to be dropped")
        assert (counts.of("resnet18").fail, counts.of("resnet18").success) == (1, 0)
        assert computed(s) - base < n // 2, computed(s) - base
    finally:
        s.stop(2.0)


def test_the_timeout_parameter_is_the_calls_deadline(rest):
    """tritonclient's infer(timeout=µs) is the request parameter `timeout`: a deadline
    already passed when the images reach the engine ends the call with 504; a generous
    one answers; a negative one is refused."""
    with pytest.raises(InferenceServerException) as err:
        rest.infer("resnet18", [image_input(IMAGES)], timeout=1)
    assert err.value.status() == "504" and "deadline" in err.value.message()
    ok = rest.infer("resnet18", [image_input(IMAGES[:1])], timeout=120_000_000)
    assert ok.as_numpy("fc").shape == (1, 1000)
    with pytest.raises(InferenceServerException) as err:
        rest.infer("resnet18", [image_input(IMAGES[:1])], timeout=-1)
    assert err.value.status() == "400" and "timeout=-1" in err.value.message()
