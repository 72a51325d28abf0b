"""Sharded `hookserve batch` over object stores, WebDataset tars and Parquet image
columns, on loopback: moto's ThreadedMotoServer (a real S3 API over HTTP on
127.0.0.1:0), fsspec's memory://, and tars and Parquet files written here.

The server runs with --max-batch-size 1, so an image's features do not depend on which
images shared its batch: outputs of 1, 2 and 4 workers, or of a killed and resumed run,
can be compared bit for bit.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hookserve.batch import plan_shards, run_shard
from hookserve.batch.remote import expand_braces, parse_storage_options
from hookserve.batch.shard_plan import select
from hookserve.cli import main

from conftest import encode, rand_image
from helpers import wait_until

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

N_TARS, PER_TAR = 8, 25                     # 200 images
CORRUPT = {(2, 7), (5, 19)}                 # 1%: (tar, member) with garbage bytes
TARS = "s3://lake/shards/{000000..000007}.tar"
OPTS = ["--resize", "32", "--crop", "32", "--no-progress", "--layers", "fc,layer4:avg"]


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(s3):
    """WebDataset tars on S3: per sample an image and a .json (skipped); 1% corrupt."""
    expected = {}
    for t in range(N_TARS):
        members = []
        for m in range(PER_TAR):
            key = f"{t:06d}{m:04d}"
            img = b"garbage, not an image" if (t, m) in CORRUPT else \
                encode(rand_image(32, 40, seed=t * 100 + m), "JPEG" if m % 2 else "PNG")
            ext = "jpg" if m % 2 else "png"
            members += [(f"{key}.{ext}", img), (f"{key}.json", b'{"label": 1}')]
            expected[f"s3://lake/shards/{t:06d}.tar/{key}.{ext}"] = img
        s3.pipe(f"lake/shards/{t:06d}.tar", _tar(members))
    return expected


def read_out(fs, root: str):
    """(rows sorted by id as {id: {layer: array}}, error ids) of a sharded output."""
    if fs:  # runs wrote with their own filesystem instance: forget what this one listed
        fs.invalidate_cache()
    t = pq.read_table(root, filesystem=fs) if fs else pq.read_table(root)
    ids = t.column("id").to_pylist()
    rows = {}
    for i, rid in enumerate(ids):
        assert rid not in rows, f"{rid} written twice"
        rows[rid] = {c: np.asarray(t.column(c)[i].values) for c in ("fc", "layer4")}
    errs = []
    names = fs.ls(root) if fs else os.listdir(root)
    for n in sorted(names):
        if os.path.basename(n).startswith("_errors-"):
            text = fs.cat(n).decode() if fs else open(os.path.join(root, n)).read()
            errs += [r["id"] for r in csv.DictReader(io.StringIO(text))]
    return rows, errs


def test_tars_on_s3_exactly_once_over_1_2_4_workers(det_server, s3, shards, capsys):
    outs = {}
    for n in (1, 2, 4):
        out = f"s3://lake/out{n}.parquet"
        rcs = [main(["batch", TARS, "--out", out, "--shard", f"{i}/{n}",
                     "--server", det_server.address, "--streams", "2", *OPTS])
               for i in range(n)]
        # 1 for the workers that met a corrupt member, 0 for the others
        assert sorted(set(rcs)) in ([1], [0, 1]), capsys.readouterr().err
        rows, errs = read_out(s3, out[5:])
        corrupt = {f"s3://lake/shards/{t:06d}.tar/{t:06d}{m:04d}.{'jpg' if m % 2 else 'png'}"
                   for t, m in CORRUPT}
        assert sorted(errs) == sorted(corrupt)  # each corrupt member exactly once
        assert set(rows) == set(shards) - corrupt
        outs[n] = rows
        names = s3.ls(f"lake/out{n}.parquet")
        assert sum("/_done-" in x for x in names) == N_TARS
        assert all(os.path.basename(x).startswith(("_", "part-")) for x in names)
    for n in (2, 4):  # the same rows, bit for bit
        assert outs[n].keys() == outs[1].keys()
        for rid, feats in outs[1].items():
            for layer, a in feats.items():
                assert np.array_equal(a, outs[n][rid][layer]), (n, rid, layer)
    # equal to the SDK on the same bytes
    sample = sorted(outs[1])[:5]
    with det_server.client() as c:
        for rid, r in zip(sample, c.extract_many([shards[s] for s in sample], ["fc"],
                                                 resize=32, crop=32), strict=True):
            assert np.array_equal(r.features["fc"], outs[1][rid]["fc"])
    # re-running a finished worker does nothing, and still says that images failed
    capsys.readouterr()
    assert main(["batch", TARS, "--out", "s3://lake/out1.parquet", "--server",
                 det_server.address, *OPTS]) == 1
    err = capsys.readouterr().err
    assert "skipped 8" in err and f"failed {len(CORRUPT)} ({len(CORRUPT)} in skipped " \
        "shards)" in err, err


def test_a_worker_without_shards_exits_0(det_server, s3, shards, capsys):
    keys = [s for s in plan_shards([TARS])]
    empty = next(i for i in range(64) if not select(keys, (i, 64)))
    assert main(["batch", TARS, "--out", "s3://lake/none.parquet", "--shard", f"{empty}/64",
                 "--server", det_server.address, *OPTS]) == 0
    assert "no input shards assigned" in capsys.readouterr().err
    assert not s3.exists("lake/none.parquet/_hookserve.json")


def test_kill_9_mid_run_then_resume_equals_uninterrupted(det_server, s3, shards, capsys):
    """Watch the remote output while a run writes it: a part is never seen half
    written, a marker never before its part. Kill -9 after the first marker, resume."""
    out = "lake/killed.parquet"
    # one shard at a time: after the first marker, seven shards are still to do
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", TARS, "--out", f"s3://{out}",
           "--server", det_server.address, "--streams", "1", *OPTS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen_parts = 0
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                names = [os.path.basename(x) for x in s3.ls(out, refresh=True)]
            except FileNotFoundError:
                names = []
            for n in names:
                if n.startswith("part-"):  # whole or absent, never half
                    pq.read_table(f"{out}/{n}", filesystem=s3)
                    seen_parts += 1
                if n.startswith("_done-"):
                    marker = json.loads(s3.cat(f"{out}/{n}"))
                    assert marker["part"] in names
            if any(n.startswith("_done-") for n in names) or proc.poll() is not None:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert seen_parts >= 1
    done_before = sum(os.path.basename(x).startswith("_done-")
                      for x in s3.ls(out, refresh=True))
    assert 1 <= done_before < N_TARS, "the kill came too late to test a resume"
    capsys.readouterr()
    assert main(["batch", TARS, "--out", f"s3://{out}", "--server", det_server.address,
                 *OPTS]) == 1
    assert f"skipped {done_before}" in capsys.readouterr().err
    rows, errs = read_out(s3, out)
    ref_rows, ref_errs = read_out(s3, "lake/out1.parquet")
    assert sorted(errs) == sorted(ref_errs)
    assert rows.keys() == ref_rows.keys()
    for rid in ref_rows:
        for layer in ("fc", "layer4"):
            assert np.array_equal(rows[rid][layer], ref_rows[rid][layer])


def test_prefix_listing_on_s3_to_npy_folder(det_server, s3, capsys):
    for i in range(12):
        s3.pipe(f"lake/imgs/{'ab'[i % 2]}/{i:03d}.png", encode(rand_image(32, 32, seed=500 + i)))
    s3.pipe("lake/imgs/readme.txt", b"not an image")
    planned = plan_shards(["s3://lake/imgs/"], listing_shards=4)
    assert 1 <= len(planned) <= 4 and sum(len(s.files) for s in planned) == 12
    out = "s3://lake/npyout"
    assert main(["batch", "s3://lake/imgs/", "--out", out, "--listing-shards", "4",
                 "--server", det_server.address, *OPTS]) == 0, capsys.readouterr().err
    ids = []
    for s in planned:
        index = s3.cat(f"lake/npyout/{s.sid}/index.jsonl").decode().splitlines()
        ids += [json.loads(line)["id"] for line in index]
        fc = np.load(io.BytesIO(s3.cat(f"lake/npyout/{s.sid}/fc.npy")))
        assert fc.shape == (len(index), 1000)
    assert sorted(ids) == sorted(f"s3://lake/imgs/{'ab'[i % 2]}/{i:03d}.png" for i in range(12))


def test_parquet_image_column_in_memory_store(det_server, capsys):
    """Hugging Face layout (struct<bytes, path>), row groups as shards, an id column,
    a null image as an error row; input and output on fsspec's memory://."""
    import fsspec

    fs = fsspec.filesystem("memory")
    images = [encode(rand_image(32, 32, seed=700 + i)) for i in range(10)]
    col = [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)]
    col[3] = None
    table = pa.table({"image": col, "key": [f"k{i}" for i in range(10)]})
    with fs.open("/lake/train.parquet", "wb") as fh:
        pq.write_table(table, fh, row_group_size=4)  # 3 row groups
    argv = ["batch", "memory://lake/train.parquet", "--image-column", "image",
            "--id-column", "key", "--shard-bytes", "1", "--out", "memory://lake/feats.parquet",
            "--server", det_server.address, *OPTS]
    assert main(argv) == 1, capsys.readouterr().err
    t = pq.read_table("/lake/feats.parquet", filesystem=fs)
    assert sorted(t.column("id").to_pylist()) == sorted(f"k{i}" for i in range(10) if i != 3)
    done = [n for n in fs.ls("/lake/feats.parquet", detail=False) if "/_done-" in n]
    assert len(done) == 3  # one shard per row group
    errs = [n for n in fs.ls("/lake/feats.parquet", detail=False) if "/_errors-" in n]
    (e,) = errs
    assert "k3,INVALID_ARGUMENT" in fs.cat(e).decode()
    # the default id: file and row number
    res = run_shard("memory://lake/train.parquet#rg=2", "memory://lake/f2.parquet", ["fc"],
                    server=det_server.address, image_column="image", resize=32, crop=(32, 32))
    assert (res.rows, res.failed, res.skipped) == (2, 0, False)
    ids = pq.read_table("/lake/f2.parquet", filesystem=fs).column("id").to_pylist()
    assert ids == ["memory://lake/train.parquet#8", "memory://lake/train.parquet#9"]
    again = run_shard("memory://lake/train.parquet#rg=2", "memory://lake/f2.parquet", ["fc"],
                      server=det_server.address, image_column="image", resize=32,
                      crop=(32, 32))
    assert again.skipped


