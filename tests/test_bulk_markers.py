"""A done marker is a promise: it is written only when every input of the shard is
accounted for, and a rerun trusts only a marker whose part is there.

Each case breaks a shard in one way (a cut tar, a shard not there yet, a store that
fails, a missing extra, an overloaded server, a deleted or damaged part), checks that
the run exits 3 naming the shard and leaves no marker, then repairs the cause and
checks that the rerun produces every row. Fault injection is in tests/bulk_faults.py.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from hookserve.batch import run_shard
from hookserve.batch.errors import EXIT_INCOMPLETE, FINAL_CODES, is_final
from hookserve.batch.shard_output import ShardIncomplete

from bulk_faults import FaultyFS, markers, read_out, run_batch, tar_bytes
from conftest import encode, rand_image
from helpers import R18

IMAGES = [(f"{i:03d}.png", encode(rand_image(32, 32, seed=40 + i))) for i in range(4)]
TAR = tar_bytes(IMAGES + [("000.json", b"{}")])




def _cuts(data: bytes) -> dict[str, int]:
    """Cut points of each kind: inside a header, at a member boundary, inside a
    member's data, inside its padding, before the end-of-archive block."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        members = tf.getmembers()
    second, last = members[1], members[-1]
    end = last.offset_data + ((last.size + 511) // 512) * 512
    return {"in-header": second.offset + 100, "at-boundary": second.offset,
            "in-data": second.offset_data + 10, "in-padding": members[0].offset_data + 600,
            "before-end-block": end, "empty": 0}


@pytest.mark.parametrize("kind", list(_cuts(TAR)))
def test_a_cut_tar_gets_no_marker_and_is_redone_once_whole(det_server, tmp_path, capsys,
                                                             kind):
    cut = _cuts(TAR)[kind]
    tar = tmp_path / "s.tar"
    tar.write_bytes(TAR[:cut])
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == EXIT_INCOMPLETE
    err = capsys.readouterr().err
    assert f"not finished: {tar}" in err, err
    assert markers(str(out)) == {}
    ids, codes = read_out(str(out))
    assert codes[f"{tar}/"] in ("DATA_LOSS", "UNAVAILABLE")
    assert all(not is_final(c) for i, c in codes.items() if i.endswith("/"))
    tar.write_bytes(TAR)  # the whole tar arrives
    assert run_batch(det_server, [str(tar)], out) == 0, capsys.readouterr().err
    ids, codes = read_out(str(out))
    assert sorted(ids) == [f"{tar}/{n}" for n, _ in IMAGES] and codes == {}
    assert list(markers(str(out))) == [str(tar)]


@pytest.mark.parametrize("mode, ext", [("w:gz", "tar.gz"), ("w:xz", "tgz")])
def test_a_compressed_tar_is_read_and_one_cut_short_is_not_done(det_server, tmp_path,
                                                                  capsys, mode, ext):
    data = tar_bytes(IMAGES, mode=mode)
    tar = tmp_path / f"s.{ext}"
    tar.write_bytes(data[:len(data) // 2])
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == EXIT_INCOMPLETE
    assert markers(str(out)) == {}
    assert read_out(str(out))[1][f"{tar}/"] == "DATA_LOSS"
    tar.write_bytes(data)
    assert run_batch(det_server, [str(tar)], out) == 0, capsys.readouterr().err
    assert sorted(read_out(str(out))[0]) == [f"{tar}/{n}" for n, _ in IMAGES]


def test_a_shard_not_there_yet_is_an_error_then_done(det_server, tmp_path, capsys):
    tars = [tmp_path / f"{i}.tar" for i in range(2)]
    tars[0].write_bytes(TAR)
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tmp_path / "{0..1}.tar")], out) == EXIT_INCOMPLETE
    err = capsys.readouterr().err
    assert f"not finished: {tars[1]}: NOT_FOUND" in err, err
    assert list(markers(str(out))) == [str(tars[0])]
    tars[1].write_bytes(TAR)  # it appears
    assert run_batch(det_server, [str(tmp_path / "{0..1}.tar")], out) == 0
    assert "skipped 1" in capsys.readouterr().err
    ids, _ = read_out(str(out))
    assert len(ids) == 2 * len(IMAGES) == len(set(ids))


@pytest.mark.parametrize("fault", [
    {"fail": 1},                                  # the store fails once
    {"fail": 1, "error": FileNotFoundError},      # not there yet
    {"fail": 1, "error": PermissionError},        # credentials not set up yet
    {"cut": 2048},                                # the body ends early
])
def test_a_store_that_fails_leaves_the_shard_open(det_server, tmp_path, capsys, fault):
    FaultyFS.reset()
    fs = FaultyFS()
    fs.pipe("/lake/a.tar", TAR)
    FaultyFS.faults[fs._strip_protocol("faulty://lake/a.tar")] = dict(fault)
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, ["faulty://lake/a.tar"], out) == EXIT_INCOMPLETE
    assert "not finished: faulty://lake/a.tar" in capsys.readouterr().err
    assert markers(str(out)) == {}
    assert run_batch(det_server, ["faulty://lake/a.tar"], out) == 0  # the fault has passed
    assert sorted(read_out(str(out))[0]) == [f"faulty://lake/a.tar/{n}" for n, _ in IMAGES]


