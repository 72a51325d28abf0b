"""One file, one row: however a sharded run's inputs are spelled or regrouped between
runs, each image of the inputs has exactly one row in the output.

- The same input spelled otherwise (``imgs``, ``imgs/``, ``./imgs``) is the same
  shards: the rerun skips them.
- Inputs regrouped (``imgs imgs/d0``, then ``imgs/d0/*.png imgs``, then ``imgs``):
  the shards an earlier run wrote for files the inputs now list elsewhere are removed.
- A tar gone from a listed folder loses its rows, like a listing shard emptied.
- Shards of inputs the run does not name at all (another data set written to the
  same output, a folder renamed) are kept, and the run says so.
- A glob means every file it matches, as in the local run.
- The local run says how many of its rows are of files its inputs no longer list.
"""

from __future__ import annotations

import os
import shutil

import pytest

from bulk_faults import markers, read_out, run_batch, tar_bytes
from conftest import encode, rand_image

FLAGS = ("--sharded", "--listing-shards", "3")


def _images(folder, n: int, seed: int, sub: str = "") -> list[str]:
    where = folder / sub if sub else folder
    where.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        p = where / f"{i:02d}.png"
        p.write_bytes(encode(rand_image(32, 32, seed=seed + i)))
        names.append(os.path.normpath(str(p)))
    return names


def _run(server, inputs, out, capsys, *flags, code: int = 0) -> str:
    capsys.readouterr()
    assert run_batch(server, [str(i) for i in inputs], out, *flags) == code
    return capsys.readouterr().err


def _ids(out) -> list[str]:
    ids = read_out(str(out))[0]
    assert len(ids) == len(set(ids)), sorted(ids)   # one row per image
    return sorted(ids)


