"""The shared tier: answers in Redis (``--cache-url``), for replicas behind a balancer.

Values are encoded answers (a JSON header and the tensor's bytes) under
``hookserve:<format>:<key hex>``, written with a TTL (``--cache-ttl-seconds``) and
only when at most ``--cache-max-value-bytes``. TLS (``rediss://``) and auth
(``redis://user:password@host``) come in the URL, as redis-py reads it.

A lookup never delays a request beyond ``--cache-timeout-ms`` overall (name lookup,
connecting and the reply together): it runs on a small pool of lookup threads and the
request waits for it that long at most; a lookup that fails or is late is a miss
(counted as the tier's ``error`` event), and after a failure lookups are skipped (also
misses) for a second, so a Redis that is down costs one timeout a second, not one per
image. When every lookup thread is still stuck on Redis, a lookup is skipped.

Writes go through one background thread and a queue of encoded values bounded by bytes
(WRITE_QUEUE_BYTES, counted in ``--max-buffer-bytes``); a write that does not fit is
dropped and counted (``dropped``). Writes run with a socket timeout of at least a
second. Values read back are checked before use (every header field's type, then kind,
name, dtype, shape, columns and size against the unit its key asks for,
`Job.unit_types`): one that does not match is a miss and an ``error``.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..attribution_spec import AttributionOutput, ClassScore, TargetResult
from ..spec import DType, LayerOutput, UnitType
from ..telemetry import Telemetry
from .key import FORMAT

log = logging.getLogger("hookserve.cache")

#: After a failed command, lookups and writes are skipped for this long.
BACKOFF_S = 1.0
#: The socket timeout of writes (on the writer thread).
WRITE_TIMEOUT_S = 1.0
#: Encoded bytes waiting for the writer thread; a write that does not fit is dropped.
WRITE_QUEUE_BYTES = 32 << 20
#: Lookups that may run at once (each at most --cache-timeout-ms once Redis answers).
LOOKUP_THREADS = 4
ITEMSIZE = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}
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
    """A value as encode wrote it; ValueError (or another exception) for anything else:
    every header field is checked for its type here, its sizes by `valid`."""
    n = int.from_bytes(blob[:4], "little")
    head = json.loads(blob[4:4 + n])
    fields = dict(name=_text(head["name"]), dtype=DType[head["dtype"]],
                  shape=tuple(_count(d) for d in head["shape"]),
                  data=memoryview(blob)[4 + n:],
                  columns=tuple(_text(c) for c in head["columns"]))
    if "targets" not in head and "top5" not in head:
        return LayerOutput(**fields)
    return AttributionOutput(
        **fields, top5=tuple(_class_score(s) for s in head["top5"]),
        targets=tuple(TargetResult(_class_score(t[:-3]), *(_number(x, True) for x in t[-3:]))
                      for t in head["targets"]))


# Each field is checked as its wire field will take it (a class index is a uint32, a
# size an int64, a score a float, a label UTF-8): a value that decodes here but could
# not be sent would end the whole call, not be a miss.
def _text(v) -> str:
    if not isinstance(v, str):
        raise ValueError("not a string")
    v.encode("utf-8")   # UnicodeEncodeError (a ValueError) for a lone surrogate
    return v


def _count(v, limit: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
        raise ValueError("not a size")
    return v


def _number(v, none: bool = False) -> float | None:
    if v is None and none:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            pass
    raise ValueError("not a number")


def _class_score(s: list) -> ClassScore:
    index, logit, prob, label = s
    return ClassScore(_count(index, 2**32 - 1), _number(logit), _number(prob),
                      label if label is None else _text(label))


def write_queue_bytes(max_value_bytes: int) -> int:
    """The write queue's bound: WRITE_QUEUE_BYTES, or one largest value if more."""
    return max(WRITE_QUEUE_BYTES, max_value_bytes)


def valid(value: LayerOutput, unit: UnitType, max_bytes: int) -> bool:
    """Whether a value read back is the answer its key asks for: of its kind (a layer's
    features or an Attribute answer, with as many targets and top classes), name,
    dtype, shape and columns, its bytes as many as the shape says, under the size cap."""
    if isinstance(value, AttributionOutput) != unit.attribution:
        return False
    if unit.attribution and (len(value.targets) != unit.targets
                             or len(value.top5) != unit.top):
        return False
    return (value.name == unit.name and value.dtype == unit.dtype
            and value.shape == unit.shape and value.columns == unit.columns
            and len(value.data) == math.prod(value.shape) * ITEMSIZE[value.dtype]
            and len(value.data) <= max_bytes)


def _refused(exc: BaseException) -> bool:
    """Whether Redis answered with a refusal of the command (an error reply), not a
    failure to reach it."""
    try:
        import redis
    except ImportError:
        return False
    return isinstance(exc, redis.exceptions.ResponseError)


def _score(s: ClassScore) -> list:
    return [s.class_index, s.logit, s.probability, s.label]


