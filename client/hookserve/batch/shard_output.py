"""The output folder of a sharded run: each shard's part, errors file and done marker.

A shard's rows are built into one part locally and published whole (rename, or one
upload), then its errors file, then, **only when every input of the shard is accounted
for**, its done marker ``_done-<sid>.json``, which records the part's files and sizes
(:meth:`ShardOutput.publish`), and what the shard's input was: for a listing shard a
digest of its files (`Shard.members`), for a tar or Parquet shard its file's size and
version (:mod:`.stamps`, taken before the shard is read). A marker is trusted only when
it parses, names its shard, records the input the shard has now, and every file it
records is there with its recorded size (:meth:`ShardOutput.done`); otherwise it is
deleted and the shard done again.

Two layouts, by the extension of ``--out``: a Parquet dataset (``part-<sid>.parquet``
per shard), or an **npy stack** folder: per shard a folder ``<sid>/`` with
``index.jsonl`` and one ``<layer>.npy`` of shape ``[rows, ...]`` per layer. (The local
run's ``.npy`` output is another layout: one file per image and layer,
:mod:`.sinks.npy`.) Files that are not parts start with ``_`` so that pyarrow, pandas
and Spark read a ``.parquet`` folder as a dataset.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from .. import __version__
from .errors import is_final
from .remote import Location
from .shard_plan import Shard
from .sinks import format_of
from .sinks.base import OutputError, check_meta, need
from .sinks.parquet import write_table
from .stamps import stamps

META = "_hookserve.json"
#: The layout of a sharded run's ``.npy`` output: one ``[rows, ...]`` array per layer
#: and shard (not :mod:`.sinks.npy`'s file per image).
NPY_STACK = "npy-stack"


@dataclass
class ShardResult:
    """What one shard's run did."""

    key: str
    rows: int = 0
    failed: int = 0
    skipped: bool = False   # its marker was already there
    part: str | None = None
    #: every input accounted for: the marker was written
    complete: bool = True
    #: the first failure that keeps the shard open ("CODE: message"), when not complete
    reason: str = ""


class ShardIncomplete(Exception):
    """A shard has inputs a rerun may still read (see :class:`ShardResult` `.reason`):
    it got no done marker. Run it again."""

    def __init__(self, result: ShardResult) -> None:
        super().__init__(f"shard {result.key} is not finished: {result.reason}")
        self.result = result


