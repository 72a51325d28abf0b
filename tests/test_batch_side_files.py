"""The files `hookserve batch` writes beside its output, and names it cannot write:
the errors file never destroys a file that is not one (an input, the output, a user's
own file) and never removes a device; a folder output's file name the filesystem
cannot hold is that image's own row; list files with a byte-order mark; --streams
bounded. Runs go through the CLI in a subprocess against a real server."""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys

import pytest

from hookserve.cli import main

from conftest import encode, rand_image

OPTS = ["--resize", "32", "--crop", "32", "--no-progress", "--layers", "fc"]


def _png(seed: int) -> bytes:
    return encode(rand_image(32, 32, seed=seed), "PNG")


@pytest.fixture
def images(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.png").write_bytes(_png(i))
    return root


def run(server, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hookserve.cli", "batch", *argv, "--server",
           server.address, *OPTS]
    return subprocess.run(cmd, capture_output=True, timeout=120, text=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})


@pytest.mark.parametrize("where", ["an input", "a file of the user's", "the output",
                                   "inside a folder output", "inside a parquet output",
                                   "a folder", "a missing folder"])
def test_an_errors_path_the_run_must_not_write_is_refused_and_left_as_it_was(
        server, images, tmp_path, where):
    out = {"inside a folder output": tmp_path / "o",
           "inside a parquet output": tmp_path / "o.parquet"}.get(where, tmp_path / "o.h5")
    if where in ("inside a folder output", "inside a parquet output"):
        assert run(server, str(images), "--out", str(out)).returncode == 0
    target = {"an input": images / "1.png",
              "a file of the user's": tmp_path / "keep.png",
              "the output": out,
              "inside a folder output": out / "index.jsonl",
              "inside a parquet output": out / "part-0.parquet",
              "a folder": tmp_path,
              "a missing folder": tmp_path / "nope" / "e.csv"}[where]
    if where == "a file of the user's":
        target.write_bytes(_png(9))
    before = target.read_bytes() if target.is_file() else None
    p = run(server, str(images), "--out", str(out), "--errors", str(target))
    assert p.returncode == 2, p.stderr
    assert f"--errors {target}" in p.stderr and "Traceback" not in p.stderr
    assert (target.read_bytes() if target.is_file() else None) == before
    if where == "a missing folder":
        assert not target.parent.exists()


def test_an_errors_file_in_a_folder_output_and_the_retry_of_an_earlier_ones_images(
        server, images, tmp_path):
    (images / "bad.png").write_bytes(b"not an image")
    out = tmp_path / "o"
    p = run(server, str(images), "--out", str(out), "--errors", str(out / "errors.csv"))
    assert p.returncode == 1, p.stderr   # beside the folder output's own files: written
    assert (out / "errors.csv").is_file() and (out / "index.jsonl").is_file()
    # the retry: an earlier run's errors file as the input list, read before it is
    # written again
    errs = str(out) + ".errors.csv"
    assert run(server, str(images), "--out", str(out)).returncode == 1
    (images / "bad.png").write_bytes(_png(7))   # fixed
    p = run(server, errs, "--out", str(out))
    assert p.returncode == 0 and "done 1," in p.stderr, p.stderr
    assert not os.path.exists(errs)   # nothing failed this time


def test_an_errors_file_of_an_earlier_run_is_rewritten_and_a_device_kept(
        server, images, tmp_path):
    (images / "bad.png").write_bytes(b"not an image")
    errs = tmp_path / "e.csv"
    assert run(server, str(images), "--out", str(tmp_path / "a.h5"),
               "--errors", str(errs)).returncode == 1
    with open(errs, newline="") as fh:
        assert [r["code"] for r in csv.DictReader(fh)] == ["INVALID_ARGUMENT"]
    (images / "bad.png").unlink()
    p = run(server, str(images), "--out", str(tmp_path / "b.h5"), "--errors", str(errs))
    assert p.returncode == 0, p.stderr
    assert not errs.exists()        # an errors file: nothing failed, so it is removed
    # A device (through a link of the test's own: were it removed, only the link goes)
    null = tmp_path / "null"
    null.symlink_to(os.devnull)
    p = run(server, str(images), "--out", str(tmp_path / "c.h5"), "--errors", str(null))
    assert p.returncode == 0, p.stderr
    assert null.is_symlink() and stat.S_ISCHR(os.stat(null).st_mode)   # never removed


