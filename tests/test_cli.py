"""The `hookserve` command, run as a real subprocess against a live server."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import hookserve

from conftest import encode, rand_image
from helpers import hs

ROOT = Path(__file__).resolve().parents[1]


def test_describe_prints_the_layer_table(server):
    r = hs("describe", "resnet18", "--server", server.address)
    assert r.returncode == 0, r.stderr
    assert "RANDOM: not for real use" in r.stdout
    lines = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.strip()}
    assert lines["layer4"][1:3] == ["Sequential", "512x7x7"]
    assert lines["layer1.0.relu_1"][1] == "ReLU"
    assert float(lines["conv1"][3]) == round(64 * 112 * 112 * 4 / 1e6, 3)  # MB per image


def test_describe_at_another_size_via_env(server):
    r = hs("describe", "vgg11", "--size", "64x96", env={"HOOKSERVE_SERVER": server.address})
    assert r.returncode == 0, r.stderr
    assert "input 64x96" in r.stdout and "512x2x3" in r.stdout


def test_extract_writes_npz(server, tmp_path):
    paths = []
    for k in range(2):
        p = tmp_path / f"im{k}.png"
        p.write_bytes(encode(rand_image(48, 64, seed=k)))
        paths.append(str(p))
    out = tmp_path / "f.npz"
    r = hs("extract", *paths, "--layers", "layer2,fc", "--reduction", "avg", "--out", str(out),
           "--server", server.address)
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        assert sorted(z.files) == sorted(f"{p}:{layer}" for p in paths
                                         for layer in ("layer2", "fc"))
        assert z[f"{paths[0]}:layer2"].shape == (128,)


def test_extract_exit_code_on_a_bad_image(server, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    r = hs("extract", str(bad), "--layers", "layer1", "--server", server.address)
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr


def test_models_and_health(server):
    r = hs("models", "--server", server.address)
    assert r.returncode == 0 and r.stdout.startswith("resnet18 (default): resnet18 on cpu")
    r = hs("health", "--server", server.address)
    assert r.returncode == 0 and r.stdout.strip() == "SERVING"


def test_health_fails_when_nobody_listens():
    r = hs("health", "--server", "127.0.0.1:9", "--timeout", "2")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_serve_help_lists_env_equivalents():
    r = hs("serve", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--weights", "--device", "--port", "--max-batch-size",
                 "--grace-seconds", "--auth-token-file", "--metrics-port"):
        assert flag in r.stdout
        assert "HOOKSERVE_" + flag[2:].upper().replace("-", "_") in r.stdout.replace("\n", " ")


def test_serve_without_server_extra_says_what_to_install():
    # Run `hookserve serve` in an interpreter where torch cannot be imported.
    code = ("import sys; sys.modules['torch'] = None; from hookserve.cli import main; "
            "sys.exit(main(['serve']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "pip install 'hookserve[server]'" in r.stderr


def test_client_package_does_not_import_torch():
    code = ("import sys, hookserve, hookserve.cli; hookserve.cli.build_parser(); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.strip() == "False", r.stderr


# -- the command's manners: version, closed pipes, timeouts, help, outputs -------------

PRINTING = [
    ["--help"], ["--version"], ["describe", "--help"], ["batch", "--help"],
    ["describe", "resnet18"], ["models"], ["health"],
    ["extract", "IMG", "--layers", "layer1,fc", "--reduction", "avg"],
    ["attribute", "IMG", "--out", "OUT"],
]


def test_version_is_the_packages():
    r = hs("--version")
    assert r.returncode == 0 and r.stdout == f"hookserve {hookserve.__version__}\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{hookserve.__version__}"\n' in pyproject


@pytest.mark.parametrize("argv", PRINTING, ids=lambda a: " ".join(a[:2]))
def test_a_closed_stdout_ends_quietly(server, tmp_path, argv):
    """`hookserve ... | head` for every command that prints: the reader is gone before
    the first line is written, and the command stops without a word."""
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    argv = [str(img) if a == "IMG" else str(tmp_path / "o") if a == "OUT" else a
            for a in argv]
    if not argv[-1].startswith("--"):
        argv += ["--server", server.address]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "hookserve.cli", *argv], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert r.stderr == ""
    # argparse drops what --help/--version cannot write, and exits 0
    assert r.returncode == (0 if {"--help", "--version"} & set(argv) else 141)


def test_timeout_bounds_every_call(server, silent_address, tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    for argv in (["describe"], ["models"], ["health"]):
        r = hs(*argv, "--server", silent_address, "--timeout", "0.5")
        assert r.returncode == 1 and "DEADLINE_EXCEEDED" in r.stderr, (argv, r.stderr)
        assert "allow more time (the CLI's --timeout" in r.stderr
    for argv in (["extract", str(img), "--layers", "layer4"],
                 ["attribute", str(img), "--out", str(tmp_path / "m")],
                 ["describe", "vgg11", "--size", "640"]):
        r = hs(*argv, "--server", server.address, "--timeout", "0.001")
        if argv[0] != "describe":        # a unary call may well finish in a millisecond
            assert r.returncode == 1 and "DEADLINE_EXCEEDED" in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr
    for bad in ("-1", "soon", "nan"):
        r = hs("models", "--timeout", bad)
        assert r.returncode == 2 and "--timeout: expected seconds" in r.stderr


def test_every_option_has_help_text():
    from hookserve.cli import build_parser

    def actions(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    if name not in ("serve", "batch"):   # their flags: their own tests
                        yield from actions(sub, [*path, name])
                        assert name in {c.dest for c in a._choices_actions}, name
            else:
                yield path, a

    missing = [(path, a.option_strings or a.dest) for path, a in actions(build_parser(), [])
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing
    for sub in ("describe", "models", "extract", "attribute", "health"):
        r = hs(sub, "--help")
        assert r.returncode == 0 and "(default: None" not in r.stdout


def test_models_marks_random_weights(server):
    r = hs("models", "--server", server.address)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2
    assert all(ln.endswith("[RANDOM: not for real use]") for ln in lines), lines


def test_an_output_of_an_unknown_format_is_refused_before_any_call(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    (tmp_path / "taken").write_text("a file")
    for argv, words in (
            (["extract", str(img), "--layers", "fc", "--out", str(tmp_path / "q.csv")],
             "extract writes one .npz file"),
            (["attribute", str(img), "--out", str(tmp_path / "maps.png")], "names a file"),
            (["attribute", str(img), "--out", str(tmp_path / "taken")], "is a file")):
        r = hs(*argv, "--server", "127.0.0.1:9")    # nobody listens: nothing is called
        assert r.returncode == 2 and words in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "taken"]


@pytest.mark.parametrize("out, extra", [
    ("q.csv", []), ("feats.npz", []), ("feats.JSON", ["--sharded"]),
    ("s3://lake/feats.csv", []), ("dir.d/feats.txt", []),
])
def test_batch_refuses_an_output_of_an_unknown_format(tmp_path, out, extra):
    """`hookserve batch --out` with a suffix that is no output format: exit code 2, one
    line naming the formats, before any server, store or file is touched."""
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    target = out if "://" in out else str(tmp_path / out)
    r = hs("batch", str(img), "--out", target, "--layers", "fc", "--no-progress",
           "--server", "127.0.0.1:9", *extra)    # nobody listens: nothing is called
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    suffix = os.path.splitext(out)[1]
    assert f"--out {target}: {suffix} is not an output format" in err, err
    assert all(f in err for f in ("NAME.h5", ".hdf5", "NAME.parquet", "NAME.npy", "folder"))
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]  # nothing written


def test_batch_takes_every_documented_output_form(tmp_path):
    """.h5/.hdf5 (any case), .parquet, NAME.npy, a name without suffix, a trailing /
    and an existing folder are outputs (--dry-run: counted, no server called)."""
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    (tmp_path / "taken.d").mkdir()
    for out in ("o.h5", "o.HDF5", "o.parquet", "o.npy", "feats", "feats.v2/", "taken.d"):
        r = hs("batch", str(img), "--out", f"{tmp_path}/{out}", "--layers", "fc",
               "--no-progress", "--server", "127.0.0.1:9", "--dry-run")
        assert r.returncode == 0 and "1 to extract" in r.stdout, (out, r.stderr)


def test_extract_keys_stay_unique_for_a_path_given_twice(server, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(encode(rand_image(40, 40, seed=1)))
    b.write_bytes(encode(rand_image(40, 40, seed=2)))
    out = tmp_path / "f.NPZ"
    r = hs("extract", str(a), str(b), str(a), "--layers", "fc", "--out", str(out),
           "--server", server.address)
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        assert sorted(z.files) == sorted([f"{a}:fc", f"{b}:fc", f"{a}-2:fc"])
        np.testing.assert_allclose(z[f"{a}:fc"], z[f"{a}-2:fc"], rtol=1e-4, atol=1e-5)


def test_sdk_and_cli_need_no_extra(server, tmp_path):
    """With every optional package unimportable (torch, the batch formats, object
    stores, Ray, the server's), the SDK, the asyncio client and every client command
    work, and `serve` says which extra to install."""
    img = tmp_path / "a.png"
    img.write_bytes(encode(rand_image(40, 40)))
    blocked = ["torch", "torchvision", "h5py", "pyarrow", "fsspec", "s3fs", "gcsfs", "ray",
               "captum", "prometheus_client", "grpc_health", "grpc_reflection"]
    code = textwrap.dedent(f"""
        import sys
        for m in {blocked!r}:
            sys.modules[m] = None
        import hookserve, hookserve.aio
        from hookserve.cli import main
        for argv in (["describe", "resnet18"], ["models"], ["health"],
                     ["extract", {str(img)!r}, "--layers", "fc", "--reduction", "avg"],
                     ["attribute", {str(img)!r}, "--out", {str(tmp_path / "m")!r}]):
            assert main([*argv, "--server", {server.address!r}]) == 0, argv
        print("serve:", main(["serve"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "serve: 2" in r.stdout and "pip install 'hookserve[server]'" in r.stderr