class ShardOutput:
    """The output folder of a sharded run: a Parquet dataset (``.parquet``) or an npy
    stack (anything else), local or remote."""

    def __init__(self, out: str, meta: dict, storage_options: dict | None = None) -> None:
        #: "parquet" or :data:`NPY_STACK`
        self.fmt = _layout(out)
        if self.fmt == "h5":
            raise OutputError("a sharded run writes a .parquet dataset or a .npy folder "
                              "(many workers share one --out), not .h5")
        if self.fmt == "parquet":
            need("pyarrow.parquet", "Parquet")
        self.loc = Location(out, storage_options)
        self.opts = storage_options or {}
        self.meta = meta
        #: tar or Parquet file -> its stamp when its shards were checked (:meth:`done`)
        self.stamps: dict[str, str] = {}
        self._files: dict[str, int] | None = None
        #: why markers were not trusted (printed by the run)
        self.notes: list[str] = []
        #: the error rows of the shards :meth:`done` found done (an earlier run's)
        self.failed_before = 0

    def open(self) -> None:
        """Check the settings of an existing output, or write them (no lock: every
        worker of one output writes the same settings)."""
        text = self.loc.read_text(META)
        if text is None and self.fmt == NPY_STACK and \
                self.loc.read_text("hookserve.json") is not None:
            raise OutputError(f"{self.loc} holds a local run's .npy files (hookserve.json), "
                              "one file per image and layer: a sharded run needs another "
                              "--out (or run without --sharded to add to it)")
        if text is not None:
            check_meta(json.loads(text), self.meta, f"{self.loc}/{META}")
        else:
            self.loc.put_text(META, json.dumps(self.meta, indent=2, sort_keys=True) + "\n")

    def files(self) -> dict[str, int]:
        """Every file of the output (name -> size), from one listing kept for the run."""
        if self._files is None:
            self._files = self.loc.listing()
        return self._files

    def done(self, shards: list[Shard]) -> set[str]:
        """The sids of `shards` with a valid done marker (one listing and one batch of
        marker reads), after stamping their tar and Parquet files (:mod:`.stamps`; the
        stamps are kept for :meth:`publish`). An invalid marker is noted in
        :attr:`notes`; a valid one from before markers recorded their shard's input gets
        it now (one write, once)."""
        self.stamps.update(stamps({s.source for s in shards if s.kind != "files"}
                                  - set(self.stamps), self.opts))
        files = self.files()
        named = {f"_done-{s.sid}.json": s for s in shards if f"_done-{s.sid}.json" in files}
        texts = self.loc.read_many(sorted(named))
        ok = set()
        for name, shard in named.items():
            why = _invalid_marker(texts.get(name), shard, self._input(shard), files,
                                  self.fmt)
            if why is not None:
                self.notes.append(f"shard {shard.key}: {why}; it is done again")
                continue
            ok.add(shard.sid)
            marker = json.loads(texts[name])
            failed = marker.get("failed")
            self.failed_before += failed if isinstance(failed, int) else 0
            if not marker.keys() & {"members", "stamp"} and self._input(shard):
                marker.update(self._input(shard))
                self.loc.put_text(name, json.dumps(marker, sort_keys=True) + "\n")
        return ok

    def _input(self, shard: Shard) -> dict[str, str]:
        """What the shard's marker records of its input (see the module doc); empty
        when that is unknown (a listing that missed a folder, a file not stamped)."""
        if shard.kind == "files":
            return {} if shard.members is None else {"members": shard.members}
        stamp = self.stamps.get(shard.source)
        return {} if stamp is None else {"stamp": stamp}

    def retire(self, shards: list[Shard], why: str = "no file of the input is in it any "
               "more") -> None:
        """Remove the part, errors file and marker of shards an earlier run wrote, which
        hold no file of the inputs now (`shard_plan.vanished`), or that
        :func:`.earlier_shards.settle` found this run need not keep; noted in
        :attr:`notes`."""
        tops = _tops(self.files())
        for shard in shards:
            names = _owned(shard.sid, self.fmt, tops)
            if not names:
                continue
            for name in names:   # the marker last: a kill leaves a shard to retire again
                self.loc.delete(name)
            self.notes.append(f"shard {shard.key}: {why}; its rows are removed")

    def row_ids(self, sid: str) -> set[str] | None:
        """The ids of shard `sid`'s rows and error rows in the output (its part's id
        column or index, and its errors file); None when they cannot be read."""
        files, ids = self.files(), set()
        try:
            if self.fmt == "parquet" and f"part-{sid}.parquet" in files:
                pq = need("pyarrow.parquet", "Parquet")
                where = f"{self.loc.path}/part-{sid}.parquet" if self.loc.remote else \
                    os.path.join(self.loc.path, f"part-{sid}.parquet")
                ids.update(pq.read_table(where, columns=["id"], filesystem=self.loc.fs)
                           .column("id").to_pylist())
            names = [n for n in (f"{sid}/index.jsonl", f"_errors-{sid}.csv") if n in files]
            texts = self.loc.read_many(names)
            for name in names:
                text = (texts.get(name) or b"").decode("utf-8")
                if name.endswith(".jsonl"):
                    ids.update(json.loads(line)["id"] for line in text.splitlines() if line)
                else:
                    ids.update(row[0] for row in list(csv.reader(io.StringIO(text)))[1:]
                               if row)
        except Exception:  # noqa: BLE001 - a part that cannot be read: judged unknown
            return None
        return ids

    def others(self, planned: set[str]) -> list[str]:
        """The keys of the finished shards in the output that are not among `planned`
        (sids): shards of inputs this run does not name, or names otherwise."""
        names = sorted(n for n in self.files() if n.startswith("_done-")
                       and n.endswith(".json") and n[6:-5] not in planned)
        keys = []
        for text in self.loc.read_many(names).values():
            try:
                key = json.loads(text).get("shard") if text is not None else None
            except (ValueError, AttributeError):
                key = None
            if isinstance(key, str):
                keys.append(key)
        return keys

    def forget(self, shard: Shard) -> None:
        """Delete the shard's marker (an invalid one, before the shard is redone)."""
        if f"_done-{shard.sid}.json" in self.files():
            self.loc.delete(f"_done-{shard.sid}.json")

    def publish(self, shard: Shard, rows: list, fails: list) -> ShardResult:
        """Write the shard's part and errors file; then its marker, when every failure
        is final. Files an earlier try left that this one does not write are removed."""
        sid = shard.sid
        part, written = None, {}
        with tempfile.TemporaryDirectory(prefix="hookserve-part-") as tmp:
            if rows:
                part = f"part-{sid}.parquet" if self.fmt == "parquet" else sid
                local = os.path.join(tmp, part)
                if self.fmt == "parquet":
                    self._parquet(rows, local)
                    written[part] = os.path.getsize(local)
                    self.loc.put_file(local, part)
                else:
                    self._npy_stack(rows, local)
                    for f in sorted(os.listdir(local)):
                        written[f"{sid}/{f}"] = os.path.getsize(os.path.join(local, f))
                    self.loc.put_tree(local, sid)
        if fails:
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(["id", "code", "message"])
            w.writerows(fails)
            self.loc.put_text(f"_errors-{sid}.csv", buf.getvalue())
        open_ = [f for f in fails if not is_final(f[1])]
        result = ShardResult(shard.key, len(rows), len(fails), False, part, not open_,
                             f"{open_[0][1]}: {open_[0][2]}" if open_ else "")
        if open_:
            return result
        stale = [f"_errors-{sid}.csv"] if not fails else []
        stale += [] if rows else [f"part-{sid}.parquet" if self.fmt == "parquet" else sid]
        for name in stale:
            if self._files is None or any(n == name or n.startswith(name + "/")
                                          for n in self._files):
                self.loc.delete(name)
        marker = {"shard": shard.key, "part": part, "files": written, "rows": len(rows),
                  "failed": len(fails), "errors": f"_errors-{sid}.csv" if fails else None,
                  "hookserve_version": __version__}
        marker.update(self._input(shard))
        self.loc.put_text(f"_done-{sid}.json", json.dumps(marker, sort_keys=True) + "\n")
        return result

    def _parquet(self, rows: list, path: str) -> None:
        write_table(path, {"id": ("string", [r[0] for r in rows]),
                           "sha256": ("string", [r[1] for r in rows])},
                    [r[2] for r in rows], self.meta)

    def _npy_stack(self, rows: list, folder: str) -> None:
        os.makedirs(folder)
        with open(os.path.join(folder, "index.jsonl"), "w", encoding="utf-8") as fh:
            for i, r in enumerate(rows):
                fh.write(json.dumps({"row": i, "id": r[0], "sha256": r[1]}) + "\n")
        for layer in rows[0][2]:
            arrays = [np.asarray(r[2][layer]) for r in rows]
            if len({a.shape for a in arrays}) != 1:
                raise OutputError(f"layer {layer}: images of one shard have different shapes "
                                  "(--native): add --reduction avg|max")
            np.save(os.path.join(folder, f"{layer}.npy"), np.stack(arrays))


