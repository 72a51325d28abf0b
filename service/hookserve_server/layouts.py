"""Per-layer layouts, and the default Grad-CAM layer of each architecture family.

A layer's per-image output is one of (`spec.Layout`):

- ``CHW``: a feature map, channels first (CNNs);
- ``HWC``: a feature map, channels last (Swin blocks, ConvNeXt's LayerNorm and MLP);
- ``TD``: tokens x features (ViT blocks; token 0 is the class token);
- ``D``: a vector (a Linear layer, the logits).

The layout is read off the shape at the layer table's input size: a 3-D output is HWC
when its first two sizes, and not its last two, follow the input's height and width
(down some stride). Reductions over "every position" (avg, max, stats) and Grad-CAM
use the layout to reduce over the spatial or token axis, never over channels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .spec import Layout

#: Strides a feature map may be at (input side / map side), with rounding slack.
_STRIDES = (1, 2, 4, 8, 14, 16, 32, 64)


def _follows(h: int, w: int, height: int, width: int) -> bool:
    """Is (h, w) the input's (height, width) down one stride, give or take rounding
    and unpadded convolutions?"""
    for s in _STRIDES:
        eh, ew = height / s, width / s
        if abs(h - eh) <= max(1.5, 0.1 * eh) and abs(w - ew) <= max(1.5, 0.1 * ew):
            return True
    return False


def layout_of(shape: tuple[int, ...], height: int, width: int) -> Layout:
    """The layout of a per-image shape at input height x width."""
    if len(shape) == 1:
        return Layout.D
    if len(shape) == 2:
        return Layout.TD
    if len(shape) == 3:
        if _follows(shape[0], shape[1], height, width) and not _follows(
                shape[1], shape[2], height, width):
            return Layout.HWC
        return Layout.CHW
    return Layout.UNSPECIFIED


def channels_first(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A batch [N, ...] with channels (features) on dim 1: HWC -> CHW, TD -> DT."""
    if layout is Layout.HWC:
        return t.permute(0, 3, 1, 2)
    if layout is Layout.TD:
        return t.transpose(1, 2)
    return t


def channels_first_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """`channels_first` on a per-image shape."""
    if layout is Layout.HWC:
        return (shape[2], shape[0], shape[1])
    if layout is Layout.TD:
        return (shape[1], shape[0])
    return tuple(shape)


def patch_grid(tokens: int) -> int | None:
    """The side of the square patch grid of `tokens` tokens after a class token."""
    side = math.isqrt(max(tokens - 1, 0))
    return side if side > 0 and side * side == tokens - 1 else None


def map_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, int] | None:
    """The (h, w) of a CAM map at a layer of this shape and layout; None when the layer
    has no spatial grid."""
    if layout is Layout.CHW and len(shape) == 3:
        return (shape[1], shape[2])
    if layout is Layout.HWC:
        return (shape[0], shape[1])
    if layout is Layout.TD and (side := patch_grid(shape[0])):
        return (side, side)
    return None


def to_grid(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A batch of a layer's outputs (or their gradients) as [N, C, h, w] for the CAM
    methods: HWC permuted; TD's patch tokens (all but the class token) on their grid."""
    if layout is Layout.HWC:
        return t.permute(0, 3, 1, 2)
    if layout is Layout.TD:
        side = patch_grid(t.shape[1])
        return t[:, 1:].reshape(t.shape[0], side, side, t.shape[2]).permute(0, 3, 1, 2)
    return t


def default_cam_layer(arch: str, table: Mapping, modules: Mapping[str, torch.nn.Module]
                      ) -> str:
    """The layer Grad-CAM explains when none is named: the last spatial block of the
    family. resnet (and resnext, wide_resnet) ``layer4``; vgg and alexnet the last
    convolution of ``features``; vit the last encoder block's ``ln_1`` (only the class
    token of the block's output reaches the head, so its patch gradients are zero);
    a model with a ``features`` stack (convnext, swin, efficientnet, mobilenet,
    densenet, squeezenet) its last stage; otherwise the last layer with a spatial map
    that is not a pooling layer's."""
    def last(pred) -> str | None:
        names = [n for n, li in table.items() if pred(n, li)]
        return names[-1] if names else None

    if "layer4" in table:
        return "layer4"
    features = modules.get("features")
    if isinstance(features, torch.nn.Module) and list(features.named_children()):
        if arch.startswith(("vgg", "alexnet")):
            found = last(lambda n, li: n.startswith("features.") and li.type == "Conv2d")
        else:
            found = f"features.{list(features.named_children())[-1][0]}"
        if found in table:
            return found
    found = last(lambda n, li: n.endswith(".ln_1") and n.startswith("encoder.layers."))
    if found:
        return found
    found = last(lambda n, li: n == li.module and "Pool" not in li.type
                 and li.layout in (Layout.CHW, Layout.HWC)
                 and map_shape(li.shape, li.layout) not in (None, (1, 1)))
    return found or next(iter(table))
