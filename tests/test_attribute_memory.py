"""The memory an Attribute job holds, estimated (engine/attribute_memory.py,
`attribution_memory`) and measured: the estimate bounds the measured peak and is not
far above it.

Each case runs in a child process: a warm-up job, then `malloc_trim` and a reset of
the peak (VmHWM), then the same job again through the engine's own `start_run` and
passes. glibc is told to map every block over 64 KiB on its own
(MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set and the peak
counts tensors alive at once, not the allocator's reuse. The child runs torch on two
threads with the OpenMP wait `hookserve serve` sets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hookserve_server.openmp import set_wait_default

_JOB = """
import ctypes, json, sys
from concurrent.futures import Future
import torch
from hookserve_server.attribution_spec import AttributeInput, AttributionSpec, Method
from hookserve_server.capture.forward import stack_inputs
from hookserve_server.engine.attribute import start_run
from hookserve_server.engine.core import Engine
from hookserve_server.engine.config import EngineConfig
from hookserve_server.engine.types import CallState, WorkItem
from hookserve_server.models import ServedModel, build_model
from hookserve_server.spec import Mode, Preprocess

arch, method, layer = sys.argv[1:4]
top_k, steps, images, side, pass_cost = map(int, sys.argv[4:9])
torch.set_num_threads(2)
module, info = build_model(arch, "random", 0)
m = ServedModel(arch, arch, module, info, torch.device("cpu"), "float32", False)
cfg = EngineConfig(attribution_pass_cost=pass_cost)
spec = Engine([m], cfg).resolve(AttributionSpec(
    arch, Method[method], layer=layer, top_k=top_k, ig_steps=steps, sg_samples=steps,
    preprocessing=Preprocess(Mode.NATIVE)))
g = torch.Generator().manual_seed(0)
pixels = [torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=g)
          for _ in range(images)]

def run():
    items = [WorkItem(m, p, spec.job, 0, CallState(), Future(),
                      target=spec.job.target_of(AttributeInput("x"))) for p in pixels]
    job = start_run(m, stack_inputs(m, pixels, m.device), items, cfg.max_batch_bytes, cfg)
    while not job.job.run_pass():
        pass
    return job, job.outputs()

run()  # warm: kernels, thread pools, caches
ctypes.CDLL("libc.so.6").malloc_trim(0)

def status(key):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) * 1024

with open("/proc/self/clear_refs", "w") as fh:  # the peak (VmHWM) restarts from here
    fh.write("5")
before = status("VmRSS:")
job, answers = run()
print(json.dumps({"peak": status("VmHWM:") - before, "estimate": job.memory,
                  "rows": job.job.plan.rows, "slots": job.job.plan.slots,
                  "passes": job.job.passes}))
"""


def measure(*case) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    set_wait_default(env)  # as `hookserve serve`: a short OpenMP spin on shared cores
    out = subprocess.run([sys.executable, "-c", _JOB, *map(str, case)], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


CASES = [
    # arch, method, layer, top_k, steps/samples, images, input side, pass cost
    pytest.param("resnet18", "GRADIENT", "", 5, 1, 2, 224, 1024, id="top5-gradient-one-pass"),
    pytest.param("resnet18", "INTEGRATED_GRADIENTS", "", 3, 4, 2, 128, 16, id="top3-ig-passes"),
    pytest.param("resnet18", "SMOOTH_GRAD", "", 2, 3, 2, 128, 16, id="top2-smoothgrad"),
    pytest.param("resnet18", "GRAD_CAM", "layer4", 1, 1, 8, 224, 24, id="gradcam-8-rows"),
    pytest.param("vgg11", "GRADIENT_X_INPUT", "", 3, 1, 2, 128, 16, id="vgg-top3-gxi"),
]


@pytest.mark.parametrize("arch,method,layer,top_k,steps,images,side,pass_cost", CASES)
def test_estimate_bounds_the_measured_peak(arch, method, layer, top_k, steps, images, side,
                                           pass_cost):
    r = measure(arch, method, layer, top_k, steps, images, side, pass_cost)
    peak, estimate = r["peak"], r["estimate"]
    assert r["passes"] >= 1 and r["slots"] == top_k
    assert peak <= estimate, f"measured {peak / 1e6:.1f} MB over the estimate " \
                             f"{estimate / 1e6:.1f} MB ({r})"
    assert estimate <= 1.6 * peak, f"estimate {estimate / 1e6:.1f} MB is loose: measured " \
                                   f"{peak / 1e6:.1f} MB ({r})"