def test_local_tar_truncated_and_oversize_members(det_server, tmp_path, capsys):
    good = [(f"{i}.png", encode(rand_image(32, 32, seed=800 + i))) for i in range(3)]
    big = ("big.png", encode(rand_image(300, 300, seed=9)))
    data = _tar([*good, big, ("more.png", good[0][1])])
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        cut = tf.getmember("more.png").offset_data + 100
    (tmp_path / "a.tar").write_bytes(data[:cut])  # cut inside the last member
    out = tmp_path / "o.parquet"
    rc = main(["batch", str(tmp_path / "a.tar"), "--out", str(out), "--max-file-bytes",
               "20000", "--server", det_server.address, *OPTS])
    assert rc == 3, capsys.readouterr().err  # cut short: no done marker, run again
    rows, errs = read_out(None, str(out))
    assert sorted(rows) == sorted(f"{tmp_path}/a.tar/{n}" for n, _ in good)
    codes = {}
    for n in os.listdir(out):
        if n.startswith("_errors-"):
            with open(out / n, newline="") as fh:
                codes.update({r["id"]: r["code"] for r in csv.DictReader(fh)})
    assert codes[f"{tmp_path}/a.tar/big.png"] == "INVALID_ARGUMENT"
    assert codes[f"{tmp_path}/a.tar/"] == "DATA_LOSS"
    assert not any(n.startswith("_done-") for n in os.listdir(out))


