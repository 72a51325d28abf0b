"""`hookserve attribute` and `--reduction stats`, run as real subprocesses against a
live server."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
from PIL import Image

import hookserve

from conftest import encode, rand_image
from helpers import hs, numpy_stats


def test_attribute_writes_an_overlay_and_the_map_per_image(server, client, tmp_path):
    paths = []
    for k in range(2):
        p = tmp_path / "in" / f"im{k}.png"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(encode(rand_image(70, 90, seed=k)))
        paths.append(str(p))
    bad = tmp_path / "in" / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    out = tmp_path / "maps"
    r = hs("attribute", paths[0], str(bad), paths[1], "--layer", "layer4", "--method",
           "grad_cam", "--target", "7", "--resize", "64", "--crop", "56x48", "--out", str(out),
           "--server", server.address)
    assert r.returncode == 1, r.stderr                     # one image failed
    assert "bad.jpg" in r.stderr and "INVALID_ARGUMENT" in r.stderr
    assert sorted(f.name for f in out.iterdir()) == ["im0.npy", "im0.png", "im1.npy", "im1.png"]
    for p, name in zip(paths, ("im0", "im1"), strict=True):
        want = client.attribute(p, "layer4", "grad_cam", target=7, resize=64, crop=(56, 48))
        # batched with the other images there, alone here: equal up to float rounding
        np.testing.assert_allclose(np.load(out / f"{name}.npy"), want.map, rtol=1e-4,
                                   atol=1e-5)
        with Image.open(out / f"{name}.png") as png:
            assert png.mode == "RGB" and png.size == (48, 56)   # the model's view, WxH
    assert "class 7" in r.stdout


def test_attribute_input_space_top_k_writes_one_overlay_per_class(server, tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(encode(rand_image(40, 40, seed=3)))
    r = hs("attribute", str(p), "--method", "gradient", "--top-k", "2", "--native",
           "--out", str(tmp_path / "o"), "--server", server.address)
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "o" / "x.npy").shape == (2, 3, 40, 40)
    for k in (1, 2):
        with Image.open(tmp_path / "o" / f"x.{k}.png") as png:
            assert png.size == (40, 40)
    # one line per image: "classes A (p=...), B (p=...)"
    import re
    assert re.search(r"x\.png  classes \d+ \(p=[0-9.]+\), \d+ \(p=[0-9.]+\)  map 2x3x40x40",
                     r.stdout), r.stdout


def test_attribute_options_that_cannot_go_together_are_named_in_flags(tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(encode(rand_image(40, 40, seed=3)))
    for flags, words in (
            (["--steps", "5"], "--steps is an option of --method integrated_gradients, not "
                               "of grad_cam: drop it, or add --method integrated_gradients"),
            (["--method", "gradient", "--layer", "layer4"],
             "--method gradient explains the input and takes no --layer: drop --layer "
             "layer4, or use a CAM method (grad_cam"),
            (["--target", "5", "--top-k", "2"], "--target 5 and --top-k 2 each choose the "
                                                 "classes explained: give one of the two")):
        r = hs("attribute", str(p), "--out", str(tmp_path / "o"), *flags,
               "--server", "localhost:1")   # refused before any call
        assert r.returncode == 2 and words in r.stderr, r.stderr


def test_extract_and_batch_take_reduction_stats(server, client, tmp_path):
    img = rand_image(48, 64, seed=2)
    p = tmp_path / "s.png"
    p.write_bytes(encode(img))
    full = client.extract(str(p), ["layer2"], native=True)["layer2"]
    r = hs("extract", str(p), "--layers", "layer2", "--reduction", "stats", "--native",
           "--out", str(tmp_path / "f.npz"), "--server", server.address)
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "f.npz") as z:
        np.testing.assert_allclose(z["layer2"], numpy_stats(full), rtol=1e-4, atol=1e-5)
    out = tmp_path / "b.h5"
    r = hs("batch", str(p), "--out", str(out), "--layers", "layer2:stats,layer3:input:stats",
           "--native", "--server", server.address)
    assert r.returncode == 0, r.stderr
    with h5py.File(out) as f:
        assert f["layer2"].shape == (1, 128, 5)
        np.testing.assert_allclose(f["layer2"][0], numpy_stats(full), rtol=1e-4, atol=1e-5)
        # layer3's input is layer2's output: the pre-hook sees what layer2 returned
        np.testing.assert_allclose(f["layer3:input"][0], f["layer2"][0], rtol=1e-6)
    r = hs("batch", str(p), "--out", str(tmp_path / "b.parquet"), "--layers", "layer2:stats",
           "--server", server.address)
    assert r.returncode == 2 and "Parquet takes 1-D" in r.stderr


def test_output_names_are_unique_per_input_and_mirror_their_folders(server, client, tmp_path):
    """a/cat.png, b/cat.png and cat-1.png each get their own files; so do x.png and
    x.jpg, and a path given twice."""
    files = {"a/cat.png": 1, "b/cat.png": 2, "cat-1.png": 3, "x.png": 4, "x.jpg": 5}
    for name, seed in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        img = rand_image(48, 48, seed=seed)
        (tmp_path / name).write_bytes(encode(img, "JPEG" if name.endswith("jpg") else "PNG"))
    inputs = [*files, "x.png"]
    r = subprocess.run([sys.executable, "-m", "hookserve.cli", "attribute", *inputs,
                        "--layer", "layer3", "--native", "--out", "maps",
                        "--server", server.address],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "maps"
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    bases = ["a/cat", "b/cat", "cat-1", "x", "x.jpg", "x.png"]
    assert written == sorted(f"{b}.{ext}" for b in bases for ext in ("npy", "png"))
    for name, base in zip(inputs, bases, strict=True):
        want = client.attribute(str(tmp_path / name), "layer3", native=True).map
        np.testing.assert_allclose(np.load(out / f"{base}.npy"), want, rtol=1e-4, atol=1e-5)
        assert f"-> {out.name}/{base}.npy" in r.stdout.replace(str(out), out.name)


def test_unique_names_keep_every_file_apart():
    from hookserve.cli_args import relative_stems, unique_names

    def files(top_k):
        return lambda n: [f"{n}.npy"] + ([f"{n}.png"] if top_k <= 1 else
                                         [f"{n}.{k}.png" for k in range(1, top_k + 1)])

    stems = relative_stems(["d/x.png", "d/x.1.png", "d/X.PNG", "d/x.png"])
    assert stems == [["x", "x.png"], ["x.1", "x.1.png"], ["X", "X.PNG"], ["x", "x.png"]]
    # X.PNG is x.png on a case-insensitive file system, so the repeated x.png,
    # whose suffixed name X.PNG took, gets a number
    names = unique_names(stems, files(2))
    assert names == ["x", "x.1", "X.PNG", "x.png-2"]
    got = [f.casefold() for n in names for f in files(2)(n)]
    assert len(got) == len(set(got))
    assert unique_names([["a/cat"], ["b/cat"]], files(1)) == ["a/cat", "b/cat"]


def test_overlay_clip_and_sign_reach_the_cli(server, client, tmp_path):
    p = tmp_path / "g.png"
    p.write_bytes(encode(rand_image(64, 64, seed=9)))
    r = hs("attribute", str(p), "--method", "gradient", "--native", "--clip", "95",
           "--sign", "all", "--alpha", "1", "--out", str(tmp_path / "o"),
           "--server", server.address)
    assert r.returncode == 0, r.stderr
    a = client.attribute(str(p), method="gradient", native=True)
    want = np.asarray(hookserve.overlay(str(p), a, alpha=1.0, clip=95, sign="all"))
    with Image.open(tmp_path / "o" / "g.png") as png:
        got = np.asarray(png)
    assert np.abs(got.astype(int) - want).max() <= 2     # batched there, alone here
    r = hs("attribute", str(p), "--clip", "0", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--clip is a percentile" in r.stderr
    r = hs("attribute", str(p), "--sign", "both", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "invalid choice: 'both'" in r.stderr
