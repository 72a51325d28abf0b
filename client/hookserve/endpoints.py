"""The addresses a Client talks to: channels, round-robin, and failover on UNAVAILABLE.

Every call goes through :meth:`Endpoints.call` (unary) or :meth:`Endpoints.stream`
(a generator of results), which pick the next address that is up, and on UNAVAILABLE
mark it down for a while and try the next one, up to `retries` times (the codes and
the backoff are :mod:`.retry`'s, which `hookserve batch` shares). Any other
failure, or the last UNAVAILABLE, becomes the SDK's typed error.

The asyncio client (:mod:`.aio`) uses the same object with ``aio=True`` (grpc.aio
channels) and the same policy (:meth:`Endpoints.pick`, :meth:`Endpoints.failed`); only
its loops await.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
import grpc.experimental

from . import errors
from .retry import FIRST_BACKOFF, RETRIES, RETRYABLE, RetryPolicy
from .v1 import hookserve_pb2_grpc as pb_grpc
from .wire import Stub

T = TypeVar("T")

#: Client channel limits: chunks are at most 4 MiB; leave headroom.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
#: Sync channels only: unary-stream calls (ExtractImage) run on the calling thread
#: instead of through the channel's polling thread: ~0.5 ms a call here against ~3 ms
#: (measured; docs/performance.md). Read by grpc's Python layer only, never sent to core.
SYNC_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


def parse_targets(target: str | Sequence[str]) -> tuple[list[str], bool]:
    """-> (addresses, secure). Accepts host:port, grpc://, grpcs://, dns:///, or a list."""
    if not isinstance(target, str) and not (
            isinstance(target, Sequence) and all(isinstance(t, str) for t in target)):
        raise TypeError(f"address {target!r:.60}: give \"host:port\" (a string), or a "
                        "list of them")
    items = [target] if isinstance(target, str) else list(target)
    if len(items) == 1 and "," in items[0] and not items[0].startswith(("dns:", "ipv4:", "ipv6:")):
        items = [t.strip() for t in items[0].split(",") if t.strip()]
    secure = None
    addrs = []
    for t in items:
        t = t.strip()
        s = t.startswith("grpcs://")
        if t.startswith(("grpcs://", "grpc://")):
            t = t.split("://", 1)[1]
        check_address(t, tls=s)
        if secure is not None and s != secure:
            raise ValueError("mix of grpcs:// and plain targets")
        secure = s
        addrs.append(t)
    if not addrs:
        raise ValueError("no target given")
    return addrs, bool(secure)


#: gRPC's own target forms (name resolvers), passed on as given.
RESOLVERS = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def check_address(t: str, tls: bool = False) -> None:
    """A plain address is host:port (ValueError saying what to write, where gRPC would
    take a bare host as port 443 or fail on a scheme with an unclear message); with
    grpcs:// a bare host is port 443, TLS's own."""
    if t.startswith(RESOLVERS):
        return
    use = "use host:port, or grpcs://host:port for TLS"
    if "://" in t:
        raise ValueError(f"address {t[:200]!r}: {use} (hookserve speaks gRPC, not "
                         f"{t.split('://', 1)[0][:20]})")
    host, colon, port = t.rpartition(":")
    if t.startswith("[") and t.endswith("]"):   # [::1]: an IPv6 host, no port
        host, colon, port = t, "", ""
    elif host.count(":") and not host.endswith("]"):
        raise ValueError(f"address {t[:200]!r}: put an IPv6 address in brackets, as in "
                         "[::1]:50051")
    if colon and not host:
        raise ValueError(f"address {t[:200]!r} has no host: {use}, e.g. "
                         f"localhost{t[:20]}")
    if not colon or not host:
        if tls and t and not any(c in t for c in "/@"):
            return
        raise ValueError(f"address {t[:200]!r} has no port: {use} (hookserve serves on "
                         "port 50051 unless told otherwise)")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"address {t[:200]!r}: port {port[:20]!r} is not a number from "
                         f"1 to 65535: {use}")


