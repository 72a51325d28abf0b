"""Layer inputs by forward pre-hook: "<name>:input" in Extract, DescribeModel and
Attribute, checked against the output of the module that feeds it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from conftest import rand_image
from helpers import NATIVE, attribute, extract_raw, ok

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def img() -> np.ndarray:
    return rand_image(64, 80, seed=3)


@pytest.mark.parametrize("model,inp,feeder", [
    ("resnet18", "layer2:input", "layer1"),
    ("resnet18", "layer1.1:input", "layer1.0"),
    ("vgg11", "features.1:input", "features.0"),   # an in-place ReLU's input
    ("vgg11", "features.3:input", "features.2"),
])
def test_input_equals_the_feeding_output(server, img, model, inp, feeder):
    got = extract_raw(server, [pb.LayerRequest(name=inp), pb.LayerRequest(name=feeder)],
                      img, model)
    assert list(got) == [inp, feeder]  # the key is the requested string
    np.testing.assert_allclose(got[inp][0], got[feeder][0], **TOL)
    if model == "vgg11" and inp == "features.1:input":
        assert got[inp][0].min() < 0  # captured before the ReLU ran in place


def test_input_alone_and_reduced(server, img):
    alone = extract_raw(server, [pb.LayerRequest(name="fc:input")], img)["fc:input"][0]
    pooled = extract_raw(server, [pb.LayerRequest(name="avgpool")], img)["avgpool"][0]
    np.testing.assert_allclose(alone, pooled.reshape(-1), **TOL)
    avg = extract_raw(server, [pb.LayerRequest(name="layer3:input",
                                               reduction=pb.REDUCTION_AVG_POOL)], img)
    full = extract_raw(server, [pb.LayerRequest(name="layer2")], img)["layer2"][0]
    np.testing.assert_allclose(avg["layer3:input"][0], full.mean(axis=(1, 2)), rtol=1e-4,
                               atol=1e-6)


def test_describe_lists_input_shapes(server):
    with grpc.insecure_channel(server.address) as ch:
        d = pb_grpc.FeatureExtractorStub(ch).DescribeModel(
            pb.DescribeModelRequest(input_height=64, input_width=80), timeout=60)
    layers = {li.name: li for li in d.layers}
    assert list(layers["conv1"].input_shape) == [3, 64, 80]
    assert layers["conv1"].input_bytes_per_image == 3 * 64 * 80 * 4
    assert list(layers["layer2"].input_shape) == list(layers["layer1"].output_shape)
    assert list(layers["fc"].input_shape) == [512]
    assert d.gradient_bytes_per_image > sum(li.bytes_per_image for li in d.layers) // 2


def test_attribute_at_an_input_equals_the_feeder(server, img):
    # layer1's output feeds only layer2, so d y / d(layer2's input) = d y / d layer1.
    maps = {}
    for layer in ("layer2:input", "layer1"):
        spec = pb.AttributionSpec(layer=layer, method=pb.ATTRIBUTION_METHOD_GRAD_CAM,
                                  preprocessing=NATIVE)
        (a,) = attribute(server, spec, [img], [4])
        maps[layer] = ok(a)
    assert maps["layer2:input"]["layer"] == "layer2:input"
    np.testing.assert_allclose(maps["layer2:input"]["map"], maps["layer1"]["map"], **TOL)


def test_unknown_input_name_is_invalid(server, img):
    with pytest.raises(grpc.RpcError) as err:
        extract_raw(server, [pb.LayerRequest(name="layer9:input")], img)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layer9:input" in err.value.details()
