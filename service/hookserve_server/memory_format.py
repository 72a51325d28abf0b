"""`--memory-format`: whether a model runs in channels_last (NHWC) or contiguous (NCHW).

The choice changes only how the weights and activations lie in memory, never what a
client receives: every answer is made contiguous in the documented layout (CHW per
image) before it leaves the device (`capture/reduce.py`), and channels_last results
equal contiguous ones within float rounding (tests/test_precision.py), so answers are
bit for bit torchvision's only with `contiguous` (docs/limits.md).
`auto` is channels_last where it was measured faster for one image and for batches
alike (docs/performance.md, "Execution modes"): the ResNet and VGG families on CUDA.
On the CPU, channels_last is faster for batches of 8 but slower for a lone image
(resnet50 p50 49.9 vs 40.4 ms on a quiet 2-core machine), so `auto` keeps the CPU on
today's contiguous path; `channels_last` is there for throughput-bound CPU servers.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("hookserve.models")

#: Where `auto` picks channels_last: (device type, architecture prefix).
FASTER_CHANNELS_LAST = {("cuda", "resnet"), ("cuda", "vgg")}


def channels_last(choice: str, flag: bool, arch: str, device: torch.device) -> bool:
    """Whether `arch` runs channels_last on `device`: `--channels-last` wins, then
    `--memory-format` (auto: the measured table above)."""
    if flag or choice == "channels_last":
        return True
    if choice == "contiguous":
        return False
    family = arch.rstrip("0123456789_bn")
    return (device.type, family) in FASTER_CHANNELS_LAST
