"""Attribution maps for a batch: Grad-CAM, HiResCAM, LayerCAM at a tapped layer;
input gradient, gradient x input, Integrated Gradients and SmoothGrad at the input.

torch only, run on the model's thread. The batch shares one spec; targets differ per
image. Scores of all images are summed into one scalar per target slot, so one
backward pass serves the whole batch: in eval mode an image's score depends on no
other image, so d(sum)/dA_i = dscore_i/dA_i.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attribution_spec import AttributionSpec, Baseline, ClassScore, Method, Score, TargetResult
from .gradients import Tap

#: How many classes the answer's top list holds.
TOP = 5


@dataclass
class ImageAttribution:
    """One image's answer: its map (float32, CPU) and what it explains."""

    map: torch.Tensor
    targets: list[TargetResult]
    top5: list[ClassScore]


def _cam(method: Method, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] activation and gradient -> [N, h, w] map (before any ReLU)."""
    if method is Method.GRAD_CAM:
        alpha = grad.mean(dim=(2, 3), keepdim=True)
        return (alpha * act).sum(dim=1)
    if method is Method.HIRES_CAM:
        return (grad * act).sum(dim=1)
    return (grad.clamp_min(0) * act).sum(dim=1)  # LAYER_CAM


class _Pass:
    """Forward passes of one batch with the spec's scores and targets."""

    def __init__(self, model: nn.Module, spec: AttributionSpec,
                 explicit: list[int | None]) -> None:
        self.model = model
        self.spec = spec
        self.explicit = explicit
        self.targets: torch.Tensor | None = None   # [N, k] long, set by the first pass
        self.logits: torch.Tensor | None = None    # [N, classes] float32 at x

    def choose(self, logits: torch.Tensor) -> None:
        """Targets from the clean image's logits: explicit ones, else the top k."""
        logits = logits.detach().float()
        targets = logits.topk(self.spec.targets_per_image, dim=1).indices
        for i, t in enumerate(self.explicit):
            if t is not None:
                targets[i, 0] = t
        self.targets, self.logits = targets, logits

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, k] target scores of a pass (float32, differentiable)."""
        s = logits.float()
        if self.spec.score is Score.SOFTMAX:
            s = s.softmax(dim=1)
        return s.gather(1, self.targets)

    def grads(self, x: torch.Tensor, wrt: Callable[[], torch.Tensor],
              tap: Tap | None, first: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One forward pass of `x`; per target slot, d(sum of scores)/d(wrt()).

        Returns the k gradients and the [N, k] scores (detached)."""
        with tap if tap is not None else nullcontext():
            logits = self.model(x)
        if first:
            self.choose(logits)
        scores = self.scores(logits)
        leaf = wrt()
        k = scores.shape[1]
        grads = [torch.autograd.grad(scores[:, j].sum(), leaf, retain_graph=j < k - 1)[0]
                 for j in range(k)]
        return grads, scores.detach()


def attribute(model: nn.Module, x: torch.Tensor, spec: AttributionSpec,
              explicit: list[int | None], *, tap: Tap | None = None,
              black: torch.Tensor | None = None) -> list[ImageAttribution]:
    """Maps for a normalised batch `x` [N, 3, H, W] (the model's dtype and layout).

    `explicit[i]` is image i's target class or None (top_k by logit). `tap` is the
    CAM methods' layer; `black` the normalised black pixel [1, 3, 1, 1] (BLACK
    baseline). Targets must already be valid class indices.
    """
    p = _Pass(model, spec, explicit)
    method = spec.method
    delta = None
    with torch.enable_grad():
        if method.is_cam:
            grads, _ = p.grads(x, tap.take, tap, first=True)
            act = tap.take().detach().float()
            maps = torch.stack([_cam(method, act, g.float()) for g in grads], dim=1)
            tap.activation = None
        elif method in (Method.GRADIENT, Method.GRADIENT_X_INPUT):
            leaf = x.detach().requires_grad_(True)
            grads, _ = p.grads(leaf, lambda: leaf, None, first=True)
            maps = torch.stack([g.float() for g in grads], dim=1)
            if method is Method.GRADIENT_X_INPUT:
                maps = maps * x.float().unsqueeze(1)
        elif method is Method.INTEGRATED_GRADIENTS:
            maps, delta = _integrated_gradients(p, x, black)
        else:
            maps = _smooth_grad(p, x)
    return _finish(p, maps, delta, spec, tuple(x.shape[2:]))