class SharedCache:
    def __init__(self, url: str, ttl_s: int, max_value_bytes: int, timeout_s: float,
                 telemetry: Telemetry | None = None) -> None:
        import redis  # the `cache` extra: preflight said so if it is missing

        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.timeout_s = timeout_s
        self.telemetry = telemetry or Telemetry()

        def connect(timeout: float):
            return redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), retry_on_timeout=False)

        self._redis = connect(timeout_s)
        #: writes delay no request: they may take longer
        self._redis_writes = connect(max(WRITE_TIMEOUT_S, timeout_s))
        self._down_until = 0.0
        #: refused (or not) -> no failure of that kind is logged again before then
        self._quiet_until: dict[bool, float] = {}
        #: lookups and writes that failed, were late, skipped or invalid (`error` events)
        self.errors = 0
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS,
                                           thread_name_prefix="hookserve-cache-get")
        self._busy = 0  # lookups running or queued on the pool
        self._lock = threading.Lock()
        #: the write queue's bound, counted in --max-buffer-bytes (cache/front.py)
        self.queue_bytes = write_queue_bytes(max_value_bytes)
        self._queued = 0  # encoded bytes in the write queue
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hookserve-cache-put",
                                        daemon=True)
        self._writer.start()

    def _failed(self, what: str, exc: BaseException | None, n: int) -> None:
        """Count a failure; one of Redis's connection or time skips Redis a while, a
        command Redis refused (a full Redis, an expiry it does not take) only that
        command. Each kind is logged at most once in BACKOFF_S."""
        self.errors += n
        self.telemetry.cache_event("shared", "error", n)
        if exc is None:
            return
        refused = _refused(exc)
        now = time.monotonic()
        if now >= self._quiet_until.get(refused, 0.0):
            self._quiet_until[refused] = now + BACKOFF_S
            if refused:
                log.warning("answer cache: Redis refused a %s (%s); that value is not "
                            "stored, lookups go on (a Redis at its maxmemory needs an "
                            "eviction policy such as allkeys-lru)", what, exc)
            else:
                log.warning("answer cache: Redis %s failed (%s); treated as misses, "
                            "retried in %.0fs", what, exc or "timed out", BACKOFF_S)
        if not refused:
            self._down_until = now + BACKOFF_S

    def refusal(self) -> str | None:
        """Ask Redis once, at start-up: what it refuses for good (a database it does not
        have, a wrong password), or None. Redis not answering now is no refusal: lookups
        are misses until it does."""
        import redis

        try:
            self._redis.ping()
        except (redis.exceptions.ResponseError, redis.exceptions.AuthenticationError) as exc:
            return str(exc) or type(exc).__name__
        except Exception:  # noqa: BLE001 - down or slow: it may come up later
            return None
        return None

    def get_many(self, keys: list[bytes], expect: list[UnitType]
                 ) -> dict[bytes, LayerOutput]:
        """The values Redis holds for `keys` (each checked against what its unit is,
        `expect`); {} when it cannot answer within the timeout."""
        with self._lock:
            skip = time.monotonic() < self._down_until or self._busy >= LOOKUP_THREADS
            if not skip:
                self._busy += 1
        if skip:
            self._failed("lookup", None, len(keys))
            return {}
        try:
            job = self._lookups.submit(self._mget, keys)
        except RuntimeError:  # closed
            self._done_lookup(None)
            return {}
        job.add_done_callback(self._done_lookup)
        try:
            blobs = job.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._failed("lookup", TimeoutError("no answer in time"), len(keys))
            return {}
        except Exception as exc:  # any failure of Redis is a miss
            self._failed("lookup", exc, len(keys))
            return {}
        out = {}
        for k, unit, blob in zip(keys, expect, blobs, strict=True):
            if blob is None:
                continue
            try:
                value = decode(blob)
                ok = valid(value, unit, self.max_value_bytes)
            except Exception:  # torn, or not ours
                ok = False
            if ok:
                out[k] = value
            else:
                log.warning("answer cache: a value in Redis that does not match its key "
                            "was ignored")
                self._failed("value", None, 1)
        return out

    def _mget(self, keys: list[bytes]) -> list:
        return self._redis.mget([PREFIX + k.hex().encode() for k in keys])

    def _done_lookup(self, _job) -> None:
        with self._lock:
            self._busy -= 1

    def put(self, key: bytes, value: LayerOutput) -> None:
        """Write in the background: encoded now, dropped (and counted) when it does not
        fit the write queue's bytes, or not at all when over --cache-max-value-bytes."""
        if value.nbytes > self.max_value_bytes:
            return
        blob = encode(value)
        if len(blob) > self.max_value_bytes:
            return
        with self._lock:
            fits = self._queued + len(blob) <= self.queue_bytes
            if fits:
                self._queued += len(blob)
        if not fits:
            self.telemetry.cache_event("shared", "dropped")
            return
        self._writes.put((key, blob))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a bug: the writer goes on with the next value
                log.exception("answer cache: writing to Redis failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._queued -= len(item[1])
                item = None
                self._writes.task_done()

    def _write(self, key: bytes, blob: bytes) -> None:
        if time.monotonic() < self._down_until:
            self._failed("write", None, 1)
            return
        try:
            self._redis_writes.set(PREFIX + key.hex().encode(), blob, ex=self.ttl_s)
            self.telemetry.cache_event("shared", "store")
        except Exception as exc:
            self._failed("write", exc, 1)

    @property
    def queued_bytes(self) -> int:
        """Encoded bytes waiting in the write queue now."""
        return self._queued

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the writes queued so far are done (tests, shutdown)."""
        done = self._writes.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._writes.unfinished_tasks, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (for `timeout` at most), then stop the threads."""
        self._writes.put(None)
        self._writer.join(timeout)
        self._lookups.shutdown(wait=False)
        self._redis.close()
        self._redis_writes.close()
