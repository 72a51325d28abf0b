"""A replica that comes back with other weights in the middle of a bulk run (a rolling
deploy): the run stops before any of its features is written, so an output never mixes
two models' features. Every Extract stream's server names its weights (the
`hookserve-weights-bin` header) and the bulk command checks them on each new stream.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

import hookserve
from hookserve.batch.errors import Abort
from hookserve.batch.streamcall import Watchdog, extract_many

from bulk_faults import OPTS, markers, tar_bytes
from conftest import encode, rand_image
from helpers import small_server, wait_until

TARS = [tar_bytes([(f"{t}-{i}.png", encode(rand_image(32, 32, seed=t * 10 + i)))
                   for i in range(3)]) for t in range(4)]


def _digest(server) -> str:
    with server.client() as c:
        return c.list_models()[0].weights_digest


def test_a_stream_from_other_weights_is_refused_before_its_first_answer(make_server):
    a = make_server(*small_server("--seed", "0"))
    b = make_server(*small_server("--seed", "1"))
    run_weights = ("resnet18", _digest(a))
    images = [encode(rand_image(32, 32, seed=i)) for i in range(3)]
    for server, ok in ((a, True), (b, False)):
        got = []
        with hookserve.Client(server.address) as c:
            try:
                for r in extract_many(c, images, ["fc"], ids=iter(["0", "1", "2"]),
                                      window=2, watchdog=Watchdog(None, run_weights),
                                      model="resnet18"):
                    got.append(r)
            except Abort as exc:
                assert not ok
                assert f"not the weights this output was written with " \
                       f"({run_weights[1][:19]})" in str(exc)
                assert _digest(b)[:19] in str(exc)
        assert len(got) == (3 if ok else 0)   # not one answer of the other weights


def _held_run(make_server, tmp_path, meanwhile, retries: int = 3):
    """A sharded run over four tars whose third is a pipe: once two shards are done,
    `meanwhile(server)` runs, then the third tar arrives. -> (exit code, stderr, the
    done markers before, after, the ids written)."""
    a = make_server(*small_server("--max-batch-size", "1", "--seed", "0"))
    src = tmp_path / "in"
    src.mkdir()
    for t, data in enumerate(TARS):
        if t == 2:
            os.mkfifo(src / "2.tar")   # held: the run waits there for a writer
        else:
            (src / f"{t}.tar").write_bytes(data)
    out = tmp_path / "out.parquet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookserve.cli", "batch", str(src / "{0..3}.tar"), "--server",
         a.address, *OPTS, "--out", str(out), "--streams", "1", "--retries", str(retries)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        wait_until(lambda: proc.poll() is not None or (
            out.is_dir() and len(markers(str(out))) >= 2), 120, "2 markers")
        done = dict(markers(str(out)))
        meanwhile(a)
        with open(src / "2.tar", "wb") as fh:   # the held shard arrives
            fh.write(TARS[2])
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = pq.read_table(str(out)).column("id").to_pylist() if any(
        n.endswith(".parquet") for n in os.listdir(out)) else []
    return proc.returncode, err, done, dict(markers(str(out))), rows


def test_a_sharded_run_whose_server_returns_with_other_weights_stops(make_server, tmp_path):
    def replaced(a):   # the replica is replaced, with other weights, at the same address
        port = a.port
        a.stop(0)
        make_server(*small_server("--max-batch-size", "1", "--seed", "1"), "--port", str(port))

    code, err, done, after, rows = _held_run(make_server, tmp_path, replaced)
    assert code == 2, err
    assert "not the weights this output was written with" in err
    assert after == done   # no shard of the other weights is marked done
    assert all(not r.startswith(("2.tar", "3.tar")) and "/2.tar" not in r
               and "/3.tar" not in r for r in rows)
    assert np.unique(rows).size == len(rows)


def test_a_run_whose_server_is_gone_stops_and_keeps_what_it_wrote(make_server, tmp_path):
    """After its retries the run stops (exit 2) with its finished shards kept."""
    code, err, done, after, rows = _held_run(make_server, tmp_path, lambda a: a.stop(0),
                                             retries=2)
    assert code == 2, err
    assert "UNAVAILABLE" in err and "(stopped; 2 shards written before)" in err
    assert after == done and len(done) == 2
    assert np.unique(rows).size == len(rows) == 6


def test_the_header_names_each_model_short_and_a_run_checks_its_own(make_server):
    """Two models: the run's model is checked, the other's weights do not matter; the
    run's streams ask for the model the run resolved (the server's default here)."""
    import json

    import grpc

    from hookserve.v1 import hookserve_pb2_grpc as pb_grpc
    s = make_server(*small_server(models=("resnet18", "vgg11")))
    with s.client() as c:
        digests = {m.name: m.weights_digest for m in c.list_models()}
    with grpc.insecure_channel(s.address) as ch:
        call = pb_grpc.FeatureExtractorStub(ch).Extract(iter([]), timeout=60)
        header = dict(call.initial_metadata())["hookserve-weights-bin"]
        list(call)
    sent = json.loads(header)
    assert sent == {n: d[:23] for n, d in digests.items()}
    images = [encode(rand_image(32, 32, seed=i)) for i in range(2)]
    with hookserve.Client(s.address) as c:
        ok = list(extract_many(c, images, ["fc"], ids=iter(["0", "1"]), window=2,
                               watchdog=Watchdog(None, ("resnet18", digests["resnet18"])),
                               model="resnet18"))
        assert len(ok) == 2
        with pytest.raises(Abort, match="no longer serves it for model gone"):
            list(extract_many(c, images, ["fc"], ids=iter(["0", "1"]), window=2,
                              watchdog=Watchdog(None, ("gone", digests["resnet18"])),
                              model="resnet18"))


def test_a_local_run_whose_server_is_gone_stops_after_its_rounds(make_server, tmp_path):
    """A local run's streams each try --retries times, four rounds in a row, then the
    run stops (exit 2) and keeps its rows (the rounds grew with --retries as well: 5
    took 20 s after the server died, 8 took 140 s, 20 did not stop in 13 minutes)."""
    from helpers import METRICS, computed

    a = make_server(*small_server("--max-batch-size", "1", *METRICS))
    src = tmp_path / "in"
    src.mkdir()
    for i in range(300):
        (src / f"{i:03d}.png").write_bytes(encode(rand_image(32, 32, seed=i)))
    out = tmp_path / "out.parquet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookserve.cli", "batch", str(src), "--server", a.address,
         *OPTS, "--out", str(out), "--streams", "2", "--retries", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        wait_until(lambda: proc.poll() is not None or computed(a) >= 20, 120, "20 images")
        a.stop(0)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "no server answered after repeated retries: UNAVAILABLE" in err
    rows = pq.read_table(str(out)).column("path").to_pylist()
    assert 0 < len(rows) < 300 and np.unique(rows).size == len(rows)
