"""Every input's cost is bounded before it is paid, and one bad input never fails its
neighbours.

- The per-file cap sits at or below what the server accepts: DescribeModel reports
  the server's --max-message-bytes, and an input over the cap is refused from its size
  (a stat, a tar header, a Parquet offset, a Content-Length) with a row naming the cap.
- Parquet: column types are checked once (one line, exit 2); a row group is refused
  from the footer when its columns would not fit; dictionaries are not expanded.
- http(s): streamed, with a read timeout and the cap on the body.
- The client's memory is measured (peak RSS of a child process running the command)
  against the bound docs/limits.md states.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hookserve.batch.errors import EXIT_INCOMPLETE
from hookserve.batch.limits import FRAMING
from hookserve.batch.readers import FIRST_READ

from bulk_faults import FaultyFS, Web, markers, read_out, run_batch, tar_bytes
from conftest import RunningServer, encode, rand_image
from helpers import R18

MiB = 1 << 20
SERVER_LIMIT = 200_000
GOOD = [encode(rand_image(32, 32, seed=60 + i)) for i in range(3)]


@pytest.fixture(scope="module")
def small_server():
    """A server that accepts request messages of at most 200 kB."""
    s = RunningServer([*R18, "--max-batch-size", "1", "--max-message-bytes", str(SERVER_LIMIT)])
    yield s
    s.stop(2.0)



def test_describe_reports_the_servers_request_limit(small_server):
    with small_server.client() as c:
        assert c.describe().max_message_bytes == SERVER_LIMIT


def test_an_oversized_member_fails_alone_with_the_servers_cap(small_server, tmp_path,
                                                              capsys):
    big = os.urandom(SERVER_LIMIT)  # under --max-file-bytes, over what the server takes
    tar = tmp_path / "s.tar"
    tar.write_bytes(tar_bytes([("0.png", GOOD[0]), ("big.png", big), ("1.png", GOOD[1]),
                               ("2.png", GOOD[2])]))
    out = tmp_path / "o.parquet"
    assert run_batch(small_server, [str(tar)], out) == 1, capsys.readouterr().err
    ids, codes = read_out(str(out))
    assert sorted(ids) == [f"{tar}/{i}.png" for i in range(3)]  # the neighbours
    assert codes == {f"{tar}/big.png": "INVALID_ARGUMENT"}
    text = open(next(out / n for n in os.listdir(out) if n.startswith("_errors-"))).read()
    assert f"cap of {SERVER_LIMIT - FRAMING} bytes" in text and "--max-message-bytes" in text
    assert list(markers(str(out))) == [str(tar)]  # a final failure: the shard is done


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_a_file_over_the_cap_is_refused_from_its_size(small_server, tmp_path, capsys,
                                                      sharded):
    """A 3 GB sparse file next to good ones: refused from its size, never read (the
    run takes a moment, not the time to read 3 GB)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, data in enumerate(GOOD):
        (folder / f"{i}.png").write_bytes(data)
    with open(folder / "huge.png", "wb") as fh:
        fh.truncate(3 << 30)
    out = tmp_path / "o.parquet"
    t0 = time.monotonic()
    assert run_batch(small_server, [str(folder)], out, *(["--sharded"] if sharded else [])) == 1
    assert time.monotonic() - t0 < 30
    if sharded:
        ids, codes = read_out(str(out))
        assert len(ids) == 3 and list(codes) == [str(folder / "huge.png")]
        text = "".join(open(out / n).read() for n in os.listdir(out) if n.startswith("_err"))
    else:
        text = open(f"{out}.errors.csv").read()
    assert f"is {3 << 30} bytes, over the per-file cap of {SERVER_LIMIT - FRAMING}" in text


# ---------------------------------------------------------------------------- Parquet
def _parquet(path, table, **kw):
    pq.write_table(table, str(path), **kw)
    return str(path)


