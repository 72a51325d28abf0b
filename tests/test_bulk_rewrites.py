"""A tar or Parquet file rewritten after its shard was done is done again.

Its done marker records the file's size and version (a local file's modification
time, an object's ETag or modification time): a shard whose file is not
the one it read is redone, whatever the store, however the file was replaced, even
when its size did not change (tar pads to 10 KiB records, so swapping a member
rarely changes a tar's size). Unchanged files stay skipped.
"""

from __future__ import annotations

import json
import os

import pytest

from bulk_faults import Web, markers, read_out, run_batch, tar_bytes
from conftest import encode, rand_image

IMAGES = [(f"{i:03d}.png", encode(rand_image(32, 32, seed=120 + i))) for i in range(4)]
#: The same tar with one member renamed: the same size, other ids.
SWAPPED = IMAGES[:3] + [("009.png", IMAGES[3][1])]
ONE, TWO = tar_bytes(IMAGES), tar_bytes(SWAPPED)
assert len(ONE) == len(TWO)


class _Store:
    """Tar files in one place (a local folder, fsspec's memory store, S3, a web
    server); `put` writes or rewrites one."""

    def __init__(self, where: str, tmp_path, request) -> None:
        self.where = where
        self.fs = None
        if where == "memory":
            import fsspec

            self.fs, self.base = fsspec.filesystem("memory"), f"memory://rw{id(self)}"
        elif where == "s3":
            self.fs, self.base = request.getfixturevalue("s3"), f"s3://lake/rw{id(self)}"
        elif where == "http":
            self.web = Web()
            request.addfinalizer(self.web.close)
            self.base = f"{self.web.url}/f"
        else:
            self.base = str(tmp_path / "tars")
            os.makedirs(self.base)

    def put(self, name: str, data: bytes, how: str = "in place") -> str:
        url = f"{self.base}/{name}"
        if self.where == "http":
            self.web.files[name] = data
        elif self.fs is not None:
            self.fs.pipe(url.split("://", 1)[1] if self.where == "s3" else url, data)
        elif how == "in place" or not os.path.exists(url):
            with open(url, "wb") as fh:
                fh.write(data)
        else:   # a new file written beside the old one, then moved over it
            with open(url + ".new", "wb") as fh:
                fh.write(data)
            os.replace(url + ".new", url)
        return url


def _run(server, inputs, out, capsys, *flags) -> str:
    capsys.readouterr()
    assert run_batch(server, inputs, out, *flags) == 0
    return capsys.readouterr().err


@pytest.mark.parametrize("where, count, how", [
    ("local", 1, "in place"), ("local", 1, "moved over"),
    ("memory", 1, "in place"), ("memory", 9, "in place"),
    ("s3", 2, "in place"), ("http", 2, "in place")])
def test_a_rewritten_tar_of_the_same_size_is_done_again(det_server, tmp_path, capsys,
                                                        request, where, count, how):
    store = _Store(where, tmp_path, request)
    tars = [store.put(f"{t:02d}.tar", ONE) for t in range(count)]
    out = tmp_path / "o.parquet"
    _run(det_server, tars, out, capsys)
    assert sorted(read_out(str(out))[0]) == sorted(f"{t}/{n}" for t in tars for n, _ in IMAGES)
    assert all("stamp" in m for m in markers(str(out)).values())

    store.put(f"{count - 1:02d}.tar", TWO, how)   # the last tar rewritten
    err = _run(det_server, tars, out, capsys)
    assert f"{tars[-1]} was rewritten since it was done; it is done again" in err, err
    assert f"skipped {count - 1}," in err, err
    want = [f"{t}/{n}" for t in tars[:-1] for n, _ in IMAGES] + \
        [f"{tars[-1]}/{n}" for n, _ in SWAPPED]
    assert sorted(read_out(str(out))[0]) == sorted(want)
    assert f"skipped {count}," in _run(det_server, tars, out, capsys)


def test_a_rewritten_parquet_file_is_done_again(det_server, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"

    def write(n: int) -> None:
        images = [encode(rand_image(32, 32, seed=130 + i)) for i in range(n)]
        pq.write_table(pa.table({"image": images}), path)

    write(3)
    out = tmp_path / "o.parquet"
    flags = ("--image-column", "image")
    _run(det_server, [str(path)], out, capsys, *flags)
    assert len(read_out(str(out))[0]) == 3
    write(5)
    err = _run(det_server, [str(path)], out, capsys, *flags)
    assert "was rewritten since it was done" in err, err
    assert sorted(read_out(str(out))[0]) == sorted(f"{path}#{i}" for i in range(5))


def test_a_tar_marker_of_an_earlier_version_is_trusted_and_stamped(det_server, tmp_path,
                                                                   capsys):
    """Markers written before markers recorded a stamp are trusted as they were (the
    upgrade redoes nothing), and get the file's stamp."""
    tar = tmp_path / "s.tar"
    tar.write_bytes(ONE)
    out = tmp_path / "o.parquet"
    _run(det_server, [str(tar)], out, capsys)
    (marker,) = [out / n for n in os.listdir(out) if n.startswith("_done-")]
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k != "stamp"}
    marker.write_text(json.dumps(old))
    assert "skipped 1," in _run(det_server, [str(tar)], out, capsys)
    assert "stamp" in json.loads(marker.read_text())
    tar.write_bytes(TWO)
    assert "was rewritten" in _run(det_server, [str(tar)], out, capsys)


def test_run_shard_redoes_a_rewritten_tar(det_server, tmp_path):
    from hookserve.batch import run_shard

    tar = tmp_path / "s.tar"
    tar.write_bytes(ONE)
    out = str(tmp_path / "o.parquet")
    kw = {"server": det_server.address, "resize": 32, "crop": (32, 32)}
    assert run_shard(str(tar), out, ["fc"], **kw).rows == 4
    assert run_shard(str(tar), out, ["fc"], **kw).skipped
    with open(tar, "r+b") as fh:   # rewritten in place, same size
        fh.write(TWO)
    again = run_shard(str(tar), out, ["fc"], **kw)
    assert not again.skipped and again.rows == 4
    assert sorted(read_out(out)[0]) == sorted(f"{tar}/{n}" for n, _ in SWAPPED)


def test_run_shard_takes_a_crop_as_the_cli_does(det_server, tmp_path):
    from hookserve.batch import run_shard

    tar = tmp_path / "s.tar"
    tar.write_bytes(ONE)
    res = run_shard(str(tar), str(tmp_path / "o.parquet"), ["fc"],
                    server=det_server.address, resize=32, crop=32)
    assert res.rows == 4
