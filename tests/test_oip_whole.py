"""An Open Inference Protocol request is answered as one, so it is admitted as one and
fails as one: room in the queue for all its images is taken together, its first
failed image fails it at once (the images behind it do not run), and its own mistakes
(shapes, parameters, classes) are named the same on both doors, before any image runs.
"""

from __future__ import annotations

import base64

import pytest
from test_oip_bounds import GOOD, IMG, _model_infer, infer

from helpers import small_server, wait_until


@pytest.fixture(scope="module")
def srv(request):
    from conftest import RunningServer

    s = RunningServer(small_server("--http-port", "0", "--max-batch-delay-ms", "2"))
    request.addfinalizer(lambda: s.stop(2.0))
    return s


def test_a_failed_image_stops_the_images_behind_it(make_server):
    """An inference is answered as one: the first image to fail fails it at once, and
    the images behind it are not run (all 199 others were, their answers dropped)."""
    from helpers import METRICS, computed

    s = make_server(*small_server("--http-port", "0", *METRICS))
    data = [{"b64": base64.b64encode(IMG).decode()}] * 200
    data[5] = {"b64": base64.b64encode(b"not an image").decode()}
    status, answer = infer(s, {"inputs": [{**GOOD, "shape": [200], "data": data}]})
    assert status == 400, answer
    assert answer["error"].startswith("IMAGE[5] (image 6 of 200): "), answer
    assert computed(s) <= 5


def test_a_requests_images_are_admitted_together_or_not_at_all():
    """Room in the queue for all of a request's images is taken at once: a request the
    queue cannot hold whole is refused before any image runs; its images take their
    places without a wait; what they did not take is given back."""
    from hookserve_server.engine.admission import Admission
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import ResourceExhausted

    adm = Admission(max_queue=4, wait_s=0.01)
    other = [adm.admit(CallState()) for _ in range(2)]
    call = CallState()
    with pytest.raises(ResourceExhausted, match=r"2 images queued \(--max-queue 4\) "
                                                r"\(this request's 3 images need room "
                                                r"together\); retry after"):
        with adm.room_for(3, call):
            pass
    assert adm.admitted == 2 and call.room is None
    with adm.room_for(2, call):
        assert adm.admitted == 4
        mine = adm.admit(call)   # the queue is full: it takes its own place
        assert adm.admitted == 4
        with pytest.raises(ResourceExhausted):
            adm.admit(CallState())
    assert adm.admitted == 3     # the place not taken was given back
    for permit in (mine, *other):
        permit.release()
    assert adm.admitted == 0
    with adm.room_for(5, call):   # more than the queue: one by one, as they come
        assert call.room is None and adm.admitted == 0


def _rest_and_grpc(srv, model: str, inputs: list[dict], params: dict | None = None):
    """The same request over REST (JSON) and gRPC (typed contents): both answers as
    (code name, message)."""
    from hookserve_server.oip import grpc_service_pb2 as pb
    status, answer = infer(srv, {"inputs": inputs, "parameters": params or {}}, model)
    rest = ({400: "INVALID_ARGUMENT", 200: "OK"}.get(status, str(status)),
            answer.get("error", ""))
    req = pb.ModelInferRequest(model_name=model)
    for k, v in (params or {}).items():
        req.parameters[k].int64_param = v
    for t in inputs:
        one = req.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        for k, v in t.get("parameters", {}).items():
            one.parameters[k].string_param = v
        if t["datatype"] == "BYTES":
            one.contents.bytes_contents.extend(base64.b64decode(e["b64"]) for e in t["data"])
        else:
            one.contents.int64_contents.extend(t["data"])
    return rest, _model_infer(srv, req)


B64 = {"b64": base64.b64encode(IMG).decode()}


