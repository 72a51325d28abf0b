"""Turn what a user holds (a path, bytes, a PIL image, an array) into a wire Image."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .v1 import hookserve_pb2 as pb


def default_id(obj: Any, index: int) -> str:
    """A path's own string; otherwise the image's position in the input."""
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    return str(index)


def to_image(obj: Any, image_id: str) -> pb.Image:
    """Build a wire Image.

    - ``str`` / ``os.PathLike``: the file's bytes are sent encoded (the server decodes).
    - ``bytes`` / ``bytearray`` / ``memoryview``: sent as encoded image bytes.
    - ``numpy.ndarray``: HxWx3 uint8 RGB (HxW grayscale and HxWx4 RGBA are converted),
      sent as raw pixels.
    - ``PIL.Image.Image``: converted to RGB and sent as raw pixels.
    """
    if isinstance(obj, (str, os.PathLike)):
        with open(obj, "rb") as fh:
            return pb.Image(id=image_id, encoded=fh.read())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return pb.Image(id=image_id, encoded=bytes(obj))
    if type(obj).__module__.startswith("PIL."):
        obj = np.asarray(obj.convert("RGB"))
    if isinstance(obj, np.ndarray):
        return _array_image(obj, image_id)
    raise TypeError(
        f"unsupported image type {type(obj).__name__}: pass a path, encoded bytes, "
        "a PIL image or an HxWx3 uint8 numpy array")


def _array_image(a: np.ndarray, image_id: str) -> pb.Image:
    if a.dtype != np.uint8:
        raise TypeError(f"array images must be uint8, got {a.dtype}: scale to 0..255 first")
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    elif a.ndim == 3 and a.shape[2] == 4:
        a = a[:, :, :3]
    if a.ndim != 3 or a.shape[2] != 3:
        raise TypeError(f"array images must be HxWx3 (RGB), got shape {a.shape}")
    h, w = a.shape[:2]
    raw = pb.RawImage(pixels=np.ascontiguousarray(a).tobytes(), height=h, width=w)
    return pb.Image(id=image_id, raw=raw)
