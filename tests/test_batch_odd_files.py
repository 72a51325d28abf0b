"""`hookserve batch` over every kind of name and file a filesystem allows: each is
processed or gets its own error row, the run never hangs or crashes, the errors CSV is
always valid UTF-8, and resume works.

The end-to-end runs go through a subprocess with a deadline, so a hang (the old
behaviour on a FIFO) fails the test instead of blocking the suite.
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hookserve import errors
from hookserve.batch.inputs import decode_name, encode_name, read_bytes
from hookserve.batch.local_run import plan
from hookserve.batch.scheduler import Scheduler, Streams
from hookserve.types import Layer

from conftest import encode, rand_image

OPTS = ["--resize", "32", "--crop", "32", "--no-progress", "--layers", "fc"]
BAD_UTF8 = b"bad\xff\xfe name%41.png"          # not UTF-8, and holds a literal '%'
ODD_TEXT = 'new\nline, "quoted" \'x\'.jpg'      # newline, comma, quotes: valid UTF-8


def _png(seed: int) -> bytes:
    return encode(rand_image(32, 32, seed=seed), "PNG")


@pytest.fixture
def odd_folder(tmp_path):
    """Good images under odd names, and one of each kind of file that must not be read."""
    root = tmp_path / "in"
    root.mkdir()
    good = {"plain.png": _png(1), ODD_TEXT: _png(2), "dir.jpg/inside.png": _png(3)}
    for name, data in good.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with open(os.path.join(os.fsencode(root), BAD_UTF8), "wb") as fh:
        fh.write(_png(4))
    os.mkfifo(root / "fifo.jpg")                       # old code: blocked forever here
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock.png"))
    os.symlink("loop.jpg", root / "loop.jpg")           # a symlink loop
    os.symlink("missing.png", root / "dangling.png")    # a dangling symlink
    big = encode(rand_image(400, 400, seed=5), "PNG")
    assert len(big) > 20000 > max(len(d) for d in good.values())
    (root / "big.png").write_bytes(big)
    listing = tmp_path / "list.txt"  # a character device, named explicitly
    listing.write_text("/dev/null\n")
    yield root, listing
    sock.close()


def _ids_good(root) -> set[str]:
    base = os.fsencode(root)
    names = [b"plain.png", ODD_TEXT.encode(), b"dir.jpg/inside.png", BAD_UTF8]
    return {encode_name(os.fsdecode(os.path.join(base, n))) for n in names}


def _run(server, *argv, timeout: float = 120):
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", *argv, "--server",
           server.address, *OPTS]
    return subprocess.run(cmd, capture_output=True, timeout=timeout,
                           env={**os.environ, "PYTHONIOENCODING": "utf-8"})


@pytest.mark.parametrize("fmt", ["parquet", "npy", "h5"])
def test_odd_files_each_get_a_row_and_resume_works(fmt, odd_folder, server, tmp_path):
    root, listing = odd_folder
    out = tmp_path / {"parquet": "out.parquet", "h5": "out.h5", "npy": "out"}[fmt]
    argv = [str(root), str(listing), "--out", str(out), "--max-file-bytes", "20000"]
    p = _run(server, *argv)
    assert p.returncode == 1, p.stderr.decode(errors="replace")  # some failed, none hung
    errs_path = str(out) + ".errors.csv"
    with open(errs_path, newline="", encoding="utf-8") as fh:  # valid UTF-8, parses
        rows = {r["path"]: (r["code"], r["message"]) for r in csv.DictReader(fh)}
    j = lambda n: os.path.join(str(root), n)  # noqa: E731
    assert rows[j("fifo.jpg")][0] == "INVALID_ARGUMENT" and "FIFO" in rows[j("fifo.jpg")][1]
    assert rows[j("sock.png")][0] == "INVALID_ARGUMENT" and "socket" in rows[j("sock.png")][1]
    assert rows["/dev/null"][0] == "INVALID_ARGUMENT" and "device" in rows["/dev/null"][1]
    assert rows[j("loop.jpg")][0] == "INVALID_ARGUMENT"   # (the link's, final)
    assert rows[j("dangling.png")][0] == "INVALID_ARGUMENT"
    assert rows[j("big.png")][0] == "INVALID_ARGUMENT"
    assert "--max-file-bytes" in rows[j("big.png")][1]
    assert len(rows) == 6  # one row each, nothing else failed

    if fmt == "parquet":
        written = pq.read_table(out, columns=["path"]).column("path").to_pylist()
    elif fmt == "h5":
        import h5py
        with h5py.File(out, "r") as f:
            written = [p.decode() for p in f["paths"][:]]
    else:
        import json
        with open(out / "index.jsonl", encoding="utf-8") as fh:
            written = [json.loads(line)["path"] for line in fh]
        for pid in written:  # the .npy file of every odd name exists
            assert os.path.exists(out / "fc" / (pid.lstrip("/") + ".npy")), pid
    assert sorted(written) == sorted(_ids_good(root))
    bad_id = encode_name(os.fsdecode(os.path.join(os.fsencode(root), BAD_UTF8)))
    assert "%FF%FE" in bad_id and "%2541" in bad_id
    assert decode_name(bad_id) == os.path.join(os.fsencode(root), BAD_UTF8)  # reversible

    again = _run(server, *argv)  # resume: same failures, nothing written twice
    assert again.returncode == 1, again.stderr.decode(errors="replace")
    assert b"skipped 4" in again.stderr
    if fmt == "parquet":
        assert sorted(pq.read_table(out, columns=["path"]).column("path").to_pylist()) == \
            sorted(written)


def test_vanished_and_changed_files_fail_alone(tmp_path, server, client):
    """Listed, then gone or rewritten before the stream reads them: own rows, the rest
    goes on (the real scheduler and streams, against the real server)."""
    paths = []
    for i in range(4):
        p = tmp_path / f"{i}.png"
        p.write_bytes(_png(10 + i))
        paths.append(str(p))
    work, failures, skipped = plan(paths, {})
    assert len(work) == 4 and not failures
    os.unlink(paths[1])                               # vanished after listing
    with open(paths[2], "ab") as fh:                  # changed after listing
        fh.write(b"more")
    streams = Streams(client, Scheduler(work, 8), [Layer("fc")],
                      {"resize": 32, "crop": (32, 32)}, model=None, retries=1, streams=2,
                      window=2)
    streams.start()
    got = {}
    while len(got) < 4:
        item, feats, err = streams.results.get(timeout=60)
        got[item.pos] = err
        streams.sched.written(1)
    streams.stop()
    assert got[0] is None and got[3] is None
    assert isinstance(got[1], errors.NotFound)
    assert isinstance(got[2], errors.FailedPrecondition) and "changed" in got[2].message


def test_read_bytes_checks_the_open_file(tmp_path):
    f = tmp_path / "a.png"
    f.write_bytes(b"12345")
    st_ = os.stat(f)
    assert read_bytes(str(f), 5, (5, st_.st_mtime_ns)) == b"12345"
    with pytest.raises(errors.InvalidArgument, match="max-file-bytes"):
        read_bytes(str(f), 4)
    with pytest.raises(errors.FailedPrecondition):
        read_bytes(str(f), 100, (4, st_.st_mtime_ns))
    os.mkfifo(tmp_path / "p.jpg")
    with pytest.raises(errors.InvalidArgument, match="FIFO"):
        read_bytes(str(tmp_path / "p.jpg"))  # returns at once: opened non-blocking
    with pytest.raises(errors.InvalidArgument, match="directory"):
        read_bytes(str(tmp_path))


@given(st.binary(min_size=1, max_size=40).filter(lambda b: b"\0" not in b and b"/" not in b))
def test_name_encoding_is_reversible_and_utf8(raw):
    name = os.fsdecode(raw)
    enc = encode_name(name)
    enc.encode("utf-8")  # never raises: ids and CSV rows are valid UTF-8
    try:
        raw.decode("utf-8")
        assert enc == name  # valid names are their own ids
    except UnicodeDecodeError:
        assert decode_name(enc) == raw


def test_a_name_like_another_inputs_temporary_file_loses_nothing(server, tmp_path):
    """`.tmp-y.png` and `y.png` in one folder, written to a folder of .npy files: each
    keeps its own features (the temporary file of one is never the other's name)."""
    root = tmp_path / "in"
    root.mkdir()
    (root / "y.png").write_bytes(_png(20))
    (root / ".tmp-y.png").write_bytes(_png(21))
    out = tmp_path / "out"
    p = _run(server, str(root), "--out", str(out))
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    import numpy as np
    a, b = (np.load(out / "fc" / (str(root / n).lstrip("/") + ".npy"))
            for n in ("y.png", ".tmp-y.png"))
    assert a.shape == b.shape == (1000,) and not np.array_equal(a, b)
    assert sorted(os.listdir(out / "fc" / str(root).lstrip("/"))) == [".tmp-y.png.npy",
                                                                      "y.png.npy"]


def test_a_killed_runs_temporary_files_are_removed_by_the_next_run(server, tmp_path):
    """A .npy folder output keeps its temporary files in `.tmp/`: a run leaves none,
    and a run that was killed mid-write leaves them for the next run to remove."""
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.png").write_bytes(_png(23))
    out = tmp_path / "out"
    assert _run(server, str(root), "--out", str(out)).returncode == 0
    assert not (out / ".tmp").exists()
    (out / ".tmp").mkdir()
    (out / ".tmp" / "4242-0").write_bytes(b"half an array")   # as a kill -9 leaves it
    (root / "b.png").write_bytes(_png(24))
    p = _run(server, str(root), "--out", str(out))
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    assert not (out / ".tmp").exists()
    assert sorted(os.listdir(out / "fc" / str(root).lstrip("/"))) == ["a.png.npy",
                                                                      "b.png.npy"]


def test_a_changed_file_with_an_odd_name_is_reported_under_its_id(tmp_path):
    raw = os.path.join(os.fsencode(tmp_path), BAD_UTF8)
    with open(raw, "wb") as fh:
        fh.write(_png(22))
    path = os.fsdecode(raw)
    st = os.stat(raw)
    _, failures, _ = plan([path], {encode_name(path): (st.st_size + 1, st.st_mtime_ns, "")})
    assert [(f[0], f[1]) for f in failures] == [(encode_name(path), "FAILED_PRECONDITION")]


def test_an_h5_output_in_a_new_folder_is_made_and_odd_places_are_named(tmp_path):
    """As the Parquet and folder outputs do, an .h5 output makes its folder; a folder
    named like the file, or a place no file can be made, is one line saying so."""
    pytest.importorskip("h5py")
    from hookserve.batch.sinks.base import OutputError
    from hookserve.batch.sinks.h5 import H5Sink

    sink = H5Sink(str(tmp_path / "new" / "sub" / "o.h5"), {})
    sink.open()
    sink.close(True)
    assert (tmp_path / "new" / "sub" / "o.h5").is_file()
    (tmp_path / "dir.h5").mkdir()
    with pytest.raises(OutputError, match="dir.h5 is a folder; an .h5 output is a file"):
        H5Sink(str(tmp_path / "dir.h5"), {}).open()
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot write the output's lock file .*: "
                                          "choose another --out"):
        H5Sink(str(tmp_path / "file" / "o.h5"), {}).open()


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "local"])
def test_a_link_to_nothing_is_the_inputs_own_failure(server, tmp_path, sharded):
    """A symbolic link to a missing file, or one in a loop, fails as final: a sharded
    run finishes its shard (it said "run it again" for ever) and says which link."""
    from bulk_faults import read_out

    root = tmp_path / "in"
    root.mkdir()
    (root / "ok.png").write_bytes(_png(7))
    os.symlink("/nonexistent/x.png", root / "dangling.png")
    os.symlink("loop.png", root / "loop.png")
    out = tmp_path / ("o.parquet" if sharded else "o.h5")
    extra = ["--sharded"] if sharded else []
    r = _run(server, str(root), "--out", str(out), *extra)
    assert r.returncode == 1, r.stderr.decode()   # some failed (final), none left open
    if sharded:
        ids, codes = read_out(str(out))
        assert ids == [str(root / "ok.png")]
        again = _run(server, str(root), "--out", str(out), *extra)
        assert again.returncode == 1 and b"shards done 0" in again.stderr, again.stderr
    else:
        with open(f"{out}.errors.csv", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        codes = {r["path"]: r["code"] for r in rows}
        messages = " ".join(r["message"] for r in rows)
        assert "a symbolic link to /nonexistent/x.png, which does not exist" in messages
        assert "a symbolic link to loop.png, which loops back" in messages
    assert codes == {str(root / "dangling.png"): "INVALID_ARGUMENT",
                     str(root / "loop.png"): "INVALID_ARGUMENT"}


def test_a_folder_that_cannot_be_listed_is_a_failed_row_not_a_silence(server, tmp_path):
    """(a local run skipped the files below an unreadable folder and exited 0)"""
    import shutil

    root = tmp_path / "in"
    (root / "locked").mkdir(parents=True)
    (root / "ok.png").write_bytes(_png(1))
    (root / "locked" / "hidden.png").write_bytes(_png(2))
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", str(root), "--out", str(out),
           "--server", server.address, *OPTS]
    if os.geteuid() == 0:   # root reads any folder: run without that power
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to run as root without CAP_DAC_*")
        drop = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    (root / "locked").chmod(0)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        (root / "locked").chmod(0o755)
    assert p.returncode == 1, p.stderr   # some failed: not "every image was written"
    with open(str(out) + ".errors.csv", newline="", encoding="utf-8") as fh:
        rows = {r["path"]: (r["code"], r["message"]) for r in csv.DictReader(fh)}
    assert rows == {str(root / "locked"): (
        "PERMISSION_DENIED", "cannot list this folder (Permission denied): the files "
                             "below it are left out; make it readable and run again")}
    assert pq.read_table(out, columns=["path"]).column("path").to_pylist() == \
        [str(root / "ok.png")]
