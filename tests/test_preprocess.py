"""Decoding: formats, EXIF orientation, mode conversions, all over the wire."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from hookserve_server.errors import InvalidArgument
from hookserve_server.preprocess import decode
from hookserve_server.spec import ImageInput

from conftest import encode, rand_image

LIMIT = 50_000_000


def _dec(data: bytes) -> np.ndarray:
    return decode(ImageInput("x", encoded=data), LIMIT)


@pytest.fixture(scope="module")
def img():
    return rand_image(40, 56, seed=2)


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("BMP", {}), ("TIFF", {}),
                                    ("WEBP", {"lossless": True})])
def test_lossless_formats_decode_exactly(img, fmt, kw):
    np.testing.assert_array_equal(_dec(encode(img, fmt, **kw)), img)


def test_jpeg_and_gif_first_frame(img):
    jpg = _dec(encode(img, "JPEG", quality=95))
    assert jpg.shape == img.shape and np.abs(jpg.astype(int) - img).mean() < 8
    frames = [Image.fromarray(img), Image.fromarray(255 - img)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    first = _dec(buf.getvalue())
    pal = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    np.testing.assert_array_equal(first, pal)


def test_exif_orientation_is_applied(img):
    im = Image.fromarray(img)
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 CW to display
    buf = io.BytesIO()
    im.save(buf, "PNG", exif=exif)
    out = _dec(buf.getvalue())
    assert out.shape == (img.shape[1], img.shape[0], 3)
    np.testing.assert_array_equal(out, np.rot90(img, k=-1))


def test_modes_become_rgb(img):
    gray = img[:, :, 0]
    np.testing.assert_array_equal(_dec(encode(gray)), np.repeat(gray[:, :, None], 3, 2))
    rgba = np.dstack([img, np.full(img.shape[:2], 128, np.uint8)])
    np.testing.assert_array_equal(_dec(encode(rgba)), img)  # alpha dropped
    pal = Image.fromarray(img).convert("P")
    buf = io.BytesIO()
    pal.save(buf, "PNG")
    np.testing.assert_array_equal(_dec(buf.getvalue()), np.asarray(pal.convert("RGB")))
    g16 = (gray.astype(np.uint16) << 8) | 0xAB  # 16-bit: top 8 bits kept
    buf = io.BytesIO()
    Image.fromarray(g16).save(buf, "PNG")
    np.testing.assert_array_equal(_dec(buf.getvalue())[:, :, 0], gray)


def test_pixel_limit_is_checked_before_decoding():
    # A 20000x20000 PNG header with almost no data: refused from the header alone.
    big = Image.new("L", (20000, 20000))
    buf = io.BytesIO()
    big.save(buf, "PNG")
    with pytest.raises(InvalidArgument, match=r"20000x20000 .*400.0 Mpx.*over this server.s limit"):
        _dec(buf.getvalue())


def test_unsupported_format_is_named(img):
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PPM")
    with pytest.raises(InvalidArgument, match="unsupported image format PPM"):
        _dec(buf.getvalue())


def test_formats_give_same_features_over_the_wire(client, img):
    ref = client.extract(img, ["layer1"], native=True)["layer1"]
    for data in (encode(img), encode(img, "BMP"), encode(img, "WEBP", lossless=True)):
        got = client.extract(data, ["layer1"], native=True)["layer1"]
        np.testing.assert_array_equal(got, ref)
