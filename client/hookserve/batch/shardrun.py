"""Sharded runs of `hookserve batch`, one shard at a time: extract it, publish its part.

A run is sharded when an input is a URL, a tar or a list of URLs, when
``--image-column`` is given, when ``--out`` is a URL, or with ``--sharded``. Then:

- planning lists each input once and cuts it into shards (:mod:`.shards`);
  ``--shard I/N`` keeps whole shards; the output folder is listed once;
- each shard not yet done is extracted (:func:`extract_shard`), its rows are built
  into one part locally, the part is published whole (rename, or one upload), then its
  errors file, then, **only when every input of the shard is accounted for**, its done
  marker ``_done-<sid>.json``, which records the part's files and sizes. Accounted for:
  the container was read to its proper end, and every image has a row or a *final*
  error row (:func:`~.errors.is_final`). Any other failure (not found, network, a
  missing extra, overload, a cut container) leaves the shard without a marker: the run
  exits 3 naming it, and the next run does it again;
- a shard with a marker is skipped only when the marker is valid: it parses, names
  this shard, and every file it records is there with its recorded size. Otherwise the
  marker is deleted and the shard done again; a part is rewritten with the same name
  and the same rows;
- workers with different ``--shard`` share one ``--out`` with no lock: each writes only
  its own shards' files. Files that are not parts start with ``_`` so that pyarrow,
  pandas and Spark read a ``.parquet`` folder as a dataset.

:mod:`.sharded` runs the shards of a command, and has :func:`~.sharded.run_shard`, which
does one shard for any scheduler (Ray, Spark, Dask, a Slurm array).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import __version__, errors, wire
from .errors import is_final
from .intake import Intake
from .limits import ByteBudget, LastRequest
from .remote import Location, expand_braces, is_url
from .scheduler import RETRY_STREAM, backoff, retryable
from .shards import Shard, entries, is_tar
from .sinks import format_of
from .sinks.base import OutputError, check_meta, need
from .sinks.parquet import write_table
from .streamcall import Watchdog, extract_many

META = "_hookserve.json"


def wants_shards(args: argparse.Namespace) -> bool:
    """Whether `args` describe a sharded run (see the module doc)."""
    if getattr(args, "sharded", False) or getattr(args, "image_column", None):
        return True
    if is_url(args.out):
        return True
    return any(is_url(s) or any(is_tar(x) or _lists_urls(x, args) for x in expand_braces(s))
               for s in args.inputs)


def _lists_urls(path: str, args) -> bool:
    """A local list or path table with a URL in it."""
    from .inputs import InputError, listed_paths

    try:
        names = listed_paths(path, getattr(args, "path_column", "path"))
    except (OSError, InputError):
        return False  # the plain run names the problem
    return any(is_url(n) for n in names or ())


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
    """The output folder of a sharded run: a Parquet dataset (``.parquet``) or a folder
    of ``.npy`` parts (anything else), local or remote."""

    def __init__(self, out: str, meta: dict, storage_options: dict | None = None) -> None:
        self.fmt = format_of(out)
        if self.fmt == "h5":
            raise OutputError("a sharded run writes a .parquet dataset or a .npy folder "
                              "(many workers share one --out), not .h5")
        if self.fmt == "parquet":
            need("pyarrow.parquet", "Parquet")
        self.loc = Location(out, storage_options)
        self.meta = meta
        self._files: dict[str, int] | None = None
        #: why markers were not trusted (printed by the run)
        self.notes: list[str] = []

    def open(self) -> None:
        """Check the settings of an existing output, or write them (no lock: every
        worker of one output writes the same settings)."""
        text = self.loc.read_text(META)
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
        marker reads). An invalid one is noted in :attr:`notes`."""
        files = self.files()
        named = {f"_done-{s.sid}.json": s for s in shards if f"_done-{s.sid}.json" in files}
        texts = self.loc.read_many(sorted(named))
        ok = set()
        for name, shard in named.items():
            why = _invalid_marker(texts.get(name), shard, files, self.fmt)
            if why is None:
                ok.add(shard.sid)
            else:
                self.notes.append(f"shard {shard.key}: {why}; it is done again")
        return ok

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
                    self._npy(rows, local)
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
        self.loc.put_text(f"_done-{sid}.json", json.dumps(marker, sort_keys=True) + "\n")
        return result

    def _parquet(self, rows: list, path: str) -> None:
        write_table(path, {"id": ("string", [r[0] for r in rows]),
                           "sha256": ("string", [r[1] for r in rows])},
                    [r[2] for r in rows], self.meta)

    def _npy(self, rows: list, folder: str) -> None:
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


