"""The Open Inference Protocol's gRPC service (inference.GRPCInferenceService) on
hookserve's port, called with tritonclient.grpc as published (no changes), against a
real server on 127.0.0.1:0 (resnet18, random weights, small images).

Answers must equal the SDK's for the same images and layers; errors carry the right
code and say what to change. Skipped when tritonclient is not installed (the
`oip-clients` extra).
"""

from __future__ import annotations

import queue

import numpy as np
import pytest

import hookserve

from conftest import RunningServer, encode, rand_image
from helpers import small_server

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install hookserve[oip-clients]")
from tritonclient.utils import InferenceServerException  # noqa: E402

R18 = small_server("--max-batch-delay-ms", "2")
LAYERS = {"layer3.1.conv2": {}, "layer4": {"reduction": "avg"},
          "layer2.0.relu_1": {"reduction": "max", "dtype": "float16"}}
IMAGES = [rand_image(40 + 8 * i, 48, seed=i) for i in range(3)]


#: the server's own class names for resnet18 (a --labels file): classification names them
NAMES = [f"class {i}" for i in range(1000)]


@pytest.fixture(scope="module")
def oip_server(tmp_path_factory):
    labels = tmp_path_factory.mktemp("labels") / "names.txt"
    labels.write_text("\n".join(NAMES) + "\n")
    s = RunningServer([*R18, "--labels", f"resnet18={labels}"])
    yield s
    s.stop(2.0)


@pytest.fixture
def triton(oip_server):
    c = grpcclient.InferenceServerClient(oip_server.address)
    yield c
    c.close()


def image_input(images: list[bytes]):
    t = grpcclient.InferInput("IMAGE", [len(images)], "BYTES")
    t.set_data_from_numpy(np.array(images, dtype=np.object_))
    return t


def requested(layers: dict) -> list:
    outs = []
    for name, params in layers.items():
        o = grpcclient.InferRequestedOutput(name)
        for k, v in params.items():
            o._output.parameters[k].string_param = v  # tritonclient's way to set them
        outs.append(o)
    return outs


def sdk_features(server: RunningServer, image, layer: str, params: dict) -> np.ndarray:
    with hookserve.Client(server.address, timeout=120) as c:
        return c.extract(image, layer, **params)[layer]


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_live_ready_and_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("resnet18")
    assert triton.is_model_ready("resnet18.grad_cam")
    assert not triton.is_model_ready("resnet99")
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "hookserve" and "classification" in meta["extensions"]
    m = triton.get_model_metadata("resnet18", as_json=True)
    assert {t["name"]: (t["datatype"], t["shape"]) for t in m["inputs"]} == {
        "IMAGE": ("BYTES", ["-1"]), "INPUT__0": ("UINT8", ["-1", "-1", "-1", "3"])}
    outs = {t["name"]: t["shape"] for t in m["outputs"]}
    assert outs["fc"] == ["-1", "1000"]
    assert outs["layer3.1.conv2"] == ["-1", "256", "14", "14"]
    assert len(outs) == 75  # every layer of resnet18
    cfg = triton.get_model_config("resnet18", as_json=True)["config"]
    assert all(i.get("optional") for i in cfg["input"])


def test_infer_image_bytes_equals_the_sdk(triton, oip_server):
    encoded = [encode(im) for im in IMAGES]
    res = triton.infer("resnet18", [image_input(encoded)], outputs=requested(LAYERS))
    for name, params in LAYERS.items():
        got = res.as_numpy(name)
        assert got.shape[0] == 3
        for i, img in enumerate(encoded):
            want = sdk_features(oip_server, img, name, params)
            assert got[i].dtype == want.dtype and got[i].shape == want.shape
            np.testing.assert_array_equal(got[i], want)


