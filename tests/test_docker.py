"""The container image, and the start-up behaviour it relies on.

Tests marked `docker` run the built image (`make docker-smoke` builds it and runs
them): start, health SERVING, extraction through the SDK compared with in-process
results for the same mounted weights file, then SIGTERM and a clean exit within the
grace period. They skip when no Docker engine is reachable or the image is missing.

The unmarked tests are fast and need no Docker: the `hookserve serve` process the image
runs (SIGTERM drain, metrics bound to --host) and the settings the image defaults to
(--no-download, environment defaults that command-line flags replace).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import hookserve
from hookserve.cli import build_parser

from conftest import RunningServer, encode, rand_image
from helpers import wait_until

IMAGE = os.environ.get("HOOKSERVE_IMAGE", "hookserve:smoke")
GRACE_S = 10.0
HOOKSERVE = str(Path(sys.executable).with_name("hookserve"))


# ---------------------------------------------------------------- no Docker needed
def test_command_line_list_flag_replaces_environment_default(monkeypatch):
    # The image sets HOOKSERVE_MODEL; `docker run IMAGE --model resnet18` must serve
    # resnet18 alone, not resnet50 and resnet18.
    monkeypatch.setenv("HOOKSERVE_MODEL", "resnet50,vgg11")
    monkeypatch.setenv("HOOKSERVE_WEIGHTS", "imagenet")
    assert build_parser().parse_args(["serve"]).model == ["resnet50", "vgg11"]
    args = build_parser().parse_args(["serve", "--model", "resnet18", "--model", "vgg11",
                                      "--weights", "random"])
    assert args.model == ["resnet18", "vgg11"]
    assert args.weights == ["random"]


def test_no_download_with_imagenet_and_empty_cache_fails_at_once(tmp_path):
    # The image's defaults (HOOKSERVE_WEIGHTS=imagenet, HOOKSERVE_DOWNLOAD=0) with no
    # baked weights: exit 2 with a message that says what to do, no network attempt.
    env = {**os.environ, "TORCH_HOME": str(tmp_path), "HOOKSERVE_MODEL": "resnet18",
           "HOOKSERVE_WEIGHTS": "imagenet", "HOOKSERVE_DOWNLOAD": "0"}
    p = subprocess.run([HOOKSERVE, "serve", "--host", "127.0.0.1", "--port", "0"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "downloads are off" in p.stderr and "--weights PATH" in p.stderr
    assert "downloading" not in p.stderr
    assert not any(tmp_path.rglob("*.pth"))


def test_no_download_with_auto_serves_random_without_downloading(make_server, tmp_path,
                                                                 monkeypatch, caplog):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO):
        s = make_server("--model", "resnet18", "--weights", "auto", "--no-download")
    with s.client(timeout=30) as c:
        (m,) = c.list_models()
    assert m.weights_source == "random" and not m.pretrained
    assert not any("downloading" in r.getMessage() for r in caplog.records)
    assert any("RANDOM" in r.getMessage() for r in caplog.records)


def test_serve_process_drains_on_sigterm_and_binds_metrics_to_host():
    """The process the image runs as PID 1: SIGTERM -> drain -> exit 0 within grace."""
    p = subprocess.Popen(
        [HOOKSERVE, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--model", "resnet18", "--weights", "random", "--device", "cpu",
         "--grace-seconds", str(GRACE_S)],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "HOOKSERVE_DOWNLOAD": "0"})
    lines: list[str] = []
    try:
        port = mport = None
        for line in p.stderr:  # JSON log lines, until the server says it is listening
            lines.append(line)
            msg = json.loads(line).get("msg", "")
            if m := re.search(r"metrics on http://([\d.]+):(\d+)/", msg):
                assert m.group(1) == "127.0.0.1"  # --host, not 0.0.0.0
                mport = int(m.group(2))
            if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", msg):
                port = int(m.group(1))
                break
        assert port and mport, "".join(lines)
        with hookserve.Client(f"127.0.0.1:{port}", timeout=60) as c:
            assert c.health() == "SERVING"
            assert c.extract(encode(rand_image(64, 64)), "layer4", native=True,
                             reduction="avg")["layer4"].shape == (512,)
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            assert b'hookserve_images_total{code="OK",model="resnet18"} 1.0' in r.read()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=GRACE_S + 15)
        took = time.monotonic() - t0
        lines.extend(p.stderr)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log = "".join(lines)
    assert rc == 0, log
    assert took < GRACE_S, took
    assert "draining" in log and '"msg": "stopped"' in log


# ---------------------------------------------------------------- the image itself
def _docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    p = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {p.returncode}: {p.stderr}")
    return p.stdout.strip()


def _logs(cid: str) -> str:
    """Container output; the server logs to stderr, which `docker logs` keeps apart."""
    return subprocess.run(["docker", "logs", cid], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60).stdout


def _engine_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True,
                              timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def image() -> str:
    if not _engine_reachable():
        pytest.skip("no Docker engine reachable (make docker-smoke starts one here)")
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True,
                      timeout=60).returncode != 0:
        pytest.skip(f"image {IMAGE} is not built: run `make docker-smoke`")
    return IMAGE


@pytest.fixture
def weights_dir(tmp_path) -> Path:
    """A resnet18 state_dict with seeded random weights, readable by the image's uid."""
    torch.manual_seed(1234)
    model = torchvision.models.resnet18(weights=None)
    d = tmp_path / "weights"
    d.mkdir()
    torch.save(model.state_dict(), d / "resnet18.pth")
    d.chmod(0o755)
    (d / "resnet18.pth").chmod(0o644)
    return d


