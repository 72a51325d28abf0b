"""The work every peer serves, written once: a torchvision model with seeded random
weights, a forward hook on one layer, an early stop after it, and a reduction.

This is what LitServe and the KServe model server needed *by hand* to return an
intermediate layer at all (neither has a notion of layers): register a forward hook,
keep its output somewhere per call, stop the forward once the layer has run (or pay
for the whole network: VGG16 to `features.0` is ~1% of its full forward), reduce,
and remove the hook state between calls. The in-process floor uses the same code.

Preprocessing is hookserve's default: decode, RGB, resize the short side to 256,
centre-crop 224, ImageNet mean/std.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision import transforms

TRANSFORM = transforms.Compose([
    transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
    transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


class _Stop(Exception):
    """Raised by the hook once the layer has run: the rest of the network is skipped."""


class Hooked:
    """`extract([jpeg, ...]) -> float32 array (N, ...)` for one model and layer."""

    def __init__(self, arch: str, layer: str, reduce: str = "avg", threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.model = torchvision.models.get_model(arch, weights=None).eval()
        self.reduce = reduce
        self._out: list[torch.Tensor] = []
        dict(self.model.named_modules())[layer].register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self._out.append(output)
        raise _Stop

    @staticmethod
    def decode(jpeg: bytes) -> torch.Tensor:
        return TRANSFORM(Image.open(io.BytesIO(jpeg)).convert("RGB"))

    def forward(self, x: torch.Tensor) -> np.ndarray:
        """The hooked forward of a preprocessed batch (N, 3, 224, 224)."""
        self._out.clear()
        with torch.inference_mode():
            try:
                self.model(x)
            except _Stop:
                pass
            out = self._out.pop()
            if self.reduce == "avg":
                out = out.mean(dim=(2, 3))
            return out.float().contiguous().numpy()

    def extract(self, jpegs: list[bytes]) -> np.ndarray:
        return self.forward(torch.stack([self.decode(b) for b in jpegs]))
