"""Compiled graphs per input size: a layer set that cannot compile at one input size
still compiles at another; a `--warm` entry at a size its layers cannot run at is
refused at start-up; the start-up warm-up pass compiles nothing (the eager backend:
no code generation, the same machinery)."""

from __future__ import annotations

import pytest
import torch

from hookserve_server.capture.forward import capture
from hookserve_server.capture.plan import CapturePlan
from hookserve_server.engine.config import CompileSettings
from hookserve_server.errors import ConfigError
from hookserve_server.spec import LayerSpec


def test_a_failure_at_one_input_size_leaves_the_others_compiling(make_server):
    def picky(gm, example_inputs):   # a backend that cannot do 32x32
        if any(t.dim() == 4 and t.shape[1] == 3 and t.shape[-1] == 32
               for t in example_inputs if isinstance(t, torch.Tensor)):
            raise RuntimeError("not at this size")
        return gm.forward

    s = make_server("--model", "resnet18", "--weights", "random")
    s.engine.compile_graphs(CompileSettings("auto", after=1, backend=picky, max_sizes=4))
    (graphs,) = s.engine.compiled
    m = s.engine.models["resnet18"]
    plan = CapturePlan.for_batch(m, [(LayerSpec("layer2"),)])
    for side in (32, 40, 32, 40, 48):
        x = torch.randn(1, 3, side, side)
        want = capture(m, x, plan)
        for spec, t in graphs.capture(m, x, plan).items():
            torch.testing.assert_close(t, want[spec], rtol=1e-5, atol=1e-5)
        assert graphs.wait_idle(600)
    assert graphs.stats.failures == 1 and graphs.stats.compiles == 2
    assert graphs.stats.hits == 1   # the second 40x40 batch


@pytest.mark.parametrize("warm, words", [
    ("vgg11=features.20@16x16", "vgg11=features.20@16x16: it cannot run at that size "
                                "(layer features.20 cannot be computed): give another @HxW"),
    ("vgg11=classifier@16x16", "give another @HxW, or another layer"),
    ("maxvit_t=blocks.0@256x256", "(maxvit_t runs at 224x224 only"),
])
def test_a_warm_entry_its_layers_cannot_run_at_is_refused(make_server, warm, words):
    with pytest.raises(ConfigError) as err:
        make_server("--model", warm.split("=")[0], "--weights", "random", "--compile",
                    "auto", "--compile-backend", "eager", "--warm", warm)
    assert str(err.value).startswith(f"--warm {warm}") and words in str(err.value), err.value


def test_the_start_up_warm_up_pass_compiles_nothing(make_server):
    s = make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                    "--compile-backend", "eager", "--compile-after", "1")
    (graphs,) = s.engine.compiled
    assert graphs.wait_idle(600)
    assert graphs.stats.compiles == 0 and not graphs._seen


def test_compile_max_bytes_must_be_positive(make_server):
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match="--compile-max-bytes must be positive"):
            make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                        "--compile-max-bytes", bad)