def _read(v: bytes | str | os.PathLike | None, what: str) -> bytes | None:
    """A PEM given as bytes, or read from the file a path names."""
    if v is None or isinstance(v, bytes):
        return v
    try:
        with open(v, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ValueError(f"{what} {os.fspath(v)!r}: cannot read it ({exc.strerror}): give "
                         "the PEM file's path, or its bytes") from None


#: Channel options whose value is a byte count (-1: no limit).
SIZE_OPTIONS = ("grpc.max_send_message_length", "grpc.max_receive_message_length")


def check_options(options: Any) -> list[tuple[str, Any]]:
    """gRPC channel options as (name, value) pairs (a dict is its items), each name a
    string and each value set (not None or a bool); the message limits byte counts."""
    pairs = list(options.items()) if isinstance(options, Mapping) else options
    if isinstance(pairs, (str, bytes)) or not all(
            isinstance(o, (tuple, list)) and len(o) == 2 and isinstance(o[0], str)
            for o in pairs):
        raise TypeError(f"options {options!r:.80}: give gRPC channel options as (name, "
                        "value) pairs or a dict, e.g. {'grpc.max_send_message_length': "
                        "128 << 20}")
    for name, value in pairs:
        if value is None or isinstance(value, bool) or (
                name in SIZE_OPTIONS and not isinstance(value, int)):
            raise ValueError(f"option {name}={value!r:.40}: "
                             + ("a byte count (-1: no limit)" if name in SIZE_OPTIONS
                                else "a gRPC channel option is a number or a string"))
    return [tuple(o) for o in pairs]


def bare_token(token: str) -> str:
    """The token alone: a token given as its whole header value ("Bearer s3cret") is
    sent once as that, not as "Bearer Bearer s3cret"."""
    parts = token.split(None, 1)
    token = parts[1].strip() if len(parts) == 2 and parts[0].lower() == "bearer" \
        else token.strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in token):   # (gRPC: INTERNAL, logged)
        raise ValueError("token holds a control character (a tab, a line end): give the "
                         "token alone, as its file holds it")
    return token


