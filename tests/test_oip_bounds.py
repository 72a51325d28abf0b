"""The Open Inference Protocol front door holds every request to the answer limit
before it does the work, and refuses out-of-range parameters by name.

- A request whose images' answers cannot fit (N images of a fixed size) is refused
  before any image runs.
- A classification output is held to the limit before its names are made (k was
  bounded only by the layer: `classification=1e9` on layer1 built 148 MB of strings).
- A `timeout` too large for a float is no limit, not an INTERNAL; `sg_seed` outside
  uint64 and a boolean `sg_sigma` are 400s.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from conftest import encode, rand_image
from helpers import small_server, wait_until

pytest.importorskip("starlette", reason="pip install hookserve[http]")
pytest.importorskip("uvicorn", reason="pip install hookserve[http]")

from test_oip_bad_requests import infer  # noqa: E402

IMG = encode(rand_image(64, 64, seed=5), "PNG")
GOOD = {"name": "IMAGE", "datatype": "BYTES", "shape": [1],
        "data": [{"b64": base64.b64encode(IMG).decode()}]}
LIMIT = 2_000_000


@pytest.fixture(scope="module")
def srv(request):
    from conftest import RunningServer

    s = RunningServer(small_server("--http-port", "0", "--max-stream-buffer-bytes",
                                   str(LIMIT), "--max-batch-delay-ms", "2"))
    request.addfinalizer(lambda: s.stop(2.0))
    return s


def test_a_request_whose_answer_cannot_fit_is_refused_before_any_image(srv):
    n = 100_000   # fc: 4000 bytes an image
    pixels = {"name": "INPUT__0", "datatype": "UINT8", "shape": [n, 1, 1, 3],
              "parameters": {"binary_data_size": 3 * n}}
    body = (b'{"inputs": [' + str(pixels).replace("'", '"').encode() + b']}')
    head = len(body)
    status, answer = infer(srv, body + bytes(3 * n), headers={
        "Inference-Header-Content-Length": str(head)})
    assert status == 429, answer
    assert f"{n} images of 4000 bytes of answer each make {n * 4000} bytes, over " \
           f"{LIMIT}" in answer["error"]


def test_a_classification_is_held_to_the_limit_before_its_names_are_made(srv):
    huge = {"name": "layer1", "parameters": {"classification": 10**9}}
    status, answer = infer(srv, {"inputs": [GOOD], "outputs": [huge]})
    assert status == 429, answer
    assert "output layer1 with classification=200704 makes up to" in answer["error"]
    # a small one is the top k, in order, as the plain output says
    status, top = infer(srv, {"inputs": [GOOD], "outputs": [
        {"name": "fc", "parameters": {"classification": 5}}]})
    status2, plain = infer(srv, {"inputs": [GOOD], "outputs": [{"name": "fc"}]})
    assert status == status2 == 200
    logits = np.asarray(plain["outputs"][0]["data"], dtype=np.float32)
    want = [f"{float(logits[i]):f}:{i}" for i in np.argsort(-logits, kind="stable")[:5]]
    assert top["outputs"][0]["data"] == want


@pytest.mark.parametrize("model, params, status, words", [
    ("resnet18", {"timeout": 10**400}, 200, None),
    ("resnet18.smooth_grad", {"sg_samples": 2, "sg_seed": 2**64}, 400,
     "sg_seed=18446744073709551616: use 0 to 2^64-1"),
    ("resnet18.smooth_grad", {"sg_samples": 2, "sg_seed": -1}, 400, "use 0 to 2^64-1"),
    ("resnet18.smooth_grad", {"sg_sigma": True}, 400, "sg_sigma=true: use a number"),
    ("resnet18.smooth_grad", {"sg_sigma": 1e39}, 400, "sg_sigma=1e+39: use 0 to 1000"),
    ("resnet18.gradient", {"upsample": True}, 400, "upsample is for the CAM methods' maps"),
])
def test_parameters_out_of_range_are_named(srv, model, params, status, words):
    got, answer = infer(srv, {"inputs": [GOOD], "parameters": params}, model=model)
    assert got == status, answer
    if words:
        assert words in answer["error"], answer


def test_request_bodies_held_at_once_are_bounded(make_server):
    """Clients that announce large bodies and send them slowly hold the server's
    memory: past four bodies' worth, the next request is 429 at once, and served again
    once the others are gone."""
    import socket

    from hookserve_server.oip.http import BODIES

    limit = 100_000
    s = make_server(*small_server("--http-port", "0", "--max-message-bytes", str(limit)))
    http = s.server.http
    slow = []
    try:
        for _ in range(BODIES):
            c = socket.create_connection(("127.0.0.1", http.port))
            c.sendall(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Content-Length: {limit}\r\n\r\n".encode() + b'{"inputs": [')
            slow.append(c)
        wait_until(lambda: http._held >= BODIES * limit, 30, "the slow bodies held")
        status, answer = infer(s, {"inputs": [GOOD]})
        assert status == 429 and "request bodies' worth of bytes" in answer["error"]
    finally:
        for c in slow:
            c.close()
    wait_until(lambda: http._held == 0, 30, "the slow bodies let go")
    assert infer(s, {"inputs": [GOOD]})[0] == 200


def test_a_shape_that_claims_more_images_than_it_holds_is_the_requests_mistake(srv):
    status, answer = infer(srv, {"inputs": [{**GOOD, "shape": [10**7]}]})
    assert status == 400 and "shape [10000000] says 10000000 images" in answer["error"], answer


def test_an_attribution_whose_maps_cannot_fit_is_refused_before_any_image(srv):
    """resnet18.gradient with top_k=8: 8 maps of 3x224x224 floats an image."""
    n = 2
    status, answer = infer(srv, {"inputs": [{**GOOD, "shape": [n], "data": GOOD["data"] * n}],
                                 "parameters": {"top_k": 8}}, model="resnet18.gradient")
    assert status == 429, answer
    assert f"{n} images of " in answer["error"] and "bytes of answer each" in answer["error"]


@pytest.mark.parametrize("model, body, words", [
    ("resnet18.grad_cam", {"parameters": {"ig_steps": 5}},
     "ig_steps is an option of integrated_gradients, not of grad_cam"),
    ("resnet18.gradient", {"parameters": {"sg_samples": 5}},
     "sg_samples is an option of smooth_grad"),
    ("resnet18.grad_cam", {"parameters": {"target": 5}, "extra": [
        {"name": "TARGET", "datatype": "INT64", "shape": [1], "data": [7]}]},
     "both the TARGET input and the target parameter"),
])
def test_attribution_parameters_that_would_be_ignored_are_refused(srv, model, body, words):
    got, answer = infer(srv, {"inputs": [GOOD, *body.pop("extra", [])], **body}, model=model)
    assert got == 400 and words in answer["error"], answer


def _model_infer(srv, req):
    """ModelInfer over a raw channel: (status code, details)."""
    import grpc

    from hookserve_server.oip import grpc_service_pb2 as pb
    with grpc.insecure_channel(srv.address) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString)
        try:
            call(req, timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", ""


def _request(**inputs):
    from hookserve_server.oip import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name="resnet18")
    for name, (datatype, shape) in inputs.items():
        req.inputs.add(name=name, datatype=datatype, shape=shape)
    return req


@pytest.mark.parametrize("case, words", [
    # many inputs: refused by their count before each is read (the name check was
    # quadratic: 50,000 inputs took 18 s of the server's CPU)
    ("inputs", "20000 inputs: a request has one image input (IMAGE or INPUT__0)"),
    ("outputs", "20000 layers requested, over the limit of 256"),
    # many empty images in few bytes (4 bytes each on the wire, ~100 as objects)
    ("raw images", "5000 images in one request, over the limit of 4096"),
    ("typed images", "input 'IMAGE': 5000 images in one request, over the limit of 4096"),
    # typed contents counted against the shape before any is copied out
    ("typed count", "input 'IMAGE': shape [1] says 1 elements, its typed contents hold 3"),
    ("typed pixels", "INPUT__0: UINT8 contents hold a value over 255"),
])
def test_counts_a_request_controls_are_bounded_before_they_cost(srv, case, words):
    if case == "inputs":
        req = _request(**{f"i{i}": ("BYTES", [1]) for i in range(20000)})
    elif case == "outputs":
        req = _request(IMAGE=("BYTES", [1]))
        req.raw_input_contents.append(len(IMG).to_bytes(4, "little") + IMG)
        for i in range(20000):
            req.outputs.add(name=f"o{i}")
    elif case == "raw images":   # (native: no fixed answer size to refuse them by)
        req = _request(IMAGE=("BYTES", [5000]))
        req.parameters["mode"].string_param = "native"
        req.raw_input_contents.append(bytes(4 * 5000))
    elif case == "typed images":
        req = _request(IMAGE=("BYTES", [5000]))
        req.inputs[0].contents.bytes_contents.extend([b""] * 5000)
    elif case == "typed count":
        req = _request(IMAGE=("BYTES", [1]))
        req.inputs[0].contents.bytes_contents.extend([IMG] * 3)
    else:
        req = _request(INPUT__0=("UINT8", [1, 2, 2, 3]))
        req.inputs[0].contents.uint_contents.extend([7] * 11 + [300])
    code, details = _model_infer(srv, req)
    assert code == "INVALID_ARGUMENT" and words in details, details


def test_typed_pixels_equal_raw_ones(srv):
    px = rand_image(40, 40, seed=9)
    typed = _request(INPUT__0=("UINT8", [1, 40, 40, 3]))
    typed.inputs[0].contents.uint_contents.extend(px.ravel().tolist())
    raw = _request(INPUT__0=("UINT8", [1, 40, 40, 3]))
    raw.raw_input_contents.append(px.tobytes())
    import grpc

    from hookserve_server.oip import grpc_service_pb2 as pb
    with grpc.insecure_channel(srv.address) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString)
        a, b = call(typed, timeout=60), call(raw, timeout=60)
    assert a.raw_output_contents[0] == b.raw_output_contents[0]


def test_a_stalled_body_lets_go_of_what_it_holds(make_server):
    """Bodies that stop arriving (a client stalled mid-upload) are answered 408 after
    the body's idle limit, and their hold on the REST bodies is released."""
    import socket

    from hookserve_server.oip.http import BODIES

    s = make_server(*small_server("--http-port", "0", "--max-message-bytes", "100000"))
    http = s.server.http
    http.body_idle_s = 0.5   # (30 s by default)
    stalled = []
    try:
        for _ in range(BODIES):
            c = socket.create_connection(("127.0.0.1", http.port))
            c.sendall(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            stalled.append(c)
        for c in stalled:
            c.settimeout(60)
            answer = c.recv(4096).decode()
            while not answer.endswith("}"):   # the JSON body may come in its own read
                answer += c.recv(4096).decode()
            assert answer.startswith("HTTP/1.1 408"), answer
            assert "no byte of the request body arrived for 0.5 s (1 bytes read)" in answer
    finally:
        for c in stalled:
            c.close()
    wait_until(lambda: http._held == 0, 30, "the stalled bodies let go")
    assert infer(s, {"inputs": [GOOD]})[0] == 200
    # a body trickled in a byte at a time, each within the pause allowed
    c = socket.create_connection(("127.0.0.1", http.port))
    try:
        c.sendall(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        c.settimeout(0.2)
        answer = b""
        for _ in range(100):   # (each wait is the socket's timeout)
            c.sendall(b" ")
            try:
                answer = c.recv(4096)
                break
            except TimeoutError:
                continue
        assert answer.startswith(b"HTTP/1.1 408"), answer
        c.settimeout(30)
        while not answer.endswith(b"}"):   # the JSON body may come in its own read
            answer += c.recv(4096)
        assert b"the request body arrives at" in answer
    finally:
        c.close()


@pytest.mark.parametrize("field, value, owner", [
    ("ig_steps", 5, "integrated_gradients"), ("sg_samples", 3, "smooth_grad"),
    ("sg_sigma", 0.2, "smooth_grad"), ("ig_baseline", 2, "integrated_gradients"),
])
def test_the_native_api_refuses_another_methods_option_as_the_oip_does(srv, field, value,
                                                                        owner):
    """A grad_cam spec with integrated gradients' steps set: refused by name (it was
    ignored; the Open Inference Protocol's door refused it)."""
    import grpc

    from hookserve.v1 import hookserve_pb2 as hpb
    from hookserve.v1 import hookserve_pb2_grpc as hgrpc
    spec = hpb.AttributionSpec(model="resnet18", layer="layer4",
                               method=hpb.ATTRIBUTION_METHOD_GRAD_CAM, **{field: value})
    image = hpb.AttributeImage(image=hpb.Image(id="a", encoded=IMG))
    with grpc.insecure_channel(srv.address) as ch:
        call = hgrpc.FeatureExtractorStub(ch).Attribute(
            iter([hpb.AttributeRequest(spec=spec), hpb.AttributeRequest(image=image)]),
            timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"AttributionSpec.{field} is an option of {owner}, not of grad_cam" \
        in err.value.details()


def test_typed_values_in_another_types_field_name_the_right_one(srv):
    req = _request(INPUT__0=("UINT8", [1, 2, 2, 3]))
    req.inputs[0].contents.fp32_contents.extend([0.5] * 12)
    code, details = _model_infer(srv, req)
    assert code == "INVALID_ARGUMENT"
    assert "input 'INPUT__0': a UINT8 input's values go in uint_contents, not " \
           "fp32_contents (or send raw_input_contents)" in details, details


@pytest.mark.parametrize("body, words", [
    ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [5000],
                  "data": ["x"] * 5000}], "parameters": {"mode": "native"}},
     "5000 images in one request, over the limit of 4096"),
    ({"inputs": [{"name": f"i{i}"} for i in range(50)]},
     "50 inputs: a request has one image input"),
])
def test_rest_json_counts_are_bounded_as_the_grpc_ones(srv, body, words):
    status, answer = infer(srv, body)
    assert status == 400 and words in answer["error"], answer

