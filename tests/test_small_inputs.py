"""An input too small for the whole model still has the layers before the module
that cannot run (vgg11 at 16x16: its fifth pooling would give 0x0, but every layer
before it has a shape). Those are served; a later layer and Attribute (which needs the
class scores) are refused, naming the module that cannot run and what to send instead
(a model whose own input size is too small: tests/test_model_file.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hookserve
from hookserve_server.capture.table import LayerTables, entry
from hookserve_server.errors import InvalidArgument

from conftest import RunningServer, rand_image
from helpers import small_server
from oracles import model_input, oracle_model

TINY = rand_image(16, 16, seed=3)


@pytest.fixture(scope="module")
def vgg() -> RunningServer:
    s = RunningServer(small_server(models=("vgg11",)))
    yield s
    s.stop(2.0)


def test_the_layers_before_the_module_that_cannot_run_are_served(vgg):
    ref = oracle_model("vgg11").features
    with torch.inference_mode():
        want = {"features.0": ref[:1](model_input(TINY)), "features.19": ref[:20](
            model_input(TINY))}
    with vgg.client(timeout=120) as c:
        got = c.extract(TINY, list(want), native=True)
        for name, t in want.items():
            np.testing.assert_allclose(got[name], t[0].numpy(), rtol=1e-5, atol=1e-6)
        # A later layer fails that image alone; the stream goes on.
        big = rand_image(64, 64, seed=4)
        results = list(c.extract_many([TINY, big], ["features.19", "classifier.0"],
                                      native=True))
        assert results[1].ok and results[1].features["classifier.0"].shape == (4096,)
        err = results[0].error
        assert err.code.name == "INVALID_ARGUMENT", err
        for part in ("layer classifier.0 cannot be computed", "at input 16x16",
                     "features.20 (MaxPool2d) of vgg11 cannot run on its input of shape "
                     "[512, 1, 1]", "send a larger input", "such as features.19"):
            assert part in err.message, err.message


def test_describe_lists_the_layers_that_can_run_and_attribute_is_refused(vgg):
    with vgg.client(timeout=120) as c:
        d = c.describe("vgg11", size=(16, 16))
        assert [li.name for li in d.layers][-1] == "features.19"
        assert d.layers[-1].shape == (512, 1, 1) and d.gradient_bytes_per_image == 0
        assert c.describe("vgg11", size=(32, 32)).gradient_bytes_per_image > 0
        with pytest.raises(hookserve.errors.InvalidArgument,
                           match="class scores, which need the whole model: at input "
                                 "16x16, features.20 \\(MaxPool2d\\)"):
            c.attribute(TINY, "features.10", native=True)


@pytest.mark.parametrize("arch, size, stops_at", [
    ("vgg11", 16, "features.20 (MaxPool2d)"), ("alexnet", 40, "features.12 (MaxPool2d)"),
    ("squeezenet1_0", 16, "features.11 (MaxPool2d)"),
    ("densenet121", 16, "features.transition3.pool (AvgPool2d)"),
    ("convnext_tiny", 16, "features.6.1 (Conv2d)"), ("inception_v3", 60, ""),
    ("googlenet", 16, None), ("mobilenet_v2", 1, None), ("resnet18", 1, None)])
def test_a_table_stops_at_the_first_module_that_cannot_run(arch, size, stops_at):
    """On the meta device: either the whole model runs (None), or the table ends just
    before the one module that cannot run, which `stopped` names."""
    table = LayerTables(arch, arch, torch.float32).at(size, size)
    assert table, arch
    if stops_at is None:
        assert not table.stopped, table.stopped
        return
    assert table.stopped.startswith(f"at input {size}x{size}, {stops_at}"), table.stopped
    whole = LayerTables(arch, arch, torch.float32).at(299, 299)
    assert list(whole)[:len(table)] == list(table)   # the same layers, up to the stop
    with pytest.raises(InvalidArgument, match=f"layer {list(whole)[-1]} cannot be computed"):
        entry(table, list(whole)[-1])


def test_an_input_too_small_for_the_first_layer_is_refused_whole():
    with pytest.raises(InvalidArgument, match="input 1x1 is too small or invalid for alexnet"):
        LayerTables("alexnet", "alexnet", torch.float32).at(1, 1)
