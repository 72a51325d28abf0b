"""LitServe serving `hooked.Hooked`: POST /extract/<arch> with JSON
{"image": base64 JPEG} (LitServe's documented image pattern), answer: the layer's
float32 bytes (application/octet-stream), batched by LitServe.

Run with the bench's venv, from the repository root: ``python -m
bench.peers.litserve_server --model resnet50 --layer layer4 --reduce avg --model vgg16
--layer features.0 --reduce none``.
LitServe needs a fixed port (1024-65535, port 0 is refused), so this picks a free one
by binding port 0 and closing it (bench only: a small race), prints ``PORT n`` and
serves; the client waits for GET /health to answer "ok".
"""

from __future__ import annotations

import base64
import sys

import litserve as ls
from fastapi import Response

from bench.peers.hooked import Hooked, free_port, server_args


class HookedAPI(ls.LitAPI):
    def __init__(self, arch: str, layer: str, reduce: str, threads: int, **kw) -> None:
        super().__init__(api_path=f"/extract/{arch}", **kw)
        self.spec_args = (arch, layer, reduce, threads)

    def setup(self, device) -> None:
        self.hooked = Hooked(*self.spec_args)

    def decode_request(self, request):
        return self.hooked.decode(base64.b64decode(request["image"]))

    def batch(self, inputs):
        import torch

        return torch.stack(inputs)

    def predict(self, x):
        return self.hooked.forward(x if x.dim() == 4 else x[None])

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output) -> Response:
        return Response(content=output.tobytes(), media_type="application/octet-stream")


def main() -> int:
    a = server_args(("--max-batch-size", {"type": int, "default": 8}),
                    ("--batch-timeout", {"type": float, "default": 0.001,
                                         "help": "seconds LitServe waits to fill a batch"}))
    apis = [HookedAPI(m, la, r, a.threads, max_batch_size=a.max_batch_size,
                      batch_timeout=a.batch_timeout) for m, la, r in a.work]
    port = free_port()
    print(f"PORT {port}", flush=True)
    server = ls.LitServer(apis, accelerator="cpu", workers_per_device=1, timeout=600)
    server.run(port=port, host="127.0.0.1", generate_client_file=False,
               log_level="warning", num_api_servers=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