def _invalid_marker(text: bytes | None, shard: Shard, files: dict[str, int],
                    fmt: str) -> str | None:
    """Why a done marker cannot be trusted, or None when it can."""
    try:
        marker = json.loads(text) if text is not None else None
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        return "its done marker is unreadable"
    if marker.get("shard") != shard.key:
        return "its done marker names another shard"
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


def extract_shard(client, shard: Shard, layers, opts: dict, *, model: str | None,
                  retries: int = 5, window: int = 64, read: dict | None = None,
                  budget: ByteBudget | None = None, watchdog: Watchdog | None = None
                  ) -> tuple[list, list]:
    """Every image of `shard` through one stream, then passes for retries (and after a
    full byte budget). -> (rows [(id, sha256, features)], failures [(id, code,
    message)]), in shard order.

    Per-image UNAVAILABLE and overload answers are sent again (up to `retries` times,
    after the server's hint or a backoff); when the stream fails as a whole, its
    unanswered images are, and the shard's remaining images follow in the next pass.
    Only the images in flight and the retries hold their bytes.
    """
    intake = Intake(entries(shard, **(read or {})), budget or ByteBudget())
    watchdog = watchdog or Watchdog(None)
    done: dict[int, tuple] = {}
    todo: deque = deque()          # (pos, id, data, attempts) to send again
    failed_passes = 0
    try:
        while True:
            retry: list = []
            sent: dict[str, tuple] = {}
            ids: deque[str] = deque()
            last = LastRequest(intake.release)

            def images(sent=sent, ids=ids, last=last):
                while True:
                    if todo:
                        pos, iid, data, att = todo.popleft()
                    else:
                        # Wait for budget only before this stream's first image: later,
                        # end the pass (gRPC lets go of its last request) and wait then.
                        got = intake.next(may_wait=last.key is None)
                        if got is None:
                            return
                        (pos, iid, data), got = got, None
                        att = 0
                        if isinstance(data, errors.HookserveError):  # could not be read
                            done[pos] = (iid, data)
                            continue
                        # Once encoded, the payload is a view of its request: the read
                        # buffer is freed, the input held once (retries included).
                        data = wire.Payload(data)
                    sid = f"{pos}#{att}"  # unique per stream, also for a retry
                    sent[sid] = (pos, iid, data, att)
                    ids.append(sid)
                    last.handed(sid)
                    yield data

            answered = 0
            try:
                for r in extract_many(client, images(), layers, model=model,
                                      ids=iter(ids.popleft, None), window=window,
                                      watchdog=watchdog, **opts):
                    answered += 1
                    pos, iid, data, att = sent.pop(r.id)
                    if r.error is not None and retryable(r.error) and att < retries:
                        retry.append((r.error.retry_after_s or backoff(att + 1),
                                      (pos, iid, data, att + 1)))
                    else:
                        if not last.answered(r.id, len(data)):
                            intake.release(len(data))
                        done[pos] = (iid, r.error if r.error is not None else
                                     (hashlib.sha256(data.data).hexdigest(), r.features))
                    del data  # an answered input is held no longer than its budget
            except errors.HookserveError as exc:
                failed_passes = 0 if answered else failed_passes + 1
                if exc.code not in RETRY_STREAM or failed_passes > retries:
                    raise
                for pos, iid, data, att in sent.values():  # unanswered: send again
                    if att >= retries:
                        intake.release(len(data))
                        done[pos] = (iid, exc)
                    else:
                        retry.append((backoff(att + 1), (pos, iid, data, att + 1)))
                data = None
                if not retry:
                    time.sleep(backoff(failed_passes))
            finally:
                last.let_go()  # the pass's stream is over
            if retry:
                time.sleep(max(d for d, _ in retry))  # back off before the retry pass
                todo.extend(item for _, item in sorted(retry, key=lambda x: x[1][0]))
            elif intake.exhausted and not todo:
                break
    finally:
        intake.close()
    rows, fails = [], []
    for pos in sorted(done):
        iid, res = done[pos]
        if isinstance(res, errors.HookserveError):
            fails.append((iid, res.code.name, res.message))
        else:
            rows.append((iid, res[0], dict(res[1])))
    return rows, fails
