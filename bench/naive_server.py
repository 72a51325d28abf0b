"""The naive baseline: the common "forward hook behind an RPC" tutorial pattern.

One unary call per image: decode with PIL, torchvision transforms, a forward hook
(registered once) that stores the layer's output in a global, a *full* forward pass
of one image under a lock (the model and the hook's global are shared), then the
average-pooled output as raw float32 bytes. No batching, no early stop, no overlap.

Run as ``python bench/naive_server.py --model resnet50 --layer layer4`` — it prints
``PORT <n>`` once it listens on 127.0.0.1 and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import io
import sys
import threading

import grpc
import torch
import torchvision
from PIL import Image
from raw_server import serve_until_signal  # bench/ sibling
from torchvision import transforms

METHOD = "/bench.Naive/Extract"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--layer", default="layer4")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torchvision.models.get_model(args.model, weights=None).eval().to(device)
    features: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output):
        features["out"] = output.detach()

    dict(model.named_modules())[args.layer].register_forward_hook(hook)
    transform = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    lock = threading.Lock()

    def extract(data: bytes, context) -> bytes:
        img = Image.open(io.BytesIO(data)).convert("RGB")
        x = transform(img).unsqueeze(0).to(device)
        with lock, torch.no_grad():
            model(x)
            out = features["out"].mean(dim=(2, 3))[0]
        return out.cpu().numpy().tobytes()

    return serve_until_signal("bench.Naive", {
        "Extract": grpc.unary_unary_rpc_method_handler(extract)})

if __name__ == "__main__":
    sys.exit(main())
