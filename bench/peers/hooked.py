"""The work every peer serves, written once: a torchvision model with seeded random
weights, a forward hook on one layer, an early stop after it, and a reduction.

This is what LitServe and the KServe model server needed *by hand* to return an
intermediate layer at all (neither has a notion of layers): register a forward hook,
keep its output somewhere per call, stop the forward once the layer has run (or pay
for the whole network: VGG16 to `features.0` is ~1% of its full forward), reduce,
and remove the hook state between calls. The in-process floor uses the same code.

Preprocessing is hookserve's default, done the way hookserve does it (so the answers
match to float rounding): PIL decode to RGB, resize the short side (bilinear,
antialiased, on the uint8 tensor) and centre-crop as the architecture's default
torchvision weights do (resnet50: 232 then 224; vgg16: 256 then 224), ImageNet
mean/std.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import time

# Same OpenMP wait as the bench and hookserve under it (see bench/common.py); set
# before torch loads OpenMP. The bench passes it down in the environment anyway.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision.transforms import InterpolationMode  # noqa: E402
from torchvision.transforms import functional as F  # noqa: E402

#: HOOKED_FORWARD_LOG=path: each forward appends "pid batch seconds" (where the time goes)
_FORWARD_LOG = os.environ.get("HOOKED_FORWARD_LOG")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class _Stop(Exception):
    """Raised by the hook once the layer has run: the rest of the network is skipped."""


class Hooked:
    """`extract([jpeg, ...]) -> float32 array (N, ...)` for one model and layer."""

    def __init__(self, arch: str, layer: str, reduce: str = "avg", threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.model = torchvision.models.get_model(arch, weights=None).eval()
        tf = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
        self.resize, self.crop = int(tf.resize_size[0]), int(tf.crop_size[0])
        self.reduce = reduce
        self._out: list[torch.Tensor] = []
        dict(self.model.named_modules())[layer].register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self._out.append(output)
        raise _Stop

    def decode(self, jpeg: bytes) -> torch.Tensor:
        arr = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        t = torch.from_numpy(arr.copy()).permute(2, 0, 1)
        t = F.resize(t, [self.resize], interpolation=InterpolationMode.BILINEAR,
                     antialias=True)
        t = F.center_crop(t, [self.crop, self.crop])
        return (t.float() / 255 - MEAN) / STD

    def forward(self, x: torch.Tensor) -> np.ndarray:
        """The hooked forward of a preprocessed batch (N, 3, 224, 224)."""
        t0 = time.perf_counter()
        try:
            return self._forward(x)
        finally:
            if _FORWARD_LOG:  # HOOKED_FORWARD_LOG=path: one line per forward
                with open(_FORWARD_LOG, "a") as fh:
                    fh.write(f"{os.getpid()} {len(x)} {time.perf_counter() - t0:.6f}\n")

    def _forward(self, x: torch.Tensor) -> np.ndarray:
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


def server_args(*extra: tuple[str, dict]) -> argparse.Namespace:
    """The peer servers' flags: repeated --model/--layer/--reduce triples, --threads."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--layer", action="append", required=True)
    ap.add_argument("--reduce", action="append", required=True)
    ap.add_argument("--threads", type=int, default=0)
    for flag, kw in extra:
        ap.add_argument(flag, **kw)
    a = ap.parse_args()
    a.work = list(zip(a.model, a.layer, a.reduce, strict=True))
    return a


def free_port() -> int:
    """A port that was free a moment ago. The peers insist on a fixed port (bench only:
    a small race; hookserve itself binds port 0 and logs the port it got)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
