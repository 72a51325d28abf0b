"""What Triton's own clients meet at the Open Inference Protocol front door beyond a
plain infer, against a real server of two models from a model file: `r18.v2` (a name
with a dot) and `mob` (mobilenet_v3_small computing in bfloat16).

- Metadata, config, ready and statistics find every name infer finds (a dotted served
  name, its `<name>.<method>` models), and keep one count per model whatever the case
  of the method's name.
- Metadata gives each output the datatype a default request answers (FP32), whatever
  the model computes in.
- Shared memory, typed contents beside raw ones and an input given twice are refused
  by name (each was ignored, or refused with a message about something else).
- A gzip or deflate request body (tritonclient.http's request_compression_algorithm)
  is read, held to --max-message-bytes as it expands.
- A ModelStreamInfer stream that is open when the server drains refuses the next
  request it reads, with its id, and ends (it does not hold the drain).
"""

from __future__ import annotations

import base64
import gzip
import json
import queue
import zlib

import numpy as np
import pytest

from conftest import RunningServer, encode, rand_image

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install hookserve[oip-clients]")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install hookserve[oip-clients]")
pytest.importorskip("starlette", reason="pip install hookserve[http]")
from test_oip_bad_requests import post  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

MODELS = """
[[model]]
name = "r18.v2"
architecture = "resnet18"
weights = "random"

[[model]]
name = "mob"
architecture = "mobilenet_v3_small"
weights = "random"
dtype = "bfloat16"
"""
IMG = encode(rand_image(40, 48, seed=7))
#: the image as a REST input, and a REST body of it alone
GOOD = {"name": "IMAGE", "datatype": "BYTES", "shape": [1],
        "data": [{"b64": base64.b64encode(IMG).decode()}]}
ONE = {"inputs": [GOOD]}
LIMIT = 1_000_000


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    toml = tmp_path_factory.mktemp("models") / "models.toml"
    toml.write_text(MODELS)
    s = RunningServer(["--models", str(toml), "--seed", "0", "--http-port", "0",
                       "--max-batch-delay-ms", "2", "--max-message-bytes", str(LIMIT)])
    yield s
    s.stop(2.0)


@pytest.fixture
def g(srv):
    c = grpcclient.InferenceServerClient(srv.address)
    yield c
    c.close()


@pytest.fixture
def h(srv):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{srv.server.http.port}")
    yield c
    c.close()


def image(client, n: int = 1):
    t = client.InferInput("IMAGE", [n], "BYTES")
    t.set_data_from_numpy(np.array([IMG] * n, dtype=np.object_))
    return t


@pytest.mark.parametrize("name", ["r18.v2", "r18.v2.grad_cam", "r18.v2.GRAD_CAM"])
def test_a_dotted_served_name_has_metadata_and_config_over_both_transports(srv, g, h, name):
    canonical = name.replace("GRAD_CAM", "grad_cam")
    assert g.is_model_ready(name) and h.is_model_ready(name)
    meta = g.get_model_metadata(name, as_json=True)
    assert meta["name"] == canonical
    assert h.get_model_metadata(name)["name"] == canonical
    config = g.get_model_config(name, as_json=True)["config"]
    assert config["name"] == canonical
    assert h.get_model_config(name)["name"] == canonical
    outputs = {o["name"] for o in meta["outputs"]}
    assert ("map" in outputs) == ("grad_cam" in canonical)
    assert ("layer4" in outputs) == ("grad_cam" not in canonical)


@pytest.mark.parametrize("name, words", [
    ("r18", "unknown model 'r18': name one of r18.v2, mob"),
    ("r18.v2.grad_cam.x", "unknown model 'r18.v2.grad_cam.x': name one of"),
    ("r18.v2..grad_cam", "unknown model 'r18.v2..grad_cam'"),
    ("r18.v2.gradcam", "an attribution model is <model>.<method>"),
])
def test_unknown_names_are_named_as_sent(g, name, words):
    for call in (lambda: g.get_model_metadata(name), lambda: g.infer(name, [image(grpcclient)])):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert str(err.value.status()) == "StatusCode.NOT_FOUND"
        assert words in err.value.message() and "ListModels" not in err.value.message()


