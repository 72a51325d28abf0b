"""`hookserve batch`: formats read back with their own libraries, resume, kill -9,
shards, a server lost mid-run, overload retries, exit codes.

Real servers on 127.0.0.1:0; a few hundred small generated images plus corrupt files.
Images are resized/cropped to 32x32 so resnet18 runs fast on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest

from hookserve import __version__
from hookserve.batch.inputs import discover, select_shard, shard_of
from hookserve.batch.sinks import Record, journal_append, journal_read
from hookserve.batch.sinks.npy import safe_relpath
from hookserve.cli import main

from conftest import encode, rand_image
from helpers import R18, wait_until

N_GOOD = 240
CORRUPT = ["b/garbage.jpg", "b/empty.png", "c/truncated.png", "a/text.jpeg"]
OPTS = ["--resize", "32", "--crop", "32", "--no-progress"]
LAYERS = ["--layers", "layer4:avg,fc"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """N_GOOD PNG/JPEG images of 32..64 px in nested folders, plus corrupt files."""
    root = tmp_path_factory.mktemp("imgs")
    good = []
    for i in range(N_GOOD):
        sub = root / "abc"[i % 3] / f"d{i % 5}"
        sub.mkdir(parents=True, exist_ok=True)
        fmt = "PNG" if i % 2 else "JPEG"
        p = sub / f"img{i:04d}.{'png' if fmt == 'PNG' else 'jpg'}"
        p.write_bytes(encode(rand_image(32 + i % 33, 64 - i % 29, seed=i), fmt))
        good.append(str(p))
    (root / "b" / "garbage.jpg").write_bytes(b"\x00definitely not an image" * 10)
    (root / "b" / "empty.png").write_bytes(b"")
    png = encode(rand_image(48, 48, seed=999), "PNG")
    (root / "c" / "truncated.png").write_bytes(png[: len(png) // 3])
    (root / "a" / "text.jpeg").write_text("hello")
    (root / "notes.txt").write_text("not an image and not picked up from a folder")
    return root, sorted(os.path.normpath(p) for p in good)


def batch(*argv: str) -> int:
    return main(["batch", *argv])


def corrupt_paths(root) -> set[str]:
    return {os.path.normpath(str(root / c)) for c in CORRUPT}


def read_errors(path) -> dict[str, str]:
    import csv

    with open(path, newline="") as fh:
        return {row["path"]: row["code"] for row in csv.DictReader(fh)}


def read_h5(path):
    with h5py.File(path, "r") as f:
        paths = [p.decode() for p in f["paths"][:]]
        feats = {k: f[k][:] for k in ("layer4", "fc")}
        sha = [s.decode() for s in f["sha256"][:]]
        attrs = dict(f.attrs)
    return paths, feats, sha, attrs


def read_parquet(path):
    t = pq.read_table(path)
    feats = {k: np.stack(t.column(k).to_numpy(zero_copy_only=False)) for k in ("layer4", "fc")}
    meta = json.loads(t.schema.metadata[b"hookserve"])
    return t.column("path").to_pylist(), feats, t.column("sha256").to_pylist(), meta


def read_npy(path):
    with open(os.path.join(path, "index.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    feats = {k: np.stack([np.load(os.path.join(path, r["files"][k])) for r in rows])
             for k in ("layer4", "fc")}
    with open(os.path.join(path, "hookserve.json")) as fh:
        meta = json.load(fh)
    return [r["path"] for r in rows], feats, [r["sha256"] for r in rows], meta


def check_against_extract(client, paths, feats, sample):
    for i in sample:
        want = client.extract(paths[i], {"layer4": {"reduction": "avg"}, "fc": None},
                              resize=32, crop=32)
        for layer in ("layer4", "fc"):
            # The server batches images differently in the two runs; CPU kernels may
            # round differently by batch size, so allow float32 rounding noise only.
            np.testing.assert_allclose(feats[layer][i], want[layer], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{paths[i]} {layer}")


@pytest.mark.parametrize("fmt", ["h5", "parquet", "npy"])
def test_each_format_reads_back_equal_to_extract(fmt, images, server, client, tmp_path,
                                                 capsys):
    root, good = images
    out = str(tmp_path / {"h5": "f.h5", "parquet": "f.parquet", "npy": "f_npy"}[fmt])
    rc = batch(str(root), "--out", out, *LAYERS, *OPTS, "--server", server.address,
               "--checkpoint", "64")
    assert rc == 1, "corrupt files make the run end with 'some failed'"
    summary = capsys.readouterr().err
    assert f"done {N_GOOD}, skipped 0, failed {len(CORRUPT)}" in summary
    assert "img/s" in summary

    paths, feats, sha, meta = {"h5": read_h5, "parquet": read_parquet, "npy": read_npy}[fmt](out)
    if fmt == "h5":
        assert meta["hookserve_layout"] == "single"
        assert not os.path.exists(out + ".parts"), "finished run consolidates into one file"
        meta = json.loads(meta["hookserve"])
    assert paths == good, "every good image exactly once, in sorted order"
    assert feats["layer4"].shape == (N_GOOD, 512) and feats["fc"].shape == (N_GOOD, 1000)
    for i in (0, 77, N_GOOD - 1):
        with open(paths[i], "rb") as fh:
            assert sha[i] == hashlib.sha256(fh.read()).hexdigest()
    check_against_extract(client, paths, feats, [0, 1, 100, N_GOOD - 1])

    model = client.describe().model
    assert meta["model"] == "resnet18" and meta["hookserve_version"] == __version__
    assert meta["weights"]["digest"] == model.weights_digest
    assert meta["layers"] == [{"name": "layer4", "reduction": "avg", "l2_normalize": False},
                              {"name": "fc", "reduction": "none", "l2_normalize": False}]
    assert meta["dtype"] == "float32"
    assert meta["preprocessing"]["mode"] == "resize_crop"
    assert meta["preprocessing"]["crop"] == [32, 32]

    errs = read_errors(out.rstrip("/") + ".errors.csv")
    assert set(errs) == corrupt_paths(root)
    assert set(errs.values()) == {"INVALID_ARGUMENT"}


def test_h5_full_maps_float16_and_resume_appends_new_images(images, server, client, tmp_path,
                                                             capsys):
    root, good = images
    src = tmp_path / "src"
    src.mkdir()
    for p in good[:20]:
        (src / os.path.basename(p)).write_bytes(open(p, "rb").read())
    out = str(tmp_path / "maps.h5")
    args = [str(src), "--out", out, "--layers", "layer3", "--dtype", "float16", *OPTS,
            "--server", server.address]
    assert batch(*args) == 0
    assert not os.path.exists(out + ".errors.csv"), "no failures: no errors file"
    with h5py.File(out, "r") as f:
        assert f["layer3"].shape == (20, 256, 2, 2) and f["layer3"].dtype == np.float16
        assert f["layer3"].chunks is not None
        first = f["layer3"][:]

    # Same command again: nothing to do. Then new images appear: only they are added.
    assert batch(*args) == 0
    assert "done 0, skipped 20, failed 0" in capsys.readouterr().err
    for p in good[20:25]:
        (src / os.path.basename(p)).write_bytes(open(p, "rb").read())
    assert batch(*args) == 0
    assert "done 5, skipped 20, failed 0" in capsys.readouterr().err
    with h5py.File(out, "r") as f:
        assert f.attrs["hookserve_layout"] == "single"
        paths = [p.decode() for p in f["paths"][:]]
        def names(ps):
            return sorted(str(src / os.path.basename(p)) for p in ps)
        assert paths == names(good[:20]) + names(good[20:25]), "new images are appended"
        np.testing.assert_array_equal(f["layer3"][:20], first)
        want = client.extract(paths[22], ["layer3"], dtype="float16", resize=32, crop=32)
        np.testing.assert_allclose(f["layer3"][22].astype(np.float32),
                                   want["layer3"].astype(np.float32), rtol=2e-3, atol=2e-3)

    # Other settings into the same output cannot proceed.
    assert batch(str(src), "--out", out, "--layers", "layer2", *OPTS,
                 "--server", server.address) == 2
    err = capsys.readouterr().err
    assert "different settings" in err, err   # each difference: what it holds, what is asked
    assert 'dtype: it holds "float16", this run asks "float32"' in err, err
    assert "layers: it holds" in err and '"layer2"' in err and '"layer3"' in err, err


def test_shards_cover_the_input_exactly_once(images, server, tmp_path, capsys):
    root, good = images
    outs = [str(tmp_path / f"s{i}.parquet") for i in range(3)]
    for i, out in enumerate(outs):
        assert batch(str(root), "--out", out, *LAYERS, *OPTS, "--server", server.address,
                     "--shard", f"{i}/3") in (0, 1)
    shards = [pq.read_table(o, columns=["path"]).column("path").to_pylist() for o in outs]
    assert all(shards), "every shard gets a share"
    union = [p for s in shards for p in s]
    assert len(union) == len(set(union)) == N_GOOD
    assert set(union) == set(good)
    failed = set()
    for out in outs:
        if os.path.exists(out + ".errors.csv"):
            failed |= set(read_errors(out + ".errors.csv"))
    assert failed == corrupt_paths(root), "each corrupt file fails in exactly one shard"

    # --dry-run counts without a server: the shard's share and what is already written.
    capsys.readouterr()
    assert batch(str(root), "--out", outs[1], *LAYERS, "--shard", "1/3", "--dry-run",
                 "--server", "127.0.0.1:1") == 0
    n1 = len(select_shard(discover([str(root)]), (1, 3)))
    assert capsys.readouterr().out.strip() == (
        f"{n1} images in shard 1/3; {len(shards[1])} already in {outs[1]}; "
        f"{n1 - len(shards[1])} to extract")


def test_losing_one_of_two_servers_mid_run_loses_nothing(images, make_server, tmp_path):
    root, good = images
    flags = [*R18, "--max-batch-delay-ms", "2", "--max-batch-size", "8"]
    a, b = make_server(*flags), make_server(*flags)
    out = str(tmp_path / "two")
    index = os.path.join(out, "index.jsonl")
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(batch(
        str(root), "--out", out, *LAYERS, *OPTS, "--server", a.address,
        "--server", b.address, "--streams", "4", "--max-in-flight", "16")))
    t.start()

    def lines() -> int:
        try:
            with open(index, "rb") as fh:
                return fh.read().count(b"\n")
        except FileNotFoundError:
            return 0

    wait_until(lambda: lines() >= 40 or not t.is_alive(), 60, "40 rows written")
    written_before = lines()
    a.stop(0)  # server A goes away with images in flight on its streams
    t.join(120)
    assert not t.is_alive()
    assert written_before < N_GOOD, "server A was stopped while the run was going on"
    assert rc == [1]
    paths, feats, _, _ = read_npy(out)
    assert paths == good, "nothing lost, nothing duplicated, order kept"
    errs = read_errors(out + ".errors.csv")
    assert set(errs) == corrupt_paths(root), "no image failed because of the lost server"
    with b.client(timeout=60) as c:
        check_against_extract(c, paths, feats, [0, N_GOOD // 2, N_GOOD - 1])


@pytest.mark.parametrize("fmt", ["h5", "parquet"])
def test_kill_9_mid_run_then_resume(fmt, images, server, tmp_path):
    root, good = images
    out = str(tmp_path / f"k.{fmt}")
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", str(root), "--out", out, *LAYERS,
           *OPTS, "--server", server.address, "--checkpoint", "8", "--streams", "1",
           "--max-in-flight", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def committed() -> int:
        try:
            if fmt == "h5":
                with h5py.File(out, "r") as f:
                    return f["paths"].shape[0]
            return pq.read_table(out, columns=["path"]).num_rows
        except (OSError, FileNotFoundError, KeyError, ValueError):
            return 0

    wait_until(lambda: committed() >= 24 or proc.poll() is not None, 120, "24 rows on disk")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]

    # Readable right after the kill, holding a sorted prefix without duplicates.
    reader = read_h5 if fmt == "h5" else read_parquet
    paths, feats, _, attrs = reader(out)
    assert 24 <= len(paths) < N_GOOD
    assert paths == good[:len(paths)]
    if fmt == "h5":
        assert attrs["hookserve_layout"] == "virtual", "mid-run: virtual file over the parts"

    assert batch(*cmd[4:]) == 1
    paths, feats, _, _ = reader(out)
    assert paths == good, "complete, no duplicates, same order as an uninterrupted run"
    with server.client(timeout=60) as c:
        check_against_extract(c, paths, feats, [0, len(paths) // 2, N_GOOD - 1])


def test_sigterm_saves_progress_and_exits_130(images, server, tmp_path):
    root, good = images
    out = str(tmp_path / "t_npy")
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", str(root), "--out", out, *LAYERS,
           *OPTS, "--server", server.address, "--streams", "1", "--max-in-flight", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    index = os.path.join(out, "index.jsonl")
    wait_until(lambda: proc.poll() is not None or (
        os.path.exists(index) and os.path.getsize(index) > 2000), 120, "rows on disk")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "interrupted" in err.decode() and "run the same command again" in err.decode()
    paths = read_npy(out)[0]
    assert 0 < len(paths) < N_GOOD and paths == good[:len(paths)]
    assert batch(*cmd[4:]) == 1
    assert read_npy(out)[0] == good


def test_overloaded_server_is_retried_not_failed(images, make_server, tmp_path, capsys):
    root, good = images
    s = make_server(*R18, "--max-queue", "2", "--queue-wait-ms", "0", "--max-batch-delay-ms", "2")
    src = tmp_path / "src"
    src.mkdir()
    for p in good[:40]:
        (src / os.path.basename(p)).write_bytes(open(p, "rb").read())
    out = str(tmp_path / "o.parquet")
    assert batch(str(src), "--out", out, *LAYERS, *OPTS, "--server", s.address,
                 # One stream: retries go back on the stream that was pushed back, so
                 # each try must carry an id the stream has not seen.
                 "--streams", "1", "--max-in-flight", "32", "--retries", "200") == 0
    assert pq.read_table(out).column("path").to_pylist() == sorted(
        str(src / os.path.basename(p)) for p in good[:40])
    assert not os.path.exists(out + ".errors.csv")
    summary = capsys.readouterr().err
    retried = int(summary.split("retried ")[1].split()[0]) if "retried " in summary else 0
    assert retried > 0, f"the server never pushed back, so nothing was tested: {summary}"


def test_cannot_proceed_exit_2(images, server, tmp_path, capsys):
    root, _ = images
    out = str(tmp_path / "x.h5")
    assert batch(str(root), "--out", out, "--layers", "layer9", *OPTS,
                 "--server", server.address) == 2
    err = capsys.readouterr().err
    assert "no layer 'layer9'" in err and "layer4" in err
    assert batch(str(tmp_path / "missing"), "--out", out, "--layers", "fc",
                 "--server", server.address) == 2
    assert batch(str(root), "--out", str(tmp_path / "x.parquet"), "--layers", "layer4",
                 *OPTS, "--server", server.address) == 2
    assert "Parquet takes 1-D features" in capsys.readouterr().err
    # answers whose spatial size follows each image's cannot share one HDF5 dataset:
    # refused before any image is sent (--resize alone wrote a partial file, exit 1)
    for geometry, words in [(["--native"], "--native gives"),
                            (["--resize", "64"], "--resize without --crop gives"),
                            (["--resize", "0"], "--resize without --crop gives")]:
        assert batch(str(root), "--out", out, "--layers", "layer4", *geometry,
                     "--server", server.address) == 2
        err = capsys.readouterr().err
        assert words in err and "avg|max|stats" in err
        assert not os.path.exists(out)
    assert batch(str(root), "--out", out, "--layers", "fc", *OPTS, "--timeout", "2",
                 "--server", "127.0.0.1:1") == 2
    assert not os.path.exists(out)


def test_progress_bar_and_help(images, server, tmp_path, capsys):
    root, good = images
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(good[:10]) + "\n")
    assert batch(str(lst), "--out", str(tmp_path / "p"), "--layers", "fc", "--resize", "32",
                 "--crop", "32", "--progress", "--server", server.address) == 0
    err = capsys.readouterr().err
    assert "img/s" in err and "ETA" in err and "\r[" in err
    assert err.rstrip().splitlines()[-1].startswith("hookserve batch: done 10, skipped 0")
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    help_text = capsys.readouterr().out
    for needle in ("exit codes", "--shard", "--dry-run", "resume", ".parquet", "kill -9"):
        assert needle in help_text


# -- no server needed --------------------------------------------------------------------
def test_discover_lists_tables_globs(tmp_path):
    for rel in ("x/1.jpg", "x/2.PNG", "x/y/3.webp", "x/readme.md", "z/4.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    d = str(tmp_path)
    assert discover([f"{d}/x"]) == sorted(f"{d}/x/{r}" for r in ("1.jpg", "2.PNG", "y/3.webp"))
    assert discover([f"{d}/**/*.png"]) == [f"{d}/z/4.png"]
    (tmp_path / "l.txt").write_text("# comment\nx/1.jpg\n\nz/4.png\nx/1.jpg\n")
    assert discover([f"{d}/l.txt"], root=d) == [f"{d}/x/1.jpg", f"{d}/z/4.png"]
    (tmp_path / "t.csv").write_text("label,file\ncat,x/1.jpg\ndog,z/4.png\n")
    assert discover([f"{d}/t.csv"], path_column="file", root=d) == [f"{d}/x/1.jpg",
                                                                     f"{d}/z/4.png"]
    import pyarrow as pa
    pq.write_table(pa.table({"p": ["x/2.PNG"]}), tmp_path / "t.parquet")
    assert discover([f"{d}/t.parquet"], path_column="p", root=d) == [f"{d}/x/2.PNG"]
    with pytest.raises(Exception, match="no column 'path'"):
        discover([f"{d}/t.csv"])


def test_shard_assignment_is_stable_and_partitions():
    paths = [f"data/{i:05d}.jpg" for i in range(3000)]
    parts = [select_shard(paths, (i, 4)) for i in range(4)]
    assert sorted(p for s in parts for p in s) == paths
    assert all(600 < len(s) < 900 for s in parts), [len(s) for s in parts]
    # Adding files never moves an existing file to another shard.
    more = paths + [f"new/{i}.jpg" for i in range(100)]
    assert {p: shard_of(p, 4) for p in paths} == {p: shard_of(p, 4) for p in more[:3000]}
    assert shard_of("data/00001.jpg", 4) == shard_of("data/00001.jpg", 4)


def test_journal_drops_a_torn_last_record(tmp_path):
    j = tmp_path / "j.bin"
    recs = [Record(f"p{i}", "ab" * 32, i, i * 10, {"a": np.full((3, 2), i, np.float32),
                                                   "b": np.arange(i + 1, dtype=np.float16)})
            for i in range(5)]
    with open(j, "ab") as fh:
        for r in recs:
            journal_append(fh, r)
    back = journal_read(str(j))
    assert [r.path for r in back] == [r.path for r in recs]
    np.testing.assert_array_equal(back[4].features["b"], recs[4].features["b"])
    data = j.read_bytes()
    j.write_bytes(data[:-7])  # killed in the middle of the last write
    assert [r.path for r in journal_read(str(j))] == ["p0", "p1", "p2", "p3"]
    j.write_bytes(data[:-30] + b"\xff" * 30)  # corrupt tail: CRC catches it
    assert len(journal_read(str(j))) == 4


def test_safe_relpath():
    assert safe_relpath("/data/a/../b/c.jpg") == "data/b/c.jpg"
    assert safe_relpath("../x/./y.png") == "__/x/y.png"


def test_size_limit_errors_are_final_not_retried(images, make_server, tmp_path, capsys):
    # A per-image RESOURCE_EXHAUSTED without a retry hint (here: the answer is over
    # --max-response-bytes at the image's native size) would fail again: no retries.
    root, good = images
    s = make_server(*R18, "--max-response-bytes", "5000")  # warm-up (fc) needs 4000
    src = tmp_path / "src"
    src.mkdir()
    for p in good[:3]:
        (src / os.path.basename(p)).write_bytes(open(p, "rb").read())
    out = str(tmp_path / "o.parquet")
    assert batch(str(src), "--out", out, "--layers", "layer1", "--reduction", "flatten",
                 "--native", "--server", s.address, "--retries", "5") == 1
    summary = capsys.readouterr().err
    assert "retried " not in summary
    rows = open(out + ".errors.csv").read().splitlines()
    assert len(rows) == 4 and all("RESOURCE_EXHAUSTED" in r for r in rows[1:])


def test_an_h5_output_stays_locked_while_it_is_consolidated(tmp_path):
    """A second run that opens the output while the first copies its parts into one
    file is refused as locked (the lock lies beside out.h5, outside the parts folder
    the consolidation removes), so none of its rows can be deleted with that folder."""
    from hookserve.batch.sinks import make_sink
    from hookserve.batch.sinks.base import OutputError

    out = str(tmp_path / "o.h5")
    meta = {"model": "m"}
    recs = [Record(f"p{i}", "ab" * 32, i, i, {"a": np.full(3, i, np.float32)})
            for i in range(4)]
    first = make_sink(out, meta)
    first.open()
    for r in recs:
        first.add(r)
    tried = []
    consolidate = first._consolidate

    def while_consolidating():
        second = make_sink(out, meta)
        with pytest.raises(OutputError, match="is locked"):
            second.open()
        tried.append(True)
        consolidate()
    first._consolidate = while_consolidating
    first.close(complete=True)
    assert tried and not os.path.exists(out + ".parts")
    with h5py.File(out, "r") as f:
        assert [p.decode() for p in f["paths"][:]] == [r.path for r in recs]
    again = make_sink(out, meta)   # the lock is free once the first run is done
    again.open()
    again.close(complete=True)
