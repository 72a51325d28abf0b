"""Decoding on the CPU: encoded bytes or raw pixels in, an HxWx3 uint8 RGB array out."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InvalidArgument
from ..spec import ImageInput

# We enforce our own pixel limit before decoding; PIL's bomb check would raise a
# different error type (or only warn) at a limit we don't control.
Image.MAX_IMAGE_PIXELS = None

#: PIL format names we accept ("MPO" is the multi-picture JPEG some cameras write).
ALLOWED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "TIFF", "GIF"})


def _mpx(n: int) -> str:
    # Exact count: a rounded "0.0 Mpx" would hide what the limit is.
    return f"{n:,} pixels ({n / 1e6:.1f} Mpx)"


#: The most scans a JPEG may hold. Encoders write 1 to 3 (baseline) or about 10
#: (progressive). A decoder makes a pass over the whole image per scan, so a small
#: file of thousands of tiny scans would hold a decoding thread for minutes.
MAX_JPEG_SCANS = 256
#: The marker that starts a scan. Entropy-coded data never holds it (a 0xFF byte
#: there is followed by 0x00 or a restart marker), so counting it counts the scans
#: (and those of an embedded thumbnail).
_SOS = b"\xff\xda"


#: EXIF orientations that swap width and height (transpose, rotate 90/270, transverse).
_SWAPS_SIDES = frozenset({5, 6, 7, 8})


def read_header(image: ImageInput, max_pixels: int) -> tuple[int, int]:
    """The (height, width) `decode` will return, from the header alone (EXIF
    orientation counted); nothing is decoded. Raises InvalidArgument like `decode`."""
    if image.raw is not None:
        _check_raw(image, max_pixels)
        return image.height, image.width
    img = _open(image.encoded, max_pixels)
    w, h = img.size
    try:
        orientation = img.getexif().get(0x0112) if _exif_in_header(img) else None
    except Exception:  # a broken EXIF block: exif_transpose ignores it too
        orientation = None
    return (w, h) if orientation in _SWAPS_SIDES else (h, w)


def _exif_in_header(img: Image.Image) -> bool:
    """Whether the EXIF orientation can be read without decoding the pixels: a PNG's
    eXIf chunk counts only before the image data (after it, PIL decodes every pixel to
    find it, before any size or memory check), as `decode` applies it."""
    return img.format != "PNG" or "exif" in img.info


def decode(image: ImageInput, max_pixels: int) -> np.ndarray:
    """Decode an image to an HxWx3 uint8 RGB array, EXIF orientation applied.

    Raises InvalidArgument with a message that says what to change.
    """
    if image.raw is not None:
        return _raw_to_array(image, max_pixels)
    data = image.encoded
    img = _open(data, max_pixels)
    fmt = img.format
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img.seek(0)  # GIF/TIFF: first frame
            upright = _exif_in_header(img)
            img.load()
            if upright:
                img = ImageOps.exif_transpose(img)
            return _to_rgb_array(img)
    except InvalidArgument:
        raise
    except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, ValueError...
        raise InvalidArgument(
            f"{fmt} data is corrupt or truncated ({len(data)} bytes): {exc}"
        ) from None


#: The first bytes of each format decoded, as (signature, offset, name).
_SIGNATURES = ((b"\xff\xd8\xff", 0, "JPEG"), (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
               (b"GIF87a", 0, "GIF"), (b"GIF89a", 0, "GIF"), (b"II*\x00", 0, "TIFF"),
               (b"MM\x00*", 0, "TIFF"), (b"WEBP", 8, "WebP"), (b"BM", 0, "BMP"))


def _looks_like(data: bytes) -> str:
    """The accepted format whose signature `data` starts with, or ""."""
    return next((name for sig, at, name in _SIGNATURES
                 if data[at:at + len(sig)] == sig
                 and (name != "WebP" or data[:4] == b"RIFF")), "")


def _open(data: bytes | None, max_pixels: int) -> Image.Image:
    """PIL's lazy open (the header only), with format and pixel-count checks."""
    if not data:
        raise InvalidArgument(
            "image is empty (0 bytes): send the bytes of an encoded image "
            "(JPEG, PNG, WebP, BMP, TIFF, GIF) or raw RGB pixels"
        )
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        fmt = _looks_like(data)
        if fmt:   # its format's signature, and no header PIL can read
            raise InvalidArgument(
                f"these {len(data)} bytes start as a {fmt} but its header could not be "
                "read (is the file cut short or damaged? send all of it)") from None
        raise InvalidArgument(
            f"bytes are not a recognised image ({len(data)} bytes starting "
            f"{data[:8].hex()}): send JPEG, PNG, WebP, BMP, TIFF or GIF"
        ) from None
    except Exception as exc:  # PIL raises many types on malformed headers
        raise InvalidArgument(f"image header could not be read: {exc} (is the file "
                              "cut short? send all of it)") from None
    fmt = img.format or "unknown"
    if fmt not in ALLOWED_FORMATS:
        raise InvalidArgument(
            f"unsupported image format {fmt}: send JPEG, PNG, WebP, BMP, TIFF or GIF, "
            "or decode it yourself and send raw RGB pixels"
        )
    w, h = img.size
    if w <= 0 or h <= 0:
        raise InvalidArgument(f"image has no pixels ({h}x{w})")
    if img.mode == "F":
        raise InvalidArgument(
            f"this {fmt} holds floating-point pixels (mode F), which have no one pixel "
            "scale (0..1 or 0..255): convert it to 8-bit before sending")
    if fmt in ("JPEG", "MPO") and (scans := data.count(_SOS)) > MAX_JPEG_SCANS:
        raise InvalidArgument(
            f"this JPEG holds {scans} scans, over the limit of {MAX_JPEG_SCANS}: a decoder "
            "passes over the whole image once per scan, so it would take long to decode; "
            "re-encode it (encoders write at most a few dozen scans)")
    if w * h > max_pixels:
        raise InvalidArgument(
            f"image is {h}x{w} = {_mpx(w * h)}, over this server's limit of "
            f"{_mpx(max_pixels)} (--max-image-pixels): downscale it before sending"
        )
    return img


def _raw_to_array(image: ImageInput, max_pixels: int) -> np.ndarray:
    _check_raw(image, max_pixels)
    return np.frombuffer(image.raw or b"", dtype=np.uint8).reshape(image.height,
                                                                   image.width, 3)


def _check_raw(image: ImageInput, max_pixels: int) -> None:
    h, w, raw = image.height, image.width, image.raw or b""
    if h <= 0 or w <= 0:
        raise InvalidArgument(
            f"raw image needs a positive height and width, got {h}x{w}"
        )
    if h * w > max_pixels:
        raise InvalidArgument(
            f"raw image is {h}x{w} = {_mpx(w * h)}, over this server's limit of "
            f"{_mpx(max_pixels)} (--max-image-pixels): downscale it before sending"
        )
    if len(raw) != h * w * 3:
        raise InvalidArgument(
            f"raw pixels are {len(raw)} bytes but height x width x 3 = {h}x{w}x3 = "
            f"{h * w * 3}: send HxWx3 uint8 RGB, rows top to bottom"
        )


def _to_rgb_array(img: Image.Image) -> np.ndarray:
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img)
        # 16-bit (or 32-bit int) grayscale: keep the top 8 bits of 16.
        arr = (np.clip(arr.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(arr[:, :, None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode != "RGB":
        # RGBA/LA drop alpha (RGB values kept), L/1/P/CMYK/YCbCr convert.
        img = img.convert("RGB")
    return np.asarray(img)
