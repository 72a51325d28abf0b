"""Image preparation stages, in order: decode (CPU, or --gpu-decode on the device),
then geometry (resize and crop). engine/prepare.py runs them for each image."""

from .decode import decode
from .geometry import apply_geometry

__all__ = ["apply_geometry", "decode"]