def test_a_missing_extra_is_not_final(det_server, tmp_path, capsys):
    pytest.importorskip("fsspec")
    if _has("gcsfs"):
        pytest.skip("gcsfs is installed")
    # the command line says which pip install fixes it, before any work
    assert run_batch(det_server, ["gs://lake/a.tar"], tmp_path / "o.parquet") == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'hookserve[gcs]'" in err and len(err.splitlines()) == 1, err
    # one shard from Python: an error row that is not final, and no marker
    with pytest.raises(ShardIncomplete, match="hookserve\\[gcs\\]") as e:
        run_shard("gs://lake/a.tar", str(tmp_path / "p.parquet"), ["fc"],
                  server=det_server.address, resize=32, crop=(32, 32))
    assert e.value.result.reason.startswith("FAILED_PRECONDITION")
    assert markers(str(tmp_path / "p.parquet")) == {}


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_resource_exhausted_is_not_final(det_server, make_server, tmp_path, capsys):
    """An image over a server budget: its row is RESOURCE_EXHAUSTED, the shard stays
    open; against a server with room, the rerun finishes it."""
    small = make_server(*R18, "--max-batch-size", "1", "--max-stream-buffer-bytes", "8000")
    tar = tmp_path / "s.tar"
    tar.write_bytes(TAR)
    out = tmp_path / "o.npy"  # fc and layer1 (64x8x8, 16 KB an answer: over 8000 bytes)
    assert run_batch(small, [str(tar)], out, "--layers", "layer1") == EXIT_INCOMPLETE
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert markers(str(out)) == {}
    assert run_batch(det_server, [str(tar)], out, "--layers", "layer1") == 0
    assert markers(str(out))[str(tar)]["rows"] == len(IMAGES)


def test_final_failures_alone_give_a_marker(det_server, tmp_path):
    tar = tmp_path / "s.tar"
    tar.write_bytes(tar_bytes(IMAGES + [("bad.png", b"not an image")]))
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == 1
    m = markers(str(out))[str(tar)]
    assert (m["rows"], m["failed"]) == (len(IMAGES), 1)
    assert read_out(str(out))[1] == {f"{tar}/bad.png": "INVALID_ARGUMENT"}
    assert FINAL_CODES == {"INVALID_ARGUMENT", "OUT_OF_RANGE", "ALREADY_EXISTS"}
    assert not any(is_final(c) for c in ("NOT_FOUND", "UNAVAILABLE", "RESOURCE_EXHAUSTED",
                                         "DATA_LOSS", "FAILED_PRECONDITION", "INTERNAL",
                                         "DEADLINE_EXCEEDED", "PERMISSION_DENIED"))


@pytest.mark.parametrize("damage", ["delete-part", "cut-part", "garbage-marker",
                                    "other-shard-marker"])
def test_a_marker_whose_part_is_gone_is_ignored(det_server, tmp_path, capsys, damage):
    tar = tmp_path / "s.tar"
    tar.write_bytes(TAR)
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == 0
    (marker,) = [out / n for n in os.listdir(out) if n.startswith("_done-")]
    (part,) = [out / n for n in os.listdir(out) if n.startswith("part-")]
    if damage == "delete-part":
        part.unlink()
    elif damage == "cut-part":
        part.write_bytes(part.read_bytes()[:-100])
    elif damage == "garbage-marker":
        marker.write_text("{not json")
    else:
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "shard": "x.tar"}))
    capsys.readouterr()
    assert run_batch(det_server, [str(tar)], out) == 0
    err = capsys.readouterr().err
    assert "it is done again" in err and "skipped 0" in err, err
    ids, _ = read_out(str(out))
    assert sorted(ids) == [f"{tar}/{n}" for n, _ in IMAGES]
    assert run_batch(det_server, [str(tar)], out) == 0
    assert "skipped 1" in capsys.readouterr().err  # now it is trusted again