class Endpoints:
    """One channel and stub per address, the auth metadata, and the failover policy.

    `aio`: grpc.aio channels (for :class:`hookserve.aio.Client`). Channels are made on
    first use, so an asyncio client binds them to the event loop that runs its calls.
    """

    def __init__(self, target: str | Sequence[str], *, token: str | None,
                 root_certificates: bytes | str | os.PathLike | None = None,
                 certificate_chain: bytes | str | os.PathLike | None = None,
                 private_key: bytes | str | os.PathLike | None = None,
                 retries: int = RETRIES, retry_backoff: float = FIRST_BACKOFF,
                 options: Sequence[tuple[str, Any]] = (), aio: bool = False) -> None:
        self.addresses, self.secure = parse_targets(target)
        #: the failover's tries and waits (:mod:`.retry`, shared with `hookserve batch`)
        self.policy = RetryPolicy(max(0, int(retries)), retry_backoff)
        self.retries = self.policy.retries
        self.aio = aio
        #: Sent with every call: ``authorization: Bearer ...`` when a token is set.
        self.metadata = (("authorization", f"Bearer {bare_token(token)}"),) if token else ()
        # the caller's options replace the defaults of the same name (gRPC would take
        # the first of two); a dict is its items
        options = check_options(options or ())
        given = {name for name, _ in options}
        self._options = [o for o in [*CHANNEL_OPTIONS, *([] if aio else SYNC_OPTIONS)]
                         if o[0] not in given] + list(options)
        named = dict(self._options)
        #: the largest request this client's channels send (gRPC's -1: no limit)
        self.max_send = int(named["grpc.max_send_message_length"])
        #: the largest answer message they take
        self.max_receive = int(named["grpc.max_receive_message_length"])
        self._creds = None
        if bool(certificate_chain) != bool(private_key):   # (gRPC aborts the process)
            raise ValueError("certificate_chain and private_key go together: a client "
                             "certificate needs its key (the CLI's --cert and --key)")
        if self.secure or root_certificates or certificate_chain:
            self.secure = True
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates, "root_certificates"),
                private_key=_read(private_key, "private_key"),
                certificate_chain=_read(certificate_chain, "certificate_chain"))
        self._channels: list[Any] | None = None
        self._stubs: list[pb_grpc.FeatureExtractorStub] = []
        self._rr = itertools.count(random.randrange(len(self.addresses)))
        #: monotonic time until which an address that answered UNAVAILABLE is skipped
        self._down_until = [0.0] * len(self.addresses)
        self._lock = threading.Lock()
        self.closed = False
        #: The smallest --max-message-bytes a server of these refused a stream's request
        #: over (or this client's own send limit, `send_limit_own`): a stream's requests
        #: over it fail alone, and the stream goes on.
        self.send_limit: int | None = None
        self.send_limit_own = False

    def _connect(self) -> list[Any]:
        if self.closed:
            raise ValueError("client is closed")
        with self._lock:
            if self._channels is None:
                lib = grpc.aio if self.aio else grpc
                channels = []
                for addr in self.addresses:
                    o = list(self._options)
                    # Names that resolve to several addresses (a headless Service via
                    # dns:///, or gRPC's static ipv4:a:p,b:p list) balance per call
                    # over all of them.
                    if addr.startswith(("dns:", "ipv4:", "ipv6:")):
                        o.append(("grpc.lb_policy_name", "round_robin"))
                    channels.append(lib.secure_channel(addr, self._creds, options=o)
                                    if self._creds else lib.insecure_channel(addr, options=o))
                self._stubs = [Stub(c) for c in channels]
                self._channels = channels
            return self._channels

    @property
    def channels(self) -> list[Any]:
        """One channel per address (grpc.aio channels when `aio`)."""
        return self._connect()

    @property
    def stubs(self) -> list[pb_grpc.FeatureExtractorStub]:
        self._connect()
        return self._stubs

    def close(self) -> list[Any]:
        """Close every sync channel; returns the aio channels' close() awaitables."""
        self.closed = True
        channels, self._channels = self._channels or [], None
        return [ch.close() for ch in channels]

    def pick(self) -> int:
        """Next address round-robin, skipping those recently found UNAVAILABLE."""
        self._connect()
        with self._lock:
            n = len(self.addresses)
            now = time.monotonic()
            for _ in range(n):
                i = next(self._rr) % n
                if self._down_until[i] <= now:
                    return i
            return min(range(n), key=self._down_until.__getitem__)  # all down: soonest back

    def failed(self, exc: grpc.RpcError, index: int, attempt: int,
               stream: bool = False) -> float:
        """After a failed call on address `index`: raise the typed error, or return the
        seconds to wait before retrying elsewhere. On UNAVAILABLE the address is skipped
        for a while (at least 1 s); the wait is the backoff only when no other is up.
        A `stream` a server ended because a request was over its size limit starts
        again at once, now that :attr:`send_limit` knows the limit (once per smaller
        limit)."""
        found = errors.send_limit(exc) if stream else None
        if found is not None and (self.send_limit is None or found[0] < self.send_limit):
            self.send_limit, self.send_limit_own = found
            return 0.0
        code = exc.code()
        if self.closed and code == grpc.StatusCode.CANCELLED:   # (as the asyncio client)
            raise errors.Cancelled("the client was closed while this call ran",
                                   grpc.StatusCode.CANCELLED) from None
        if code not in RETRYABLE:
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and len(self.addresses) > 1:
                with self._lock:   # a hung server: the next calls go elsewhere a while
                    self._down_until[index] = time.monotonic() + max(
                        self.policy.backoff(attempt), 1.0)
            raise errors.from_rpc_error(exc, self.max_receive) from None
        delay = self.policy.backoff(attempt)
        with self._lock:
            now = time.monotonic()
            self._down_until[index] = now + max(delay, 1.0)
            others_up = any(t <= now for i, t in enumerate(self._down_until) if i != index)
        # every address gets its try before the retries are spent (dead ones are skipped
        # for a while, so the tries go to those not found down yet)
        spare = self.policy.retries and others_up and attempt < (
            self.policy.retries + len(self.addresses))
        if not (self.policy.again(attempt) or spare):
            raise errors.from_rpc_error(exc, self.max_receive) from None
        return 0.0 if others_up else delay

    def call(self, fn: Callable[[pb_grpc.FeatureExtractorStub], T]) -> T:
        """``fn(stub)`` on the next address, moved to another one on UNAVAILABLE."""
        for attempt in itertools.count():
            index = self.pick()
            try:
                return fn(self.stubs[index])
            except grpc.RpcError as exc:
                time.sleep(self.failed(exc, index, attempt))
        raise AssertionError("unreachable")

    def stream(self, fn: Callable[[pb_grpc.FeatureExtractorStub], Iterator[T]]
               ) -> Iterator[T]:
        """Yield from ``fn(stub)``; on UNAVAILABLE call it again on another address
        (`fn` keeps whatever state it needs to resume where the last call stopped).
        The retries count the failures since the stream's last answer: a long stream
        outlives any number of restarts, each followed by progress."""
        attempt = 0
        while True:
            index = self.pick()
            answered = False
            try:
                for item in fn(self.stubs[index]):
                    answered = True
                    yield item
                return
            except grpc.RpcError as exc:
                attempt = 0 if answered else attempt
                time.sleep(self.failed(exc, index, attempt, stream=True))
                attempt += 1
