"""Geometry: resize and center-crop to the model's input, on a uint8 image.

One rule for every path: `geometry_params` says what a Preprocess does for a model,
`plan_geometry` predicts every size the image goes through without touching pixels
(engine/limits.py checks them from the header, before decoding), and
`apply_geometry` / `geometry_on_tensor` do it on the CPU or on an image already on the
model's device. Normalisation (to float, minus mean, over
std) happens later on the model's device, on the whole batch, so only uint8 crosses
host to device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from ..errors import InvalidArgument
from ..spec import Mode, Preprocess


def geometry_params(pre: Preprocess, default_resize: int, default_crop: tuple[int, int]
                    ) -> tuple[int, tuple[int, int] | None]:
    """(resize of the shorter side or 0, center crop HxW or None) for a Preprocess."""
    if pre.mode is Mode.DEFAULT:
        return default_resize, default_crop
    if pre.mode is Mode.NATIVE:
        return 0, None
    crop = (pre.crop_height, pre.crop_width) if pre.crop_height else None
    return pre.resize, crop


def validate_preprocess(pre: Preprocess) -> None:
    """Spec-level checks of a Preprocess (raises InvalidArgument); sizes are checked
    against the server's limits in engine/limits.py."""
    if pre.mode is not Mode.RESIZE_CROP:
        if pre.resize or pre.crop_height or pre.crop_width:
            raise InvalidArgument(
                f"preprocessing mode {pre.mode.label} takes no resize or crop: "
                "use MODE_RESIZE_CROP")
        return
    if bool(pre.crop_height) != bool(pre.crop_width):
        raise InvalidArgument(
            "crop_height and crop_width must be set together "
            f"(got {pre.crop_height}x{pre.crop_width})"
        )
    if not pre.resize and not pre.crop_height:
        raise InvalidArgument(
            "MODE_RESIZE_CROP needs a resize or a crop; use MODE_NATIVE for neither"
        )


def fixed_input_size(pre: Preprocess, default_crop: tuple[int, int]) -> tuple[int, int] | None:
    """The input size when it does not depend on the image (a crop is set)."""
    if pre.mode is Mode.DEFAULT:
        return default_crop
    if pre.mode is Mode.RESIZE_CROP and pre.crop_height:
        return (pre.crop_height, pre.crop_width)
    return None


#: Peak preprocessing bytes per decoded pixel, and per pixel of the resized image.
DECODE_BYTES_PER_PIXEL = 24
RESIZE_BYTES_PER_PIXEL = 26


@dataclass(frozen=True)
class Geometry:
    """Every size one image goes through, known from its header before decoding."""

    decoded: tuple[int, int]
    #: the shorter side to resize to (0: none), and the size after that resize
    resize: int
    resized: tuple[int, int] | None
    #: the model input (after the crop, if any)
    input: tuple[int, int]

    @property
    def peak_bytes(self) -> int:
        """A bound on the memory decoding and resizing this image takes at its peak
        (measured, docs/limits.md): PIL's buffer and the RGB array, then the
        antialiased resize working in float32."""
        dh, dw = self.decoded
        rh, rw = self.resized or (0, 0)
        return DECODE_BYTES_PER_PIXEL * dh * dw + RESIZE_BYTES_PER_PIXEL * rh * rw


def plan_geometry(pre: Preprocess, default_resize: int, default_crop: tuple[int, int],
                  h: int, w: int) -> Geometry:
    """The sizes `apply_geometry` will produce for an HxW image."""
    resize, crop = geometry_params(pre, default_resize, default_crop)
    resized = _resized(h, w, resize) if resize else None
    return Geometry((h, w), resize, resized, crop or resized or (h, w))


def _resized(h: int, w: int, size: int) -> tuple[int, int]:
    # torchvision's rule for resize([size]): the shorter side becomes `size`.
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def apply_geometry(arr: np.ndarray, pre: Preprocess, default_resize: int,
                   default_crop: tuple[int, int], interpolation: str = "bilinear"
                   ) -> torch.Tensor:
    """HxWx3 uint8 array -> contiguous 3xHxW uint8 tensor after resize (antialiased,
    with the model's `interpolation`, as its `transforms()` resizes) and crop."""
    if not arr.flags.writeable:  # raw pixels wrap the request's bytes
        arr = arr.copy()
    t = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)
    resize, crop = geometry_params(pre, default_resize, default_crop)
    if resize:
        t = F.resize(t, [resize], interpolation=InterpolationMode(interpolation),
                     antialias=True)
    if crop:
        t = F.center_crop(t, list(crop))
    return t.contiguous()


def geometry_on_tensor(t: torch.Tensor, pre: Preprocess, default_resize: int,
                       default_crop: tuple[int, int], interpolation: str = "bilinear"
                       ) -> torch.Tensor:
    """`apply_geometry` for a 3xHxW uint8 tensor already on its device (--gpu-decode).

    Resizes in float32 and rounds back (antialiased uint8 resize is CPU-only in
    some torch versions), so values may differ by one level from the CPU path.
    """
    resize, crop = geometry_params(pre, default_resize, default_crop)
    if resize:
        t = F.resize(t.float(), [resize], interpolation=InterpolationMode(interpolation),
                     antialias=True).round_().clamp_(0, 255).to(torch.uint8)
    if crop:
        t = F.center_crop(t, list(crop))
    return t.contiguous()