@pytest.mark.parametrize("column, kind", [
    (pa.array([10**9, 5]), "int64"),
    (pa.array(["a", "b"]), "string"),
    (pa.array([[1, 2], [3]]), "list<element: int64>"),
])
def test_a_column_of_the_wrong_type_is_one_line_exit_2(small_server, tmp_path, capsys,
                                                       column, kind):
    f = _parquet(tmp_path / "t.parquet", pa.table({"image": column}))
    t0 = time.monotonic()
    assert run_batch(small_server, [f], tmp_path / "o.parquet", "--image-column", "image") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"column 'image' is {kind}, not image bytes" in err, err
    assert time.monotonic() - t0 < 20  # nothing was allocated from the values


def test_an_id_column_of_the_wrong_type_is_one_line(small_server, tmp_path, capsys):
    f = _parquet(tmp_path / "t.parquet", pa.table({"image": [GOOD[0]], "k": [[1.0]]}))
    assert run_batch(small_server, [f], tmp_path / "o.parquet", "--image-column", "image",
                "--id-column", "k") == 2
    assert "column 'k' is list<element: double>, not text or integers" in \
        capsys.readouterr().err


def test_parquet_cells_are_capped_and_row_groups_bounded(small_server, tmp_path, capsys):
    """A cell over the cap: its own row. A 20 MB cell that compresses to a few kB: its
    row group is refused from the footer (RESOURCE_EXHAUSTED, not final)."""
    cells = [GOOD[0], os.urandom(SERVER_LIMIT), GOOD[1]]
    f = _parquet(tmp_path / "cells.parquet", pa.table({"image": cells}))
    out = tmp_path / "o.parquet"
    assert run_batch(small_server, [f], out, "--image-column", "image") == 1
    ids, codes = read_out(str(out))
    assert sorted(ids) == [f"{f}#0", f"{f}#2"] and codes == {f"{f}#1": "INVALID_ARGUMENT"}

    bomb = _parquet(tmp_path / "bomb.parquet",
                    pa.table({"image": [GOOD[0], bytes(20 * MiB)]}), compression="zstd",
                    use_dictionary=False)
    assert os.path.getsize(bomb) < 64 << 10
    out = tmp_path / "b.parquet"
    assert run_batch(small_server, [bomb], out, "--image-column", "image",
                "--max-in-flight-bytes", str(4 * MiB)) == EXIT_INCOMPLETE
    ids, codes = read_out(str(out))
    assert ids == [] and set(codes.values()) == {"RESOURCE_EXHAUSTED"}
    assert "over --max-in-flight-bytes" in capsys.readouterr().err


_READ_PEAK = """
import sys
def st(k):
    return int(open("/proc/self/status").read().split(k)[1].split()[0]) * 1024
from hookserve.batch.limits import Cap
from hookserve.batch.readers import entries
from hookserve.batch.shard_plan import Shard
import pyarrow.parquet  # imported before the baseline: the library's own pages are not the reader's
open("/proc/self/clear_refs", "w").write("5")
base = st("VmRSS:")
n = 0
for e in entries(Shard(sys.argv[1], "parquet", sys.argv[1]), image_column="image",
                 cap=Cap(1 << 26)):
    e.start()
    n += len(e.result())
print(n, st("VmHWM:") - base)
"""


def test_a_repeated_cell_is_not_expanded(tmp_path):
    """1000 rows holding the same 1 MB cell, dictionary-encoded: 1 GB once expanded.
    The reader keeps the dictionary and copies one cell at a time (measured)."""
    cell = os.urandom(MiB)
    f = _parquet(tmp_path / "dict.parquet", pa.table({"image": pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(1000, np.int32)), pa.array([cell]))}))
    assert os.path.getsize(f) < 4 * MiB
    out = subprocess.run([sys.executable, "-c", _READ_PEAK, f], capture_output=True,
                         text=True, check=True, env=_env()).stdout.split()
    total, peak = int(out[0]), int(out[1])
    assert total == 1000 * MiB
    assert peak < 64 * MiB, f"reading grew the reader by {peak / MiB:.0f} MiB"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


