"""`--memory-format`: whether a model runs in channels_last (NHWC) or contiguous (NCHW).

The choice changes only how the weights and activations lie in memory, never what a
client receives: every answer is made contiguous in the documented layout (CHW per
image) before it leaves the device (`capture/reduce.py`), and channels_last results
equal contiguous ones within float rounding (tests/test_precision.py), so answers are
bit for bit torchvision's only with `contiguous` (docs/limits.md).
`auto` is channels_last wherever it was measured faster (docs/performance.md,
"Execution modes"): every served architecture, on the CPU and on CUDA.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("hookserve.models")

#: Where `auto` picks channels_last: (device type, architecture prefix).
FASTER_CHANNELS_LAST = {("cpu", "resnet"), ("cpu", "vgg"), ("cuda", "resnet"),
                        ("cuda", "vgg")}


def channels_last(choice: str, flag: bool, arch: str, device: torch.device) -> bool:
    """Whether `arch` runs channels_last on `device`: `--channels-last` wins, then
    `--memory-format` (auto: the measured table above)."""
    if flag or choice == "channels_last":
        return True
    if choice == "contiguous":
        return False
    family = arch.rstrip("0123456789_bn")
    return (device.type, family) in FASTER_CHANNELS_LAST