def test_pixels_input_equals_the_sdk(triton, oip_server):
    pixels = np.stack([rand_image(32, 32, seed=s) for s in (5, 6)])
    t = grpcclient.InferInput("INPUT__0", list(pixels.shape), "UINT8")
    t.set_data_from_numpy(pixels)
    res = triton.infer("resnet18", [t], outputs=requested({"layer4": {"reduction": "avg"}}))
    got = res.as_numpy("layer4")
    for i in range(2):
        want = sdk_features(oip_server, pixels[i], "layer4", {"reduction": "avg"})
        np.testing.assert_array_equal(got[i], want)


def test_no_outputs_is_the_logits_and_classification(triton, oip_server):
    img = encode(IMAGES[0])
    logits = triton.infer("resnet18", [image_input([img])]).as_numpy("fc")
    assert logits.shape == (1, 1000)
    np.testing.assert_array_equal(logits[0], sdk_features(oip_server, img, "fc", {}))
    res = triton.infer("resnet18", [image_input([img, img])],
                       outputs=[grpcclient.InferRequestedOutput("fc", class_count=5)])
    top = res.as_numpy("fc")
    assert top.shape == (2, 5)
    fields = [s.decode().split(":") for s in top[0]]
    assert [int(f[1]) for f in fields] == list(np.argsort(-logits[0], kind="stable")[:5])
    assert [f[2] for f in fields] == [NAMES[int(f[1])] for f in fields]  # value:index:label
    np.testing.assert_allclose([float(f[0]) for f in fields],
                               np.sort(logits[0])[::-1][:5], rtol=1e-5)


def test_unknown_layer_and_bad_image(triton):
    good = encode(IMAGES[0])
    with pytest.raises(InferenceServerException) as err:
        triton.infer("resnet18", [image_input([good])],
                     outputs=requested({"layer3.9.conv7": {}}))
    assert code_of(err.value) == "StatusCode.INVALID_ARGUMENT"
    assert "unknown layer 'layer3.9.conv7'" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        triton.infer("resnet18", [image_input([good, b"not an image", good])])
    assert code_of(err.value) == "StatusCode.INVALID_ARGUMENT"
    assert "IMAGE[1] (image 2 of 3)" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        triton.infer("resnet18", [image_input([good])],
                     outputs=requested({"fc": {"reduction": "mean"}}))
    assert "reduction='mean': use one of none, avg, max" in err.value.message()
    for call, words in [
            (triton.get_model_repository_index, "the model repository (load, unload, "
                                                "index): it serves the models it was "
                                                "started with (--model, --models)"),
            (lambda: triton.load_model("resnet18"), "the model repository"),
            (triton.get_system_shared_memory_status, "system shared memory: send tensors"),
            (lambda: triton.unregister_cuda_shared_memory("r"), "CUDA shared memory"),
            (triton.get_trace_settings, "trace settings: its call log is on stderr"),
            (triton.get_log_settings, "log settings: set --log-level")]:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert code_of(err.value) == "StatusCode.UNIMPLEMENTED"
        assert f"hookserve does not support {words}" in err.value.message()
    assert triton.is_server_live()  # the server goes on


def test_statistics_rise(triton):
    def count():
        stats = triton.get_inference_statistics("resnet18", as_json=True)["model_stats"]
        return int(stats[0].get("inference_count", 0)), stats[0]["version"]
    before, version = count()
    assert version == "1"
    triton.infer("resnet18", [image_input([encode(IMAGES[1])] * 2)])
    assert count()[0] == before + 2


