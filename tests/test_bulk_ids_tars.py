"""Ids are unique per output, and every member of a tar is accounted for.

- A repeated id in a shard (a tar member name twice, a repeated --id-column value) is
  an ALREADY_EXISTS error row: the first input with that id keeps it. A file named by
  several inputs (or twice in a list) is listed once.
- Link members (symlink, hard link) and other non-regular members named like images
  get an error row; compressed tars are read as a stream.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk_faults import markers, read_out, run_batch, tar_bytes
from conftest import encode, rand_image

IMGS = [encode(rand_image(32, 32, seed=80 + i)) for i in range(3)]




def test_a_repeated_member_name_is_an_error_row(det_server, tmp_path):
    tar = tmp_path / "s.tar"
    tar.write_bytes(tar_bytes([("a.png", IMGS[0]), ("b.png", IMGS[1]), ("a.png", IMGS[2])]))
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == 1  # final: the shard is done
    ids, codes = read_out(str(out))
    assert sorted(ids) == [f"{tar}/a.png", f"{tar}/b.png"]
    assert codes == {f"{tar}/a.png": "ALREADY_EXISTS"}
    assert len(set(ids) | set(codes)) == 2 and list(markers(str(out))) == [str(tar)]
    # the row kept is the first member's
    with det_server.client() as c:
        (first,) = c.extract_many([IMGS[0]], ["fc"], resize=32, crop=32)
    t = pq.read_table(out)
    row = t.column("id").to_pylist().index(f"{tar}/a.png")
    assert t.column("fc")[row].values.to_pylist() == first.features["fc"].tolist()


def test_a_repeated_id_column_value_is_an_error_row(det_server, tmp_path):
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": IMGS, "key": ["x", "y", "x"]}), f)
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(f)], out, "--image-column", "image", "--id-column",
                "key") == 1
    ids, codes = read_out(str(out))
    assert sorted(ids) == ["x", "y"] and codes == {"x": "ALREADY_EXISTS"}


def test_a_file_named_twice_is_listed_once(det_server, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, data in enumerate(IMGS):
        (folder / f"{i}.png").write_bytes(data)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{folder}/0.png\n{folder}/0.png\n{folder}/1.png\n")
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(folder), str(folder / "*.png"), str(listing)], out,
                "--sharded", "--listing-shards", "2") == 0
    ids, codes = read_out(str(out))
    assert sorted(ids) == sorted(str(folder / f"{i}.png") for i in range(3)) and not codes


@pytest.mark.parametrize("mode, ext", [("w", "tar"), ("w:gz", "tar.gz"), ("w:gz", "tgz"),
                                       ("w:bz2", "tar.bz2")])
def test_link_members_get_rows_in_plain_and_compressed_tars(det_server, tmp_path, mode,
                                                            ext):
    tar = tmp_path / f"s.{ext}"
    tar.write_bytes(tar_bytes([("0.png", IMGS[0]), ("1.png", IMGS[1])], mode=mode,
                              links={"sym.png": ("sym", "0.png"),
                                     "hard.jpg": ("hard", "1.png"),
                                     "meta.json": ("sym", "0.png")}))  # not an image
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(tar)], out) == 1
    ids, codes = read_out(str(out))
    assert sorted(ids) == [f"{tar}/0.png", f"{tar}/1.png"]
    assert codes == {f"{tar}/sym.png": "INVALID_ARGUMENT",
                     f"{tar}/hard.jpg": "INVALID_ARGUMENT"}
    text = "".join(open(out / n).read() for n in os.listdir(out) if n.startswith("_err"))
    assert "a symlink to '0.png'" in text and "a hard link to '1.png'" in text
    assert list(markers(str(out))) == [str(tar)]
