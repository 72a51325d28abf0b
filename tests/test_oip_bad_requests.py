"""Malformed and unusual Open Inference Protocol requests, over REST (raw bodies, as a
hand-written client or curl sends them) and gRPC (tritonclient and raw protobuf),
against a real server (resnet18, random weights): each gets its own status and a
message naming the field to change, nothing is logged as a server error, and the
server answers the next good request. Skipped without the http extra or tritonclient.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging

import numpy as np
import pytest

from conftest import RunningServer, encode, rand_image
from helpers import small_server

pytest.importorskip("starlette", reason="pip install hookserve[http]")
pytest.importorskip("uvicorn", reason="pip install hookserve[http]")
grpcclient = pytest.importorskip("tritonclient.grpc",
                                 reason="pip install hookserve[oip-clients]")
httpclient = pytest.importorskip("tritonclient.http",
                                 reason="pip install hookserve[oip-clients]")
from tritonclient.utils import InferenceServerException  # noqa: E402

IMG = encode(rand_image(40, 48, seed=3))
GOOD = {"name": "IMAGE", "datatype": "BYTES", "shape": [1],
        "data": [{"b64": base64.b64encode(IMG).decode()}]}


@pytest.fixture(scope="module")
def srv():
    s = RunningServer(small_server("--max-batch-delay-ms", "2", "--http-port", "0"))
    yield s
    s.stop(2.0)


def post(s, path: str, body: bytes | dict, headers: dict | None = None,
         method: str = "POST") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", s.server.http.port, timeout=120)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data if method == "POST" else None,
                     headers=headers or {})
        r = conn.getresponse()
        raw = r.read()
        n = int(r.getheader("Inference-Header-Content-Length") or len(raw))
        return r.status, json.loads(raw[:n])  # (the JSON part of a binary answer)
    finally:
        conn.close()


def infer(s, body, model: str = "resnet18", **kw):
    return post(s, f"/v2/models/{model}/infer", body, **kw)


def with_good(**fields) -> dict:
    return {"inputs": [GOOD], **fields}


BAD_BODIES = [  # (body, words the 400's message must hold)
    # base64 not wrapped as {"b64": ...} (it was decoded as "not a recognised image")
    ({"inputs": [{**GOOD, "data": [GOOD["data"][0]["b64"]]}]},
     'IMAGE: an element is a JSON string of base64 (it starts \'iVBORw0KGgoA\'): wrap it '
     'as {"b64": "..."}'),
    ({"inputs": {"IMAGE": GOOD}}, '"inputs" must be a JSON list, not an object'),
    ({"inputs": ["IMAGE"]}, "inputs[0] must be a JSON object, not a string"),
    ({"inputs": [None]}, "inputs[0] must be a JSON object, not null"),
    ({"inputs": [{**GOOD, "name": 7}]}, 'inputs[0]: "name" must be a non-empty string'),
    ({"inputs": [{k: v for k, v in GOOD.items() if k != "datatype"}]},
     "input 'IMAGE' has no \"datatype\": BYTES for IMAGE"),
    ({"inputs": [{k: v for k, v in GOOD.items() if k != "shape"}]},
     "input 'IMAGE' has no \"shape\""),
    ({"inputs": [{**GOOD, "shape": 1}]}, "input 'IMAGE': \"shape\" must be a JSON list"),
    ({"inputs": [{**GOOD, "shape": [True]}]}, "list of non-negative integers"),
    ({"inputs": [{**GOOD, "shape": [-1]}]}, "list of non-negative integers"),
    ({"inputs": [{k: v for k, v in GOOD.items() if k != "data"}]},
     "input 'IMAGE' has no \"data\""),
    ({"inputs": [{**GOOD, "parameters": []}]},
     "input 'IMAGE': \"parameters\" must be a JSON object, not a list"),
    ({"inputs": [{**GOOD, "parameters": {"binary_data_size": -4}}]},
     "binary_data_size must be a byte count"),
    ({"inputs": [{**GOOD, "parameters": {"binary_data_size": True}}]},
     "binary_data_size must be a byte count"),
    (with_good(outputs=["fc"]), "outputs[0] must be a JSON object, not a string"),
    (with_good(outputs={"name": "fc"}), '"outputs" must be a JSON list, not an object'),
    (with_good(outputs=[{"name": "fc", "parameters": [["reduction", "avg"]]}]),
     "output 'fc': \"parameters\" must be a JSON object, not a list"),
    (with_good(outputs=[{"name": "fc", "parameters": {"binary_data": "false"}}]),
     "binary_data must be true or false"),
    (with_good(parameters="mode=native"),
     "the request's \"parameters\" must be a JSON object, not a string"),
    (with_good(parameters=[["mode", "native"]]),
     "the request's \"parameters\" must be a JSON object, not a list"),
    (with_good(parameters={"binary_data_output": 1}), "binary_data_output must be true or"),
    (with_good(id=5), "the request's \"id\" must be a string, not a number"),
    ({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 2, 2, 3],
                  "data": [0.5] * 12}]}, "INPUT__0 is UINT8 [N, H, W, 3] pixels, not FP32"),
    ({"inputs": [{"name": "INPUT__0", "datatype": "UINT8", "shape": [1, 2, 2, 3],
                  "data": ["a"] * 12}]}, "UINT8 data must be integers"),
    (with_good(parameters={"resize": 300}),
     "mode=default takes no resize=300: add mode=resize_crop"),
    (with_good(parameters={"mode": "resize_crop", "resize": -5}),
     "resize=-5: use a size in pixels"),
    (with_good(parameters={"mode": "resize_crop", "crop_height": -3, "crop_width": -3}),
     "crop_height=-3: use a size in pixels"),
    (with_good(parameters={"mode": "resize_crop", "crop_height": 32}),
     "crop_height and crop_width go together"),
    (with_good(parameters={"mode": "resize_crop"}), "mode=resize_crop needs resize"),
    ({"inputs": [GOOD, {"name": "TARGET", "datatype": "INT64", "shape": [1],
                        "data": [3]}]}, "TARGET is for attribution models only"),
    ({"inputs": [{**GOOD, "name": ""}]},
     'inputs[0]: "name" must be a non-empty string, not an empty one'),
    ({"inputs": [{**GOOD, "datatype": 5}]},
     "input 'IMAGE' has a \"datatype\" that is a number, not a string"),
    # an integer parameter is digits: not what Python's int() also takes
    (with_good(parameters={"mode": "resize_crop", "resize": "1_000"}),
     "resize='1_000': use an integer"),
    (with_good(parameters={"mode": "resize_crop", "resize": " 64 "}),
     "resize=' 64 ': use an integer"),
    (with_good(parameters={"mode": "resize_crop", "resize": "\uff16\uff14"}),
     "use an integer"),
    (with_good(parameters={"mode": "resize_crop", "resize": "9" * 5000}), "use an integer"),
]


@pytest.mark.parametrize("body, words", BAD_BODIES,
                         ids=[f"case{i}" for i in range(len(BAD_BODIES))])
def test_a_malformed_rest_body_is_a_400_naming_the_field(srv, caplog, body, words):
    with caplog.at_level(logging.WARNING):
        status, answer = infer(srv, body)
    assert (status, words) == (400, words) and words in answer["error"], answer
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_server_goes_on_after_bad_bodies(srv):
    for body, _ in BAD_BODIES[:5]:
        assert infer(srv, body)[0] == 400
    status, answer = infer(srv, with_good(outputs=[{"name": "layer4", "parameters": {
        "reduction": "avg"}}]))
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 512]


def test_json_nested_too_deeply_is_a_400(srv):
    status, answer = infer(srv, b"[" * 200_000)
    assert status == 400 and "nested too deeply" in answer["error"]


def test_binary_bytes_no_input_accounts_for_are_refused(srv):
    head = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": len(IMG) + 4}}]})
    blob = len(IMG).to_bytes(4, "little") + IMG
    status, answer = infer(srv, head.encode() + blob + b"extra",
                           headers={"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "5 bytes after the JSON part" in answer["error"]


@pytest.mark.parametrize("model", ["resnet18.", ".grad_cam", "resnet18.nope"])
def test_names_that_are_no_served_model_are_404(srv, model):
    status, answer = infer(srv, with_good(), model=model)
    assert status == 404 and "unknown model" in answer["error"]


def test_routes_that_do_not_exist_answer_json(srv):
    status, answer = post(srv, "/v2/nothing/here", {}, method="GET")
    assert status == 404 and "no route GET /v2/nothing/here" in answer["error"]
    status, answer = post(srv, "/v2/repository/index", {})
    assert status == 501 and "model repository" in answer["error"]
    status, answer = post(srv, "/v2/models/resnet18/infer", {}, method="GET")
    assert status == 405 and "use POST" in answer["error"]
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{srv.server.http.port}")
    for call in (rest.get_model_repository_index, rest.get_trace_settings,
                 rest.get_log_settings, rest.get_system_shared_memory_status):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert "hookserve does not support" in err.value.message()
    # every model's statistics, as tritonclient asks for them
    names = {m["name"] for m in rest.get_inference_statistics()["model_stats"]}
    assert {"resnet18", "resnet18.grad_cam"} <= names
    rest.close()


def test_classes_are_named_only_by_the_models_own_labels(srv):
    """Random weights have no class names: ImageNet's would be a lie."""
    status, answer = infer(srv, with_good(outputs=[{"name": "fc", "parameters": {
        "classification": 3}}]))
    assert status == 200
    assert all(len(v.split(":")) == 2 for v in answer["outputs"][0]["data"])


