"""The shared tier: answers in Redis (``--cache-url``), for replicas behind a balancer.

Values are encoded answers (a JSON header and the tensor's bytes) under
``hookserve:<format>:<key hex>``, written with a TTL (``--cache-ttl-seconds``) and
only when at most ``--cache-max-value-bytes``. TLS (``rediss://``) and auth
(``redis://user:password@host``) come in the URL, as redis-py reads it.

Redis never fails or delays a request beyond ``--cache-timeout-ms``: every command
runs with that socket timeout and no retries, a lookup that fails is a miss (counted
as the tier's ``error`` event), and after a failure lookups are skipped (also misses)
for a second, so a Redis that is down costs one timeout a second, not one per image.
Writes go through one background thread and a bounded queue (a full queue drops the
write), with a socket timeout of at least a second.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

from ..attribution_spec import AttributionOutput, ClassScore, TargetResult
from ..spec import DType, LayerOutput
from ..telemetry import Telemetry
from .key import FORMAT

log = logging.getLogger("hookserve.cache")

#: After a failed command, lookups and writes are skipped for this long.
BACKOFF_S = 1.0
#: The socket timeout of writes (on the writer thread).
WRITE_TIMEOUT_S = 1.0
#: Writes waiting for the writer thread; more are dropped.
WRITE_QUEUE = 256
PREFIX = b"hookserve:" + FORMAT.rsplit(b"-", 1)[-1] + b":"


def encode(value: LayerOutput) -> bytes:
    head: dict = {"name": value.name, "dtype": value.dtype.name, "shape": list(value.shape),
                  "columns": list(value.columns)}
    if isinstance(value, AttributionOutput):
        head["targets"] = [[*_score(t.target), t.map_min, t.map_max, t.delta]
                           for t in value.targets]
        head["top5"] = [_score(s) for s in value.top5]
    raw = json.dumps(head).encode()
    return len(raw).to_bytes(4, "little") + raw + bytes(value.data)


def decode(blob: bytes) -> LayerOutput:
    n = int.from_bytes(blob[:4], "little")
    head = json.loads(blob[4:4 + n])
    fields = dict(name=head["name"], dtype=DType[head["dtype"]], shape=tuple(head["shape"]),
                  data=memoryview(blob)[4 + n:], columns=tuple(head["columns"]))
    if "targets" not in head:
        return LayerOutput(**fields)
    return AttributionOutput(
        **fields, top5=tuple(ClassScore(*s) for s in head["top5"]),
        targets=tuple(TargetResult(ClassScore(*t[:-3]), *t[-3:]) for t in head["targets"]))


def _score(s: ClassScore) -> list:
    return [s.class_index, s.logit, s.probability, s.label]


class SharedCache:
    def __init__(self, url: str, ttl_s: int, max_value_bytes: int, timeout_s: float,
                 telemetry: Telemetry | None = None) -> None:
        import redis  # the `cache` extra: preflight said so if it is missing

        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.telemetry = telemetry or Telemetry()
        def connect(timeout: float):
            return redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), retry_on_timeout=False)

        self._redis = connect(timeout_s)
        #: writes delay no request: they may take longer
        self._redis_writes = connect(max(WRITE_TIMEOUT_S, timeout_s))
        self._down_until = 0.0
        #: lookups and writes that failed or were skipped (the tier's `error` events)
        self.errors = 0
        self._writes: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="hookserve-cache-put",
                                        daemon=True)
        self._writer.start()

    def _failed(self, what: str, exc: Exception | None, n: int) -> None:
        self.errors += n
        self.telemetry.cache_event("shared", "error", n)
        if exc is not None:
            if time.monotonic() >= self._down_until:
                log.warning("answer cache: Redis %s failed (%s); treated as misses, "
                            "retried in %.0fs", what, exc, BACKOFF_S)
            self._down_until = time.monotonic() + BACKOFF_S

    def get_many(self, keys: list[bytes]) -> dict[bytes, LayerOutput]:
        """The values Redis holds for `keys`; {} when it cannot answer in time."""
        if time.monotonic() < self._down_until:
            self._failed("lookup", None, len(keys))
            return {}
        try:
            blobs = self._redis.mget([PREFIX + k.hex().encode() for k in keys])
        except Exception as exc:  # any failure of Redis is a miss
            self._failed("lookup", exc, len(keys))
            return {}
        out = {}
        for k, blob in zip(keys, blobs, strict=True):
            if blob is None:
                continue
            try:
                out[k] = decode(blob)
            except Exception:  # a value that is not ours (or torn): a miss
                log.warning("answer cache: an unreadable value in Redis was ignored")
        return out

    def put(self, key: bytes, value: LayerOutput) -> None:
        """Write in the background (dropped when the queue is full)."""
        if value.nbytes > self.max_value_bytes:
            return
        try:
            self._writes.put_nowait((key, value))
        except queue.Full:
            self.telemetry.cache_event("shared", "dropped")

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                item = None
                self._writes.task_done()

    def _write(self, key: bytes, value: LayerOutput) -> None:
        if time.monotonic() < self._down_until:
            self._failed("write", None, 1)
            return
        blob = encode(value)
        if len(blob) > self.max_value_bytes:
            return
        try:
            self._redis_writes.set(PREFIX + key.hex().encode(), blob, ex=self.ttl_s)
            self.telemetry.cache_event("shared", "store")
        except Exception as exc:
            self._failed("write", exc, 1)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the writes queued so far are done (tests, shutdown)."""
        done = self._writes.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._writes.unfinished_tasks, timeout)

    def close(self) -> None:
        try:
            self._writes.put_nowait(None)
        except queue.Full:
            pass
        self._redis.close()
        self._redis_writes.close()
