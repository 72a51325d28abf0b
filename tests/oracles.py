"""Attribution oracles: the definitions, computed with torch on a model with the same
seeded weights as the test servers.

The oracles split the model at the layer (no hooks): A = body(x), y = head(A), and
take torch.autograd.grad of the target's score. The model input of an image sent raw
in MODE_NATIVE is its normalised pixels (`model_input`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server.models import build_model

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

def model_input(arr: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(arr.copy()).permute(2, 0, 1)[None].float() / 255
    return (x - MEAN) / STD


# -- oracles --------------------------------------------------------------------------
_MODELS: dict[str, nn.Module] = {}


def oracle_model(arch: str) -> nn.Module:
    if arch not in _MODELS:
        _MODELS[arch] = build_model(arch, "random", 0)[0].eval().requires_grad_(False)
    return _MODELS[arch]


def split(arch: str, layer: str):
    """(body, head) with head(body(x)) == model(x); body's output is `layer`'s."""
    m = oracle_model(arch)
    if arch == "resnet18":
        names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
        cut = names.index(layer) + 1
        body = nn.Sequential(*[getattr(m, n) for n in names[:cut]])
        rest = [getattr(m, n) for n in names[cut:]]
        return body, nn.Sequential(*rest, m.avgpool, nn.Flatten(), m.fc)
    idx = int(layer.split(".")[1]) + 1                      # vgg "features.N"
    body = m.features[:idx]
    tail = m.features[idx:]
    # clone: an in-place ReLU right after the cut must not touch the leaf A
    return body, lambda a: m.classifier(torch.flatten(m.avgpool(tail(a.clone())), 1))


def grad_at(arch: str, layer: str | None, x: torch.Tensor, target: int | None,
            softmax: bool = False):
    """(A, dy/dA, y logits) for one image; layer None differentiates the input."""
    with torch.enable_grad():
        if layer is None:
            a = x.clone().requires_grad_(True)
            logits = oracle_model(arch)(a)
        else:
            body, head = split(arch, layer)
            a = body(x).detach().requires_grad_(True)
            logits = head(a)
        c = int(logits.argmax()) if target is None else target
        s = logits.softmax(1)[0, c] if softmax else logits[0, c]
        (g,) = torch.autograd.grad(s, a)
    return a.detach()[0], g[0], logits.detach()[0], c


CAM = {
    pb.ATTRIBUTION_METHOD_GRAD_CAM: lambda a, g: (g.mean((1, 2), keepdim=True) * a).sum(0),
    pb.ATTRIBUTION_METHOD_HIRES_CAM: lambda a, g: (g * a).sum(0),
    pb.ATTRIBUTION_METHOD_LAYER_CAM: lambda a, g: (g.clamp_min(0) * a).sum(0),
}


