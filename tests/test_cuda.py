"""The CUDA paths, over the wire: skipped where torch sees no GPU.

A server on ``cuda:0`` must answer what the same weights answer in process on the CPU
(within TF32/cuDNN tolerance), in float16 and channels-last too, with ``--gpu-decode``,
under concurrent streams (the completer thread and pinned host buffers), and for
Attribute (the backward pass on the GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import encode, rand_image
from helpers import R18, in_threads

# HOOKSERVE_TEST_DEVICE=cpu runs the same checks on the CPU (to check the tests).
DEVICE = os.environ.get("HOOKSERVE_TEST_DEVICE", "cuda:0")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device")

LAYERS = ["conv1", "layer1", "layer3.1.conv2", "layer4", "fc"]


def cuda_server(make_server, *extra: str):
    s = make_server(*R18, "--max-batch-delay-ms", "2", *extra)
    # conftest forces --device cpu first; a later --device wins in argparse.
    return s


def close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    scale = float(np.abs(want).max()) or 1.0
    err = float(np.abs(got.astype(np.float32) - want).max()) / scale
    assert err <= rel, f"max |diff| / max |want| = {err:.2e} > {rel:.0e}"


@pytest.fixture(scope="module")
def cpu_answers(server):
    import hookserve
    imgs = [rand_image(96, 128, seed=s) for s in range(6)]
    with hookserve.Client(server.address, timeout=120) as c:
        want = [c.extract(encode(im), LAYERS, model="resnet18") for im in imgs]
    return imgs, want


@pytest.mark.parametrize("extra,rel", [
    ((), 5e-3),                                         # fp32 (TF32 convolutions allowed)
    (("--channels-last",), 5e-3),
    (("--dtype", "float16"), 3e-2),
    (("--dtype", "float16", "--channels-last"), 3e-2),
    (("--dtype", "bfloat16"), 8e-2),
    (("--precision", "fp16"), 3e-2),                    # autocast, float32 weights
    (("--precision", "bf16"), 8e-2),
])
def test_cuda_features_equal_cpu(make_server, cpu_answers, extra, rel):
    imgs, want = cpu_answers
    s = cuda_server(make_server, "--device", DEVICE, *extra)
    with s.client(timeout=120) as c:
        info = c.describe("resnet18").model
        assert info.device == DEVICE
        if "--precision" in extra:
            assert info.precision == extra[extra.index("--precision") + 1]
        for im, w in zip(imgs, want, strict=True):
            got = c.extract(encode(im), LAYERS, model="resnet18")
            for name in LAYERS:
                close(got[name], w[name], rel)


@pytest.mark.parametrize("extra,rel", [((), 5e-3), (("--precision", "fp16"), 3e-2)])
def test_cuda_compiled_graph_equals_cpu(make_server, cpu_answers, extra, rel):
    """inductor on the GPU (unfrozen), compiled at start-up: its answers are the CPU's."""
    imgs, want = cpu_answers
    s = cuda_server(make_server, "--device", DEVICE, "--compile", "auto",
                    "--warm", "resnet18=" + "+".join(LAYERS), *extra)
    (graphs,) = s.engine.compiled
    assert graphs.wait_idle(600), "compiling did not finish"
    assert graphs.stats.compiles == 1 and graphs.stats.failures == 0
    with s.client(timeout=120) as c:
        for im, w in zip(imgs, want, strict=True):
            got = c.extract(encode(im), LAYERS, model="resnet18")
            for name in LAYERS:
                close(got[name], w[name], rel)
    assert graphs.stats.hits == len(imgs)


def test_cuda_concurrent_streams_batch_and_match(make_server, cpu_answers):
    imgs, want = cpu_answers
    s = cuda_server(make_server, "--device", DEVICE, "--max-batch-size", "16")
    results: dict[int, list] = {}
    pooled_layers = LAYERS[:-1]  # avg pools the spatial axes; fc has none

    def run(k: int) -> None:
        with s.client(timeout=120) as c:
            results[k] = [r.raise_for_error() for r in
                          c.extract_many([encode(im) for im in imgs] * 3, pooled_layers,
                                         model="resnet18", reduction="avg")]

    in_threads(run, range(6), timeout=300)
    assert sorted(results) == list(range(6))
    for k in range(6):
        for i, feats in enumerate(results[k]):
            w = want[i % len(imgs)]
            for name in pooled_layers:
                close(feats[name], w[name].mean(axis=(1, 2)), 5e-3)


def test_cuda_gpu_decode_matches_cpu_decode(make_server, cpu_answers):
    imgs, _ = cpu_answers
    jpegs = [encode(im, "JPEG", quality=95) for im in imgs]
    s_gpu = cuda_server(make_server, "--device", DEVICE, "--gpu-decode")
    s_cpu = cuda_server(make_server, "--device", DEVICE)
    with s_gpu.client(timeout=120) as g, s_cpu.client(timeout=120) as c:
        for jp in jpegs:
            a = g.extract(jp, ["layer4", "fc"], model="resnet18", reduction="avg")
            b = c.extract(jp, ["layer4", "fc"], model="resnet18", reduction="avg")
            # nvJPEG and libjpeg may round a few pixels differently.
            close(a["fc"], b["fc"], 5e-2)


def test_cuda_attribute_equals_cpu(make_server, server):
    import hookserve
    im = encode(rand_image(96, 128, seed=3))
    with hookserve.Client(server.address, timeout=120) as c:
        want = c.attribute(im, "layer4", "grad_cam", model="resnet18", target=7)
        want_ig = c.attribute(im, None, "integrated_gradients", model="resnet18",
                              target=7, steps=16)
    s = cuda_server(make_server, "--device", DEVICE)
    with s.client(timeout=120) as c:
        got = c.attribute(im, "layer4", "grad_cam", model="resnet18", target=7)
        got_ig = c.attribute(im, None, "integrated_gradients", model="resnet18",
                             target=7, steps=16)
    close(got.map, want.map, 2e-2)
    close(got_ig.map, want_ig.map, 1e-1)
    assert got.target == want.target == 7