@pytest.mark.parametrize("bad", ["long", "folder in the way"])
def test_a_name_a_folder_output_cannot_hold_is_its_images_row(server, images, tmp_path,
                                                              bad):
    if bad == "long":   # a legal 255-byte name, over the limit once .npy is added
        name = "y" * 251 + ".png"
        (images / name).write_bytes(_png(5))
    else:               # a.png's answer file, a.png.npy, is a folder of another input
        name = "a.png"
        (images / name).write_bytes(_png(5))
        (images / "a.png.npy").mkdir()
        (images / "a.png.npy" / "b.png").write_bytes(_png(6))
    out = tmp_path / "o"
    p = run(server, str(images), "--out", str(out))
    assert p.returncode == 1, p.stderr
    with open(str(out) + ".errors.csv", newline="") as fh:
        rows = {r["path"]: r for r in csv.DictReader(fh)}
    (row,) = rows.values()
    assert row["path"].endswith(name if bad == "long" else "a.png.npy/b.png"), row
    assert row["code"] == "INVALID_ARGUMENT" and "cannot store its answer" in row["message"]
    with open(out / "index.jsonl") as fh:
        written = [json.loads(line)["path"] for line in fh]
    n = 3 if bad == "long" else 4
    assert len(written) == n and row["path"] not in written   # the run went on
    again = run(server, str(images), "--out", str(out))   # and a rerun ends the same way
    assert again.returncode == 1 and f"skipped {n}" in again.stderr, again.stderr


