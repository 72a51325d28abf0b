"""REDUCTION_STATS: per-channel mean, std, min, max and zero fraction, equal to numpy
on the full tensor; column names travel on the tensor message."""

from __future__ import annotations

import numpy as np
import pytest

from hookserve.v1 import hookserve_pb2 as pb

from conftest import rand_image
from helpers import extract_raw, numpy_stats

COLUMNS = ["mean", "std", "min", "max", "zero_fraction"]


@pytest.mark.parametrize("model,layer", [
    ("resnet18", "layer1"), ("resnet18", "layer1.0.relu"), ("resnet18", "fc"),
    ("resnet18", "layer3:input"), ("vgg11", "features.4"),
])
def test_stats_equal_numpy(server, model, layer):
    img = rand_image(64, 80, seed=4)
    got = extract_raw(server, [pb.LayerRequest(name=layer, reduction=pb.REDUCTION_STATS)],
                      img, model)[layer]
    (full, _) = extract_raw(server, [pb.LayerRequest(name=layer)], img, model)[layer]
    stats, columns = got
    assert columns == COLUMNS
    assert stats.dtype == np.float32
    assert stats.shape == ((full.shape[0], 5) if full.ndim > 1 else (1, 5))
    np.testing.assert_allclose(stats, numpy_stats(full.astype(np.float64)), rtol=1e-4,
                               atol=1e-5)
    if layer == "layer1.0.relu":
        assert stats[:, 4].mean() > 0.2  # a ReLU output has dead units


def test_other_reductions_have_no_columns(server):
    got = extract_raw(server, [pb.LayerRequest(name="layer1", reduction=pb.REDUCTION_AVG_POOL)],
                      rand_image(32, 32))
    assert got["layer1"][1] == []
