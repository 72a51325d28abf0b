"""One input shard, start to finish: :func:`extract_shard` sends its images through
the streams, :func:`run_shard` does a whole shard (describe, extract, publish) for any
scheduler (Ray, Spark, Dask, a Slurm array).

    from hookserve.batch import plan_shards, run_shard
    for shard in plan_shards(["s3://bucket/shards/{000000..000127}.tar"]):
        run_shard(shard, out="s3://bucket/feats.parquet", layers=["layer4:avg"],
                  server="dns:///hookserve:50051")
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections import deque
from collections.abc import Sequence

from .. import errors, wire
from ..retry import RETRY_STREAM, RetryPolicy
from .defaults import DEFAULTS, LOCAL_ONLY
from .errors import Abort, one_line
from .intake import Intake
from .limits import ByteBudget, Cap, LastRequest, check_flags
from .readers import entries
from .remote import MissingExtra, set_store_timeout
from .shard_output import ShardIncomplete, ShardOutput, ShardResult
from .shard_plan import Shard, shard_from_key
from .sinks.base import OutputError
from .spec import connect, describe_and_check, parse_layers
from .streamcall import Watchdog, extract_many, weights_of


def read_opts(args, storage_options: dict, cap: Cap) -> dict:
    """How a shard is read (the keywords of :func:`~.readers.entries`)."""
    return {"opts": storage_options, "image_column": args.image_column,
            "id_column": args.id_column, "cap": cap, "timeout": args.timeout,
            "max_group_bytes": args.max_in_flight_bytes}


def output_meta(meta: dict, args) -> dict:
    """Settings that define the shards go into the metadata; --shard does not (every
    worker of one output writes the same metadata)."""
    meta = dict(meta, shard=None)
    meta["sharding"] = {"listing_shards": args.listing_shards, "shard_bytes": args.shard_bytes,
                        "image_column": args.image_column, "id_column": args.id_column}
    return meta


def open_output(out: str, meta: dict, opts: dict) -> ShardOutput:
    """The sharded run's output, its settings checked (or written) and listed once."""
    try:
        output = ShardOutput(out, meta, opts)
        output.open()
        output.files()
    except (OutputError, MissingExtra) as exc:
        raise Abort(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a store that cannot be reached or used
        raise Abort(f"cannot use the output {out}: {one_line(exc)}") from None
    return output


def run_shard(shard: str | Shard, out: str, layers: Sequence[str], *,
              server: str | Sequence[str] | None = None, client=None,
              storage_options: dict | None = None, **flags) -> ShardResult:
    """Extract one input shard into `out` (its part, errors file and done marker).

    `shard` is a :class:`~.shard_plan.Shard` from :func:`~.shard_plan.plan_shards`, or
    its key: a tar path or URL, a Parquet file (``...#rg=K`` for one row group; give
    ``image_column=``), or a listing bucket ``<input>#b/B``. `flags` are the
    `hookserve batch` flags with underscores (``reduction="avg"``, ``image_column=``,
    ``model=``, ``retries=``...). A shard whose marker is valid is skipped.

    Raises :class:`~.shard_output.ShardIncomplete` when an input failed in a way a rerun
    may fix (not found, network, overload, a cut container): the shard then has no
    marker, so a scheduler's retry does it again. Raises
    :class:`hookserve.HookserveError` when no server can do the work, and ValueError
    for bad settings; final per-image failures go to the shard's errors file.
    """
    unknown = set(flags) - (set(DEFAULTS) - LOCAL_ONLY)
    if unknown:
        raise TypeError(f"run_shard: unknown flags {sorted(unknown)}")
    args = argparse.Namespace(**{**DEFAULTS, "sharded": True, **flags, "out": out,
                                 "layers": list(layers), "inputs": [], "server": server})
    if isinstance(server, str):
        args.server = [server]
    opts = storage_options or {}
    set_store_timeout(args.timeout)
    try:
        check_flags(args)
        if not isinstance(shard, Shard):
            shard = shard_from_key(shard, opts, image_column=args.image_column,
                                   listing_shards=args.listing_shards,
                                   path_column=args.path_column, root=args.root)
        layer_objs = parse_layers(args.layers, args.reduction, args.dtype,
                                  args.l2_normalize)
    except Abort as exc:
        raise ValueError(str(exc)) from None
    own = client is None
    client = connect(args) if own else client
    try:
        try:
            meta, xopts, cap = describe_and_check(args, client, layer_objs)
            output = open_output(out, output_meta(meta, args), opts)
        except Abort as exc:
            raise ValueError(str(exc)) from None
        if shard.sid in output.done([shard]):
            return ShardResult(shard.key, skipped=True)
        output.forget(shard)
        rows, fails = extract_shard(client, shard, layer_objs, xopts, model=meta["model"],
                                    retries=args.retries, window=args.max_in_flight,
                                    read=read_opts(args, opts, cap),
                                    budget=ByteBudget(args.max_in_flight_bytes),
                                    watchdog=Watchdog(args.timeout, weights_of(meta)))
        result = output.publish(shard, rows, fails)
        if not result.complete:
            raise ShardIncomplete(result)
        return result
    finally:
        if own:
            client.close()


def extract_shard(client, shard: Shard, layers, opts: dict, *, model: str | None,
                  retries: int = DEFAULTS["retries"], window: int = 64, read: dict | None = None,
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
    policy = RetryPolicy(retries)
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
                    delay = policy.image_delay(r.error, att)
                    if delay is not None:
                        retry.append((delay, (pos, iid, data, att + 1)))
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
                        retry.append((policy.backoff(att + 1), (pos, iid, data, att + 1)))
                data = None
                if not retry:
                    time.sleep(policy.backoff(failed_passes))
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