def present(out: str, shards: list[Shard], storage_options: dict | None = None
            ) -> list[Shard]:
    """The shards among `shards` with any file in the output `out` (one listing)."""
    if not shards:
        return []
    fmt, tops = _layout(out), _tops(Location(out, storage_options).listing())
    return [s for s in shards if _owned(s.sid, fmt, tops)]


def _layout(out: str) -> str:
    """The sharded output's layout by `--out`'s extension: "parquet" or NPY_STACK."""
    fmt = format_of(out)
    return NPY_STACK if fmt == "npy" else fmt


def _tops(files: dict[str, int]) -> set[str]:
    """The top-level names of an output listing (files, and the npy stack's folders)."""
    return {n.split("/", 1)[0] for n in files}


def _owned(sid: str, fmt: str, tops: set[str]) -> list[str]:
    """Shard `sid`'s part, errors file and marker among `tops`, the marker last."""
    part = f"part-{sid}.parquet" if fmt == "parquet" else sid
    return [n for n in (part, f"_errors-{sid}.csv", f"_done-{sid}.json") if n in tops]


def _invalid_marker(text: bytes | None, shard: Shard, now: dict[str, str],
                    files: dict[str, int], fmt: str) -> str | None:
    """Why a done marker cannot be trusted, or None when it can."""
    try:
        marker = json.loads(text) if text is not None else None
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        return "its done marker is unreadable"
    if marker.get("shard") != shard.key:
        return "its done marker names another shard"
    if marker.get("pruned"):
        return "a run of other inputs removed some of its rows"
    if "members" in now:
        # A marker from before markers recorded the files: its row and error counts
        # must still add up to the shard's files.
        counts = (marker.get("rows"), marker.get("failed"))
        same = (marker["members"] == now["members"] if "members" in marker else
                all(isinstance(n, int) for n in counts) and sum(counts) == len(shard.files))
        if not same:
            return "its files changed since it was done (added, removed or resized)"
    # (a tar or Parquet marker from before markers recorded a stamp is trusted)
    if "stamp" in now and marker.get("stamp", now["stamp"]) != now["stamp"]:
        return f"{shard.source} was rewritten since it was done"
    recorded = marker.get("files")
    if recorded is None and marker.get("rows"):  # a marker that records no sizes
        part = marker.get("part") or ""
        recorded = {part if fmt == "parquet" else f"{part}/index.jsonl": None}
    for name, size in (recorded or {}).items():
        if name not in files:
            return f"its part file {name} is missing"
        if size is not None and files[name] != size:
            return f"its part file {name} has {files[name]} bytes, the marker says {size}"
    return None