def test_a_finished_shard_drops_what_an_earlier_try_left(det_server, tmp_path):
    """A try that failed wrote its errors file; the try that finishes the shard with no
    failure removes it, so the output lists only what is true now."""
    FaultyFS.reset()
    fs = FaultyFS()
    fs.pipe("/lake/b.tar", TAR)
    FaultyFS.faults[fs._strip_protocol("faulty://lake/b.tar")] = {"cut": 3000}
    out = tmp_path / "o.npy"
    assert run_batch(det_server, ["faulty://lake/b.tar"], out) == EXIT_INCOMPLETE
    assert any(n.startswith("_errors-") for n in os.listdir(out))
    assert run_batch(det_server, ["faulty://lake/b.tar"], out) == 0
    names = os.listdir(out)
    assert not any(n.startswith("_errors-") for n in names)
    (m,) = markers(str(out)).values()
    assert m["rows"] == len(IMAGES) and all(os.path.getsize(out / f) == size
                                            for f, size in m["files"].items())


class _Listed:
    """A listed input whose files a test adds and removes: a local folder, a list of
    its paths, or a prefix on fsspec's memory:// store (whose listing gives sizes)."""

    def __init__(self, source: str, tmp_path) -> None:
        import fsspec
        self.source = source
        self.fs = fsspec.filesystem("memory") if source == "memory" else None
        self.root = f"memory://imgs-{tmp_path.name}" if self.fs else str(tmp_path / "imgs")
        if not self.fs:
            os.makedirs(self.root)
        self.list = tmp_path / "list.txt"

    @property
    def input(self) -> str:
        return str(self.list) if self.source == "list" else self.root

    def put(self, name: str, data: bytes) -> None:
        if self.fs:
            self.fs.pipe(f"{self.root}/{name}", data)
        else:
            with open(os.path.join(self.root, name), "wb") as fh:
                fh.write(data)
        self._write_list()

    def remove(self, name: str) -> None:
        (self.fs.rm if self.fs else os.unlink)(f"{self.root}/{name}")
        self._write_list()

    def ids(self) -> list[str]:
        names = (sorted(p.rsplit("/", 1)[1] for p in self.fs.ls(self.root, detail=False))
                 if self.fs else sorted(os.listdir(self.root)))
        return [f"{self.root}/{n}" for n in names]

    def _write_list(self) -> None:
        if not self.fs:
            self.list.write_text("".join(f"{p}\n" for p in self.ids()))


@pytest.mark.parametrize("source", ["folder", "list", "memory"])
def test_a_listing_shard_whose_files_changed_is_done_again(det_server, tmp_path, capsys,
                                                           source):
    """Files added to or removed from a listed input (or resized, where the listing
    gives sizes: object stores) join or leave their hash shard: that shard's marker no
    longer holds and the shard is redone, a shard left with no file loses its rows, and
    the others stay skipped; the output has the rows of the input as it is now."""
    src = _Listed(source, tmp_path)
    for i in range(8):
        src.put(f"{i:02d}.png", encode(rand_image(32, 32, seed=60 + i)))
    out = tmp_path / "o.parquet"

    def run() -> str:
        capsys.readouterr()
        assert run_batch(det_server, [src.input], out, "--sharded", "--listing-shards",
                         "4") == 0
        err = capsys.readouterr().err
        ids, _ = read_out(str(out))
        assert sorted(ids) == src.ids(), err
        return err

    run()
    before = markers(str(out))
    src.put("08.png", encode(rand_image(32, 32, seed=68)))  # added
    src.remove("00.png")                                    # removed
    err = run()
    assert "its files changed since it was done" in err, err
    after = markers(str(out))
    redone = [k for k, m in after.items() if before.get(k) != m]  # (or new)
    assert redone and f"skipped {len(after) - len(redone)}," in err, err
    if source == "memory":   # a file rewritten with another size: its shard again
        src.put("03.png", encode(rand_image(40, 40, seed=99)))
        err = run()
        assert "its files changed since it was done" in err, err
        assert f"skipped {len(after) - 1}," in err, err
    for name in src.ids()[1:]:   # all but one file gone: shards emptied
        src.remove(name.rsplit("/", 1)[1])
    err = run()
    assert "no file of the input is in it any more; its rows are removed" in err, err
    assert len(markers(str(out))) == 1
    assert "skipped 1," in run()


def test_an_input_that_lists_nothing_keeps_its_rows(det_server, tmp_path, capsys):
    """An emptied folder among the inputs (an unmounted mount point, say) is more
    likely a mistake than a deletion: its rows stay, and the run says so."""
    a, b = tmp_path / "a", tmp_path / "b"
    for k, folder in enumerate((a, b)):
        folder.mkdir()
        for i in range(3):
            (folder / f"{i}.png").write_bytes(encode(rand_image(32, 32, seed=80 + 3 * k + i)))
    out = tmp_path / "o.parquet"
    flags = ("--sharded", "--listing-shards", "2")
    assert run_batch(det_server, [str(a), str(b)], out, *flags) == 0
    want = sorted(read_out(str(out))[0])
    for p in b.iterdir():
        p.unlink()
    capsys.readouterr()
    assert run_batch(det_server, [str(a), str(b)], out, *flags) == 0
    err = capsys.readouterr().err
    assert f"{b} lists no file now; the rows an earlier run wrote for it, if any, are " \
           "kept" in err and "rows are removed" not in err, err
    assert sorted(read_out(str(out))[0]) == want



