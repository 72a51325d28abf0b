"""One count of the open calls that hold a thread, and their caps.

The synchronous gRPC server holds one pool thread per open call. The work calls
(`WORK_RPCS`: Extract, ExtractImage, Attribute) are counted together against
`--max-streams` (the servicer holds a `work_slot` for each; the drain waits for them,
`wait_idle`); they may be silent for as long as a big batch computes, so no idle
timeout applies to them. Every other streaming method (health Watch, reflection) is
counted per method by the interceptor: calls beyond `--max-side-streams` of one
method get RESOURCE_EXHAUSTED, and a call with no message either way for
`--stream-idle-seconds` is cancelled. The server sizes its thread pool from these
caps plus spare threads, so no number of open streams can stop health Check,
ListModels or DescribeModel from answering.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from hookserve.v1 import hookserve_pb2 as pb

from .errors import ResourceExhausted, Unavailable
from .oip import grpc_service_pb2 as oip_pb

_HOOKSERVE = pb.DESCRIPTOR.services_by_name["FeatureExtractor"].full_name
_OIP = oip_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
#: The work calls by name, each with the method path it is counted under; together
#: they are capped at --max-streams (a new one joins here). `HTTPInfer` is the REST
#: front door's infer route, which has no gRPC path.
WORK_RPCS = {**{m: f"/{_HOOKSERVE}/{m}" for m in ("Extract", "ExtractImage", "Attribute")},
             **{m: f"/{_OIP}/{m}" for m in ("ModelInfer", "ModelStreamInfer")},
             "HTTPInfer": "POST /v2/models/{model}/infer"}
#: The gRPC methods among them (exempt from the side streams' caps and idle timeout).
WORK_STREAMS = tuple(path for path in WORK_RPCS.values() if path.startswith("/"))
#: Every other streaming method this server registers (health Watch, reflection, and
#: any added to the proto later). The thread pool keeps `--max-side-streams` for each.
SIDE_STREAMS = tuple(sorted(
    f"/{svc.full_name}/{m.name}"
    for fd in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)
    for svc in fd.services_by_name.values() for m in svc.methods
    if (m.client_streaming or m.server_streaming)
    and f"/{svc.full_name}/{m.name}" not in WORK_STREAMS))


class _Slot:
    """One open capped call: its method, context and time of last message."""

    __slots__ = ("method", "context", "last", "cancelled")

    def __init__(self, method: str, context) -> None:
        self.method = method
        self.context = context
        self.last = time.monotonic()
        self.cancelled = False


class StreamCaps(grpc.ServerInterceptor):
    """Counts the open calls of each method: the work calls together (`work_slot`,
    --max-streams), each side-stream method alone (refuses extras, cancels idle ones).

    `draining` says whether shutdown began (new calls get UNAVAILABLE); `start_drain`
    runs the engine's own drain under the count's lock, so no call slips in between.
    """

    def __init__(self, per_method: int, idle_s: float, max_streams: int = 128,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.per_method = per_method
        self.idle_s = idle_s
        self.max_streams = max_streams
        self._draining = draining
        self._open: collections.Counter[str] = collections.Counter()
        self._slots: set[_Slot] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._reaper: threading.Thread | None = None

    def open_calls(self, method: str) -> int:
        with self._cond:
            return self._open[method]

    def wait_closed(self, method: str, timeout: float) -> bool:
        """Until no call of `method` is open (its handler returned); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._open[method] == 0, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the work calls ----------------------------------------------------------------
    @property
    def work_streams(self) -> int:
        """Work calls open now (tests and the drain watch this)."""
        with self._cond:
            return self._open_work()

    def _open_work(self) -> int:
        return sum(self._open[m] for m in WORK_RPCS.values())

    def refuse_if_draining(self) -> None:
        # Unary calls too: during a rolling restart the SDK then asks another replica.
        if self._draining():
            raise Unavailable("server is shutting down: retry on another replica")

    @contextlib.contextmanager
    def work_slot(self, rpc: str):
        """An open work call (one of WORK_RPCS), counted for the length of the call;
        together they are capped at --max-streams."""
        method = WORK_RPCS[rpc]
        with self._cond:
            self.refuse_if_draining()
            total = self._open_work()
            if total >= self.max_streams:
                raise ResourceExhausted(
                    f"{total} work calls ({', '.join(WORK_RPCS)}) are open, this server's limit "
                    "(--max-streams): retry shortly or use another replica",
                    retry_after_s=1.0)
            self._open[method] += 1
        try:
            yield
        finally:
            with self._cond:
                self._open[method] -= 1
                self._cond.notify_all()

    def start_drain(self, drain: Callable[[], None]) -> None:
        """Run `drain` (the engine's: open streams stop taking new images) under the
        count's lock: from here on new calls get UNAVAILABLE."""
        with self._cond:
            drain()

    def wait_idle(self, timeout: float) -> bool:
        """Until no work call is open; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._open_work() == 0, timeout)

    # -- interceptor -------------------------------------------------------------------
    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if (handler is None or details.method in WORK_STREAMS
                or not (handler.request_streaming or handler.response_streaming)):
            return handler
        method = details.method
        inner = (handler.stream_stream or handler.unary_stream
                 or handler.stream_unary)
        if handler.response_streaming:
            def behavior(request, context):
                slot = self._enter(method, context)
                try:
                    if handler.request_streaming:
                        request = self._touching(request, slot)
                    for msg in inner(request, context):
                        slot.last = time.monotonic()
                        yield msg
                finally:
                    self._exit(slot)
        else:
            def behavior(request, context):
                slot = self._enter(method, context)
                try:
                    return inner(self._touching(request, slot), context)
                finally:
                    self._exit(slot)
        return same_shape(handler, behavior)

    @staticmethod
    def _touching(requests, slot: _Slot):
        for req in requests:
            slot.last = time.monotonic()
            yield req

    def _enter(self, method: str, context) -> _Slot:
        with self._cond:
            n = self._open[method]
            if n >= self.per_method:
                refused = True
            else:
                refused = False
                self._open[method] = n + 1
                slot = _Slot(method, context)
                self._slots.add(slot)
                self._start_reaper()
                self._cond.notify_all()
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{n} {method} streams are open, this server's limit per method "
                          "(--max-side-streams): close idle streams or retry later")
        return slot

    def _exit(self, slot: _Slot) -> None:
        with self._cond:
            self._slots.discard(slot)
            self._open[slot.method] -= 1
            self._cond.notify_all()

    # -- idle timeout --------------------------------------------------------------------
    def _start_reaper(self) -> None:
        if self._reaper is None and self.idle_s > 0:
            self._reaper = threading.Thread(target=self._reap, name="hookserve-idle-streams",
                                            daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        """Cancel calls idle for idle_s; sleeps until the next one could be due."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                live = [s for s in self._slots if not s.cancelled]
                idle = [s for s in live if now - s.last >= self.idle_s]
                for s in idle:  # still counted until its handler returns (_exit)
                    s.cancelled = True
                if not idle:
                    due = min((s.last for s in live), default=None)
                    self._cond.wait(None if due is None else due + self.idle_s - now)
            for s in idle:
                s.context.cancel()


def same_shape(handler, behavior):
    """A method handler of `handler`'s shape (unary/stream both ways) running `behavior`."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(behavior, handler.request_deserializer, handler.response_serializer)
