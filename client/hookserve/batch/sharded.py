"""The sharded `hookserve batch` command, and :func:`run_shard` for other schedulers.

    from hookserve.batch import plan_shards, run_shard
    for shard in plan_shards(["s3://bucket/shards/{000000..000127}.tar"]):
        run_shard(shard, out="s3://bucket/feats.parquet", layers=["layer4:avg"],
                  server="dns:///hookserve:50051")
"""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence

from .errors import (
    EXIT_CANNOT_PROCEED,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    Abort,
)
from .inputs import MAX_FILE_BYTES, InputError, parse_shard
from .intake import Interrupted
from .limits import IN_FLIGHT_BYTES, ByteBudget, Cap, check_flags
from .remote import (
    MissingExtra,
    expand_braces,
    filesystem,
    is_http,
    is_url,
    parse_storage_options,
    set_store_timeout,
)
from .shardrun import ShardIncomplete, ShardOutput, ShardResult, extract_shard
from .shards import Shard, ShardError, plan_shards, select, shard_from_key
from .sinks.base import OutputError
from .spec import connect, describe_and_check, parse_layers
from .streamcall import Watchdog

#: Defaults of the flags a sharded run reads (the CLI's and run_shard's).
DEFAULTS = {
    "model": None, "reduction": "none", "dtype": "float32", "l2_normalize": False,
    "native": False, "resize": None, "crop": None, "image_column": None, "id_column": None,
    "listing_shards": 64, "shard_bytes": 256 << 20, "max_file_bytes": MAX_FILE_BYTES,
    "max_in_flight_bytes": IN_FLIGHT_BYTES, "retries": 5, "max_in_flight": 128,
    "streams": 4, "timeout": 60.0, "ca": None, "cert": None, "key": None,
    "token_file": None, "storage_option": [], "shard": None, "sharded": True,
    "progress": None, "dry_run": False, "path_column": "path",
}
#: Shards named one by one when a run leaves shards open.
NAMED = 20


def _read_opts(args, storage_options: dict, cap: Cap) -> dict:
    return {"opts": storage_options, "image_column": args.image_column,
            "id_column": args.id_column, "cap": cap, "timeout": args.timeout,
            "max_group_bytes": args.max_in_flight_bytes}


