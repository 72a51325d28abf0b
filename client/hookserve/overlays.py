"""Heat-map overlays of attribution maps on the image the model saw (numpy + PIL only).

    >>> a = client.attribute("cat.jpg", layer="layer4", method="grad_cam")
    >>> hookserve.overlay("cat.jpg", a).save("cat_cam.png")
    >>> g = client.attribute("cat.jpg", method="gradient")
    >>> hookserve.overlay("cat.jpg", g, clip=99, sign="all").save("cat_grad.png")

No matplotlib: the colour maps ("jet" for magnitudes, blue and red for the sign) are
computed in numpy. PIL (pillow) is a core dependency of the SDK, so this
needs no extra.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from .types import Size, parse_side, parse_size

#: Which values an overlay shows, as captum's ``visualize_image_attr`` offers:
#: "absolute" magnitudes, only the "positive" or the "negative" ones (as magnitudes),
#: or "all" with their sign (a diverging colour map).
SIGNS = ("absolute", "positive", "negative", "all")
#: The percentile that tops the colour scale when none is given, by the map's number
#: of dimensions: input-space maps have a few extreme pixels that would otherwise
#: squeeze every other pixel into the bottom colour.
DEFAULT_CLIP = {2: 100.0, 3: 99.0}
#: The "all" ramp: -1 blue, 0 light grey, +1 red.
_DIVERGING = np.array([[59, 76, 192], [221, 221, 221], [180, 4, 38]], dtype=np.float32)


def jet(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> uint8 RGB of shape ``x.shape + (3,)``, dark blue to dark red."""
    x = np.clip(np.asarray(x, dtype=np.float32), 0.0, 1.0)[..., None]
    centres = np.array([0.75, 0.5, 0.25], dtype=np.float32)  # r, g, b
    rgb = np.clip(1.5 - np.abs(4.0 * x - 4.0 * centres), 0.0, 1.0)
    return (rgb * 255.0 + 0.5).astype(np.uint8)


