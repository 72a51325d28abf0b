"""The examples in docs/oip.md run as written against a real server (only the
addresses and the image paths are this test's)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import RunningServer, encode, rand_image
from helpers import small_server

pytest.importorskip("tritonclient.grpc", reason="pip install hookserve[oip-clients]")
pytest.importorskip("starlette", reason="pip install hookserve[http]")

DOC = Path(__file__).resolve().parents[1] / "docs" / "oip.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory):
    s = RunningServer(small_server("--http-port", "0"))
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i in range(3):
        p = folder / f"{i}.png"
        p.write_bytes(encode(rand_image(40, 48, seed=i)))
        paths.append(str(p))
    yield s, paths
    s.stop(2.0)


def addressed(code: str, s: RunningServer) -> str:
    return (code.replace("localhost:8001", s.address)
            .replace("localhost:8000", f"127.0.0.1:{s.server.http.port}"))


def test_python_examples_run(doc_server):
    s, paths = doc_server
    examples = blocks("python")
    assert len(examples) == 2
    for code in examples:
        exec(compile(addressed(code, s), str(DOC), "exec"), {"paths": paths})


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("base64")),
                    reason="no curl or base64")
def test_curl_example_runs(doc_server):
    s, paths = doc_server
    (script,) = blocks("bash")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", addressed(script, s)],
                         env={"IMAGE": paths[0], "PATH": "/usr/bin:/bin"},
                         capture_output=True, check=True, timeout=120).stdout.decode()
    live, _, answer = out.partition("}")
    assert json.loads(live + "}") == {"live": True}
    assert json.loads(answer)["outputs"][0]["shape"] == [1, 512]