# ------------------------------------------------------------------------------- http
def test_http_inputs_are_streamed_capped_and_timed_out(small_server, tmp_path, capsys):
    web = Web()
    try:
        web.files.update({"0.png": GOOD[0], "1.png": GOOD[1], "big.png": os.urandom(300_000)})
        want = {f"{web.url}/{u}": c for u, c in {
            "f/0.png": "OK", "f/1.png": "OK",
            "f/big.png": "INVALID_ARGUMENT",      # over the cap by its Content-Length
            "big": "INVALID_ARGUMENT",            # 10 GB announced: refused unread
            "endless": "INVALID_ARGUMENT",        # no length, no end: stopped at the cap
            "hang": "UNAVAILABLE",                # never answers: --timeout
            "missing.png": "NOT_FOUND",
            "f/1.png?cut=100": "UNAVAILABLE",     # the body ends early
        }.items()}
        listing = tmp_path / "urls.txt"
        listing.write_text("".join(f"{u}\n" for u in want))
        out = tmp_path / "o.parquet"
        t0 = time.monotonic()
        rc = run_batch(small_server, [str(listing)], out, "--listing-shards", "1",
                  "--timeout", "1")
        took = time.monotonic() - t0
    finally:
        web.close()
    assert rc == EXIT_INCOMPLETE, capsys.readouterr().err
    assert took < 30  # /hang gave up after --timeout, /endless at the cap
    ids, codes = read_out(str(out))
    assert sorted(ids) == sorted(u for u, c in want.items() if c == "OK")
    assert codes == {u: c for u, c in want.items() if c != "OK"}


# ------------------------------------------------------------------ the byte budget
def test_a_one_byte_budget_still_reads_every_input_once(det_server, tmp_path):
    """--max-in-flight-bytes 1: one input at a time (each larger than the budget goes
    alone); every row is there, equal to a run without the limit."""
    members = [(f"{i}.png", encode(rand_image(32, 32, seed=90 + i))) for i in range(5)]
    tar = tmp_path / "s.tar"
    tar.write_bytes(tar_bytes(members))
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name, data in members:
        (folder / name).write_bytes(data)
    for src, sharded in ((str(tar), []), (str(folder), ["--sharded"])):
        outs = []
        for budget in ("1", str(1 << 30)):
            out = tmp_path / f"o{len(outs)}{sharded}.parquet"
            assert run_batch(det_server, [src], out, "--max-in-flight-bytes", budget,
                             *sharded) == 0
            t = pq.read_table(out)
            outs.append(dict(zip(t.column("id").to_pylist(), t.column("fc").to_pylist(),
                                 strict=True)))
        assert len(outs[0]) == 5 and outs[0] == outs[1]


def test_an_object_of_unknown_size_is_read_again_when_larger(det_server, tmp_path):
    """A URL from a list (no size known) is first asked for 4 MiB; a larger one is
    read again with the cap reserved, and extracted."""
    FaultyFS.reset()
    fs = FaultyFS()
    big = encode(np.random.default_rng(3).integers(0, 256, (1000, 1500, 3), np.uint8))
    assert len(big) > FIRST_READ
    fs.pipe("/lake/big.png", big)
    fs.pipe("/lake/small.png", GOOD[0])
    listing = tmp_path / "urls.txt"
    listing.write_text("faulty://lake/big.png\nfaulty://lake/small.png\n")
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(listing)], out, "--listing-shards", "1") == 0
    assert sorted(read_out(str(out))[0]) == ["faulty://lake/big.png",
                                             "faulty://lake/small.png"]
    assert FaultyFS.opened.count("/lake/big.png") == 2
    assert FaultyFS.opened.count("/lake/small.png") == 1


# ----------------------------------------------------------------------------- memory
_RUN_PEAK = """
import sys
def st(k):
    return int(open("/proc/self/status").read().split(k)[1].split()[0]) * 1024
import hookserve.cli, hookserve.batch.local_run, hookserve.batch.sharded_run, pyarrow.parquet
open("/proc/self/clear_refs", "w").write("5")
base = st("VmRSS:")
rc = hookserve.cli.main(sys.argv[1:])
print(rc, st("VmHWM:") - base)
"""