def test_brace_expansion_and_storage_options():
    assert expand_braces("s/{000008..000011}.tar") == [f"s/{i:06d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert expand_braces("plain") == ["plain"]
    assert parse_storage_options(["anon=true", "endpoint_url=http://x:1", "n=3"]) == \
        {"anon": True, "endpoint_url": "http://x:1", "n": 3}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_storage_options(["novalue"])


def test_list_of_urls_and_paths_is_sharded(det_server, tmp_path, capsys):
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for i in range(3):
        fs.pipe(f"/pics/{i}.png", encode(rand_image(32, 32, seed=900 + i)))
        urls.append(f"memory://pics/{i}.png")
    local = tmp_path / "x.png"
    local.write_bytes(encode(rand_image(32, 32, seed=950)))
    listing = tmp_path / "inputs.txt"
    listing.write_text("\n".join([*urls, str(local), "memory://pics/missing.png"]) + "\n")
    out = tmp_path / "o.parquet"
    # a URL list is a sharded run without --sharded; a URL not found yet keeps its
    # shard open (exit 3)
    assert main(["batch", str(listing), "--listing-shards", "2", "--out",
                 str(out), "--server", det_server.address, *OPTS]) == 3
    rows, errs = read_out(None, str(out))
    assert sorted(rows) == sorted([*urls, str(local)])
    assert errs == ["memory://pics/missing.png"]


def test_sigterm_stops_a_sharded_run_with_130(det_server, tmp_path):
    for t in range(4):
        (tmp_path / f"{t}.tar").write_bytes(_tar(
            [(f"{t}-{i}.png", encode(rand_image(32, 32, seed=t * 50 + i))) for i in range(25)]))
    out = tmp_path / "o.parquet"
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", str(tmp_path / "{0..3}.tar"),
           "--out", str(out), "--streams", "1", "--server", det_server.address, *OPTS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: proc.poll() is not None or (
        out.is_dir() and any(n.startswith("_done-") for n in os.listdir(out))),
        120, "a marker on disk")
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "run the same command again" in err
    done = [n for n in os.listdir(out) if n.startswith("_done-")]
    assert 1 <= len(done) < 4
    assert main(["batch", str(tmp_path / "{0..3}.tar"), "--out", str(out), "--server",
                 det_server.address, *OPTS]) == 0
    assert len(pq.read_table(out).column("id")) == 100