def test_one_input_spelled_three_ways_is_one_set_of_shards(det_server, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = sorted(os.path.normpath(p) for p in _images(tmp_path / "imgs", 6, 200))
    want = [os.path.relpath(p, tmp_path) for p in want]
    out = tmp_path / "o.parquet"
    _run(det_server, ["imgs"], out, capsys, *FLAGS)
    for spelling in ("imgs/", "./imgs", "imgs//"):
        err = _run(det_server, [spelling], out, capsys, *FLAGS)
        assert "done 0," in err and "rows are removed" not in err, err
    assert _ids(out) == want


def test_regrouped_inputs_keep_one_row_per_image(det_server, tmp_path, capsys):
    imgs = tmp_path / "imgs"
    want = sorted(_images(imgs, 4, 210) + _images(imgs, 3, 220, "d0"))
    out = tmp_path / "o.parquet"
    for inputs in ([imgs, imgs / "d0"], [imgs / "d0" / "*.png", imgs], [imgs]):
        err = _run(det_server, inputs, out, capsys, *FLAGS)
        assert _ids(out) == want, err
    assert "its files are this run's, in other shards, or gone; its rows are " \
           "removed" in err, err


def test_a_tar_gone_from_a_listed_folder_loses_its_rows(det_server, tmp_path, capsys):
    tars = tmp_path / "tars"
    tars.mkdir()
    for t in range(3):
        (tars / f"{t}.tar").write_bytes(tar_bytes(
            [(f"{t}{i}.png", encode(rand_image(32, 32, seed=230 + 10 * t + i)))
             for i in range(2)]))
    out = tmp_path / "o.parquet"
    _run(det_server, [tars], out, capsys, "--sharded")
    assert len(_ids(out)) == 6
    (tars / "1.tar").unlink()
    err = _run(det_server, [tars], out, capsys, "--sharded")
    assert f"shard {tars}/1.tar: its files are this run's, in other shards, or gone" in err, err
    assert _ids(out) == sorted(f"{tars}/{t}.tar/{t}{i}.png" for t in (0, 2) for i in range(2))
    assert len(markers(str(out))) == 2


def test_shards_of_inputs_the_run_does_not_name_are_kept_and_said(det_server, tmp_path,
                                                                   capsys):
    a = _images(tmp_path / "a", 3, 240)
    b = _images(tmp_path / "b", 3, 250)
    out = tmp_path / "o.parquet"
    _run(det_server, [tmp_path / "a"], out, capsys, *FLAGS)
    err = _run(det_server, [tmp_path / "b"], out, capsys, *FLAGS)   # another data set
    assert "the output also holds" in err and "their rows are kept" in err, err
    assert _ids(out) == sorted(a + b)
    shutil.move(tmp_path / "b", tmp_path / "b2")                  # a folder renamed
    err = _run(det_server, [tmp_path / "a", tmp_path / "b2"], out, capsys, *FLAGS)
    assert f"finished shards of inputs this run does not name (first: {tmp_path / 'b'}#" \
           in err, err


@pytest.mark.parametrize("sharded", [False, True])
def test_a_glob_means_every_file_it_matches(det_server, tmp_path, capsys, sharded):
    gx = tmp_path / "gx"
    _images(gx, 2, 260)
    img = encode(rand_image(32, 32, seed=270))
    for name in ("b0.dat", "b1.image"):
        (gx / name).write_bytes(img)
    (gx / "notes.txt").write_bytes(b"not an image")
    out = tmp_path / "o.parquet"
    flags = FLAGS if sharded else ()
    _run(det_server, [gx / "*"], out, capsys, *flags, code=1)   # notes.txt: an error row
    ids, codes = read_out(str(out)) if sharded else (None, None)
    if sharded:
        assert sorted(ids) == sorted(str(gx / n) for n in ("00.png", "01.png", "b0.dat",
                                                           "b1.image"))
        assert codes == {str(gx / "notes.txt"): "INVALID_ARGUMENT"}


def test_the_local_run_says_rows_of_files_no_longer_listed(det_server, tmp_path, capsys):
    names = _images(tmp_path / "imgs", 4, 280)
    out = tmp_path / "o.parquet"
    _run(det_server, [tmp_path / "imgs"], out, capsys)
    os.unlink(names[0])
    err = _run(det_server, [tmp_path / "imgs"], out, capsys)
    assert f"the output holds 1 rows of files these inputs do not list (deleted, renamed, " \
           f"or another run's inputs; first: {names[0]}); they are kept" in err, err


def test_an_input_has_one_spelling_in_shard_keys():
    from hookserve.batch.shard_plan import key_input, key_source

    assert {key_input(s) for s in ("imgs", "imgs/", "./imgs", "imgs//", "x/../imgs")} == \
        {"imgs"}
    assert key_input("s3://b/imgs/") == key_input("s3://b/imgs") == "s3://b/imgs"
    assert key_input("memory://") == "memory://"
    assert key_source("s3://b/imgs#2/8") == "s3://b/imgs"
    assert key_source("d/t.parquet#rg=3") == "d/t.parquet"
    assert key_source("d/0.tar") == "d/0.tar" and key_source("d/a#b.tar") == "d/a#b.tar"


NAMES = ["plain.png", "50%.png", "Cat%20photo.png", "caf%E9.png", "caf%25E9.png",
         "caf%e9.png", "%2525.png", "caf\udce9.png", "caf\udce9%E9.png", "%\udcff%25.png"]


def test_ids_are_one_to_one_and_give_the_name_back():
    from hookserve.batch import decode_name, encode_name

    ids = [encode_name(n) for n in NAMES]
    assert len(set(ids)) == len(ids), ids
    assert all(i.encode("utf-8") for i in ids)   # valid UTF-8, every one
    assert [decode_name(i) for i in ids] == [os.fsencode(n) for n in NAMES]
    assert ids[:3] == NAMES[:3] and ids[5] == NAMES[5]   # readable names stay as they are
    url = "https://host/caf%C3%A9%20au%20lait.jpg"   # a URL's escapes are its own
    assert encode_name(url) == url


@pytest.mark.parametrize("out, sharded", [("o.parquet", False), ("o_npy", False),
                                          ("o.parquet", True)])
def test_a_name_like_an_escaped_one_gets_its_own_row(det_server, tmp_path, capsys, out,
                                                     sharded):
    enc = tmp_path / "enc"
    enc.mkdir()
    a, b = encode(rand_image(32, 32, seed=290)), encode(rand_image(32, 32, seed=291))
    (enc / "caf%E9.png").write_bytes(a)
    with open(os.fsencode(enc) + b"/caf\xe9.png", "wb") as fh:
        fh.write(b)
    flags = FLAGS if sharded else ()
    for _ in range(2):   # the rerun finds both rows
        err = _run(det_server, [enc], tmp_path / out, capsys, *flags)
        assert "failed 0" in err or "failed" not in err, err
    if sharded:
        assert _ids(tmp_path / out) == sorted([f"{enc}/caf%25E9.png", f"{enc}/caf%E9.png"])


def test_a_row_written_under_an_earlier_id_is_found_on_resume(tmp_path):
    from hookserve.batch.local_run import plan

    p = tmp_path / "caf%E9.png"
    p.write_bytes(b"x")
    st = os.stat(p)
    work, failures, skipped = plan([str(p)], {str(p): (st.st_size, st.st_mtime_ns)})
    assert (work, failures, skipped) == ([], [], 1)


def test_a_local_and_a_sharded_run_do_not_share_an_npy_folder(det_server, tmp_path,
                                                               capsys):
    """The two lay out .npy folders differently (a file per image, an array per shard):
    neither adds to the other's."""
    _images(tmp_path / "imgs", 2, 300)
    local, sharded = tmp_path / "local_npy", tmp_path / "sharded_npy"
    _run(det_server, [tmp_path / "imgs"], local, capsys)
    _run(det_server, [tmp_path / "imgs"], sharded, capsys, *FLAGS)
    err = _run(det_server, [tmp_path / "imgs"], local, capsys, *FLAGS, code=2)
    assert "holds a local run's .npy files (hookserve.json)" in err, err
    err = _run(det_server, [tmp_path / "imgs"], sharded, capsys, code=2)
    assert "holds a sharded run's output (_hookserve.json)" in err, err


def _tree(root) -> None:
    """imgs/{a,b}.png, imgs/sub/c.png, imgs/scan.dat (a PNG under another name),
    imgs/link -> ../real (a folder symlink, which a folder's listing does not follow)."""
    _images(root / "imgs", 2, 310)
    (root / "imgs" / "00.png").rename(root / "imgs" / "a.png")
    (root / "imgs" / "01.png").rename(root / "imgs" / "b.png")
    (root / "imgs" / "sub").mkdir()
    (root / "imgs" / "sub" / "c.png").write_bytes(encode(rand_image(32, 32, seed=315)))
    (root / "imgs" / "scan.dat").write_bytes(encode(rand_image(32, 32, seed=316)))
    (root / "real").mkdir()
    (root / "real" / "d.png").write_bytes(encode(rand_image(32, 32, seed=317)))
    (root / "imgs" / "link").symlink_to(root / "real")


@pytest.mark.parametrize("runs, want, pruned", [
    ((["imgs/sub"], ["imgs/*"]), {"sub/c.png", "a.png", "b.png", "scan.dat"}, False),
    ((["imgs/link"], ["imgs"]), {"link/d.png", "a.png", "b.png", "sub/c.png"}, False),
    ((["imgs"], ["imgs/*.png"]), {"a.png", "b.png", "sub/c.png"}, True),
    ((["imgs/a.png"], ["imgs/**/*.png"]), {"a.png", "b.png", "sub/c.png", "link/d.png"},
     False),
    ((["imgs/*"], ["imgs"]), {"a.png", "b.png", "scan.dat", "sub/c.png"}, True),
    ((["imgs"], ["imgs/sub"], ["imgs"]), {"a.png", "b.png", "sub/c.png"}, False),
    ((["imgs"], ["im*/a.png"]), {"a.png", "b.png", "sub/c.png"}, False),
])
@pytest.mark.parametrize("out", ["o.parquet", "o_npy"])
def test_no_earlier_row_is_removed_unless_this_run_writes_it(det_server, tmp_path, capsys,
                                                             monkeypatch, runs, want,
                                                             pruned, out):
    """An earlier shard is removed only when this run writes each of its ids itself;
    one that shares only some loses just those rows. A glob lists one level and no
    folder, and a folder's listing takes images only and follows no symlinked folder,
    so the earlier rows of the files they leave out stay. Each id has one row."""
    monkeypatch.chdir(tmp_path)
    _tree(tmp_path)
    out = tmp_path / out
    for inputs in runs:
        err = _run(det_server, inputs, out, capsys, *FLAGS)
    ids = _stack_ids(out) if out.name.endswith("npy") else _ids(out)
    assert {i[len("imgs/"):] for i in ids} == want, (ids, err)
    assert ("of its rows are of files this run writes" in err) is pruned, err
    if len(runs) == 3:   # the shards the middle run pruned are done again, not trusted
        assert "a run of other inputs removed some of its rows; it is done again" in err
    again = _run(det_server, runs[-1], out, capsys, *FLAGS)   # settled: nothing to do
    assert "shards done 0," in again and "rows are removed" not in again, again


def _stack_ids(out) -> list[str]:
    """Row ids of a sharded npy stack, checked against its arrays' lengths."""
    import json

    import numpy as np

    ids = []
    for sid in sorted(p for p in os.listdir(out) if not p.startswith("_")):
        rows = [json.loads(line)["id"] for line in (out / sid / "index.jsonl").read_text()
                .splitlines()]
        for arr in (out / sid).glob("*.npy"):
            assert len(np.load(arr)) == len(rows), arr
        ids += rows
    assert len(ids) == len(set(ids)), ids
    return sorted(ids)


def test_a_parquet_file_split_otherwise_keeps_one_row_per_image(det_server, tmp_path,
                                                                capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    flags = ("--image-column", "image", "--shard-bytes", "3000")

    def write(n: int, group: int) -> None:
        images = [encode(rand_image(32, 32, seed=320 + i)) for i in range(n)]
        pq.write_table(pa.table({"image": images}), path, row_group_size=group)

    out = tmp_path / "o.parquet"
    for n, group in ((2, 2), (4, 2), (3, 3)):   # one shard, two row groups, one again
        write(n, group)
        _run(det_server, [path], out, capsys, *flags)
        assert _ids(out) == sorted(f"{path}#{i}" for i in range(n))


def test_only_inputs_that_may_share_ids_have_their_parts_read():
    from hookserve.batch.earlier_shards import _may_share

    for src, specs, want in [("imgs/d0", ["imgs"], True), ("imgs", ["imgs/d0/*.png"], True),
                             ("a", ["b"], False), ("imgs2", ["imgs"], False),
                             ("list.txt", ["b"], True), ("a", ["paths.csv"], True),
                             ("s3://x/a", ["s3://x/a/b"], True), ("s3://x/a", ["s3://x/b"],
                                                                   False),
                             ("a", ["*.png"], True)]:
        assert _may_share(src, specs) is want, (src, specs)


def test_a_new_file_named_like_an_earlier_id_is_extracted(det_server, tmp_path, capsys):
    """caf\\xe9.png has the id caf%E9.png, which an earlier version gave the valid name
    caf%E9.png: a local run that finds that id must not take it for the new file's."""
    d = tmp_path / "enc"
    d.mkdir()
    with open(os.fsencode(d) + b"/caf\xe9.png", "wb") as fh:
        fh.write(encode(rand_image(32, 32, seed=330)))
    out = tmp_path / "o.parquet"
    _run(det_server, [d], out, capsys)
    (d / "caf%E9.png").write_bytes(encode(rand_image(32, 32, seed=331)))
    err = _run(det_server, [d], out, capsys)
    assert "done 1, skipped 1, failed 0" in err, err


def test_tar_member_ids_are_escaped_and_give_the_name_back(det_server, tmp_path, capsys):
    from hookserve.batch import decode_name

    img = encode(rand_image(32, 32, seed=332))
    names = ["caf\udce9.png", "caf%E9.png", "pct%2541.png", "plain.png"]
    tar = tmp_path / "t.tar"
    tar.write_bytes(tar_bytes([(n, img) for n in names]))
    out = tmp_path / "o.parquet"
    _run(det_server, [tar], out, capsys)
    ids = _ids(out)
    assert sorted(decode_name(i) for i in ids) == sorted(
        os.fsencode(f"{tar}/{n}") for n in names)


def test_a_parquet_file_named_with_percent_split_otherwise_keeps_one_row(det_server,
                                                                          tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p%25.parquet"
    flags = ("--image-column", "image", "--shard-bytes", "3000")
    out = tmp_path / "o.parquet"
    for n, group in ((2, 2), (4, 2)):
        images = [encode(rand_image(32, 32, seed=340 + i)) for i in range(n)]
        pq.write_table(pa.table({"image": images}), path, row_group_size=group)
        _run(det_server, [path], out, capsys, *flags)
        assert _ids(out) == sorted(f"{path}#{i}" for i in range(n))


def test_a_tar_gone_from_the_current_folder_loses_its_rows(det_server, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    for t in ("a", "b"):
        (tmp_path / f"{t}.tar").write_bytes(tar_bytes(
            [(f"{t}.png", encode(rand_image(32, 32, seed=350 + len(t))))]))
    out = tmp_path.parent / f"{tmp_path.name}-out.parquet"
    _run(det_server, ["."], out, capsys, "--sharded")
    (tmp_path / "a.tar").unlink()
    err = _run(det_server, ["."], out, capsys, "--sharded")
    assert _ids(out) == ["b.tar/b.png"], err


def test_a_glob_on_a_store_spells_ids_as_its_folder_does(det_server, tmp_path, capsys):
    import fsspec

    fs = fsspec.filesystem("memory")
    for i in range(3):
        fs.pipe(f"/gl{os.getpid()}/imgs/{i}.png", encode(rand_image(32, 32, seed=360 + i)))
    base = f"memory://gl{os.getpid()}/imgs"
    out = tmp_path / "o.parquet"
    for spec in (base, base + "/*.png"):
        _run(det_server, [spec], out, capsys, *FLAGS)
        assert _ids(out) == [f"{base}/{i}.png" for i in range(3)]


def test_a_listing_that_missed_a_folder_removes_no_earlier_rows(det_server, tmp_path,
                                                                capsys, monkeypatch):
    """A folder that cannot be listed leaves its input's shards as they were: their
    files listed now are not taken as this run's, so no earlier shard of them goes."""
    import hookserve.batch.shard_plan as plan

    imgs = tmp_path / "imgs"
    _images(imgs, 1, 370)
    out = tmp_path / "o.parquet"
    one = ("--sharded", "--listing-shards", "1")
    _run(det_server, [imgs], out, capsys, *one)
    _images(imgs, 1, 371, "d0")
    (imgs / "locked").mkdir()
    _run(det_server, [imgs / "d0"], out, capsys, *one)
    walk = os.walk

    def unreadable(top, onerror=None, **kw):   # as an unreadable folder lists
        for entry in walk(top, onerror=onerror, **kw):
            if entry[0].endswith("locked") and onerror is not None:
                onerror(PermissionError(13, "Permission denied", entry[0]))
                continue
            yield entry
    monkeypatch.setattr(plan.os, "walk", unreadable)
    err = _run(det_server, [imgs], out, capsys, *one)
    assert "rows are removed" not in err, err
    assert _ids(out) == sorted([f"{imgs}/00.png", f"{imgs}/d0/00.png"])


def test_a_torn_earlier_shard_is_kept_not_fatal(det_server, tmp_path, capsys):
    import numpy as np

    imgs = tmp_path / "imgs"
    _images(imgs, 3, 380)
    out = tmp_path / "o_npy"
    one = ("--sharded", "--listing-shards", "1")
    _run(det_server, [imgs], out, capsys, *one)
    (sid,) = [p for p in os.listdir(out) if not p.startswith("_")]
    arr = np.load(out / sid / "fc.npy")
    np.save(out / sid / "fc.npy", arr[:2])   # as a write cut short leaves it
    err = _run(det_server, [imgs / "00.png"], out, capsys, *one)
    assert "could not be written again without them" in err and "kept" in err, err


def test_tar_members_on_a_store_get_ids_of_their_own(det_server, tmp_path, capsys):
    import fsspec

    img = encode(rand_image(32, 32, seed=390))
    url = f"memory://tm{os.getpid()}/t.tar"
    fsspec.filesystem("memory").pipe(url[len("memory:/"):], tar_bytes(
        [("caf\udce9.png", img), ("caf%E9.png", img)]))
    out = tmp_path / "o.parquet"
    _run(det_server, [url], out, capsys)
    assert _ids(out) == [f"{url}/caf%25E9.png", f"{url}/caf%E9.png"]
