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

from .. import errors
from .errors import EXIT_CANNOT_PROCEED, EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, Abort
from .inputs import MAX_FILE_BYTES, parse_shard
from .remote import parse_storage_options
from .shardrun import ShardOutput, ShardResult, extract_shard
from .shards import Shard, ShardError, plan_shards, select, shard_from_key
from .sinks.base import OutputError
from .spec import connect, describe_and_check, parse_layers

#: Defaults of the flags a sharded run reads (the CLI's and run_shard's).
DEFAULTS = {
    "model": None, "reduction": "none", "dtype": "float32", "l2_normalize": False,
    "native": False, "resize": None, "crop": None, "image_column": None, "id_column": None,
    "listing_shards": 64, "shard_bytes": 256 << 20, "max_file_bytes": MAX_FILE_BYTES,
    "retries": 5, "max_in_flight": 128, "streams": 4, "timeout": 60.0, "ca": None,
    "cert": None, "key": None, "token_file": None, "storage_option": [], "shard": None,
    "sharded": True, "progress": None, "dry_run": False,
}


def _read_opts(args, storage_options: dict) -> dict:
    return {"opts": storage_options, "image_column": args.image_column,
            "id_column": args.id_column, "max_bytes": args.max_file_bytes}


def _meta(meta: dict, args) -> dict:
    """Settings that define the shards go into the metadata; --shard does not (every
    worker of one output writes the same metadata)."""
    meta = dict(meta, shard=None)
    meta["sharding"] = {"listing_shards": args.listing_shards, "shard_bytes": args.shard_bytes,
                        "image_column": args.image_column, "id_column": args.id_column}
    return meta


def run_shard(shard: str | Shard, out: str, layers: Sequence[str], *,
              server: str | Sequence[str] | None = None, client=None,
              storage_options: dict | None = None, **flags) -> ShardResult:
    """Extract one input shard into `out` (its part, errors file and done marker).

    `shard` is a :class:`~.shards.Shard` from :func:`plan_shards`, or its key: a
    ``.tar`` path or URL, a Parquet file (``...#rg=K`` for one row group; give
    ``image_column=``), or a listing bucket ``<input>#b/B``. `flags` are the
    `hookserve batch` flags with underscores (``reduction="avg"``, ``image_column=``,
    ``model=``, ``retries=``...). A shard whose marker exists is skipped. Raises
    :class:`hookserve.HookserveError` when no server can do the work, and ValueError
    for bad settings; per-image failures go to the shard's errors file.
    """
    unknown = set(flags) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"run_shard: unknown flags {sorted(unknown)}")
    args = argparse.Namespace(**{**DEFAULTS, **flags, "out": out, "layers": list(layers),
                                 "inputs": [], "server": server})
    if isinstance(server, str):
        args.server = [server]
    opts = storage_options or {}
    if not isinstance(shard, Shard):
        shard = shard_from_key(shard, opts, image_column=args.image_column,
                               listing_shards=args.listing_shards)
    layer_objs = parse_layers(args.layers, args.reduction, args.dtype, args.l2_normalize)
    own = client is None
    client = connect(args) if own else client
    try:
        try:
            meta, xopts = describe_and_check(args, client, layer_objs)
            output = ShardOutput(out, _meta(meta, args), opts)
            output.open()
        except (Abort, OutputError) as exc:
            raise ValueError(str(exc)) from None
        if shard.sid in output.done():
            return ShardResult(shard.key, skipped=True)
        rows, fails = extract_shard(client, shard, layer_objs, xopts, model=args.model,
                                    retries=args.retries, window=args.max_in_flight,
                                    read=_read_opts(args, opts))
        return output.publish(shard, rows, fails)
    finally:
        if own:
            client.close()


def run_sharded(args: argparse.Namespace) -> int:
    """`hookserve batch` over input shards (see :mod:`.shardrun`); -> the exit code."""
    try:
        opts = parse_storage_options(args.storage_option)
        part = parse_shard(args.shard) if args.shard else None
        shards = plan_shards(args.inputs, image_column=args.image_column,
                             listing_shards=args.listing_shards, shard_bytes=args.shard_bytes,
                             storage_options=opts)
    except (ShardError, ValueError, OSError) as exc:
        raise Abort(str(exc)) from None
    mine = select(shards, part)
    layers = parse_layers(args.layers, args.reduction, args.dtype, args.l2_normalize)
    where = f" for shard {args.shard}" if args.shard else ""
    if not shards:
        raise Abort("no input shards found")
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
        meta, xopts = describe_and_check(args, client, layers)
        try:
            output = ShardOutput(args.out, _meta(meta, args), opts)
            output.open()
            done = output.done()
        except (OutputError, OSError) as exc:
            raise Abort(str(exc)) from None
        todo = [s for s in mine if s.sid not in done]
        t0 = time.monotonic()
        results, fatal, interrupted = _run_pool(args, client, todo, output, layers, xopts,
                                                opts)
    elapsed = time.monotonic() - t0
    rows = sum(r.rows for r in results)
    failed = sum(r.failed for r in results)
    summary = (f"hookserve batch: shards done {len(results)}, skipped {len(mine) - len(todo)}"
               f", images {rows}, failed {failed}, {rows / max(elapsed, 1e-9):.1f} img/s in "
               f"{elapsed:.1f}s -> {args.out}")
    if failed:
        summary += f" (errors: {args.out.rstrip('/')}/_errors-*.csv)"
    if fatal is not None:
        print(summary + "; stopped early", file=sys.stderr)
        print(f"hookserve batch: {fatal}", file=sys.stderr)
        return EXIT_CANNOT_PROCEED
    if interrupted:
        print(summary + f"; interrupted with {len(todo) - len(results)} shards left: run the "
              "same command again to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary, file=sys.stderr)
    return EXIT_SOME_FAILED if failed else EXIT_OK


def _run_pool(args, client, todo: list[Shard], output: ShardOutput, layers, xopts, opts):
    """--streams shards at once, each on its own stream. A signal stops the run at once:
    shards in progress have no marker yet, so the next run does them again."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for s in todo:
        work.put(s)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    window = max(1, args.max_in_flight // max(1, args.streams))
    progress = args.progress if args.progress is not None else sys.stderr.isatty()

    def worker():
        while not stop.is_set():
            try:
                shard = work.get_nowait()
            except queue.Empty:
                return
            try:
                rows, fails = extract_shard(client, shard, layers, xopts, model=args.model,
                                            retries=args.retries, window=window,
                                            read=_read_opts(args, opts))
                if stop.is_set():
                    return
                results.put(output.publish(shard, rows, fails))
            except (errors.HookserveError, ShardError, OutputError, OSError) as exc:
                results.put(exc)
                stop.set()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                results.put(exc)
                stop.set()

    threads = [threading.Thread(target=worker, daemon=True, name=f"hookserve-shard-{i}")
               for i in range(min(max(1, args.streams), len(todo)))]
    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True
        stop.set()

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
                print(f"[{len(done)}/{len(todo)}] {r.key}: {r.rows} rows, {r.failed} failed",
                      file=sys.stderr)
    finally:
        stop.set()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return done, fatal, interrupted


__all__ = ["run_shard", "run_sharded", "plan_shards", "ShardResult", "DEFAULTS"]