def heat(attribution_map: np.ndarray, *, clip: float | None = None,
         sign: str = "absolute") -> np.ndarray:
    """An attribution map -> a 2-D float32 heat: in [0, 1], or in [-1, 1] for
    ``sign="all"``.

    - Channels: a layer map ``[h, w]`` is used as it is. An input-space map
      ``[3, H, W]`` becomes one value per pixel: the sum of the channels' absolute
      values for "absolute", the signed sum of the channels for the other signs.
    - `sign` (:data:`SIGNS`): "absolute" shows magnitudes; "positive" only values
      above zero, "negative" only those below (as magnitudes, the rest zero); "all"
      keeps the sign.
    - `clip`: the percentile of those magnitudes that tops the scale; values above it
      saturate. None: 99 for input-space maps, 100 (the maximum) for layer maps.
      Magnitudes run from their minimum (0) to that percentile (1), so a constant
      map gives zeros; signed values are divided by the percentile of their absolute
      values (zero stays zero).
    """
    if sign not in SIGNS:
        raise ValueError(f"sign must be one of {', '.join(SIGNS)}, got {sign!r}")
    m = np.nan_to_num(np.asarray(attribution_map, dtype=np.float32))
    if m.ndim not in DEFAULT_CLIP:
        raise ValueError(f"expected an [h, w] or [3, H, W] map, got shape {m.shape}")
    clip = DEFAULT_CLIP[m.ndim] if clip is None else float(clip)
    if not 0.0 < clip <= 100.0:
        raise ValueError(f"clip is a percentile in (0, 100], got {clip}")
    if m.ndim == 3:
        m = np.abs(m).sum(axis=0) if sign == "absolute" else m.sum(axis=0)
    elif sign == "absolute":
        m = np.abs(m)
    if sign == "all":
        span = float(np.percentile(np.abs(m), clip))
        return np.clip(m / span, -1.0, 1.0) if span > 0 else np.zeros_like(m)
    if sign != "absolute":
        m = np.maximum(m if sign == "positive" else -m, 0.0)
    lo, hi = float(m.min()), float(np.percentile(m, clip))
    return np.clip((m - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.zeros_like(m)


def diverging(x: np.ndarray) -> np.ndarray:
    """Values in [-1, 1] -> uint8 RGB: blue (-1) through light grey (0) to red (+1)."""
    t = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)[..., None]
    lo, mid, hi = _DIVERGING
    rgb = np.where(t < 0, mid + (lo - mid) * -t, mid + (hi - mid) * t)
    return (rgb + 0.5).astype(np.uint8)


def model_view(image: Any, resize: int = 0, crop: tuple[int, int] | None = None
               ) -> Image.Image:
    """The image as the model saw it: RGB, EXIF orientation applied, the shorter side
    resized to `resize` (0: no resize), then centre-cropped to `crop` (HxW, None: no
    crop), by the server's rules (torchvision's resize and center_crop)."""
    img = _to_pil(image)
    if resize:
        w, h = img.size
        short, long = min(w, h), max(w, h)
        new_long = int(resize * long / short)
        size = (resize, new_long) if w <= h else (new_long, resize)
        img = img.resize(size, Image.BILINEAR)
    if crop:
        ch, cw = crop
        w, h = img.size
        if ch > h or cw > w:  # torchvision pads with zeros, then crops
            canvas = Image.new("RGB", (max(w, cw), max(h, ch)))
            canvas.paste(img, ((max(w, cw) - w) // 2, (max(h, ch) - h) // 2))
            img, (w, h) = canvas, canvas.size
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        img = img.crop((left, top, left + cw, top + ch))
    return img


def overlay(image: Any, attribution: Any, alpha: float = 0.5, *, index: int = 0,
            clip: float | None = None, sign: str = "absolute",
            resize: int | str | None = None, crop: Size | None = None) -> Image.Image:
    """Blend a colour-mapped attribution over the image the model saw; a PIL RGB image.

    Args:
        image: what was sent: a path, encoded bytes, a PIL image or an HxWx3 uint8 array.
        attribution: an :class:`~hookserve.Attribution` (its map and the preprocessing
            geometry it was computed with), or a bare ``[h, w]`` / ``[3, H, W]`` array.
        alpha: weight of the heat map, 0 (image only) to 1 (heat map only).
        index: which map of a ``top_k >= 2`` Attribution (0: the most likely class).
        clip: the percentile of the map's magnitudes that tops the colour scale (values
            above it saturate); None: 99 for input-space maps, 100 for layer maps.
        sign: "absolute" (default: magnitudes on the jet ramp, blended with `alpha`
            everywhere), or "positive", "negative", "all": red for positive values,
            blue for negative ones, each pixel blended by ``alpha * |value|`` so that
            the image shows where the map is zero. See :func:`heat`.
        resize, crop: the preprocessing geometry (as the SDK takes it: ``256``,
            ``"224x224"``...); taken from the Attribution when not given. With a bare
            array and neither given, the whole image is used.

    The result has the size of the model's input (e.g. 224x224 under the default
    preprocessing); the map is upsampled to it bilinearly.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    amap = getattr(attribution, "map", attribution)
    if amap is None:
        raise ValueError("this attribution has no map (it failed: see its .error)")
    if len(getattr(attribution, "targets", ())) > 1:  # top_k >= 2: one map per class
        amap = amap[index]
    geometry = getattr(attribution, "geometry", None) or (0, None)
    view = model_view(image, geometry[0] if resize is None else (parse_side(resize) or 0),
                      geometry[1] if crop is None else parse_size(crop, "crop"))
    h = np.asarray(Image.fromarray(heat(amap, clip=clip, sign=sign)).resize(
        view.size, Image.BILINEAR))
    base = np.asarray(view, dtype=np.float32)
    if sign == "absolute":
        weight: Any = alpha
        colour = jet(h).astype(np.float32)
    else:  # red for positive, blue for negative, the image where the map is zero
        weight = alpha * np.abs(h)[..., None]
        colour = diverging(-h if sign == "negative" else h).astype(np.float32)
    out = (1.0 - weight) * base + weight * colour
    return Image.fromarray(np.clip(out + 0.5, 0, 255).astype(np.uint8))


def _to_pil(image: Any) -> Image.Image:
    """The RGB image the server decoded from what the SDK sent (see images.to_image):
    encoded bytes get EXIF orientation applied there; PIL images and arrays are sent as
    raw pixels, as they are."""
    if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
        img = Image.open(image if isinstance(image, (str, os.PathLike))
                         else io.BytesIO(bytes(image)))
        img.seek(0)  # GIF/TIFF: the first frame, as the server decodes
        return ImageOps.exif_transpose(img).convert("RGB")
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        a = image[:, :, :3] if image.ndim == 3 else np.repeat(image[:, :, None], 3, axis=2)
        return Image.fromarray(np.ascontiguousarray(a, dtype=np.uint8))
    raise TypeError(f"unsupported image type {type(image).__name__}: pass a path, "
                    "encoded bytes, a PIL image or an HxWx3 uint8 array")