def test_metadata_datatypes_are_what_a_default_request_answers(g, h):
    meta = g.get_model_metadata("mob", as_json=True)
    declared = {o["name"]: o["datatype"] for o in meta["outputs"]}
    assert set(declared.values()) == {"FP32"}
    assert {o["name"]: o["datatype"] for o in h.get_model_metadata("mob")["outputs"]} == declared
    res = g.infer("mob", [image(grpcclient)],
                  outputs=[grpcclient.InferRequestedOutput(n)
                           for n in ("features.0.0", "classifier.3")])
    for name in ("features.0.0", "classifier.3"):
        assert res.get_output(name).datatype == declared[name]
        assert res.as_numpy(name).dtype == np.float32


def test_case_variants_of_a_method_count_under_its_one_name(g):
    before = g.get_inference_statistics("r18.v2.grad_cam", as_json=True)
    n0 = int(before["model_stats"][0].get("inference_count", 0))
    for name in ("r18.v2.GRAD_CAM", "r18.v2.Grad_Cam", "r18.v2.grad_cam"):
        g.infer(name, [image(grpcclient)])
    after = g.get_inference_statistics("r18.v2.Grad_Cam", as_json=True)["model_stats"]
    assert [s["name"] for s in after] == ["r18.v2.grad_cam"]
    assert int(after[0]["inference_count"]) == n0 + 3
    every = g.get_inference_statistics(as_json=True)["model_stats"]
    assert sum(int(s.get("inference_count", 0)) for s in every
               if s["name"].startswith("r18.v2.")) == n0 + 3


def _shared(client, t):
    t.set_shared_memory("region", 1000)
    return t


@pytest.mark.parametrize("client", [grpcclient, httpclient], ids=["grpc", "http"])
def test_shared_memory_is_refused_by_name(g, h, client):
    c = g if client is grpcclient else h
    with pytest.raises(InferenceServerException) as err:
        c.infer("r18.v2", [_shared(client, client.InferInput("IMAGE", [1], "BYTES"))])
    assert "shared_memory_region: hookserve has no shared memory" in err.value.message()
    out = client.InferRequestedOutput("fc")
    out.set_shared_memory("region", 4000)
    with pytest.raises(InferenceServerException) as err:
        c.infer("r18.v2", [image(client)], outputs=[out])
    assert "output 'fc': shared_memory_region: hookserve has no shared memory" \
        in err.value.message()


