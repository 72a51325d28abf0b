"""In-process limits: torchvision models in the bench process, as a user would run
them without a server (rows a, c's compute and e's in-process side)."""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

import hookserve


class Local:
    """torchvision models in this process, as a user would run them without a server."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torchvision  # noqa: F401

        self.torch = torch
        if a.threads:
            torch.set_num_threads(a.threads)
        self.device = torch.device("cuda" if a.device.startswith("cuda") else a.device)
        if a.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = {"float32": torch.float32, "float16": torch.float16,
                      "bfloat16": torch.bfloat16}[a.dtype]
        self.channels_last = a.channels_last
        self._fx: dict = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def extractor(self, arch: str, layer: str):
        import torchvision
        from torchvision.models.feature_extraction import create_feature_extractor

        self.torch.manual_seed(0)
        m = torchvision.models.get_model(arch, weights=None).eval()
        fx = create_feature_extractor(m, {layer: "f"}).to(self.device, self.dtype)
        if self.channels_last:
            fx = fx.to(memory_format=self.torch.channels_last)
        return fx

    def forward_throughput(self, arch: str, layer: str, batch: int, batches: int, *,
                           pool: bool = True) -> float:
        """img/s of the forward pass to `layer` (avg-pooled if `pool`) at `batch`."""
        torch = self.torch
        key = (arch, layer)
        if key not in self._fx:
            self._fx[key] = self.extractor(arch, layer)
        fx = self._fx[key]
        x = torch.randn(batch, 3, 224, 224).to(self.device, self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)

        def run():
            f = fx(x)["f"]
            return (f.mean(dim=(2, 3)) if pool else f.contiguous()).float().cpu()

        with torch.inference_mode():
            run()  # warm-up (kernel selection, allocator)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(batches):
                run()
            self.sync()
            return batch * batches / (time.perf_counter() - t0)

    def latencies(self, arch: str, layer: str, data: list[bytes], address: str,
                  layers) -> tuple[list[float], list[float]]:
        """Row e: one image at a time, in process (decode + normalise + forward + pool)
        and through hookserve (Client.extract, native size), alternating per image."""
        torch = self.torch
        fx = self.extractor(arch, layer)
        mean = torch.tensor([0.485, 0.456, 0.406], device=self.device).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225], device=self.device).view(1, 3, 1, 1)

        def one(b: bytes) -> np.ndarray:
            arr = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
            x = torch.from_numpy(arr.copy()).permute(2, 0, 1)[None].to(self.device)
            x = ((x.float() / 255 - mean) / std).to(self.dtype)
            with torch.inference_mode():
                return fx(x)["f"].mean(dim=(2, 3)).float().cpu().numpy()

        local: list[float] = []
        service: list[float] = []
        with hookserve.Client(address, timeout=600) as c:
            for b in data[:3]:  # warm-up
                one(b)
                c.extract(b, layers, model=arch, native=True)
            for b in data:
                t0 = time.perf_counter()
                one(b)
                local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.extract(b, layers, model=arch, native=True)
                service.append(time.perf_counter() - t0)
        return local, service
