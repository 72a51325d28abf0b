"""`hookserve batch`: bulk, resumable, sharded feature extraction to .h5, .parquet or .npy.

Design (see docs/batch.md for the user's view):

- Inputs are listed, sorted and sharded up front (:mod:`.batch_inputs`); images already
  in the output are skipped.
- ``--streams`` worker threads each run one ``Client.extract_many`` stream fed from a
  shared :class:`_Scheduler`. The scheduler bounds the images taken and not yet written
  (``--max-in-flight``), which bounds memory and what a kill can cost.
- Results go to the main thread, which writes them **in input order** (a reorder buffer
  holds at most the in-flight images). So what is written is always a prefix of the
  work list, and a resumed run produces the same rows in the same order.
- Per-image UNAVAILABLE answers, and RESOURCE_EXHAUSTED ones that carry the server's
  overload retry hint, are retried (after that hint); a RESOURCE_EXHAUSTED without a
  hint (the answer or the image is too big) fails at once; a stream that fails as a
  whole has its unanswered images re-queued.
  The Client itself already moves a broken stream's unanswered images to the next
  server, and the writer ignores a second answer for an image, so nothing is lost or
  written twice.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import heapq
import json
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from . import errors
from .cli import size_arg

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_CANNOT_PROCEED = 2
EXIT_INTERRUPTED = 130

#: Per-image codes worth another try (possibly on another server).
RETRY_IMAGE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _retryable(error) -> bool:
    """UNAVAILABLE, or RESOURCE_EXHAUSTED from overload (it carries a retry hint); the
    size limits' RESOURCE_EXHAUSTED would fail again, so it is final."""
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return error.retry_after_s is not None
    return error.code in RETRY_IMAGE
#: Call-level codes after which the stream's unanswered images are re-queued.
RETRY_STREAM = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
REDUCTIONS = ("none", "avg", "max", "flatten")

EXIT_HELP = f"""\
exit codes:
  {EXIT_OK}    every image was written (or was already in the output)
  {EXIT_SOME_FAILED}    the run finished but some images failed: see the errors file
  {EXIT_CANNOT_PROCEED}    the run could not proceed: bad arguments, no input, no server
       reachable, unknown model/layer, output written with other settings or locked
  {EXIT_INTERRUPTED}  interrupted (SIGINT/SIGTERM): what was done is saved; run again
"""

OUTPUT_HELP = """\
outputs (by the extension of --out):
  .h5 / .hdf5   a dataset per layer [N, ...] plus paths, sha256, size, mtime_ns;
                metadata in attrs. During a run out.h5 is a small virtual file over
                out.h5.parts/; at the end it becomes one self-contained file.
  .parquet      a folder of Parquet parts (one row per image, a fixed-size list
                column per layer; needs 1-D features: --reduction avg|max|flatten).
  otherwise     a folder: <layer>/<path>.npy per image and layer, index.jsonl,
                hookserve.json.

resume: run the same command again. Images already written are skipped (matched by
path, and checked against the file's size and mtime); failed and missing images are
tried again. kill -9 loses at most the images in flight.
"""


class _Abort(Exception):
    """The run cannot proceed; the message says why."""


@dataclass
class _Item:
    pos: int                    # position in the work list = write order
    path: str
    size: int
    mtime_ns: int
    attempts: int = 0
    sha256: str = ""

    def __lt__(self, other: _Item) -> bool:
        return self.pos < other.pos


_DONE = object()