def test_attribution_outputs_take_no_parameters_and_top_k_is_positive(srv):
    model = "resnet18.grad_cam"
    status, answer = infer(srv, with_good(outputs=[{"name": "map", "parameters": {
        "reduction": "avg"}}], parameters={"layer": "layer4"}), model=model)
    assert status == 400 and "output 'map' of resnet18.grad_cam takes no parameters" \
        in answer["error"]
    for k in (0, -1):
        status, answer = infer(srv, with_good(parameters={"layer": "layer4", "top_k": k}),
                               model=model)
        assert status == 400 and f"top_k={k}: use 1 or more" in answer["error"]
    status, answer = infer(srv, with_good(parameters={"layer": "layer4", "top_k": 2}),
                           model=model)
    assert status == 200
    shapes = {o["name"]: o["shape"] for o in answer["outputs"]}
    assert shapes["map"] == [1, 2, 7, 7] and shapes["logits"] == [1, 2]


def test_a_json_answer_is_held_to_the_limit_as_json(make_server):
    """layer4 unreduced is 100 KB in binary, about 650 KB at most as JSON."""
    s = make_server(*small_server("--http-port", "0", "--max-stream-buffer-bytes",
                                  "200000"))
    out = [{"name": "layer4"}]
    status, answer = infer(s, with_good(outputs=out, parameters={
        "binary_data_output": True}))
    assert status == 200 and answer["outputs"][0]["parameters"] == {
        "binary_data_size": 512 * 7 * 7 * 4}
    status, answer = infer(s, with_good(outputs=out))
    assert status == 429 and "binary_data_output=true" in answer["error"]
    status, answer = infer(s, with_good(outputs=[{"name": "layer4", "parameters": {
        "reduction": "avg"}}]))
    assert status == 200 and len(answer["outputs"][0]["data"]) == 512