def test_async_infer_and_stream(triton):
    img = encode(IMAGES[2])
    want = triton.infer("resnet18", [image_input([img])],
                        outputs=requested({"layer4": {"reduction": "avg"}})).as_numpy("layer4")
    done: queue.SimpleQueue = queue.SimpleQueue()
    triton.async_infer("resnet18", [image_input([img])],
                       lambda result, error: done.put((result, error)),
                       outputs=requested({"layer4": {"reduction": "avg"}}))
    result, error = done.get(timeout=120)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("layer4"), want)

    answers: queue.SimpleQueue = queue.SimpleQueue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(20):
            if i == 7:  # a bad request in the middle: its error, and the stream goes on
                triton.async_stream_infer("resnet18", [image_input([img])], request_id="bad",
                                          outputs=requested({"nope": {}}))
            triton.async_stream_infer("resnet18", [image_input([img])], request_id=str(i),
                                      outputs=requested({"layer4": {"reduction": "avg"}}))
        got = [answers.get(timeout=120) for _ in range(21)]
    finally:
        triton.stop_stream()
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1 and "unknown layer 'nope'" in errors[0].message()
    ids = [r.get_response().id for r, e in got if e is None]
    assert ids == [str(i) for i in range(20)]
    for r, e in got:
        if e is None:
            np.testing.assert_array_equal(r.as_numpy("layer4"), want)


def test_answer_over_the_limit_names_the_flag(make_server):
    s = make_server(*R18, "--max-stream-buffer-bytes", str(2_000_000))
    c = grpcclient.InferenceServerClient(s.address)
    one = c.infer("resnet18", [image_input([encode(IMAGES[0])])],
                  outputs=requested({"layer1": {}}))
    assert one.as_numpy("layer1").shape == (1, 64, 56, 56)  # 0.8 MB: fits
    with pytest.raises(InferenceServerException) as err:
        c.infer("resnet18", [image_input([encode(IMAGES[0])] * 3)],
                outputs=requested({"layer1": {}}))
    assert code_of(err.value) == "StatusCode.RESOURCE_EXHAUSTED"
    assert "--max-stream-buffer-bytes" in err.value.message()
    assert "extract_many" in err.value.message()
    c.close()


def test_token(tmp_path, make_server):
    token = tmp_path / "token"
    token.write_text("oip-s3cret\n")
    s = make_server(*R18, "--auth-token-file", str(token))
    c = grpcclient.InferenceServerClient(s.address)
    with pytest.raises(InferenceServerException) as err:
        c.infer("resnet18", [image_input([encode(IMAGES[0])])])
    assert code_of(err.value) == "StatusCode.UNAUTHENTICATED"
    res = c.infer("resnet18", [image_input([encode(IMAGES[0])])],
                  headers={"authorization": "Bearer oip-s3cret"})
    assert res.as_numpy("fc").shape == (1, 1000)
    c.close()


def test_stubs_are_what_the_tool_writes(tmp_path):
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "tools" / "gen_oip_proto.py"), str(tmp_path)],
                   check=True, timeout=120)
    here = root / "service" / "hookserve_server" / "oip"
    for f in sorted(tmp_path.iterdir()):
        assert f.read_bytes() == (here / f.name).read_bytes(), f.name


def test_typed_contents(oip_server):
    """KServe's clients may send typed contents (bytes_contents) instead of raw."""
    import grpc

    from hookserve_server.oip import grpc_service_pb2 as pb
    img = encode(IMAGES[0])
    req = pb.ModelInferRequest(model_name="resnet18")
    t = req.inputs.add(name="IMAGE", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([img, img])
    req.outputs.add(name="layer4").parameters["reduction"].string_param = "avg"
    with grpc.insecure_channel(oip_server.address) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString)
        resp = call(req, timeout=120)
    assert list(resp.outputs[0].shape) == [2, 512] and not resp.outputs[0].contents.ListFields()
    got = np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(2, 512)
    want = sdk_features(oip_server, img, "layer4", {"reduction": "avg"})
    np.testing.assert_array_equal(got[1], want)


