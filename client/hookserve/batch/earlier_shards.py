"""Finished shards in a sharded output that this run does not plan: an earlier run's,
with its inputs spelled, grouped or split otherwise, or of other inputs.

Each is removed only when nothing is lost by it, since this run writes its rows
elsewhere or its file is gone from this run's inputs (:func:`settle`):

- **its own key spelled otherwise** (``imgs/#0/4`` for ``imgs#0/4``: the same files);
- **a listing shard whose every id this run lists** in its own shards (the rows and
  error rows of its part and errors file are read: ``imgs/d0`` once, ``imgs`` now;
  only for inputs that may share ids: one below the other, or a list of paths);
- **a Parquet file this run splits otherwise** (a whole-file shard, now row groups,
  or the reverse);
- **a tar or Parquet file that is gone** and that this run's inputs would list were it
  there (below a listed folder, or matched by a glob component by component).

A listing shard that shares only some ids with this run (``imgs`` once, ``imgs/*.png``
now, which lists neither ``imgs/sub/`` nor ``imgs/scan.dat``) loses just those rows
(:func:`prune`: its part and errors file are written again without them), so each id
has one row, this run's. Any other is kept: of inputs this run does not name (another
data set written to the same output, a folder since renamed), and the run counts them.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from .inputs import LIST_EXTS, TABLE_EXTS, decode_name, encode_name
from .readers import names_a_tar
from .remote import expand_braces, filesystem, is_url
from .shard_output import ShardOutput
from .shard_plan import PlanReport, Shard, key_input, key_source
from .sinks.base import need


@dataclass
class Earlier:
    """What :func:`settle` did with the finished shards this run does not plan."""

    removed: list[str] = field(default_factory=list)
    #: of inputs this run does not name: kept
    kept: list[str] = field(default_factory=list)
    #: kept without the rows of ids this run writes: shard key -> how many went
    pruned: dict[str, int] = field(default_factory=dict)


def settle(output: ShardOutput, shards: list[Shard], specs: list[str],
           report: PlanReport) -> Earlier:
    """Remove what can go of the finished shards `output` holds that `shards` (the whole
    plan) lacks, as the module doc says; -> what was done."""
    planned = {s.key for s in shards}
    # (a shard whose listing missed a folder keeps its marker as it is: its files now
    # may not be in its part)
    ids = {encode_name(f) for s in shards if s.kind == "files" and s.whole for f in s.files}
    files = {key_input(s.source) for s in shards if s.kind != "files"}   # tars, Parquet
    done = Earlier()
    gone = []
    for key in output.others({s.sid for s in shards}):
        src = key_source(key)
        listing = _is_listing(key, src)
        if listing and not is_url(src):   # (listing keys encode their input; file keys
            src = os.fsdecode(decode_name(src))   # do not)
        if _respelled(key, src, listing) in planned:
            gone.append(key)   # the same shard
        elif listing:
            held = (output.row_ids(Shard(key, "files", src).sid)
                    if _may_share(src, specs) else None)
            if held and held <= ids:
                gone.append(key)
            elif held and held & ids:
                try:
                    done.pruned[key] = prune(output, key, held & ids)
                except Exception as exc:  # noqa: BLE001 - another worker's, or torn
                    output.notes.append(f"shard {key}: holds ids this run writes, and could "
                                        f"not be written again without them ({exc}); kept")
            else:
                done.kept.append(key)
        elif key_input(src) in files:
            gone.append(key)   # a file this run reads, split (or spelled) otherwise
        elif _would_list(src, specs, report) and not _exists(src, output.opts):
            gone.append(key)
        else:
            done.kept.append(key)
    output.retire([Shard(k, "files", k) for k in gone],
                  "its files are this run's, in other shards, or gone")
    done.removed = gone
    return done


def prune(output: ShardOutput, key: str, drop: set[str]) -> int:
    """Write shard `key`'s part and errors file again without the rows whose id is in
    `drop`, then its marker with the new files and counts; -> the rows and error rows
    removed. (The marker says "pruned" first: a kill before the end leaves a shard that a
    run which plans it does again, and that a run which does not keeps or prunes anew.)"""
    loc, files, sid = output.loc, output.files(), Shard(key, "files", key).sid
    name = f"_done-{sid}.json"
    marker = json.loads(loc.read_many([name])[name] or b"{}")
    marker.pop("members", None)   # (it no longer holds its input's files)
    marker["pruned"] = True   # first: a kill below leaves a marker no run trusts as done
    loc.put_text(name, json.dumps(marker, sort_keys=True) + "\n")
    before = after = 0
    written: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="hookserve-prune-") as tmp:
        part = f"part-{sid}.parquet" if output.fmt == "parquet" else sid
        if output.fmt == "parquet" and part in files:
            pq = need("pyarrow.parquet", "Parquet")
            table = pq.read_table(_where(loc, part), filesystem=loc.fs)
            keep = [i not in drop for i in table.column("id").to_pylist()]
            before, table = table.num_rows, table.filter(keep)
            after = table.num_rows
            local = os.path.join(tmp, part)
            pq.write_table(table, local)
            written[part] = os.path.getsize(local)
        elif f"{sid}/index.jsonl" in files:
            after, before = _prune_stack(loc, files, sid, drop, os.path.join(tmp, sid),
                                         written)
        if written and after:
            (loc.put_file if output.fmt == "parquet" else loc.put_tree)(
                os.path.join(tmp, part), part)
        elif before:
            loc.delete(part)
            written = {}
    errs = f"_errors-{sid}.csv"
    text = (loc.read_many([errs]).get(errs) or b"").decode("utf-8") if errs in files else ""
    rows = list(csv.reader(io.StringIO(text)))[1:]
    kept = [r for r in rows if r and r[0] not in drop]
    if len(kept) != len(rows):
        buf = io.StringIO()
        csv.writer(buf).writerows([["id", "code", "message"], *kept])
        if kept:
            loc.put_text(errs, buf.getvalue())
        else:
            loc.delete(errs)
    marker.update(files=written, rows=after, failed=len(kept),
                  part=part if written else None, errors=errs if kept else None)
    loc.put_text(name, json.dumps(marker, sort_keys=True) + "\n")
    return before - after + len(rows) - len(kept)


def _where(loc, name: str) -> str:
    return f"{loc.path}/{name}" if loc.remote else os.path.join(loc.path, name)


def _prune_stack(loc, files: dict, sid: str, drop: set[str], local: str,
                 written: dict[str, int]) -> tuple[int, int]:
    """An npy stack's folder without the rows of `drop`, built in `local`; -> (rows
    kept, rows before)."""
    names = [n for n in files if n.startswith(f"{sid}/")]
    got = loc.read_many(names)
    index = [json.loads(line) for line in (got[f"{sid}/index.jsonl"] or b"")
             .decode("utf-8").splitlines() if line]
    keep = [r["row"] for r in index if r["id"] not in drop]
    os.makedirs(local)
    with open(os.path.join(local, "index.jsonl"), "w", encoding="utf-8") as fh:
        for i, row in enumerate(keep):
            fh.write(json.dumps({**index[row], "row": i}) + "\n")
    for n in names:
        if n.endswith(".npy"):
            arr = np.load(io.BytesIO(got[n] or b""), allow_pickle=False)
            if len(arr) != len(index):   # (a write another run left half done)
                raise ValueError(f"{n} has {len(arr)} rows, its index {len(index)}")
            np.save(os.path.join(local, n[len(sid) + 1:]), arr[keep])
    for f in sorted(os.listdir(local)):
        written[f"{sid}/{f}"] = os.path.getsize(os.path.join(local, f))
    return len(keep), len(index)


def _is_listing(key: str, src: str) -> bool:
    return key != src and not key[len(src):].startswith("#rg=")


def _respelled(key: str, src: str, listing: bool) -> str:
    """`key` (its input `src`, decoded) with its input spelled as this version spells
    it (a listing key encodes it)."""
    spelled = key_input(src)
    return (encode_name(spelled) if listing else spelled) + key[len(key_source(key)):]


def _may_share(src: str, specs: list[str]) -> bool:
    """Whether a listing shard of input `src` may hold ids this run's inputs list: a
    listing's ids are the paths below its input, so inputs apart share none (their
    parts are not read); a list or table of paths may name any."""
    lists = LIST_EXTS | TABLE_EXTS
    path = _stem(key_input(src))
    if os.path.splitext(path)[1].lower() in lists:
        return True
    for spec0 in specs:
        for spec in expand_braces(spec0):
            base = _stem(key_input(spec))
            if os.path.splitext(base)[1].lower() in lists or base in (".", "") or \
                    path in (".", "") or base == path or _below(base, path) or \
                    _below(path, base):
                return True
    return False


def _stem(path: str) -> str:
    """A glob's folder before its first wildcard (``imgs/d0/*.png`` -> ``imgs/d0``)."""
    magic = min((i for i in (path.find(c) for c in "*?[") if i >= 0), default=-1)
    if magic < 0:
        return path
    head = path[:magic]
    return head.rsplit("/", 1)[0] if "/" in head else ""   # ("im*/a.png": no folder)