@pytest.mark.docker
def test_image_metadata(image):
    cfg = json.loads(_docker("image", "inspect", image))[0]["Config"]
    assert cfg["Entrypoint"] == ["hookserve", "serve"]
    assert cfg["User"] and not cfg["User"].startswith(("0", "root"))
    assert "hookserve health" in " ".join(cfg["Healthcheck"]["Test"])
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["HOOKSERVE_DOWNLOAD"] == "0" and env["HOOKSERVE_WEIGHTS"] == "imagenet"
    assert "org.opencontainers.image.revision" in cfg["Labels"]


@pytest.mark.docker
def test_image_serves_like_in_process_and_stops_on_sigterm(image, weights_dir, tmp_path):
    images_dir = tmp_path / "images"
    images_dir.mkdir(mode=0o755)
    cid = _docker(
        "run", "-d",
        # bridge network; docker picks free loopback ports: no port race, and the
        # image's HEALTHCHECK can use its default port inside the container
        "-p", "127.0.0.1::50051", "-p", "127.0.0.1::9090",
        "-v", f"{weights_dir}:/weights:ro", "-v", f"{images_dir}:/images:ro",
        "-e", f"HOOKSERVE_GRACE_SECONDS={GRACE_S}",
        image, "--model", "resnet18", "--weights", "/weights/resnet18.pth",
        "--device", "cpu", "--threads", "2", "--max-batch-delay-ms", "2")
    try:
        def state():
            s = json.loads(_docker("inspect", cid))[0]["State"]
            if not s["Running"]:
                raise AssertionError(f"container exited {s['ExitCode']}:\n"
                                     + _logs(cid))
            return s["Health"]["Status"] == "healthy"

        # Docker's own HEALTHCHECK (hookserve health, every 15 s) must turn healthy.
        wait_until(state, 240, "the container to turn healthy", every=1.0)
        host, port = _docker("port", cid, "50051/tcp").splitlines()[0].rsplit(":", 1)
        mhost, mport = _docker("port", cid, "9090/tcp").splitlines()[0].rsplit(":", 1)
        assert _docker("exec", cid, "id", "-u") == "1000"

        images = [encode(rand_image(64, 64, seed=i)) for i in range(3)]
        images.append(encode(rand_image(240, 300, seed=7), "JPEG"))  # default preprocessing
        layers = ["layer2", "layer4", "fc"]
        local = RunningServer(["--model", "resnet18",
                               "--weights", str(weights_dir / "resnet18.pth")])
        try:
            with hookserve.Client(f"{host}:{port}", timeout=120) as remote, \
                    local.client(timeout=120) as here:
                assert remote.health() == "SERVING"
                (rm,), (lm,) = remote.list_models(), here.list_models()
                assert rm.weights_source == "file" and rm.weights_name == "resnet18.pth"
                assert rm.weights_digest == lm.weights_digest
                for native in (True, False):
                    sel = images[:3] if native else images[3:]
                    got = list(remote.extract_many(sel, layers, native=native))
                    want = list(here.extract_many(sel, layers, native=native))
                    assert len(got) == len(sel) and all(r.ok for r in got)
                    for g, w in zip(got, want, strict=True):
                        for name in layers:
                            np.testing.assert_allclose(g.features[name], w.features[name],
                                                       rtol=1e-4, atol=1e-5)
        finally:
            local.stop(2.0)
        with urllib.request.urlopen(f"http://{mhost}:{mport}/metrics", timeout=10) as r:
            assert b'hookserve_images_total{code="OK",model="resnet18"} 4.0' in r.read()

        # What deploy/k8s/job-batch.yaml runs, in this image: `hookserve batch --shard`
        # to .parquet (the image's batch extra), here against the container itself.
        for i in range(2):
            (images_dir / f"img{i}.png").write_bytes(encode(rand_image(64, 64, seed=50 + i)))
        shards = [_docker("exec", cid, "hookserve", "batch", "/images",
                          "--layers=avgpool:flatten", f"--out=/tmp/features-{i}.parquet",
                          "--server=localhost:50051", f"--shard={i}/2", "--no-progress",
                          timeout=180)
                  for i in range(2)]
        rows = _docker("exec", cid, "python3", "-c",
                       "import pyarrow.parquet as pq; print(sum(pq.read_table("
                       "f'/tmp/features-{i}.parquet').num_rows for i in range(2)))")
        assert rows == "2", shards

        t0 = time.monotonic()
        _docker("kill", "--signal", "TERM", cid)
        code = int(_docker("wait", cid, timeout=GRACE_S + 30))
        took = time.monotonic() - t0
        logs = _logs(cid)
        assert code == 0, logs
        assert took < GRACE_S, took
        assert "draining" in logs and '"msg": "stopped"' in logs
    finally:
        _docker("rm", "-f", cid, check=False)