@pytest.mark.parametrize("method, options", [
    ("grad_cam", {"layer": "layer4"}),
    ("gradient", {}),
])
def test_attribution_equals_the_sdk(triton, oip_server, method, options):
    img = encode(IMAGES[1])
    inp = [image_input([img, img])]
    target = grpcclient.InferInput("TARGET", [2], "INT64")
    target.set_data_from_numpy(np.array([3, 7], dtype=np.int64))
    res = triton.infer(f"resnet18.{method}", [*inp, target], parameters=options)
    maps, logits = res.as_numpy("map"), res.as_numpy("logits")
    top5 = res.as_numpy("top5")
    meta = {o["name"]: o["shape"] for o in triton.get_model_metadata(
        f"resnet18.{method}", as_json=True)["outputs"]}
    assert maps.ndim == len(meta["map"]) and maps.shape[:2] == (2, 1)  # [N, maps, ...]
    with hookserve.Client(oip_server.address, timeout=120) as c:
        for i, cls in enumerate((3, 7)):
            a = c.attribute(img, options.get("layer"), method=method, target=cls)
            np.testing.assert_allclose(maps[i, 0], a.map, rtol=1e-4, atol=1e-6)
            assert logits[i, 0] == pytest.approx(a.logit, rel=1e-5)
            fields = [s.decode().split(":") for s in top5[i]]
            assert [int(f[1]) for f in fields] == [t.index for t in a.top5]
            assert [f[2] for f in fields] == [NAMES[t.index] for t in a.top5]
    # a `target` parameter for every image, and only the map asked for
    res = triton.infer(f"resnet18.{method}", inp, parameters={**options, "target": 3},
                       outputs=[grpcclient.InferRequestedOutput("map")])
    np.testing.assert_allclose(res.as_numpy("map")[0], maps[0], rtol=1e-4, atol=1e-6)
    assert res.as_numpy("logits") is None
    # top_k maps: the same rank, k maps an image
    res = triton.infer(f"resnet18.{method}", inp, parameters={**options, "top_k": 3})
    assert res.as_numpy("map").shape[:2] == (2, 3)
    assert res.as_numpy("map").ndim == maps.ndim
    with pytest.raises(InferenceServerException) as err:
        triton.infer("resnet18.grad_cam", inp, parameters={"layer": "layer9"})
    assert code_of(err.value) == "StatusCode.INVALID_ARGUMENT"
    assert "unknown layer 'layer9'" in err.value.message()


def test_metrics_by_method_and_drain(make_server):
    import urllib.request
    s = make_server(*R18, "--metrics-port", "0")
    c = grpcclient.InferenceServerClient(s.address)
    c.infer("resnet18", [image_input([encode(IMAGES[0])])])
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    assert ('hookserve_requests_total{attribution_method="",code="OK",'
            'method="ModelInfer",model="resnet18"} 1.0') in text
    answers: queue.SimpleQueue = queue.SimpleQueue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    c.async_stream_infer("resnet18", [image_input([encode(IMAGES[0])])])
    assert answers.get(timeout=120)[1] is None
    s.server.stream_caps.start_drain(s.server.engine.start_drain)
    # an open stream: its next request is refused, and the stream ends
    c.async_stream_infer("resnet18", [image_input([encode(IMAGES[0])])])
    result, error = answers.get(timeout=120)
    assert result is None and "[UNAVAILABLE] server is shutting down" in error.message()
    c.stop_stream()
    assert not c.is_server_ready()
    with pytest.raises(InferenceServerException) as err:
        c.infer("resnet18", [image_input([encode(IMAGES[0])])])
    assert code_of(err.value) == "StatusCode.UNAVAILABLE"
    c.close()


def test_oip_package_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, hookserve_server.oip.servicer, hookserve_server.oip.metadata; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_timeout_parameter_is_the_calls_deadline(triton):
    """infer(timeout=µs) sends the request parameter `timeout`: with the transport's
    deadline, the earlier ends the call."""
    with pytest.raises(InferenceServerException) as err:
        triton.infer("resnet18", [image_input([encode(i) for i in IMAGES])], timeout=1)
    assert code_of(err.value) == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline" in err.value.message()
    ok = triton.infer("resnet18", [image_input([encode(IMAGES[0])])], timeout=120_000_000)
    assert ok.as_numpy("fc").shape == (1, 1000)
