"""NVIDIA's perf_analyzer, unchanged, against hookserve's OIP gRPC service at the
default flags: an IMAGE input-data file, 10 s windows at concurrency 1 and 4, no
errors. perf_analyzer asks for every output ModelMetadata lists (every layer: about
35 MB an answer for resnet18), so this also runs the largest answers.

perf_analyzer comes from the `tritonclient==2.47.0` wheel (`bin/perf_analyzer`; the
`perf-analyzer` wheels need a newer glibc than some machines have), with the two
libraries it loads: `libb64` (Debian's `libb64-0d`) and `libcudart.so.12` (the
`nvidia-cuda-runtime-cu12` wheel). The fixture fetches them into a cache folder
(`$HOOKSERVE_TEST_CACHE`, default ~/.cache/hookserve-tests) with pip and apt-get;
the test is skipped when that, or running the binary, is not possible here.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import RunningServer, encode, rand_image
from helpers import R18

pytestmark = pytest.mark.slow
PA_WHEEL = "tritonclient==2.47.0"
CUDART_WHEEL = "nvidia-cuda-runtime-cu12"


def _fetch(cache: Path) -> tuple[Path, dict]:
    """perf_analyzer and the environment it runs in; pytest.skip when impossible."""
    binary = cache / "bin" / "perf_analyzer"
    libs = [cache / "lib"]
    if not binary.exists():
        wheels = cache / "wheels"
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--only-binary=:all:", "-d", str(wheels), PA_WHEEL,
                              CUDART_WHEEL], capture_output=True, text=True, timeout=600)
        if pip.returncode:
            pytest.skip(f"cannot download {PA_WHEEL}, {CUDART_WHEEL}: {pip.stderr[-300:]}")
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            pytest.skip("no apt-get/dpkg to fetch libb64-0d")
        apt = subprocess.run(["apt-get", "download", "libb64-0d"], cwd=wheels,
                             capture_output=True, text=True, timeout=300)
        debs = sorted(wheels.glob("libb64-0d_*.deb"))
        if not debs:
            pytest.skip(f"cannot download libb64-0d: {apt.stderr[-300:]}")
        subprocess.run(["dpkg", "-x", str(debs[-1]), str(cache / "deb")], check=True)
        (cache / "lib").mkdir(parents=True, exist_ok=True)
        for so in (cache / "deb").rglob("libb64.so*"):
            shutil.copy(so, cache / "lib" / so.name)
        for whl in wheels.glob("*.whl"):
            with zipfile.ZipFile(whl) as z:
                for name in z.namelist():
                    if name.endswith("bin/perf_analyzer") or "libcudart.so.12" in name:
                        target = (binary if name.endswith("perf_analyzer")
                                  else cache / "lib" / Path(name).name)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(z.read(name))
        binary.chmod(0o755)
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(str(p) for p in libs))
    probe = subprocess.run([str(binary), "--help"], env=env, capture_output=True,
                           text=True, timeout=60)
    if "measurement" not in probe.stdout + probe.stderr:
        pytest.skip(f"perf_analyzer cannot run here: {(probe.stderr or probe.stdout)[-300:]}")
    return binary, env


@pytest.fixture(scope="module")
def perf_analyzer():
    cache = Path(os.environ.get("HOOKSERVE_TEST_CACHE",
                                Path.home() / ".cache" / "hookserve-tests")) / "perf_analyzer"
    cache.mkdir(parents=True, exist_ok=True)
    return _fetch(cache)


def test_perf_analyzer_concurrency_1_and_4(perf_analyzer, tmp_path):
    binary, env = perf_analyzer
    s = RunningServer(R18)
    try:
        img = encode(rand_image(64, 64))
        data = {"data": [{"IMAGE": {"b64": base64.b64encode(
            struct.pack("<I", len(img)) + img).decode(), "shape": [1]}}]}
        (tmp_path / "input.json").write_text(json.dumps(data))
        run = subprocess.run(
            [str(binary), "-m", "resnet18", "-i", "grpc", "-u", s.address,
             "--input-data", str(tmp_path / "input.json"), "--concurrency-range", "1:4:3",
             "-p", "10000", "-s", "100", "-r", "3"],
            env=env, capture_output=True, text=True, timeout=280)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-2000:]
        assert "Concurrency: 1, throughput" in out and "Concurrency: 4, throughput" in out
        assert "error" not in out.lower(), out[-2000:]
        counts = s.server.oip.inference.counts.of("resnet18")
        assert counts.fail == 0 and counts.success > 0
    finally:
        s.stop(2.0)