def _meta(meta: dict, args) -> dict:
    """Settings that define the shards go into the metadata; --shard does not (every
    worker of one output writes the same metadata)."""
    meta = dict(meta, shard=None)
    meta["sharding"] = {"listing_shards": args.listing_shards, "shard_bytes": args.shard_bytes,
                        "image_column": args.image_column, "id_column": args.id_column}
    return meta


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _open_output(out: str, meta: dict, opts: dict) -> ShardOutput:
    try:
        output = ShardOutput(out, meta, opts)
        output.open()
        output.files()
    except (OutputError, MissingExtra) as exc:
        raise Abort(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a store that cannot be reached or used
        raise Abort(f"cannot use the output {out}: {_one_line(exc)}") from None
    return output


def run_shard(shard: str | Shard, out: str, layers: Sequence[str], *,
              server: str | Sequence[str] | None = None, client=None,
              storage_options: dict | None = None, **flags) -> ShardResult:
    """Extract one input shard into `out` (its part, errors file and done marker).

    `shard` is a :class:`~.shards.Shard` from :func:`plan_shards`, or its key: a
    tar path or URL, a Parquet file (``...#rg=K`` for one row group; give
    ``image_column=``), or a listing bucket ``<input>#b/B``. `flags` are the
    `hookserve batch` flags with underscores (``reduction="avg"``, ``image_column=``,
    ``model=``, ``retries=``...). A shard whose marker is valid is skipped.

    Raises :class:`~.shardrun.ShardIncomplete` when an input failed in a way a rerun
    may fix (not found, network, overload, a cut container): the shard then has no
    marker, so a scheduler's retry does it again. Raises
    :class:`hookserve.HookserveError` when no server can do the work, and ValueError
    for bad settings; final per-image failures go to the shard's errors file.
    """
    unknown = set(flags) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"run_shard: unknown flags {sorted(unknown)}")
    args = argparse.Namespace(**{**DEFAULTS, **flags, "out": out, "layers": list(layers),
                                 "inputs": [], "server": server})
    if isinstance(server, str):
        args.server = [server]
    opts = storage_options or {}
    set_store_timeout(args.timeout)
    try:
        check_flags(args)
        if not isinstance(shard, Shard):
            shard = shard_from_key(shard, opts, image_column=args.image_column,
                                   listing_shards=args.listing_shards,
                                   path_column=args.path_column)
        layer_objs = parse_layers(args.layers, args.reduction, args.dtype,
                                  args.l2_normalize)
    except Abort as exc:
        raise ValueError(str(exc)) from None
    own = client is None
    client = connect(args) if own else client
    try:
        try:
            meta, xopts, cap = describe_and_check(args, client, layer_objs)
            output = _open_output(out, _meta(meta, args), opts)
        except Abort as exc:
            raise ValueError(str(exc)) from None
        if shard.sid in output.done([shard]):
            return ShardResult(shard.key, skipped=True)
        output.forget(shard)
        rows, fails = extract_shard(client, shard, layer_objs, xopts, model=args.model,
                                    retries=args.retries, window=args.max_in_flight,
                                    read=_read_opts(args, opts, cap),
                                    budget=ByteBudget(args.max_in_flight_bytes),
                                    watchdog=Watchdog(args.timeout))
        result = output.publish(shard, rows, fails)
        if not result.complete:
            raise ShardIncomplete(result)
        return result
    finally:
        if own:
            client.close()


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
            raise Abort(f"{url}: bad --storage-option: {_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - e.g. an endpoint nothing listens on
            raise Abort(f"cannot reach {url}: {_one_line(exc)}") from None


def run_sharded(args: argparse.Namespace) -> int:
    """`hookserve batch` over input shards (see :mod:`.shardrun`); -> the exit code."""
    check_flags(args)
    set_store_timeout(args.timeout)
    try:
        opts = parse_storage_options(args.storage_option)
        part = parse_shard(args.shard) if args.shard is not None else None
        probe(args.inputs, opts, args.path_column, args.image_column)
        shards = plan_shards(args.inputs, image_column=args.image_column,
                             listing_shards=args.listing_shards, shard_bytes=args.shard_bytes,
                             storage_options=opts, path_column=args.path_column)
    except (ShardError, ValueError, OutputError, MissingExtra, InputError) as exc:
        raise Abort(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a listing the store refused
        raise Abort(f"cannot list the inputs: {_one_line(exc)}") from None
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
        print(f"{len(shards)} input shards; {len(mine)} assigned{where}")
        for s in mine:
            print(s.key)
        return EXIT_OK
    if not mine:
        print(f"hookserve batch: no input shards assigned{where}; nothing to do",
              file=sys.stderr)
        return EXIT_OK
    with connect(args) as client:
        meta, xopts, cap = describe_and_check(args, client, layers)
        output = _open_output(args.out, _meta(meta, args), opts)
        try:
            done = output.done(mine)
        except Exception as exc:  # noqa: BLE001 - the output store failed
            raise Abort(f"cannot read the output {args.out}: {_one_line(exc)}") from None
        for note in output.notes:
            print(f"hookserve batch: {note}", file=sys.stderr)
        todo = [s for s in mine if s.sid not in done]
        t0 = time.monotonic()
        results, fatal, interrupted = _run_pool(args, client, todo, output, layers, xopts,
                                                _read_opts(args, opts, cap))
    return _report(args, results, fatal, interrupted, len(mine) - len(todo), len(todo),
                   time.monotonic() - t0)


def _report(args, results: list[ShardResult], fatal, interrupted: bool, skipped: int,
            n_todo: int, elapsed: float) -> int:
    rows = sum(r.rows for r in results)
    failed = sum(r.failed for r in results)
    open_ = [r for r in results if not r.complete]
    summary = (f"hookserve batch: shards done {len(results) - len(open_)}"
               + (f", not finished {len(open_)}" if open_ else "")
               + f", skipped {skipped}, images {rows}, failed {failed}, "
               f"{rows / max(elapsed, 1e-9):.1f} img/s in {elapsed:.1f}s -> {args.out}")
    if failed:
        summary += f" (errors: {args.out.rstrip('/')}/_errors-*.csv)"
    if fatal is not None:  # one line: what stopped the run, and how far it came
        print(f"hookserve batch: {_one_line(fatal)} (stopped; {len(results)} shards "
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
              read: dict):
    """--streams shards at once, each on its own stream, sharing one byte budget and
    one --timeout watch. A signal stops the run at once: shards in progress have no
    marker yet, so the next run does them again."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for s in todo:
        work.put(s)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    window = max(1, args.max_in_flight // max(1, args.streams))
    budget = ByteBudget(args.max_in_flight_bytes)
    watchdog = Watchdog(args.timeout)
    progress = args.progress if args.progress is not None else sys.stderr.isatty()

    def worker():
        while not stop.is_set():
            try:
                shard = work.get_nowait()
            except queue.Empty:
                return
            try:
                output.forget(shard)
                rows, fails = extract_shard(client, shard, layers, xopts, model=args.model,
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


__all__ = ["run_shard", "run_sharded", "plan_shards", "ShardResult", "ShardIncomplete",
           "DEFAULTS"]