def _integrated_gradients(p: _Pass, x: torch.Tensor, black: torch.Tensor | None):
    """Trapezoid rule over ig_steps intervals, x first (it picks the targets)."""
    steps = p.spec.ig_steps
    base = (black.expand_as(x).to(x.dtype) if p.spec.ig_baseline is Baseline.BLACK
            and black is not None else torch.zeros_like(x))
    diff = x - base
    acc = f_x = f_0 = None
    for m in range(steps, -1, -1):
        point = (base + diff * (m / steps)).detach().requires_grad_(True)
        grads, scores = p.grads(point, lambda point=point: point, None, first=m == steps)
        g = torch.stack([gj.float() for gj in grads], dim=1)
        weight = 0.5 if m in (0, steps) else 1.0
        acc = g * weight if acc is None else acc.add_(g, alpha=weight)
        if m == steps:
            f_x = scores
        if m == 0:
            f_0 = scores
    maps = diff.float().unsqueeze(1) * (acc / steps)
    delta = maps.flatten(2).sum(dim=2) - (f_x - f_0)
    return maps, delta


def _smooth_grad(p: _Pass, x: torch.Tensor) -> torch.Tensor:
    """Mean gradient over noisy copies. Image i's noise comes from its own CPU
    generator seeded with sg_seed, drawn sample by sample: independent of the batch
    and of the device."""
    spec = p.spec
    with torch.no_grad():
        p.choose(p.model(x))
    n = x.shape[0]
    span = (x.float().flatten(1).amax(dim=1) - x.float().flatten(1).amin(dim=1))
    sigma = (span * spec.sg_sigma).view(n, 1, 1, 1).cpu()
    gens = [torch.Generator().manual_seed(spec.sg_seed) for _ in range(n)]
    acc = None
    for _ in range(spec.sg_samples):
        noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]) * sigma
        point = (x + noise.to(x.device, x.dtype)).detach().requires_grad_(True)
        grads, _ = p.grads(point, lambda point=point: point, None)
        g = torch.stack([gj.float() for gj in grads], dim=1)
        acc = g if acc is None else acc.add_(g)
    return acc / spec.sg_samples


def _finish(p: _Pass, maps: torch.Tensor, delta: torch.Tensor | None,
            spec: AttributionSpec, size: tuple[int, int]) -> list[ImageAttribution]:
    """Post-processing (ReLU, min-max, upsample) and the per-image answers.

    `maps` is [N, k, ...]; with top_k <= 1 the k dimension is dropped per image."""
    if spec.apply_relu:
        maps = maps.clamp_min(0)
    flat = maps.flatten(2)
    lo, hi = flat.amin(dim=2), flat.amax(dim=2)
    if spec.normalize:
        span = (hi - lo).view(*hi.shape, *([1] * (maps.dim() - 2)))
        low = lo.view_as(span)
        maps = torch.where(span > 0, (maps - low) / span.clamp_min(1e-30),
                           torch.zeros_like(maps))
    if spec.upsample and spec.method.is_cam:
        maps = F.interpolate(maps, size=size, mode="bilinear", align_corners=False)
    if spec.top_k <= 1:
        maps = maps.squeeze(1)
    maps = maps.detach().cpu().contiguous()
    logits = p.logits
    probs = logits.softmax(dim=1)
    top_p, top_i = probs.topk(min(TOP, probs.shape[1]), dim=1)
    tgt = p.targets
    rows = {
        "tgt": tgt.tolist(), "tl": logits.gather(1, tgt).tolist(),
        "tp": probs.gather(1, tgt).tolist(), "lo": lo.tolist(), "hi": hi.tolist(),
        "ti": top_i.tolist(), "tpp": top_p.tolist(), "til": logits.gather(1, top_i).tolist(),
        "d": delta.tolist() if delta is not None else None,
    }
    out = []
    for i in range(maps.shape[0]):
        targets = [TargetResult(ClassScore(c, rows["tl"][i][j], rows["tp"][i][j]),
                                rows["lo"][i][j], rows["hi"][i][j],
                                rows["d"][i][j] if rows["d"] is not None else None)
                   for j, c in enumerate(rows["tgt"][i])]
        top5 = [ClassScore(c, rows["til"][i][j], rows["tpp"][i][j])
                for j, c in enumerate(rows["ti"][i])]
        out.append(ImageAttribution(maps[i].clone() if maps.shape[0] > 1 else maps[i],
                                    targets, top5))
    return out