class _Scheduler:
    """The shared work list: hands items to streams, takes them back for retries."""

    def __init__(self, items: list[_Item], max_in_flight: int) -> None:
        self.cond = threading.Condition()
        self.ready = deque(items)
        self.retry: list[tuple[float, _Item]] = []  # heap of (not before, item)
        self.in_flight = 0       # taken and not yet written; retries keep their slot
        self.max_in_flight = max(1, max_in_flight)
        self.remaining = len(items)
        self.stopped = False
        self.stream_failures = 0  # consecutive, reset by any answered image

    def take(self, block: bool):
        """The next item, None when none is available now (block=False), or _DONE."""
        with self.cond:
            while True:
                if self.stopped or self.remaining <= 0:
                    return _DONE
                now = time.monotonic()
                if self.retry and self.retry[0][0] <= now:
                    return heapq.heappop(self.retry)[1]  # already holds a slot
                if self.ready and self.in_flight < self.max_in_flight:
                    self.in_flight += 1
                    return self.ready.popleft()
                if not block:
                    return None
                # Wake on notify (a write freed a slot, a retry was queued, stop) or
                # when the earliest retry is due.
                wait = self.retry[0][0] - now if self.retry else None
                self.cond.wait(timeout=wait)

    def requeue(self, item: _Item, delay: float) -> None:
        with self.cond:
            heapq.heappush(self.retry, (time.monotonic() + delay, item))
            self.cond.notify_all()

    def written(self, n: int) -> None:
        with self.cond:
            self.in_flight -= n
            self.remaining -= n
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def _backoff(attempt: int) -> float:
    return min(5.0, 0.1 * (2 ** attempt)) * (0.5 + random.random() / 2)


class _Feed:
    """The image and id iterables of one extract_many stream.

    extract_many pulls the next image only when its window has room, and calls
    next(ids) right after next(images). The feed must never block while this stream
    has unanswered images (their answers are read by the same thread), so then it
    ends the stream instead; the worker opens a new one.
    """

    def __init__(self, sched: _Scheduler, first: _Item) -> None:
        self.sched = sched
        self.first: _Item | None = first
        self.pending: dict[str, _Item] = {}
        self._ids: deque[str] = deque()

    def images(self):
        while True:
            if self.first is not None:
                item, self.first = self.first, None
            else:
                item = self.sched.take(block=not self.pending)
                if item is None or item is _DONE:
                    return
            # A server rejects an id seen before on the same stream, and a retry may
            # land on the stream that pushed the image back: tag each retry's id.
            sid = item.path if item.attempts == 0 else f"{item.path}#retry{item.attempts}"
            self.pending[sid] = item
            self._ids.append(sid)
            try:
                with open(item.path, "rb") as fh:
                    data = fh.read()
            except OSError:
                yield item.path  # the SDK fails it with a clear "could not read" error
                continue
            item.sha256 = hashlib.sha256(data).hexdigest()
            yield data

    def ids(self):
        while True:
            yield self._ids.popleft()


class _Run:
    """One `hookserve batch` invocation after its arguments are parsed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.fatal: BaseException | None = None
        self.interrupted = False
        self.retried = 0  # images sent again (overload, lost server)

    # -- workers -------------------------------------------------------------------------
    def worker(self, client, sched: _Scheduler, layers, opts: dict, window: int) -> None:
        try:
            while True:
                first = sched.take(block=True)
                if first is _DONE:
                    return
                feed = _Feed(sched, first)
                try:
                    for r in client.extract_many(feed.images(), layers, model=self.args.model,
                                                 ids=feed.ids(), max_in_flight=window,
                                                 **opts):
                        item = feed.pending.pop(r.id, None)
                        if item is None:  # not ours (cannot happen): never write twice
                            continue
                        self._answer(sched, item, r.features, r.error)
                except errors.HookserveError as exc:
                    unanswered = list(feed.pending.values())
                    if exc.code not in RETRY_STREAM:
                        self._fail(exc)
                        return
                    with sched.cond:
                        sched.stream_failures += 1
                        give_up = sched.stream_failures > self.args.retries * 4 + 8
                    if give_up:
                        self._fail(_Abort(f"no server answered after repeated retries: {exc}"))
                        return
                    for item in unanswered:
                        item.attempts += 1
                        if item.attempts > self.args.retries:
                            self.results.put((item, None, exc))
                        else:
                            self.retried += 1
                            sched.requeue(item, _backoff(item.attempts))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self._fail(exc)

    def _answer(self, sched: _Scheduler, item: _Item, features, error) -> None:
        with sched.cond:
            sched.stream_failures = 0
        if error is not None and _retryable(error) and item.attempts < self.args.retries:
            item.attempts += 1
            self.retried += 1
            delay = error.retry_after_s if error.retry_after_s else _backoff(item.attempts)
            sched.requeue(item, delay)
            return
        self.results.put((item, features, error))

    def _fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.results.put(None)  # wake the writer


def _parse_layers(specs: list[str], default_reduction: str, dtype: str = "float32",
                  l2_normalize: bool = False) -> list:
    from .client import Layer

    out, seen = [], set()
    for spec in specs:
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, _, red = part.partition(":")
            red = red or default_reduction
            if red not in REDUCTIONS:
                raise _Abort(f"layer {name}: reduction must be one of {', '.join(REDUCTIONS)}, "
                             f"got {red!r}")
            if name in seen:
                raise _Abort(f"layer {name} is given twice")
            seen.add(name)
            out.append((name, red))
    if not out:
        raise _Abort("give at least one layer with --layers")
    return [Layer(n, r, dtype, l2_normalize) for n, r in out]


class _Progress:
    """A one-line progress bar on stderr (images/s and ETA) and the final summary."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.start = time.monotonic()
        self.last = 0.0
        self.width = 0

    def update(self, done: int, failed: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < 0.2):
            return
        self.last = now
        n = done + failed
        elapsed = max(1e-9, now - self.start)
        rate = n / elapsed
        frac = n / self.total if self.total else 1.0
        eta = (self.total - n) / rate if rate > 0 else float("inf")
        bar = "#" * int(frac * 24)
        eta_s = "--:--" if eta == float("inf") else _hms(eta)
        line = (f"[{bar:<24}] {n}/{self.total} {frac:4.0%}  {rate:6.1f} img/s  "
                f"ETA {eta_s}" + (f"  failed {failed}" if failed else ""))
        pad = max(0, self.width - len(line))
        self.width = len(line)
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.width:
            sys.stderr.write("\n")


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60:02d}:{s % 60:02d}"


