"""--gpu-decode: plain RGB JPEGs decoded by torchvision on the model's CUDA device."""

from __future__ import annotations

import io

import torch

from ..spec import ImageInput


def decode_jpeg_on_device(image: ImageInput, max_pixels: int,
                          device: torch.device) -> torch.Tensor | None:
    """Decode a plain RGB JPEG with torchvision on `device`: a 3xHxW uint8 tensor.

    Returns None for anything the CPU path should handle so that both paths mean
    the same pixels: not a JPEG, not 3-channel (grayscale, CMYK), an EXIF block (the
    CPU path applies its orientation), over `max_pixels` (the CPU path words the
    error). Only the header is parsed here (PIL, lazily). Raises if the decoder
    fails. Decoders differ slightly (nvjpeg vs libjpeg IDCT): pixels may differ
    by a few levels from the CPU path's.
    """
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    data = image.encoded
    if not data or not data.startswith(b"\xff\xd8"):
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode != "RGB" or "exif" in img.info:
                return None
            w, h = img.size
    except Exception:
        return None
    if w * h > max_pixels:
        return None
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)


def probe_jpeg_bytes() -> bytes:
    """A small known-good JPEG, for the warm-up probe of the GPU decoder."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 60, 30)).save(buf, "JPEG")
    return buf.getvalue()