def test_binary_and_json_outputs_share_the_answer_limit(make_server):
    """layer4 unreduced as JSON (up to 652 KB) fits 700 KB alone, and so does another
    100 KB layer in binary, but not both together."""
    s = make_server(*small_server("--http-port", "0", "--max-stream-buffer-bytes",
                                  "700000"))
    as_json = {"name": "layer4"}
    binary = {"name": "layer4.1.conv2", "parameters": {"binary_data": True}}
    assert infer(s, with_good(outputs=[as_json]))[0] == 200
    assert infer(s, with_good(outputs=[binary]))[0] == 200
    status, answer = infer(s, with_good(outputs=[as_json, binary]))
    assert status == 429 and "with JSON outputs could take 752640 bytes" in answer["error"]


def test_a_failed_stream_request_keeps_its_id(srv):
    import grpc

    from hookserve_server.oip import grpc_service_pb2 as pb
    good = pb.ModelInferRequest(model_name="resnet18", id="ok-1")
    good.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(IMG)
    bad = pb.ModelInferRequest(model_name="resnet18", id="bad-2")
    bad.CopyFrom(good)
    bad.id = "bad-2"
    bad.outputs.add(name="layer9")
    with grpc.insecure_channel(srv.address) as ch:
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        got = list(stream(iter([bad, good]), timeout=120))
    assert "unknown layer 'layer9'" in got[0].error_message
    assert (got[0].infer_response.id, got[0].infer_response.model_name) == ("bad-2",
                                                                           "resnet18")
    assert not got[1].error_message and got[1].infer_response.id == "ok-1"
    assert np.frombuffer(got[1].infer_response.raw_output_contents[0], "<f4").shape == (1000,)
