"""The sharded run of `hookserve batch`: plan the shards, do each one not yet done.

A run is sharded when an input is a URL, a tar or a list of URLs, when
``--image-column`` is given, when ``--out`` is a URL, or with ``--sharded``
(:func:`~.command.wants_shards`). Then:

- planning lists each input once and cuts it into shards (:mod:`.shard_plan`);
  ``--shard I/N`` keeps whole shards; the output folder is listed once;
- ``--streams`` shards are done at once, each on its own stream
  (:func:`~.one_shard.extract_shard`, reading through :func:`~.readers.entries`),
  sharing one byte budget; each is published to the output (:mod:`.shard_output`):
  its part, its errors file, and, only when every input is accounted for, its done
  marker. Accounted for: the container was read to its proper end, and every image has
  a row or a *final* error row (:func:`~.errors.is_final`). Any other failure (not
  found, network, a missing extra, overload, a cut container) leaves the shard without
  a marker: the run exits 3 naming it, and the next run does it again;
- a shard with a valid marker is skipped;
- workers with different ``--shard`` share one ``--out`` with no lock: each writes only
  its own shards' files.
"""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import threading
import time

from .earlier_shards import Earlier, settle
from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    Abort,
    one_line,
)
from .inputs import InputError, parse_shard
from .intake import Interrupted
from .limits import ByteBudget, check_flags
from .one_shard import extract_shard, open_output, output_meta, read_opts
from .remote import (
    MissingExtra,
    expand_braces,
    file_url_spelled,
    filesystem,
    is_http,
    is_url,
    parse_storage_options,
    set_store_timeout,
)
from .shard_output import ShardOutput, ShardResult, present
from .shard_plan import PlanReport, Shard, ShardError, plan_shards, select, vanished
from .sinks.base import OutputError
from .spec import connect, describe_and_check, parse_layers
from .streamcall import Watchdog, weights_of

#: Shards named one by one when a run leaves shards open.
NAMED = 20


def _store_urls(specs: list[str], path_column: str, image_column: str | None
                ) -> dict[tuple, str]:
    """One URL per object store (scheme and bucket) the inputs name, lists included."""
    from .inputs import listed_paths

    found: dict[tuple, str] = {}
    for spec in specs:
        urls = listed_paths(spec, path_column, image_column) or expand_braces(spec)[:1]
        for url in urls:
            if is_url(url) and not is_http(url):
                found.setdefault(tuple(url.split("/", 3)[:3]), url)
    return found