def _errors_path(args) -> str:
    return args.errors or (args.out.rstrip("/") + ".errors.csv")


def _make_client(args, addresses: list[str] | None = None):
    from .client import Client

    token = None
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
    return Client(addresses or args.server, timeout=args.timeout, token=token,
                  root_certificates=args.ca, certificate_chain=args.cert,
                  private_key=args.key, retries=max(3, args.retries),
                  max_in_flight=args.max_in_flight)


def _metadata(args, client, layers) -> tuple[dict, dict]:
    """Validate model, layers and servers up front; -> (metadata, extract options)."""
    import hookserve

    crop = args.crop
    # dtype and l2_normalize travel inside each Layer.
    opts = {"native": args.native, "resize": args.resize, "crop": crop}
    try:
        desc = client.describe(args.model, crop)
    except errors.HookserveError as exc:
        raise _Abort(f"cannot describe the model on {', '.join(client.addresses)}: {exc}"
                     ) from None
    names = {li.name for li in desc.layers}
    for layer in layers:
        if layer.name not in names:
            import difflib
            close = difflib.get_close_matches(layer.name, sorted(names), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise _Abort(f"model {desc.model.name} has no layer {layer.name!r}{hint}; "
                         f"`hookserve describe {desc.model.name}` lists them")
    m = desc.model
    # Several servers must compute the same features: compare their weights digests.
    if len(client.addresses) > 1:
        for addr in client.addresses:
            try:
                with _make_client(args, [addr]) as one:
                    other = one.describe(m.name, crop).model
            except errors.HookserveError as exc:
                print(f"warning: {addr}: {exc} (going on with the other servers)",
                      file=sys.stderr)
                continue
            if other.weights_digest != m.weights_digest:
                raise _Abort(f"servers disagree on model {m.name}'s weights: "
                             f"{other.weights_digest[:19]} on {addr} vs "
                             f"{m.weights_digest[:19]}")
    if args.native:
        pre = {"mode": "native"}
    elif args.resize is None and crop is None:
        pre = {"mode": "default", "resize": m.resize, "crop": list(m.crop)}
    else:
        pre = {"mode": "resize_crop", "resize": args.resize or 0,
               "crop": list(crop) if crop else [0, 0]}
    pre.update(mean=list(m.mean), std=list(m.std))
    meta = {
        "format": "hookserve-batch/1",
        "hookserve_version": hookserve.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": m.name,
        "architecture": m.architecture,
        "weights": {"source": m.weights_source, "name": m.weights_name,
                    "digest": m.weights_digest, "pretrained": m.pretrained},
        "layers": [{"name": li.name, "reduction": li.reduction,
                    "l2_normalize": bool(args.l2_normalize)} for li in layers],
        "dtype": args.dtype,
        "preprocessing": pre,
        "shard": args.shard or "0/1",
    }
    if os.path.splitext(args.out.rstrip("/"))[1].lower() == ".parquet":
        for li in layers:
            if li.reduction == "none" and len(desc.layer(li.name).shape) != 1:
                raise _Abort(f"layer {li.name} gives {desc.layer(li.name).shape} per image; "
                             "Parquet takes 1-D features: add --reduction avg|max|flatten "
                             f"(or {li.name}:avg), or write .h5 or a folder")
    if args.native and os.path.splitext(args.out)[1].lower() in (".h5", ".hdf5"):
        for li in layers:
            if li.reduction in ("none", "flatten") and len(desc.layer(li.name).shape) > 1:
                raise _Abort(f"--native gives layer {li.name} a shape that follows each "
                             "image's size; HDF5 needs one shape: use --reduction avg|max, "
                             "or a folder output")
    return meta, opts


def run(args: argparse.Namespace) -> int:
    """Entry point of `hookserve batch`; returns the exit code."""
    try:
        return _run(args)
    except _Abort as exc:
        print(f"hookserve batch: {exc}", file=sys.stderr)
        return EXIT_CANNOT_PROCEED


def _run(args) -> int:
    from .batch_inputs import InputError, discover, parse_shard, select_shard
    from .batch_sinks import OutputError, Record, ShapeMismatch, make_sink

    args.server = [s for s in (args.server or [os.environ.get("HOOKSERVE_SERVER",
                                                              "localhost:50051")])]
    try:
        shard = parse_shard(args.shard) if args.shard else None
        paths = select_shard(discover(args.inputs, path_column=args.path_column,
                                      root=args.root), shard)
    except (InputError, ValueError, OSError) as exc:
        raise _Abort(str(exc)) from None
    layers = _parse_layers(args.layers, args.reduction, args.dtype, args.l2_normalize)

    if args.dry_run:
        return _dry_run(args, paths)
    if not paths:
        raise _Abort("no input images found")

    client = _make_client(args)
    with client:
        meta, opts = _metadata(args, client, layers)
        try:
            sink = make_sink(args.out, meta, checkpoint=args.checkpoint,
                             checkpoint_secs=args.checkpoint_secs,
                             consolidate=args.consolidate)
            sink.open()
        except OutputError as exc:
            raise _Abort(str(exc)) from None

        failures: list[tuple[str, str, str]] = []
        work: list[_Item] = []
        done = sink.done()
        skipped = 0
        for p in paths:
            try:
                st = os.stat(p)
            except OSError as exc:
                failures.append((p, "NOT_FOUND", f"cannot read: {exc.strerror or exc}"))
                continue
            prev = done.get(p)
            if prev is not None:
                if (prev[0], prev[1]) == (st.st_size, st.st_mtime_ns):
                    skipped += 1
                else:
                    failures.append((p, "FAILED_PRECONDITION",
                                     "file changed since its features were written (size or "
                                     "mtime differ); its old row is kept: write to a new --out "
                                     "to extract it again"))
                continue
            work.append(_Item(len(work), p, st.st_size, st.st_mtime_ns))

        err_path = _errors_path(args)
        err_fh = open(err_path, "w", newline="", encoding="utf-8")  # noqa: SIM115
        err_csv = csv.writer(err_fh)
        err_csv.writerow(["path", "code", "message"])
        for f in failures:
            err_csv.writerow(f)
        err_fh.flush()

        progress = _Progress(len(work), args.progress if args.progress is not None
                             else sys.stderr.isatty())
        the_run = _Run(args)
        sched = _Scheduler(work, args.max_in_flight)
        streams = max(1, args.streams)
        # Half of --max-in-flight goes to the streams' windows; the other half is slack
        # for answers waiting in the reorder buffer behind a slower image. Without it,
        # streams would often find no free slot, end, and reopen (a pipeline bubble,
        # and a new pick of server).
        window = max(1, args.max_in_flight // (2 * streams))
        threads = [threading.Thread(target=the_run.worker, name=f"hookserve-batch-{i}",
                                    args=(client, sched, layers, opts, window), daemon=True)
                   for i in range(streams)]

        def on_signal(signum, frame):
            the_run.interrupted = True
            the_run.results.put(None)

        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, on_signal)
        t0 = time.monotonic()
        n_done = 0
        n_failed = len(failures)
        buffered: dict[int, tuple] = {}
        next_pos = 0
        try:
            for t in threads:
                t.start()
            stopping = False
            while next_pos < len(work):
                if (the_run.fatal is not None or the_run.interrupted) and not stopping:
                    stopping = True
                    sched.stop()
                if stopping and not any(t.is_alive() for t in threads) \
                        and the_run.results.empty():
                    break
                try:
                    msg = the_run.results.get(timeout=0.5)  # lets signal handlers run
                except queue.Empty:
                    continue
                if msg is None:
                    continue
                item, feats, err = msg
                if item.pos >= next_pos and item.pos not in buffered:
                    buffered[item.pos] = msg
                wrote = 0
                while next_pos in buffered:  # write in input order
                    item, feats, err = buffered.pop(next_pos)
                    next_pos += 1
                    wrote += 1
                    if err is None:
                        rec = Record(item.path, item.sha256, item.size, item.mtime_ns,
                                     dict(feats))
                        try:
                            sink.add(rec)
                            n_done += 1
                            continue
                        except ShapeMismatch as exc:
                            err = errors.InvalidArgument(str(exc))
                    n_failed += 1
                    err_csv.writerow([item.path, err.code.name, err.message])
                    err_fh.flush()
                if wrote:
                    sched.written(wrote)
                    sink.checkpoint()
                progress.update(n_done, n_failed - len(failures))
        finally:
            sched.stop()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            for t in threads:
                t.join(timeout=30)
            progress.update(n_done, n_failed - len(failures), force=True)
            progress.finish()
            complete = next_pos >= len(work)
            sink.close(complete=complete and the_run.fatal is None)
            err_fh.close()
            if n_failed == 0:
                os.unlink(err_path)

    elapsed = time.monotonic() - t0
    rate = n_done / elapsed if elapsed > 0 else 0.0
    summary = (f"hookserve batch: done {n_done}, skipped {skipped}, failed {n_failed}, "
               f"{rate:.1f} img/s in {elapsed:.1f}s -> {args.out}")
    if the_run.retried:
        summary += f", retried {the_run.retried}"
    if n_failed:
        summary += f" (errors: {err_path})"
    if the_run.fatal is not None:
        print(summary + "; stopped early", file=sys.stderr)
        exc = the_run.fatal
        if isinstance(exc, (_Abort, errors.HookserveError)):
            print(f"hookserve batch: {exc}", file=sys.stderr)
            return EXIT_CANNOT_PROCEED
        raise exc
    if the_run.interrupted:
        print(summary + f"; interrupted with {len(work) - next_pos} left: run the same "
              "command again to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary, file=sys.stderr)
    return EXIT_SOME_FAILED if n_failed else EXIT_OK


def _dry_run(args, paths: list[str]) -> int:
    """Count inputs, and what an existing output already holds; contacts no server."""
    done: dict = {}
    out = args.out.rstrip("/")
    try:
        done = _peek_done(out)
    except Exception as exc:  # noqa: BLE001 - a dry run only reports
        print(f"note: cannot read {out}: {exc}", file=sys.stderr)
    already = sum(1 for p in paths if p in done)
    shard = f" in shard {args.shard}" if args.shard else ""
    print(f"{len(paths)} images{shard}; {already} already in {out}; "
          f"{len(paths) - already} to extract")
    return EXIT_OK


def _peek_done(out: str) -> dict:
    """The paths an existing output holds, read without taking its lock."""
    ext = os.path.splitext(out)[1].lower()
    if ext in (".h5", ".hdf5") and os.path.exists(out):
        import h5py

        with h5py.File(out, "r") as f:
            return dict.fromkeys(p.decode() if isinstance(p, bytes) else p
                                 for p in f["paths"][:])
    if ext == ".parquet" and os.path.isdir(out):
        import pyarrow.parquet as pq

        return dict.fromkeys(pq.read_table(out, columns=["path"]).column("path").to_pylist())
    index = os.path.join(out, "index.jsonl")
    if os.path.exists(index):
        with open(index, "rb") as fh:
            return {json.loads(line)["path"]: True for line in fh if line.endswith(b"\n")}
    return {}


def add_batch_parser(subparsers, client_args=None) -> argparse.ArgumentParser:
    """Register `hookserve batch` on the `hookserve` command's subparsers.

    `client_args` (cli._client_args) is not used: batch defines its own connection
    flags because --server may be repeated here.
    """
    p = subparsers.add_parser(
        "batch", help="extract features of many images to .h5, .parquet or .npy files",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Extract layers of every image in folders, globs, or path lists into "
                    "one output, with progress, resume, retries and sharding.",
        epilog=OUTPUT_HELP + "\n" + EXIT_HELP)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a folder (recursive; files with image extensions), a glob ('**' "
                        "recurses; quote it), a .txt/.lst list of paths, a .csv/.tsv/"
                        ".parquet table with a path column, or an image file")
    p.add_argument("--out", required=True,
                   help="output: NAME.h5, NAME.parquet, or a folder for .npy files")
    p.add_argument("--layers", action="append", required=True,
                   help="layer names, comma-separated or repeated; NAME:REDUCTION sets a "
                        "reduction per layer (e.g. layer4:avg,fc)")
    p.add_argument("--model", help="model name (default: the server's default)")
    p.add_argument("--reduction", default="none", choices=REDUCTIONS,
                   help="reduction for layers without their own (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="feature dtype; bfloat16 is stored as uint16 bit patterns")
    p.add_argument("--l2-normalize", action="store_true",
                   help="divide each image's feature by its L2 norm")
    p.add_argument("--native", action="store_true",
                   help="no resize or crop: feature maps follow each image's size")
    p.add_argument("--resize", type=int, help="resize the shorter side to this")
    p.add_argument("--crop", type=size_arg, help="centre crop HxW (or one number)")
    p.add_argument("--path-column", default="path",
                   help="path column of .csv/.tsv/.parquet inputs (default: %(default)s)")
    p.add_argument("--root", help="folder that relative paths in list/table inputs are "
                                  "relative to (default: the working directory)")
    p.add_argument("--shard", metavar="I/N",
                   help="take only shard I of N (0-based), chosen by a hash of each path: "
                        "N jobs with I=0..N-1 cover the input exactly once. Give each "
                        "shard its own --out")
    p.add_argument("--streams", type=int, default=4,
                   help="parallel extraction streams (default: %(default)s)")
    p.add_argument("--max-in-flight", type=int, default=128,
                   help="images read and not yet written, over all streams; bounds memory "
                        "and what a kill can lose (default: %(default)s)")
    p.add_argument("--retries", type=int, default=5,
                   help="tries per image on UNAVAILABLE or overload (RESOURCE_EXHAUSTED with a "
                        "retry hint) before it counts as failed (default: %(default)s)")
    p.add_argument("--checkpoint", type=int, default=1024, metavar="N",
                   help=".h5/.parquet: make written images visible as a new part every N "
                        "images (default: %(default)s), every --checkpoint-secs, or every "
                        "256 MB. Images are safe from a kill as soon as they are written, "
                        "checkpoint or not")
    p.add_argument("--checkpoint-secs", type=float, default=60.0,
                   help="seconds between checkpoints (default: %(default)s)")
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false",
                   help=".h5: at the end keep out.h5 as a virtual file over out.h5.parts/ "
                        "instead of copying everything into one file")
    p.add_argument("--errors", help="CSV of failed images: path, code, message "
                                    "(default: OUT.errors.csv; removed when none failed)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show the progress bar (default: only when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--dry-run", action="store_true",
                   help="count the inputs (and those already in --out) and exit; contacts "
                        "no server")
    p.add_argument("--server", action="append",
                   help="host:port, grpcs://host:port or dns:///name:port (round-robin over "
                        "its addresses); repeat for several servers (default: env "
                        "HOOKSERVE_SERVER or localhost:50051)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds per unary call (streams have no deadline)")
    p.add_argument("--ca", help="PEM CA file to trust (TLS)")
    p.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key", help="PEM client key (mutual TLS)")
    p.add_argument("--token-file",
                   help="file with a bearer token (default: env HOOKSERVE_TOKEN)")
    p.set_defaults(func=run)
    return p


__all__ = ["add_batch_parser", "run", "EXIT_OK", "EXIT_SOME_FAILED", "EXIT_CANNOT_PROCEED",
           "EXIT_INTERRUPTED"]
