"""A JPEG made of thousands of tiny scans is refused from its bytes, before decoding.

A decoder passes over the whole image once per scan, so a 3 MB progressive JPEG of
7000x7000 pixels whose one small AC scan is repeated 40,000 times took minutes to
decode (under the pixel and size limits), holding a preprocessing thread and every
client behind it. The server counts the scans first (`MAX_JPEG_SCANS`).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

import hookserve
from hookserve_server.preprocess.decode import MAX_JPEG_SCANS

from conftest import encode, rand_image


def _scans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan of a JPEG: its SOS segment and entropy-coded data."""
    out, i = [], 2
    while i < len(data) and data[i + 1] != 0xD9:
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        j = i + 2 + length
        if data[i + 1] == 0xDA:
            while not (data[j] == 0xFF and data[j + 1] != 0 and not 0xD0 <= data[j + 1] <= 0xD7):
                j += 1
            out.append((i, j))
        i = j
    return out


def scan_bomb(side: int, scans: int) -> bytes:
    """A grey progressive JPEG whose smallest AC scan is repeated until the file holds
    `scans` scans."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, "JPEG", progressive=True, quality=50)
    data = buf.getvalue()
    found = _scans(data)
    # an AC scan: its spectral start (after the component selectors) is above 0
    start, end = min((e - s, s, e) for s, e in found if data[s + 5 + 2 * data[s + 4]] > 0)[1:]
    return data[:end] + data[start:end] * (scans - len(found)) + data[end:]


def test_a_jpeg_at_the_scan_limit_decodes_and_one_over_it_is_refused_alone(server):
    at, over = scan_bomb(48, MAX_JPEG_SCANS), scan_bomb(48, MAX_JPEG_SCANS + 1)
    assert Image.open(io.BytesIO(at)).size == (48, 48)   # a valid JPEG either way
    ok = encode(rand_image(48, 48, seed=1), "JPEG", progressive=True)
    with server.client(timeout=120) as c:
        results = list(c.extract_many([ok, over, at], ["layer1"], reduction="avg"))
    assert results[0].ok and results[2].ok, (results[0].error, results[2].error)
    err = results[1].error
    assert err.code.name == "INVALID_ARGUMENT"
    assert f"this JPEG holds {MAX_JPEG_SCANS + 1} scans, over the limit of " \
           f"{MAX_JPEG_SCANS}" in err.message and "re-encode it" in err.message


def test_a_large_scan_bomb_is_refused_at_once(server):
    """7000x7000 with 40,000 scans (minutes of decoding): refused from its bytes; the
    call ends long before its deadline, and the server answers the next image."""
    bomb = scan_bomb(7000, 40_000)
    with server.client(timeout=30) as c:
        with pytest.raises(hookserve.errors.InvalidArgument, match="holds 40000 scans"):
            c.extract(bomb, ["layer1"])
        got = c.extract(np.asarray(rand_image(32, 32)), ["layer1"], reduction="avg")
    assert got["layer1"].shape == (64,)
