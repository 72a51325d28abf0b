"""The local run of `hookserve batch` (local files, one output): plan the work, start
the streams, write in order.

- Inputs are listed, sorted and sharded up front (:mod:`.inputs`); images already in
  the output are skipped (:func:`plan`).
- :class:`~.scheduler.Streams` runs the extraction threads; this module's main thread
  is the only one that writes, and it writes results **in input order** (a reorder
  buffer holds at most the in-flight images). So what is written is always a prefix
  of the work list, and a resumed run produces the same rows in the same order.
- SIGINT/SIGTERM stop the run cleanly: what was written is saved (exit 130).
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import signal
import sys
import threading
import time

from .. import errors
from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    Abort,
    ErrorsFile,
    check_errors_path,
    errors_path,
)
from .inputs import (
    InputError,
    discover,
    encode_name,
    legacy_id,
    not_regular,
    parse_shard,
    read_error,
    select_shard,
)
from .limits import Cap
from .progress import Progress
from .readers import is_tar
from .scheduler import Item, Scheduler, Streams
from .sinks import Record, ShapeMismatch, Sink, make_sink, owned_paths, peek_done
from .spec import connect, describe_and_check, parse_layers
from .streamcall import weights_of


def plan(paths: list[str], done: dict, cap: Cap | None = None
         ) -> tuple[list[Item], list[tuple[str, str, str]], int]:
    """-> (work list, failures (path, code, message), images already written). A file
    over the per-file `cap` fails here, from its size: it is never opened."""
    failures: list[tuple[str, str, str]] = []
    work: list[Item] = []
    skipped = 0
    ids = {encode_name(p) for p in paths}   # (an earlier id that is another file's now
    for p in paths:                         # is that file's, not this one's)
        name = encode_name(p)  # the id: valid UTF-8 whatever the file name's bytes
        try:
            st = os.stat(p)
        except OSError as exc:
            err = read_error(exc, p)
            failures.append((name, err.code.name, err.message))
            continue
        what = not_regular(st.st_mode)
        if what:  # never opened: a FIFO would block, a device never ends
            failures.append((name, "INVALID_ARGUMENT",
                             f"{what}, not a regular file: only regular files are read"))
            continue
        prev = done.get(name)
        if prev is None and (old := legacy_id(p)) is not None and old not in ids:
            prev = done.get(old)   # written by an earlier version under another id
        if prev is not None:
            if (prev[0], prev[1]) == (st.st_size, st.st_mtime_ns):
                skipped += 1
            else:
                failures.append((name, "FAILED_PRECONDITION",
                                 "file changed since its features were written (size or "
                                 "mtime differ); its old row is kept: write to a new --out "
                                 "to extract it again"))
            continue
        if cap is not None and st.st_size > cap.limit:
            failures.append((name, "INVALID_ARGUMENT", cap.refuse(st.st_size).message))
            continue
        work.append(Item(len(work), p, st.st_size, st.st_mtime_ns, name=name))
    return work, failures, skipped


def _say_unlisted(done: dict, listed: list[str]) -> None:
    """Say how many rows of the output are of files the inputs no longer list
    (deleted, renamed, or named by another run's inputs): they are kept."""
    ids = {encode_name(p) for p in listed} | {legacy_id(p) for p in listed}
    gone = [i for i in done if i not in ids]
    if gone:
        print(f"hookserve batch: the output holds {len(gone)} rows of files these inputs "
              f"do not list (deleted, renamed, or another run's inputs; first: "
              f"{min(gone)}); they are kept", file=sys.stderr)


def run_local(args: argparse.Namespace) -> int:
    """`hookserve batch` over local files into one output; -> the exit code. Raises
    :class:`~.errors.Abort` when the run cannot start."""
    try:
        shard = parse_shard(args.shard) if args.shard is not None else None
        unlisted: list[tuple[str, str, str]] = []
        listed = discover(args.inputs, path_column=args.path_column, root=args.root,
                          unlisted=unlisted)
        paths = select_shard(listed, shard)
    except (InputError, ValueError, OSError) as exc:
        raise Abort(str(exc)) from None
    layers = parse_layers(args.layers, args.reduction, args.dtype, args.l2_normalize)

    if args.dry_run:
        return _dry_run(args, paths)
    check_errors_path(errors_path(args), args.out, owned_paths(args.out),
                      given=args.errors is not None)
    if not paths and unlisted:
        raise Abort(f"cannot list {unlisted[0][0]}: {unlisted[0][2]}: no input images "
                    "found")
    if not paths:
        raise Abort("no input images found" + (
            " (the tar files below it are read by a sharded run: add --sharded)"
            if _holds_tars(args.inputs) else ""))

    with connect(args) as client:
        meta, opts, cap = describe_and_check(args, client, layers)
        # (an OutputError goes up as it is: `batch.command.run` reports it in one line,
        # and ends the process at once when the output's file cannot be torn down)
        sink = make_sink(args.out, meta, checkpoint=args.checkpoint,
                         checkpoint_secs=args.checkpoint_secs, consolidate=args.consolidate)
        sink.open()
        done = sink.done()
        work, failures, skipped = plan(paths, done, cap)
        if shard is None:
            _say_unlisted(done, listed)
        errs = ErrorsFile(errors_path(args))
        for f in failures:
            errs.add(*f)
        for folder, code, why in unlisted:   # the files below it are unknown: a row
            errs.add(encode_name(folder), code, f"cannot list this folder ({why}): the "
                     "files below it are left out; make it readable and run again")
        # Half of --max-in-flight goes to the streams' windows; the other half is slack
        # for answers waiting in the reorder buffer behind a slower image. Without it,
        # streams would often find no free slot, end, and reopen (a pipeline bubble,
        # and a new pick of server).
        streams = max(1, min(args.streams, len(work)))   # (no stream without an image)
        window = max(1, args.max_in_flight // (2 * streams))
        workers = Streams(client, Scheduler(work, args.max_in_flight,
                                            args.max_in_flight_bytes), layers, opts,
                          model=meta["model"], retries=args.retries, streams=streams,
                          window=window, cap=cap, timeout=args.timeout,
                          weights=weights_of(meta))
        progress = Progress(len(work), args.progress if args.progress is not None
                            else sys.stderr.isatty())
        t0 = time.monotonic()
        n_done, next_pos = _write_in_order(workers, work, sink, errs, progress, errs.count)

    elapsed = time.monotonic() - t0
    rate = n_done / elapsed if elapsed > 0 else 0.0
    n_failed = errs.count
    summary = (f"hookserve batch: done {n_done}, skipped {skipped}, failed {n_failed}, "
               f"{rate:.1f} img/s in {elapsed:.1f}s -> {args.out}")
    if workers.retried:
        summary += f", retried {workers.retried}"
    if n_failed:
        summary += f" (errors: {errs.path})"
    if workers.fatal is not None:
        print(summary + "; stopped early", file=sys.stderr)
        exc = workers.fatal
        if isinstance(exc, (Abort, errors.HookserveError)):
            print(f"hookserve batch: {exc}", file=sys.stderr)
            return EXIT_CANNOT_PROCEED
        raise exc
    if workers.interrupted:
        left = len(work) - next_pos
        print(summary + (f"; interrupted with {left} left: run the same command again to "
                         "finish" if left else "; interrupted after every image was "
                         "written: run the same command again to finish the output (no "
                         "image is extracted again)"), file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary, file=sys.stderr)
    return EXIT_SOME_FAILED if n_failed else EXIT_OK


def _write_in_order(workers: Streams, work: list[Item], sink: Sink, errs: ErrorsFile,
                    progress: Progress, n_prior: int) -> tuple[int, int]:
    """The writer: start the streams, write their results in work-list order until
    all are written, a fatal error, or a signal; then stop and close everything.
    `n_prior` failures were recorded before the streams started.
    -> (images written, position reached in the work list)."""
    def on_signal(signum, frame):
        workers.interrupt()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, on_signal)
    n_done = 0
    buffered: dict[int, tuple] = {}
    next_pos = 0
    try:
        workers.start()
        stopping = False
        while next_pos < len(work):
            if (workers.fatal is not None or workers.interrupted) and not stopping:
                stopping = True
                workers.sched.stop()
            if stopping and not workers.alive() and workers.results.empty():
                break
            try:
                msg = workers.results.get(timeout=0.5)  # lets signal handlers run
            except queue.Empty:
                continue
            if msg is None:
                continue
            item = msg[0]
            if item.pos >= next_pos and item.pos not in buffered:
                buffered[item.pos] = msg
            wrote = nbytes = 0
            while next_pos in buffered:  # write in input order
                item, feats, err = buffered.pop(next_pos)
                next_pos += 1
                wrote += 1
                nbytes += item.size
                if err is None:
                    rec = Record(item.name, item.sha256, item.size, item.mtime_ns,
                                 dict(feats))
                    try:
                        sink.add(rec)
                        n_done += 1
                        continue
                    except ShapeMismatch as exc:
                        err = errors.InvalidArgument(str(exc))
                errs.add(item.name, err.code.name, err.message)
            if wrote:
                workers.sched.written(wrote, nbytes)
                sink.checkpoint()
            progress.update(n_done, errs.count - n_prior)
    finally:
        workers.sched.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        workers.stop()
        progress.update(n_done, errs.count - n_prior, force=True)
        progress.finish()
        complete = next_pos >= len(work)
        try:
            sink.close(complete=complete and workers.fatal is None)
        finally:   # (a full disk fails the sink's close; the errors file still closes)
            errs.close()
    return n_done, next_pos


def _dry_run(args, paths: list[str]) -> int:
    """Count inputs, and what an existing output already holds; contacts no server."""
    done: dict = {}
    out = args.out.rstrip("/")
    try:
        done = peek_done(out)
    except Exception as exc:  # noqa: BLE001 - a dry run only reports
        print(f"note: cannot read {out}: {exc}", file=sys.stderr)
    already = sum(1 for p in paths if encode_name(p) in done or legacy_id(p) in done)
    shard = f" in shard {args.shard}" if args.shard else ""
    print(f"{len(paths)} images{shard}; {already} already in {out}; "
          f"{len(paths) - already} to extract")
    return EXIT_OK


def _holds_tars(inputs: list[str], look: int = 10_000) -> bool:
    """Whether a folder among `inputs` holds tar files (among its first `look` files):
    a local run lists images only."""
    names = (n for spec in inputs if os.path.isdir(spec)
             for _, _, files in os.walk(spec) for n in files)
    return any(is_tar(n) for n in itertools.islice(names, look))