def _peak(*argv: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _RUN_PEAK, "batch", *argv],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.stdout, out.stderr
    rc, peak = out.stdout.split()[-2:]
    return int(rc), int(peak)


#: The constant of the client's memory bound (docs/limits.md):
#: peak <= 2 x max(--max-in-flight-bytes, the largest accepted input) + BOUND_CONSTANT
BOUND_CONSTANT = 32 * MiB


def _errors_text(out) -> str:
    if os.path.exists(f"{out}.errors.csv"):  # a plain run
        return open(f"{out}.errors.csv").read()
    return "".join(open(os.path.join(out, n)).read() for n in os.listdir(out)
                   if n.startswith("_errors-"))  # a sharded run: one file per shard


@pytest.mark.parametrize("layout, large, small, budget", [
    ("files", 32, 24, 8), ("files-sharded", 32, 24, 8), ("tar", 32, 24, 8),
    ("tar", 12, 0, 24),
], ids=["files-near-cap", "files-sharded-near-cap", "tar-near-cap", "tar-budget-over-inputs"])
def test_client_memory_stays_within_the_documented_bound(server, tmp_path, layout, large,
                                                         small, budget):
    """Peak RSS of `hookserve batch` in a child process, over two streams, within
    docs/limits.md's bound: 2 x max(--max-in-flight-bytes, largest input) + 32 MiB.

    Near the cap: one input of 32 MiB less 1 KiB (the cap, --max-file-bytes 32 MiB)
    between 24 inputs of 512 KiB, --max-in-flight-bytes 8 MiB: bound 96 MiB (measured
    69-70 MiB; 139 MiB from files and 173 MiB from a tar when each input was held as
    bytes, Image, request and serialised request). With the budget over the inputs: six
    12 MiB inputs, 24 MiB budget: bound 80 MiB (measured 52 MiB)."""
    rng = np.random.default_rng(0)
    half = [(f"a{i:02d}.png", rng.bytes(512 << 10)) for i in range(small // 2)]
    members = half + [(f"b{i}.png", rng.bytes(large * MiB - 1024))
                      for i in range(1 if small else 6)]
    members += [(f"c{i:02d}.png", rng.bytes(512 << 10)) for i in range(small - len(half))]
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name, data in members:
        (folder / name).write_bytes(data)
    src = str(folder)
    if layout == "tar":
        src = str(tmp_path / "s.tar")
        with open(src, "wb") as fh:
            fh.write(tar_bytes(members))
    out = tmp_path / "o.parquet"
    rc, peak = _peak(src, "--out", str(out), "--layers", "fc", "--server", server.address,
                     "--streams", "2", "--no-progress", "--max-in-flight-bytes",
                     str(budget * MiB), "--max-file-bytes", str(32 * MiB),
                     *(["--sharded"] if layout == "files-sharded" else []))
    assert rc == 1  # random bytes are no image: every one failed, after being sent
    text = _errors_text(out)
    assert "per-file cap" not in text and text.count("INVALID_ARGUMENT") == len(members)
    bound = 2 * max(budget * MiB, large * MiB) + BOUND_CONSTANT
    assert peak <= bound, f"peak {peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB"


def test_a_200_mb_file_costs_nothing_before_it_is_refused(server, tmp_path):
    (tmp_path / "imgs").mkdir()
    with open(tmp_path / "imgs" / "big.png", "wb") as fh:
        fh.truncate(200 * MiB)  # under the 256 MiB default, over the 64 MiB messages
    rc, peak = _peak(str(tmp_path / "imgs"), "--out", str(tmp_path / "o.h5"), "--layers",
                     "fc", "--server", server.address, "--no-progress")
    assert rc == 1
    assert peak < 64 * MiB, f"peak {peak / MiB:.0f} MiB"
    assert "over the per-file cap" in open(tmp_path / "o.h5.errors.csv").read()
