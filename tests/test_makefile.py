"""The Makefile: every documented `make` target builds the virtual environment first, so
each works on a fresh clone."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["docker-smoke", "serve", "test", "test-slow", "lint",
                                    "proto", "bench", "bench-quick"])
def test_make_targets_build_the_venv_first_on_a_fresh_clone(tmp_path, target):
    assert f"make {target}" in (ROOT / "README.md").read_text()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    # Under `make test` the parent's MAKELEVEL/MAKEFLAGS would make this child print
    # "Entering directory" lines: run it as a first, top-level make would be.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=tmp_path,
                         capture_output=True, text=True, check=True,
                         env=env).stdout.splitlines()
    assert out[0].startswith("test -x .venv/bin/python ||"), out[:3]