def _would_list(src: str, specs: list[str], report: PlanReport) -> bool:
    """Whether this run's inputs would list the tar or Parquet file `src` (a key's
    spelling) were it there: below a listed folder, or matched by a glob one path
    component per pattern component (``**`` aside: not judged)."""
    path = key_input(src)
    for spec0 in specs:
        for spec in expand_braces(spec0):
            if spec in report.empty or spec in report.partial:
                continue
            base = key_input(spec)
            if "*" in spec or "?" in spec or "[" in spec:
                if "**" not in base and _glob_match(path, base):
                    return True
            elif names_a_tar(spec) or not (is_url(spec) or os.path.isdir(spec)):
                continue
            elif _below(path, base):
                return True
    return False


def _below(path: str, folder: str) -> bool:
    """Whether `path` lies below `folder` ("." holds every relative path that does not
    climb out of it)."""
    if folder == ".":
        return not (is_url(path) or os.path.isabs(path) or path == ".."
                    or path.startswith("../"))
    return path.startswith(folder.rstrip("/") + "/")


def _glob_match(path: str, pattern: str) -> bool:
    parts, pats = path.split("/"), pattern.split("/")
    return len(parts) == len(pats) and all(
        fnmatch.fnmatchcase(a, p) and (p.startswith(".") or not a.startswith("."))
        for a, p in zip(parts, pats, strict=True))


def _exists(src: str, opts: dict) -> bool:
    """Whether the file is there (when that cannot be told: yes, and it is kept)."""
    try:
        if not is_url(src):
            return os.path.lexists(src)
        fs, path = filesystem(src, opts)
        return bool(fs.exists(path))
    except Exception:  # noqa: BLE001 - a store that cannot say: keep the rows
        return True
