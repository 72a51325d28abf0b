"""Caps on the open streaming calls other than the work streams: health Watch, reflection.

The synchronous gRPC server holds one pool thread per open call. The work calls
(Extract, ExtractImage and Attribute) are counted by the servicer (`--max-streams`,
shared); they may be silent for as long as a big batch computes, so no idle timeout
applies to them. Every other streaming method (health Watch, reflection) is counted here, per
method: calls beyond
`--max-side-streams` of one method get RESOURCE_EXHAUSTED, and a call with no message
either way for `--stream-idle-seconds` is cancelled. The server sizes its thread pool
from these caps plus spare threads, so no number of open streams can stop health
Check, ListModels or DescribeModel from answering.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from hookserve.v1 import hookserve_pb2 as pb

#: The work calls: the servicer counts them itself (--max-streams, shared).
EXTRACT = "/hookserve.v1.FeatureExtractor/Extract"
EXTRACT_IMAGE = "/hookserve.v1.FeatureExtractor/ExtractImage"
ATTRIBUTE = "/hookserve.v1.FeatureExtractor/Attribute"
WORK_STREAMS = (EXTRACT, EXTRACT_IMAGE, ATTRIBUTE)
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
    """Counts open calls of each side-stream method; refuses extras, cancels idle ones."""

    def __init__(self, per_method: int, idle_s: float, exempt: tuple[str, ...] = WORK_STREAMS
                 ) -> None:
        self.per_method = per_method
        self.idle_s = idle_s
        self._exempt = exempt
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

    # -- interceptor -------------------------------------------------------------------
    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if (handler is None or details.method in self._exempt
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