def test_a_list_file_and_a_table_with_a_byte_order_mark_miss_nothing(server, images,
                                                                     tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_bytes("\ufeff".encode() + b"\n".join(
        str(images / f"{i}.png").encode() for i in range(3)) + b"\n")
    table = tmp_path / "t.csv"
    table.write_bytes("\ufeffpath,label\n".encode() + b"".join(
        f"{images / f'{i}.png'},x\n".encode() for i in range(3)))
    for i, src in enumerate((listing, table)):
        p = run(server, str(src), "--out", str(tmp_path / f"o{i}.h5"))
        assert p.returncode == 0 and "done 3," in p.stderr, p.stderr


def test_streams_are_bounded(capsys):
    assert main(["batch", "in", "--out", "o.h5", "--layers", "fc",
                 "--streams", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--streams must be at most 256" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("damage", ["no json", "a key missing", "no object"])
def test_a_damaged_line_of_a_folder_outputs_index_is_named(server, images, tmp_path, damage):
    out = tmp_path / "o"
    assert run(server, str(images), "--out", str(out)).returncode == 0
    lines = (out / "index.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    lines[1] = {"no json": lines[1][:20],
                "a key missing": json.dumps({k: v for k, v in row.items() if k != "size"}),
                "no object": "[1, 2]"}[damage]
    (out / "index.jsonl").write_text("\n".join(lines) + "\n")
    p = run(server, str(images), "--out", str(out))
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip()
    assert f"{out / 'index.jsonl'} line 2 is damaged" in err and "Traceback" not in err, err
    assert "remove that line" in err and len(err.splitlines()) == 1, err


#: `python -m hookserve.cli` with a file size limit (a full disk, for that process's
#: files alone), set after the fork in a process of its own: no preexec_fn in a test
#: process whose gRPC threads a fork could deadlock.
LIMITED = ("import os, resource, sys; n = int(sys.argv[1]); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
           "os.execv(sys.executable, [sys.executable, '-m', 'hookserve.cli', *sys.argv[2:]])")


@pytest.mark.parametrize("fmt, limit, extra", [
    ("h5", 60 << 10, []),                         # the journal fills up
    ("h5", 300 << 10, ["--checkpoint", "32"]),    # the parts fit, the whole file does not
    ("parquet", 60 << 10, []),
    ("npy", 12 << 10, []),                        # the folder output's index fills up
])
def test_a_full_disk_is_one_line_and_the_next_run_loses_nothing(server, tmp_path, fmt,
                                                                 limit, extra):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(60):
        (root / f"{i:02d}.png").write_bytes(_png(i))
    out = tmp_path / (f"o.{fmt}" if fmt != "npy" else "o")
    argv = ["batch", str(root), "--out", str(out), "--server", server.address, *OPTS[:-1],
            "layer4:avg,fc", *extra]
    for _ in range(2):   # the run, and a rerun on a disk still full
        p = subprocess.run([sys.executable, "-c", LIMITED, str(limit), *argv],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        err = p.stderr.strip()
        assert f"cannot write {out}: File too large: free space" in err, err
        assert len(err.splitlines()) == 1, err
    assert not (tmp_path / f".tmp-o.{fmt}").exists()
    assert not (tmp_path / f"{out.name}.errors.csv").exists()   # nothing failed
    again = subprocess.run([sys.executable, "-m", "hookserve.cli", *argv],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    if fmt == "h5":
        import h5py
        with h5py.File(out) as f:
            paths = [p.decode() for p in f["paths"][:]]
    elif fmt == "parquet":
        import pyarrow.parquet as pq
        paths = pq.read_table(out, columns=["path"]).column("path").to_pylist()
    else:
        with open(out / "index.jsonl") as fh:
            paths = [json.loads(line)["path"] for line in fh]
    assert sorted(paths) == sorted(str(root / f"{i:02d}.png") for i in range(60))


def test_a_parquet_input_that_is_no_parquet_is_named(tmp_path, capsys):
    bad = tmp_path / "list.parquet"
    bad.write_bytes(b"not parquet at all")
    assert main(["batch", str(bad), "--out", str(tmp_path / "o.h5"), "--layers", "fc",
                 "--server", "localhost:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad} is no Parquet table" in err and len(err.splitlines()) == 1, err


def test_class_names_that_hold_commas_are_quoted_in_the_models_line():
    from types import SimpleNamespace

    from hookserve.cli_args import classes_text
    m = SimpleNamespace(num_classes=4, labels=["cat, tabby", "dog", "x", "y"])
    assert classes_text(m) == "4 classes ('cat, tabby', dog, x, ...)"


def test_the_default_errors_file_goes_in_the_folder_the_output_makes(server, images,
                                                                     tmp_path):
    (images / "bad.png").write_bytes(b"not an image")
    out = tmp_path / "new" / "sub" / "o.h5"
    p = run(server, str(images), "--out", str(out))
    assert p.returncode == 1, p.stderr
    assert out.is_file() and (out.parent / "o.h5.errors.csv").is_file()


def test_a_list_naming_tars_is_a_sharded_run_over_their_members(server, images, tmp_path):
    import tarfile
    tars = []
    for t in range(2):
        path = tmp_path / f"s{t}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(3):
                tf.add(images / f"{i}.png", arcname=f"{t}-{i}.png")
        tars.append(path)
    listing = tmp_path / "tars.txt"
    listing.write_text("".join(f"{p}\n" for p in tars))
    out = tmp_path / "o.parquet"
    p = run(server, str(listing), "--out", str(out))
    assert p.returncode == 0, p.stderr   # (a local run sent each tar whole: 2 failures)
    import pyarrow.parquet as pq
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()   # (a sharded run's)
    assert sorted(i.rsplit("/", 1)[-1] for i in ids) == sorted(
        f"{t}-{i}.png" for t in range(2) for i in range(3))
