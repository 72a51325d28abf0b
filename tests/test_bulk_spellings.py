"""One file, one row, whichever way the inputs spell it, in a sharded run as in a local
one:

- Paths read from a list or path table are normalised (``./imgs/a.png`` is
  ``imgs/a.png``) and joined to ``--root``, as the local run reads them: a file named
  by a list and by a folder (or a tar by a list and by a folder) is one row.
- ``--root`` applies to a sharded run (it was ignored: every path "not found", and the
  run said to run it again).
- A ``file://`` input spelled with ``//``, ``/./`` or ``/../`` is the same input, given
  on the command line or in a list or path table.
- A folder whose name ends in ``.tar`` is a folder (it was opened as a tar, for ever
  "not finished").
"""

from __future__ import annotations

import os

import pytest

from bulk_faults import read_out, run_batch, tar_bytes
from conftest import encode, rand_image

FLAGS = ("--sharded", "--listing-shards", "2")


def _images(folder, n: int, seed: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{i:02d}.png").write_bytes(encode(rand_image(32, 32, seed=seed + i)))
    return sorted(str(folder / f"{i:02d}.png") for i in range(n))


def _ids(out) -> list[str]:
    ids, errors = read_out(str(out))
    assert not errors, errors
    assert len(ids) == len(set(ids)), sorted(ids)   # one row per image
    return sorted(ids)


def test_a_lists_paths_are_spelled_as_the_folders_listing(det_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _images(tmp_path / "imgs", 4, 300)
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "a.tar").write_bytes(tar_bytes(
        [(f"{i}.png", encode(rand_image(32, 32, seed=310 + i))) for i in range(2)]))
    (tmp_path / "dot.txt").write_text("./imgs/00.png\nimgs/./01.png\nimgs/x/../02.png\n"
                                      "./tars/a.tar\n")
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, ["dot.txt", "imgs", "tars"], out, *FLAGS) == 0
    assert _ids(out) == ["imgs/00.png", "imgs/01.png", "imgs/02.png", "imgs/03.png",
                         "tars/a.tar/0.png", "tars/a.tar/1.png"]


def test_root_applies_to_a_sharded_run(det_server, tmp_path, monkeypatch):
    from hookserve.batch.one_shard import run_shard
    from hookserve.batch.shard_plan import plan_shards

    data = tmp_path / "data"
    _images(data / "imgs", 3, 320)
    lst = tmp_path / "rel.txt"
    lst.write_text("imgs/00.png\nimgs/01.png\nimgs/02.png\n")
    monkeypatch.chdir(tmp_path)
    want = sorted(os.path.normpath(str(data / "imgs" / f"{i:02d}.png")) for i in range(3))
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(lst)], out, "--root", str(data), *FLAGS) == 0
    assert _ids(out) == want
    # the library's one-shard call takes the same root
    keys = [s.key for s in plan_shards([str(lst)], listing_shards=2, root=str(data))]
    out2 = tmp_path / "o2.parquet"
    for key in keys:
        run_shard(key, str(out2), ["layer4:avg"], server=det_server.address,
                  listing_shards=2, root=str(data))
    assert _ids(out2) == want


def test_a_file_url_spelled_otherwise_is_the_same_input(det_server, tmp_path, capsys):
    _images(tmp_path / "imgs" / "d0", 3, 330)
    base = f"file://{tmp_path}"
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [f"{base}/imgs"], out, *FLAGS) == 0
    want = _ids(out)
    assert len(want) == 3 and all(i.startswith(f"{base}/imgs/d0/") for i in want)
    for spelling in (f"{base}//imgs", f"{base}/./imgs", f"{base}/imgs/d0/../"):
        capsys.readouterr()
        assert run_batch(det_server, [spelling], out, *FLAGS) == 0
        assert "done 0," in capsys.readouterr().err
        assert _ids(out) == want


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "local"])
@pytest.mark.parametrize("listing", ["list.txt", "table.csv"])
def test_file_urls_in_a_list_are_spelled_one_way(det_server, tmp_path, sharded, listing):
    _images(tmp_path / "imgs" / "d0", 2, 340)
    one = f"file://{tmp_path}/imgs/d0/00.png"
    spellings = [one, f"file://{tmp_path}/imgs//d0/00.png", f"file://{tmp_path}/imgs/./d0/00.png",
                 f"file://{tmp_path}/imgs/d1/../d0/00.png", f"file://{tmp_path}/imgs/d0/01.png"]
    lst = tmp_path / listing
    lst.write_text(("path\n" if listing.endswith(".csv") else "") + "\n".join(spellings) + "\n")
    out = tmp_path / "o.parquet"
    assert run_batch(det_server, [str(lst)], out, *(FLAGS if sharded else ())) == 0
    assert _ids(out) == [one, f"file://{tmp_path}/imgs/d0/01.png"]


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "local"])
def test_a_folder_named_like_a_tar_is_a_folder(det_server, tmp_path, sharded):
    folder = tmp_path / "x.tar"
    want = _images(folder, 2, 340)
    out = tmp_path / "o.parquet"
    flags = FLAGS if sharded else ()
    assert run_batch(det_server, [str(folder)], out, *flags) == 0
    if sharded:
        assert _ids(out) == [os.path.normpath(p) for p in want]
    else:
        import pyarrow.parquet as pq

        assert sorted(pq.read_table(out).column("path").to_pylist()) == want


def test_a_local_run_of_a_folder_of_tars_says_to_shard(det_server, tmp_path, capsys):
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "a.tar").write_bytes(tar_bytes(
        [("0.png", encode(rand_image(32, 32, seed=350)))]))
    capsys.readouterr()
    assert run_batch(det_server, [str(tmp_path / "tars")], tmp_path / "o.parquet") == 2
    assert "no input images found (the tar files below it are read by a sharded run: add " \
           "--sharded)" in capsys.readouterr().err


@pytest.mark.parametrize("ext", [".csv", ".tsv", ".parquet"])
def test_an_empty_cell_of_a_path_table_names_nothing_in_every_format(tmp_path, ext):
    """(a Parquet table's empty cell was the id "." with a directory error row; a CSV's
    was skipped)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hookserve.batch.inputs import listed_paths

    table = tmp_path / f"t{ext}"
    cells = ["a.png", "", None, "b.png"]
    if ext == ".parquet":
        pq.write_table(pa.table({"path": cells}), table)
    else:
        sep = "\t" if ext == ".tsv" else ","
        table.write_text("path" + sep + "n\n" + "".join(
            f"{c or ''}{sep}{i}\n" for i, c in enumerate(cells)))
    assert listed_paths(str(table), root="/data") == ["/data/a.png", "/data/b.png"]
