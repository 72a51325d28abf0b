"""The `hookserve` command, run as a real subprocess against a live server."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from conftest import encode, rand_image


def hs(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hookserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


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