@pytest.mark.parametrize("model, inputs, params, words", [
    # an input's parameter that nothing reads (an output's or the request's is refused)
    ("resnet18", [{**GOOD, "parameters": {"foo": "r"}}], None,
     "input 'IMAGE': unknown parameter 'foo': an input takes only binary_data_size"),
    # a tensor of one element per image is [N] (or Triton's batched [N, 1])
    ("resnet18", [{**GOOD, "shape": []}], None,
     "IMAGE: shape []: use [N], one element per image (or [N, 1])"),
    ("resnet18", [{**GOOD, "shape": [1, 1, 1]}], None, "IMAGE: shape [1, 1, 1]: use [N]"),
    ("resnet18.grad_cam", [GOOD, {"name": "TARGET", "datatype": "INT64", "shape": [],
                                  "data": [3]}], None, "TARGET: shape []: use [N]"),
    # a shape that does not match the contents is named as such
    ("resnet18.grad_cam", [GOOD, {"name": "TARGET", "datatype": "INT64", "shape": [1],
                                  "data": [3, 4]}], None,
     "shape [1] says 1 "),
    # a class out of range is the request's, named where it was given, before any runs
    ("resnet18.grad_cam", [GOOD], {"target": -1},
     "target=-1 is out of range: resnet18 has 1000 classes (0 to 999)"),
    ("resnet18.grad_cam", [{**GOOD, "shape": [2], "data": [B64, B64]},
                           {"name": "TARGET", "datatype": "INT64", "shape": [2],
                            "data": [3, 1000]}], None,
     "TARGET[1]=1000 is out of range: resnet18 has 1000 classes"),
])
def test_a_requests_own_mistakes_are_named_on_both_doors(srv, model, inputs, params, words):
    for code, message in _rest_and_grpc(srv, model, inputs, params):
        assert code == "INVALID_ARGUMENT" and words in message, message


@pytest.mark.parametrize("shape", [[1], [1, 1]])
def test_images_and_targets_of_shape_n_or_n_by_1_are_taken(srv, shape):
    for code, message in _rest_and_grpc(
            srv, "resnet18.grad_cam",
            [{**GOOD, "shape": shape}, {"name": "TARGET", "datatype": "INT64",
                                        "shape": shape, "data": [3]}]):
        assert code == "OK", message


def test_an_image_that_fails_after_its_header_fails_the_request_by_its_own_error(
        make_server):
    """An image that fails in preprocessing (its data, after a good header) is the error
    the request reports, not the Cancelled of the images its failure cancelled; and
    every place in the queue comes back."""
    s = make_server(*small_server("--http-port", "0"))
    cut = IMG[:len(IMG) - 200]   # a good header, data cut short
    data = [{"b64": base64.b64encode(e).decode()} for e in [IMG] * 3 + [cut] + [IMG] * 60]
    for _ in range(3):
        status, answer = infer(s, {"inputs": [{**GOOD, "shape": [64], "data": data}]})
        assert status == 400, answer
        assert answer["error"].startswith("IMAGE[3] (image 4 of 64): PNG data is corrupt or "
                                          "truncated"), answer
    wait_until(lambda: s.engine.admission.admitted == 0, 30, "the queue to empty")


def test_a_request_waiting_for_room_ends_with_its_deadline_or_cancel_and_is_not_starved():
    """The wait for room ended only at --queue-wait-ms (a request with a 200 ms deadline
    held its call 3 s); single images took every place freed, so a request that needs
    all of them at once never got them."""
    import threading
    import time

    from hookserve_server.engine.admission import Admission
    from hookserve_server.engine.types import CallState
    from hookserve_server.errors import Cancelled, DeadlineExceeded

    adm = Admission(max_queue=4, wait_s=30.0)
    held = [adm.admit(CallState()) for _ in range(3)]
    late = CallState(deadline=time.monotonic() + 0.05)
    with pytest.raises(DeadlineExceeded, match="deadline passed while its images waited"):
        with adm.room_for(4, late):
            pass
    gone = CallState()
    threading.Thread(target=gone.cancel).start()
    with pytest.raises(Cancelled, match="cancelled while its images waited"):
        with adm.room_for(4, gone):
            pass
    assert adm.admitted == 3 and adm._pending == 0

    got = threading.Event()
    waiting = CallState()

    def block():
        with adm.room_for(4, waiting):
            got.set()

    t = threading.Thread(target=block)
    t.start()
    wait_until(lambda: adm._pending == 4, 10, "the request to wait")
    held.pop().release()        # a place frees: a single image may not take it
    with pytest.raises(DeadlineExceeded):
        adm.admit(CallState(deadline=time.monotonic() + 0.05))
    assert not got.is_set() and adm.admitted == 2
    for permit in held:
        permit.release()
    t.join(10)
    assert got.is_set() and adm.admitted == 0