def test_empty_and_missing_objects_on_s3(det_server, s3, tmp_path, capsys):
    """An empty object (its ranged GET is refused as not satisfiable) is an empty image:
    a final INVALID_ARGUMENT row; a missing one (whose name holds "range") is NOT_FOUND,
    which keeps its shard open."""
    s3.pipe("lake/e/empty.png", b"")
    s3.pipe("lake/e/ok.png", encode(rand_image(32, 32, seed=5)))
    listing = tmp_path / "urls.txt"
    listing.write_text("s3://lake/e/empty.png\ns3://lake/e/ok.png\ns3://lake/e/orange.png\n")
    out = tmp_path / "o.parquet"
    assert main(["batch", str(listing), "--listing-shards", "1", "--out", str(out),
                 "--server", det_server.address, *OPTS]) == 3, capsys.readouterr().err
    rows, _ = read_out(None, str(out))
    assert list(rows) == ["s3://lake/e/ok.png"]
    codes = {}
    for n in os.listdir(out):
        if n.startswith("_errors-"):
            with open(out / n, newline="") as fh:
                codes.update({r["id"]: r["code"] for r in csv.DictReader(fh)})
    assert codes == {"s3://lake/e/empty.png": "INVALID_ARGUMENT",
                     "s3://lake/e/orange.png": "NOT_FOUND"}


def test_a_table_of_urls_is_a_sharded_run(det_server, tmp_path, capsys):
    """A .csv whose path column holds URLs is read like a list of them: no --sharded,
    and no URL is mistaken for a local path."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for i in range(2):
        fs.pipe(f"/tablepics/{i}.png", encode(rand_image(32, 32, seed=960 + i)))
        urls.append(f"memory://tablepics/{i}.png")
    table = tmp_path / "t.csv"
    table.write_text("url,label\n" + "".join(f"{u},{i}\n" for i, u in enumerate(urls)))
    out = tmp_path / "o.parquet"
    assert main(["batch", str(table), "--path-column", "url", "--out", str(out),
                 "--server", det_server.address, *OPTS]) == 0, capsys.readouterr().err
    rows, errs = read_out(None, str(out))
    assert sorted(rows) == urls and errs == []