def test_typed_contents_beside_raw_ones_and_an_input_twice_are_refused(srv, g):
    import grpc

    from hookserve_server.oip import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name="r18.v2.grad_cam")
    req.inputs.add(name="IMAGE", datatype="BYTES", shape=[1])
    t = req.inputs.add(name="TARGET", datatype="INT64", shape=[1])
    t.contents.int64_contents.append(3)
    req.raw_input_contents.extend([len(IMG).to_bytes(4, "little") + IMG,
                                   np.int64(5).tobytes()])
    with grpc.insecure_channel(srv.address) as ch:
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            infer(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'TARGET' has typed contents beside raw_input_contents" \
            in err.value.details()
    target = {"name": "TARGET", "datatype": "INT64", "shape": [1], "data": [3]}
    status, body = post(srv, "/v2/models/r18.v2.grad_cam/infer",
                        {"inputs": [GOOD, target, {**target, "data": [5]}]})
    assert status == 400 and "input 'TARGET' is given twice" in body["error"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_body_is_read(h, algorithm):
    plain = h.infer("r18.v2", [image(httpclient, 2)])
    packed = h.infer("r18.v2", [image(httpclient, 2)], request_compression_algorithm=algorithm)
    # (the same images; batches may form otherwise, which moves the last bits)
    np.testing.assert_allclose(packed.as_numpy("fc"), plain.as_numpy("fc"), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("encoding, data, status, words", [
    ("br", b"{}", 400, "Content-Encoding br is not one this server reads"),
    ("gzip", b"not gzip at all", 400, "the body is not the gzip data"),
    ("gzip", gzip.compress(b'{"inputs": []}')[:-12], 400, "the gzip body is cut short"),
    ("deflate", zlib.compress(b" " * (LIMIT + 1)), 429, f"expands to over {LIMIT} bytes"),
    ("gzip", gzip.compress(b'{"inputs": []}') + b"garbage", 400, "is not the gzip data"),
    ("gzip", gzip.compress(b" " * LIMIT) + gzip.compress(b" "), 429, "expands to over"),
    ("gzip", gzip.compress(b"", mtime=0) * 65, 400, "the gzip body has over 64 members"),
])
def test_a_compressed_body_that_cannot_be_read_is_refused(srv, encoding, data, status, words):
    got, body = post(srv, "/v2/models/r18.v2/infer", data, {"Content-Encoding": encoding})
    assert got == status and words in body["error"], body
    assert post(srv, "/v2/models/r18.v2/infer", gzip.compress(json.dumps(ONE).encode()),
                {"Content-Encoding": "gzip"})[0] == 200


def test_a_gzip_body_of_several_members_is_read_whole(srv):
    body = json.dumps(ONE)
    half = len(body) // 2
    packed = gzip.compress(body[:half].encode()) + gzip.compress(body[half:].encode())
    status, answer = post(srv, "/v2/models/r18.v2/infer", packed, {"Content-Encoding": "gzip"})
    assert status == 200 and answer["outputs"][0]["name"] == "fc", answer


def test_a_rest_refusal_to_retry_says_when_in_retry_after(make_server):
    import http.client

    s = make_server("--model", "resnet18", "--weights", "random", "--http-port", "0",
                    "--max-streams", "1")
    body = json.dumps(ONE)
    hold = s.server.stream_caps.work_slot("Extract")   # the one work call allowed
    hold.__enter__()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.server.http.port, timeout=60)
        conn.request("POST", "/v2/models/resnet18/infer", body)
        r = conn.getresponse()
        r.read()
        assert r.status == 429 and int(r.getheader("Retry-After")) >= 1
        conn.close()
    finally:
        hold.__exit__(None, None, None)


def _answered_stream(make_server, rid: str):
    """(server, tritonclient, answers queue) of a ModelStreamInfer stream whose one
    request `rid` was answered, the stream left open."""
    s = make_server("--model", "resnet18", "--weights", "random", "--seed", "0",
                    "--max-batch-delay-ms", "2")
    c = grpcclient.InferenceServerClient(s.address)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    c.async_stream_infer("resnet18", [image(grpcclient)], request_id=rid)
    result, error = answers.get(timeout=120)
    assert error is None and result.get_response().id == rid
    return s, c, answers


def test_a_stream_open_at_drain_refuses_its_next_request_by_id_and_ends(make_server):
    s, c, answers = _answered_stream(make_server, "before")
    s.server.stream_caps.start_drain(s.server.engine.start_drain)
    c.async_stream_infer("resnet18", [image(grpcclient)], request_id="after")
    result, error = answers.get(timeout=120)
    # refused by its id, or (the drain began while the last answer was on its way) the
    # stream's last message: requests after the last answer were not read
    assert result is None and "[UNAVAILABLE] server is shutting down" in error.message()
    # the stream ended there: it holds no work slot, so the drain need not wait for it
    assert s.server.stream_caps.wait_idle(60)
    c.stop_stream()
    c.close()


@pytest.mark.parametrize("params, words", [
    ({"mode": None}, "request parameter mode=null: use one of"),
    ({"resize": True}, "request parameter resize=true: use an integer"),
])
def test_rest_messages_show_values_as_json_writes_them(srv, params, words):
    status, body = post(srv, "/v2/models/r18.v2/infer", {"inputs": [GOOD],
                                                         "parameters": params})
    assert status == 400 and words in body["error"], body
    status, body = post(srv, "/v2/models/r18.v2/infer", {"inputs": [GOOD], "outputs": [
        {"name": "fc", "parameters": {"classification": True}}]})
    assert status == 400 and "classification=true: use an integer" in body["error"], body


def test_a_stream_waiting_for_its_next_request_is_ended_at_drain(make_server):
    s, c, answers = _answered_stream(make_server, "only")
    s.server.start_drain()   # the stream sends nothing more, and never closes
    assert s.server.stream_caps.wait_idle(60), "an idle stream held the drain"
    c.stop_stream()
    c.close()