def test_a_marker_written_before_markers_recorded_files_is_checked_by_its_counts(
        det_server, tmp_path, capsys):
    """An output of an earlier version: its markers hold no digest of the files. They
    are trusted while their row and error counts still add up to the shard's files."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.png").write_bytes(encode(rand_image(32, 32, seed=95 + i)))
    out = tmp_path / "o.parquet"
    flags = ("--sharded", "--listing-shards", "1")
    assert run_batch(det_server, [str(folder)], out, *flags) == 0
    (marker,) = [out / n for n in os.listdir(out) if n.startswith("_done-")]
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k != "members"}
    marker.write_text(json.dumps(old))
    capsys.readouterr()
    assert run_batch(det_server, [str(folder)], out, *flags) == 0
    assert "skipped 1," in capsys.readouterr().err
    assert "members" in json.loads(marker.read_text())   # trusted, then completed
    marker.write_text(json.dumps(old))
    (folder / "4.png").write_bytes(encode(rand_image(32, 32, seed=99)))
    assert run_batch(det_server, [str(folder)], out, *flags) == 0
    assert "its files changed since it was done" in capsys.readouterr().err
    assert len(read_out(str(out))[0]) == 5


def test_a_worker_whose_listing_shards_all_emptied_still_removes_their_rows(
        det_server, tmp_path, capsys):
    from hookserve.batch.inputs import encode_name, shard_of

    folder = tmp_path / "imgs"
    folder.mkdir()
    paths = [folder / f"{i:02d}.png" for i in range(10)]
    for i, p in enumerate(paths):
        p.write_bytes(encode(rand_image(32, 32, seed=110 + i)))
    bucket = {p: shard_of(encode_name(str(p)), 2) for p in paths}
    assert set(bucket.values()) == {0, 1}
    keys = [f"{encode_name(str(folder))}#{b}/2" for b in (0, 1)]
    n = next(n for n in range(2, 50) if shard_of(keys[0], n) != shard_of(keys[1], n))
    owner = [shard_of(k, n) for k in keys]
    out = tmp_path / "o.parquet"

    def worker(i: int) -> int:
        return run_batch(det_server, [str(folder)], out, "--sharded", "--listing-shards",
                         "2", "--shard", f"{i}/{n}")
    assert worker(owner[0]) == worker(owner[1]) == 0
    for p in paths:
        if bucket[p] == 0:
            p.unlink()
    capsys.readouterr()
    assert worker(owner[0]) == 0
    assert "its rows are removed" in capsys.readouterr().err
    assert sorted(read_out(str(out))[0]) == sorted(str(p) for p in folder.iterdir())


def test_a_worker_with_nothing_to_do_needs_no_server(tmp_path, capsys):
    """Its buckets hold no file now and never had rows: nothing to remove either."""
    from hookserve.batch.inputs import encode_name, shard_of
    from hookserve.cli import main

    folder = tmp_path / "imgs"
    folder.mkdir()
    owners = set()
    for i in range(3):
        p = folder / f"{i}.png"
        p.write_bytes(encode(rand_image(32, 32, seed=120 + i)))
        b = shard_of(encode_name(str(p)), 64)
        owners.add(shard_of(f"{encode_name(str(folder))}#{b}/64", 8))
    idle = next(i for i in range(8) if i not in owners)
    rc = main(["batch", str(folder), "--out", str(tmp_path / "o.parquet"), "--sharded",
               "--shard", f"{idle}/8", "--server", "127.0.0.1:1", "--layers", "fc",
               "--no-progress"])
    assert rc == 0 and "nothing to do" in capsys.readouterr().err


def test_files_another_input_lists_first_are_not_kept_twice(det_server, tmp_path, capsys):
    """`imgs/sub` alone, then `imgs imgs/sub`: each file is listed once, by `imgs`, so
    the rows written for `imgs/sub` go."""
    sub = tmp_path / "imgs" / "sub"
    sub.mkdir(parents=True)
    for i in range(3):
        (sub / f"{i}.png").write_bytes(encode(rand_image(32, 32, seed=130 + i)))
    out = tmp_path / "o.parquet"
    flags = ("--sharded", "--listing-shards", "2")
    assert run_batch(det_server, [str(sub)], out, *flags) == 0
    assert run_batch(det_server, [str(tmp_path / "imgs"), str(sub)], out, *flags) == 0
    ids = read_out(str(out))[0]
    assert sorted(ids) == sorted(str(p) for p in sub.iterdir())