def probe(specs: list[str], opts: dict, path_column: str = "path",
          image_column: str | None = None) -> None:
    """One cheap request per object store the inputs name (not http(s)): a missing
    extra, a bad --storage-option or a store that cannot be reached stops the run
    here, with exit code 2 and one line. A shard that does not exist yet is no error."""
    for url in _store_urls(specs, path_column, image_column).values():
        try:
            fs, path = filesystem(url, opts)
            fs.info(path)
        except FileNotFoundError:
            continue
        except MissingExtra as exc:
            raise Abort(str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise Abort(f"{url}: bad --storage-option: {one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - e.g. an endpoint nothing listens on
            raise Abort(f"cannot reach {url}: {one_line(exc)}") from None


def run_sharded(args: argparse.Namespace) -> int:
    """`hookserve batch` over input shards (see the module doc); -> the exit code."""
    check_flags(args)
    set_store_timeout(args.timeout)
    args.inputs = [file_url_spelled(s) for s in args.inputs]   # one spelling per input
    try:
        opts = parse_storage_options(args.storage_option)
        part = parse_shard(args.shard) if args.shard is not None else None
        probe(args.inputs, opts, args.path_column, args.image_column)
        report = PlanReport()
        shards = plan_shards(args.inputs, image_column=args.image_column,
                             listing_shards=args.listing_shards, shard_bytes=args.shard_bytes,
                             storage_options=opts, path_column=args.path_column,
                             report=report, root=args.root)
    except (ShardError, ValueError, OutputError, MissingExtra, InputError) as exc:
        raise Abort(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a listing the store refused
        raise Abort(f"cannot list the inputs: {one_line(exc)}") from None
    mine = select(shards, part)
    layers = parse_layers(args.layers, args.reduction, args.dtype, args.l2_normalize)
    where = f" for shard {args.shard}" if args.shard is not None else ""
    if not shards:
        raise Abort("no input shards found")
    if any(s.kind == "parquet" for s in mine):
        from .sinks.base import need
        try:
            need("pyarrow.parquet", "reading Parquet")
        except OutputError as exc:
            raise Abort(str(exc)) from None
    if args.dry_run:
        print(f"{len(shards)} input shards; {len(mine)} assigned{where} (a dry run of a "
              "sharded run reads no done marker: a run skips the shards --out has done)")
        for s in mine:
            print(s.key)
        return EXIT_OK
    for spec in report.empty[:NAMED]:
        print(f"hookserve batch: {spec} lists no file now; the rows an earlier run wrote "
              "for it, if any, are kept", file=sys.stderr)
    for spec, why in list(report.partial.items())[:NAMED]:
        print(f"hookserve batch: cannot list {why}: the files below it are left out, and "
              f"the finished shards of {spec} are kept as they are", file=sys.stderr)
    gone = select(vanished(args.inputs, shards, args.listing_shards, report), part)
    if not mine:
        gone = present(args.out, gone, opts)   # (a bucket with no rows has nothing to remove)
    if not mine and not gone:
        print(f"hookserve batch: no input shards assigned{where}; nothing to do",
              file=sys.stderr)
        return EXIT_OK
    with connect(args) as client:
        meta, xopts, cap = describe_and_check(args, client, layers)
        output = open_output(args.out, output_meta(meta, args), opts)
        try:
            done = output.done(mine)
            output.retire(gone)
            earlier = settle(output, shards, args.inputs, report)
        except Exception as exc:  # noqa: BLE001 - the output store failed
            raise Abort(f"cannot read the output {args.out}: {one_line(exc)}") from None
        for note in output.notes:
            print(f"hookserve batch: {note}", file=sys.stderr)
        _say_earlier(earlier)
        todo = [s for s in mine if s.sid not in done]
        t0 = time.monotonic()
        results, fatal, interrupted = _run_pool(args, client, todo, output, layers, xopts,
                                                read_opts(args, opts, cap), weights_of(meta))
    return _report(args, results, fatal, interrupted, len(mine) - len(todo), len(todo),
                   time.monotonic() - t0, output.failed_before)


def _say_earlier(earlier: Earlier) -> None:
    if earlier.kept:
        print(f"hookserve batch: the output also holds {len(earlier.kept)} finished shards "
              f"of inputs this run does not name (first: {earlier.kept[0]}); their rows "
              "are kept", file=sys.stderr)
    for key, n in list(earlier.pruned.items())[:NAMED]:
        print(f"hookserve batch: shard {key}: {n} of its rows are of files this run "
              "writes, in other shards; those rows are removed, its others kept",
              file=sys.stderr)


def _report(args, results: list[ShardResult], fatal, interrupted: bool, skipped: int,
            n_todo: int, elapsed: float, failed_before: int = 0) -> int:
    rows = sum(r.rows for r in results)
    failed = sum(r.failed for r in results) + failed_before   # (skipped shards' too)
    open_ = [r for r in results if not r.complete]
    summary = (f"hookserve batch: shards done {len(results) - len(open_)}"
               + (f", not finished {len(open_)}" if open_ else "")
               + f", skipped {skipped}, images {rows}, failed {failed}"
               + (f" ({failed_before} in skipped shards)" if failed_before else "")
               + f", {rows / max(elapsed, 1e-9):.1f} img/s in {elapsed:.1f}s -> {args.out}")
    if failed:
        summary += f" (errors: {args.out.rstrip('/')}/_errors-*.csv)"
    if fatal is not None:  # one line: what stopped the run, and how far it came
        print(f"hookserve batch: {one_line(fatal)} (stopped; {len(results)} shards "
              "written before)", file=sys.stderr)
        return EXIT_CANNOT_PROCEED
    for r in open_[:NAMED]:
        print(f"hookserve batch: not finished: {r.key}: {r.reason}", file=sys.stderr)
    if len(open_) > NAMED:
        print(f"hookserve batch: ... and {len(open_) - NAMED} more shards not finished",
              file=sys.stderr)
    if interrupted:
        print(summary + f"; interrupted with {n_todo - len(results)} shards left: run the "
              "same command again to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    if open_:
        print(summary + f"; {len(open_)} shards have no done marker (an error a rerun can "
              "fix): run the same command again", file=sys.stderr)
        return EXIT_INCOMPLETE
    print(summary, file=sys.stderr)
    return EXIT_SOME_FAILED if failed else EXIT_OK


def _run_pool(args, client, todo: list[Shard], output: ShardOutput, layers, xopts,
              read: dict, weights: tuple[str, str]):
    """--streams shards at once, each on its own stream, sharing one byte budget and
    one watch (--timeout, and the run's `weights`). A signal stops the run at once:
    shards in progress have no marker yet, so the next run does them again."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for s in todo:
        work.put(s)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    window = max(1, args.max_in_flight // max(1, args.streams))
    budget = ByteBudget(args.max_in_flight_bytes)
    watchdog = Watchdog(args.timeout, weights)
    progress = args.progress if args.progress is not None else sys.stderr.isatty()

    def worker():
        while not stop.is_set():
            try:
                shard = work.get_nowait()
            except queue.Empty:
                return
            try:
                output.forget(shard)
                rows, fails = extract_shard(client, shard, layers, xopts, model=weights[0],
                                            retries=args.retries, window=window, read=read,
                                            budget=budget, watchdog=watchdog)
                if stop.is_set():
                    return
                results.put(output.publish(shard, rows, fails))
            except Interrupted:
                return
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                results.put(exc)
                stop.set()
                budget.cancel()

    threads = [threading.Thread(target=worker, daemon=True, name=f"hookserve-shard-{i}")
               for i in range(min(max(1, args.streams), len(todo)))]
    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True
        stop.set()
        budget.cancel()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, on_signal)
    done: list[ShardResult] = []
    fatal = None
    try:
        for t in threads:
            t.start()
        while len(done) < len(todo) and not interrupted:
            try:
                r = results.get(timeout=0.5)  # lets signal handlers run
            except queue.Empty:
                if not any(t.is_alive() for t in threads) and results.empty():
                    break
                continue
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                fatal = r
                break
            done.append(r)
            if progress:
                state = "" if r.complete else " (not finished)"
                print(f"[{len(done)}/{len(todo)}] {r.key}: {r.rows} rows, {r.failed} "
                      f"failed{state}", file=sys.stderr)
    finally:
        stop.set()
        budget.cancel()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return done, fatal, interrupted
