"""Decoding: formats, EXIF orientation, mode conversions, all over the wire; the features
equal torchvision's tensor recipe bit for bit."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_image
from torchvision.models import ResNet18_Weights

from hookserve_server.errors import InvalidArgument
from hookserve_server.models import build_model
from hookserve_server.preprocess import decode
from hookserve_server.spec import ImageInput

from conftest import encode, rand_image
from helpers import feature_extractor, small_server

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


def test_features_equal_torchvision_tensor_recipe_bit_for_bit(client, make_server):
    """decode_image, then weights.transforms() on the uint8 tensor: equal bit for bit.

    The recipe's model runs contiguous (NCHW), so the bit-for-bit server does too
    (`--memory-format contiguous`, also what `auto` picks on the CPU); channels_last
    sums the convolutions in another order: equal within float rounding."""
    data = encode(rand_image(150, 210, seed=7))
    layers = ["conv1", "layer2"]
    s = make_server(*small_server("--memory-format", "contiguous"))
    with s.client(timeout=120) as contiguous:
        got = contiguous.extract(data, layers)
    model, _ = build_model("resnet18", "random", 0)
    fe = feature_extractor(model.eval(), layers)
    x = ResNet18_Weights.IMAGENET1K_V1.transforms()(
        decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
    with torch.inference_mode():
        want = {k: v[0].numpy() for k, v in fe(x[None]).items()}
    for name in layers:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    auto = client.extract(data, layers)  # the default server: `auto` is contiguous on CPU
    for name in layers:
        np.testing.assert_array_equal(auto[name], want[name], err_msg=name)
    # The PIL path (transforms on a PIL image) is a different recipe: close, not equal.
    xp = ResNet18_Weights.IMAGENET1K_V1.transforms()(Image.open(io.BytesIO(data)))
    with torch.inference_mode():
        pil = fe(xp[None])["conv1"][0].numpy()
    assert 0 < np.abs(pil - want["conv1"]).max() < 0.5


def test_a_bicubic_model_is_resized_bicubically(make_server):
    """efficientnet_b0's weights resize with bicubic interpolation: the features equal
    its own transforms() recipe bit for bit, and differ from a bilinear resize."""
    from torchvision.models import EfficientNet_B0_Weights
    from torchvision.transforms import InterpolationMode

    data = encode(rand_image(150, 210, seed=9))
    layers = ["features.0"]
    s = make_server(*small_server("--memory-format", "contiguous",
                                  models=("efficientnet_b0",)))
    with s.client(timeout=120) as c:
        assert c.list_models()[0].interpolation == "bicubic"
        got = c.extract(data, layers)["features.0"]
    model, _ = build_model("efficientnet_b0", "random", 0)
    fe = feature_extractor(model.eval(), layers)
    pixels = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    recipe = EfficientNet_B0_Weights.IMAGENET1K_V1.transforms()
    assert recipe.interpolation is InterpolationMode.BICUBIC
    with torch.inference_mode():
        want = fe(recipe(pixels)[None])["features.0"][0].numpy()
        recipe.interpolation = InterpolationMode.BILINEAR
        bilinear = fe(recipe(pixels)[None])["features.0"][0].numpy()
    np.testing.assert_array_equal(got, want)
    assert np.abs(bilinear - want).max() > 1e-2


def _exif_after_the_pixels(png: bytes) -> bytes:
    """`png` with its eXIf chunk moved from before the image data to just before IEND."""
    import struct

    chunks, pos = [], 8
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        chunks.append(png[pos:pos + 12 + n])
        pos += 12 + n
    exif = next(c for c in chunks if c[4:8] == b"eXIf")
    rest = [c for c in chunks if c is not exif]
    return png[:8] + b"".join(rest[:-1]) + exif + rest[-1]


def test_a_png_orientation_counts_only_before_the_pixels(img):
    """Read after the image data, it would need every pixel decoded before any size or
    memory check (PIL's getexif loads the image to find it); torchvision's decode_image
    reads only the chunks before the image data too."""
    from hookserve_server.preprocess.decode import read_header

    im = Image.fromarray(img)
    exif = im.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, "PNG", exif=exif)
    after = _exif_after_the_pixels(buf.getvalue())
    h, w = img.shape[:2]
    assert read_header(ImageInput("x", encoded=buf.getvalue()), LIMIT) == (w, h)
    assert read_header(ImageInput("x", encoded=after), LIMIT) == (h, w)
    np.testing.assert_array_equal(_dec(after), img)
    tv = decode_image(torch.frombuffer(bytearray(after), dtype=torch.uint8),
                      apply_exif_orientation=True)
    np.testing.assert_array_equal(_dec(after), tv.permute(1, 2, 0).numpy())
