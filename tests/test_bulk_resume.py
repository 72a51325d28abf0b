"""Kill -9 and resume, over local, S3 (moto) and http inputs: the resumed output has
exactly the rows of an uninterrupted run, bit for bit, and the shards finished before
the kill are skipped.

A sharded run works one shard at a time (--streams 1). For local and http inputs the
third shard is held back (a FIFO that no one writes; an http answer that waits) so the
kill always lands mid-run; on S3 the run is killed once its first marker is listed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from hookserve.cli import main

from bulk_faults import OPTS, Web, markers, tar_bytes
from conftest import encode, rand_image
from helpers import wait_until

N_TARS, PER_TAR = 4, 6
TARS = [tar_bytes([(f"{t}-{i}.png", encode(rand_image(32, 32, seed=t * 10 + i)))
                   for i in range(PER_TAR)] + [(f"{t}-bad.png", b"not an image")])
        for t in range(N_TARS)]



def _rows(out: str, fs=None) -> dict[str, np.ndarray]:
    t = pq.read_table(out, filesystem=fs) if fs else pq.read_table(out)
    ids = t.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a row written twice"
    return {rid: np.asarray(t.column("fc")[i].values) for i, rid in enumerate(ids)}


class _Local:
    def __init__(self, tmp_path):
        self.dir = tmp_path / "in"
        self.dir.mkdir()
        self.spec = str(self.dir / "{0..3}.tar")
        self.fs = None

    def stage(self, held: int | None) -> None:
        for t, data in enumerate(TARS):
            p = self.dir / f"{t}.tar"
            if t != held and p.is_file():
                continue   # there already (rewriting it would have its shard redone)
            if p.exists() or p.is_fifo():
                p.unlink()
            if t == held:
                os.mkfifo(p)  # opening it waits for a writer that never comes
            else:
                p.write_bytes(data)

    def close(self) -> None:
        pass


class _Http:
    def __init__(self, tmp_path):
        self.web = Web()
        self.web.files.update({f"{t}.tar": d for t, d in enumerate(TARS)})
        self.spec = self.web.url + "/f/{0..3}.tar"
        self.fs = None

    def stage(self, held: int | None) -> None:
        for g in self.web.gates.values():
            g.set()  # a request still held answers now
        self.web.gates.clear()
        if held is not None:
            self.web.gates[f"{held}.tar"] = threading.Event()  # answers once set

    def close(self) -> None:
        for g in self.web.gates.values():
            g.set()
        self.web.close()


class _S3:
    def __init__(self, tmp_path, s3):
        for t, data in enumerate(TARS):
            s3.pipe(f"lake/resume/{t}.tar", data)
        self.spec = "s3://lake/resume/{0..3}.tar"
        self.fs = s3

    def stage(self, held: int | None) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("where", ["local", "http", pytest.param("s3", marks=pytest.mark.slow)])
def test_kill_9_and_resume_equals_an_uninterrupted_run(det_server, tmp_path, request,
                                                       where):
    src = {"local": lambda: _Local(tmp_path), "http": lambda: _Http(tmp_path),
           "s3": lambda: _S3(tmp_path, request.getfixturevalue("s3"))}[where]()
    try:
        src.stage(None)
        ref = tmp_path / "ref.parquet"
        argv = ["batch", src.spec, "--server", det_server.address, *OPTS]
        assert main([*argv, "--out", str(ref)]) == 1  # one bad member a tar: final rows
        expected = _rows(str(ref))
        assert len(expected) == N_TARS * PER_TAR

        src.stage(2)
        out = tmp_path / "killed.parquet"
        proc = subprocess.Popen(
            [sys.executable, "-m", "hookserve.cli", *argv, "--out", str(out),
             "--streams", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        want = 2 if where != "s3" else 1
        try:
            wait_until(lambda: proc.poll() is not None or (
                out.is_dir() and len(markers(str(out))) >= want), 120, f"{want} markers")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        before = len(markers(str(out)))
        assert want <= before < N_TARS, proc.stderr.read().decode()

        src.stage(None)  # what was held back arrives
        r = subprocess.run([sys.executable, "-m", "hookserve.cli", *argv, "--out",
                            str(out)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                           timeout=300)
        assert r.returncode == 1, r.stderr
        assert f"skipped {before}" in r.stderr, r.stderr
        got = _rows(str(out))
        assert got.keys() == expected.keys()
        for rid, fc in expected.items():
            assert np.array_equal(got[rid], fc), rid
        assert len(markers(str(out))) == N_TARS
    finally:
        src.close()
