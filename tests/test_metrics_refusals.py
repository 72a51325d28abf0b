"""Every call is counted and logged with the code its client saw, also when it was
refused before its work began, or ran out of time:

- a call whose deadline passed is DEADLINE_EXCEEDED (it was counted as CANCELLED);
- a stream whose deadline passed while the server waited for its next request is
  DEADLINE_EXCEEDED (it was OK);
- an Open Inference Protocol request refused while it is read (a message or body that
  does not parse), on gRPC and REST, is one call with its code (it was neither logged
  nor counted);
- a call refused for its token is one UNAUTHENTICATED call (native, OIP and REST).
"""

from __future__ import annotations

import base64

import grpc
import pytest
from test_oip_bad_requests import post

import hookserve
from hookserve.v1 import hookserve_pb2 as pb

from conftest import encode, rand_image
from helpers import R18, sample, wait_until

pytest.importorskip("starlette", reason="pip install hookserve[http]")


def calls(server, method: str, code: str) -> float:
    return sample(server, "hookserve_requests_total", method=method, model="",
                  code=code, attribution_method="") + sample(
        server, "hookserve_requests_total", method=method, model="resnet18", code=code,
        attribution_method="")


def test_a_call_past_its_deadline_is_counted_as_deadline_exceeded(make_server):
    from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

    s = make_server(*R18, "--metrics-port", "0", "--max-batch-size", "1")
    img = encode(rand_image(224, 224, seed=1))
    reqs = [pb.ExtractRequest(spec=pb.ExtractionSpec(layers=[pb.LayerRequest(name="layer4")])),
            *(pb.ExtractRequest(image=pb.Image(id=str(i), encoded=img)) for i in range(200))]
    with grpc.insecure_channel(s.address) as ch:   # more work than the deadline allows
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.FeatureExtractorStub(ch).Extract(iter(reqs), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: calls(s, "Extract", "DEADLINE_EXCEEDED") == 1, 60,
               "the Extract call counted as DEADLINE_EXCEEDED")
    assert calls(s, "Extract", "CANCELLED") == 0


def test_a_stream_whose_deadline_passed_while_it_waited_for_requests_is_not_ok(
        make_server):
    """The server waits on the client's next request when the client's deadline
    passes: the stream ends without an error of the server's own, and was counted
    and logged OK."""
    import threading

    from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

    s = make_server(*R18, "--metrics-port", "0")
    never = threading.Event()

    def requests():
        yield pb.ExtractRequest(spec=pb.ExtractionSpec(layers=[pb.LayerRequest(name="fc")]))
        yield pb.ExtractRequest(image=pb.Image(id="0", encoded=encode(rand_image(32, 32))))
        never.wait(120)   # the client has nothing more to send, and keeps the call open

    try:
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.FeatureExtractorStub(ch)
            for n in (1, 2, 3):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Extract(requests(), timeout=1.0))
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                wait_until(lambda n=n: calls(s, "Extract", "DEADLINE_EXCEEDED") == n, 60,
                           "the Extract call counted as DEADLINE_EXCEEDED")
    finally:
        never.set()
    assert calls(s, "Extract", "OK") == 0 and calls(s, "Extract", "CANCELLED") == 0


def test_oip_requests_refused_while_read_are_counted(make_server):
    s = make_server(*R18, "--metrics-port", "0", "--http-port", "0")
    with grpc.insecure_channel(s.address) as ch:
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            infer(b"\xff\xff not a message", timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for body in (b"not json", {"inputs": [{"name": "IMAGE"}]}):
        assert post(s, "/v2/models/resnet18/infer", body)[0] == 400
    wait_until(lambda: calls(s, "ModelInfer", "INVALID_ARGUMENT") == 1, 30, "ModelInfer")
    wait_until(lambda: calls(s, "HTTPInfer", "INVALID_ARGUMENT") == 2, 30, "HTTPInfer")


def test_calls_refused_for_their_token_are_counted(make_server, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    s = make_server(*R18, "--metrics-port", "0", "--http-port", "0", "--auth-token-file",
                    str(tmp_path / "token"))
    with hookserve.Client(s.address, timeout=60, retries=0) as c, \
            pytest.raises(hookserve.errors.Unauthenticated):
        c.list_models()
    with hookserve.Client(s.address, timeout=60, retries=0, token="wrong") as c, \
            pytest.raises(hookserve.errors.Unauthenticated):
        c.extract(encode(rand_image(32, 32, seed=1)), ["fc"])
    body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                        "data": [{"b64": base64.b64encode(b"x").decode()}]}]}
    assert post(s, "/v2/models/resnet18/infer", body)[0] == 401
    wait_until(lambda: calls(s, "ListModels", "UNAUTHENTICATED") == 1, 30, "ListModels")
    wait_until(lambda: calls(s, "ExtractImage", "UNAUTHENTICATED") == 1, 30, "ExtractImage")
    wait_until(lambda: calls(s, "HTTPInfer", "UNAUTHENTICATED") == 1, 30, "HTTPInfer")
