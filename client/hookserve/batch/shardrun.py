"""Sharded runs of `hookserve batch`, one shard at a time: extract it, publish its part.

A run is sharded when an input is a URL or a ``.tar``, when ``--image-column`` is given,
when ``--out`` is a URL, or with ``--sharded``. Then:

- planning lists each input once and cuts it into shards (:mod:`.shards`);
  ``--shard I/N`` keeps whole shards; the output folder is listed once for markers;
- each shard not yet done is extracted, its rows are built into one part locally,
  the part is published whole (rename, or one upload), then its errors file, then its
  done marker ``_done-<sid>.json``. A shard with a marker is skipped, so re-running
  (after kill -9, or on another worker) is idempotent; a part without a marker is
  rewritten with the same name and the same rows;
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

from .. import __version__, errors
from .remote import Location, expand_braces, is_url
from .scheduler import RETRY_STREAM, backoff, retryable
from .shards import Shard, entries
from .sinks import format_of
from .sinks.base import OutputError, check_meta
from .sinks.parquet import write_table

META = "_hookserve.json"


def wants_shards(args: argparse.Namespace) -> bool:
    """Whether `args` describe a sharded run (see the module doc)."""
    if getattr(args, "sharded", False) or getattr(args, "image_column", None):
        return True
    if is_url(args.out):
        return True
    return any(is_url(s) or any(x.lower().endswith(".tar") for x in expand_braces(s))
               for s in args.inputs)


@dataclass
class ShardResult:
    """What one shard's run did."""

    key: str
    rows: int = 0
    failed: int = 0
    skipped: bool = False   # its marker was already there
    part: str | None = None


class ShardOutput:
    """The output folder of a sharded run: a Parquet dataset (``.parquet``) or a folder
    of ``.npy`` parts (anything else), local or remote."""

    def __init__(self, out: str, meta: dict, storage_options: dict | None = None) -> None:
        self.fmt = format_of(out)
        if self.fmt == "h5":
            raise OutputError("a sharded run writes a .parquet dataset or a .npy folder "
                              "(many workers share one --out), not .h5")
        self.loc = Location(out, storage_options)
        self.meta = meta
        self._names: set[str] | None = None

    def open(self) -> None:
        """Check the settings of an existing output, or write them (no lock: every
        worker of one output writes the same settings)."""
        text = self.loc.read_text(META)
        if text is not None:
            check_meta(json.loads(text), self.meta, f"{self.loc}/{META}")
        else:
            self.loc.put_text(META, json.dumps(self.meta, indent=2, sort_keys=True) + "\n")

    def done(self) -> set[str]:
        """The sids of shards with a done marker (one listing, kept for the run)."""
        if self._names is None:
            self._names = self.loc.names()
        return {n[len("_done-"):-len(".json")] for n in self._names
                if n.startswith("_done-") and n.endswith(".json")}

    def publish(self, shard: Shard, rows: list, fails: list) -> ShardResult:
        """Write the shard's part, its errors file (if any), then its marker."""
        sid = shard.sid
        part = None
        with tempfile.TemporaryDirectory(prefix="hookserve-part-") as tmp:
            if rows:
                if self.fmt == "parquet":
                    part = f"part-{sid}.parquet"
                    self._parquet(rows, os.path.join(tmp, part))
                    self.loc.put_file(os.path.join(tmp, part), part)
                else:
                    part = sid
                    self._npy(rows, os.path.join(tmp, sid))
                    self.loc.put_tree(os.path.join(tmp, sid), sid)
        if fails:
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(["id", "code", "message"])
            w.writerows(fails)
            self.loc.put_text(f"_errors-{sid}.csv", buf.getvalue())
        marker = {"shard": shard.key, "part": part, "rows": len(rows), "failed": len(fails),
                  "errors": f"_errors-{sid}.csv" if fails else None,
                  "hookserve_version": __version__}
        self.loc.put_text(f"_done-{sid}.json", json.dumps(marker, sort_keys=True) + "\n")
        return ShardResult(shard.key, len(rows), len(fails), False, part)

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


def extract_shard(client, shard: Shard, layers, opts: dict, *, model: str | None,
                  retries: int = 5, window: int = 64, read: dict | None = None
                  ) -> tuple[list, list]:
    """Every image of `shard` through one stream, then passes for retries.
    -> (rows [(id, sha256, features)], failures [(id, code, message)]), in shard order.

    Per-image UNAVAILABLE and overload answers are sent again (up to `retries` times,
    after the server's hint or a backoff); when the stream fails as a whole, its
    unanswered images are, and the shard's remaining images follow in the next pass.
    Only the images in flight and the retries hold their bytes.
    """
    source = enumerate(entries(shard, **(read or {})))
    done: dict[int, tuple] = {}
    todo: deque = deque()          # (pos, id, data, attempts) to send again
    exhausted = False
    failed_passes = 0
    while True:
        retry: list = []
        sent: dict[str, tuple] = {}
        ids: deque[str] = deque()

        def images(sent=sent, ids=ids):
            nonlocal exhausted
            while True:
                if todo:
                    pos, iid, data, att = todo.popleft()
                elif exhausted:
                    return
                else:
                    try:
                        pos, (iid, data) = next(source)
                    except StopIteration:
                        exhausted = True
                        return
                    att = 0
                    if isinstance(data, errors.HookserveError):  # could not be read
                        done[pos] = (iid, data)
                        continue
                sid = f"{pos}#{att}"  # unique per stream, also for a retry
                sent[sid] = (pos, iid, data, att)
                ids.append(sid)
                yield data

        answered = 0
        try:
            for r in client.extract_many(images(), layers, model=model,
                                         ids=iter(ids.popleft, None), max_in_flight=window,
                                         **opts):
                answered += 1
                pos, iid, data, att = sent.pop(r.id)
                if r.error is not None and retryable(r.error) and att < retries:
                    retry.append((r.error.retry_after_s or backoff(att + 1),
                                  (pos, iid, data, att + 1)))
                else:
                    done[pos] = (iid, r.error if r.error is not None else
                                 (hashlib.sha256(data).hexdigest(), r.features))
        except errors.HookserveError as exc:
            failed_passes = 0 if answered else failed_passes + 1
            if exc.code not in RETRY_STREAM or failed_passes > retries:
                raise
            for pos, iid, data, att in sent.values():  # unanswered: send again
                if att >= retries:
                    done[pos] = (iid, exc)
                else:
                    retry.append((backoff(att + 1), (pos, iid, data, att + 1)))
            if not retry:
                time.sleep(backoff(failed_passes))
        if retry:
            time.sleep(max(d for d, _ in retry))  # back off before the retry pass
            todo.extend(item for _, item in sorted(retry, key=lambda x: x[1][0]))
        elif exhausted and not todo:
            break
    rows, fails = [], []
    for pos in sorted(done):
        iid, res = done[pos]
        if isinstance(res, errors.HookserveError):
            fails.append((iid, res.code.name, res.message))
        else:
            rows.append((iid, res[0], dict(res[1])))
    return rows, fails
