"""The gRPC servicer: a thin adapter between protobuf and the engine.

Protobuf in (wire.py) -> domain objects -> Engine -> domain results -> protobuf out
(wire.py). Errors are raised as domain errors and mapped to statuses by status.py.
It counts the open work streams, Extract and Attribute, against one cap
(--max-streams), so a drain waits for both; the drain state is the engine's.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from . import wire
from .attribution_spec import AttributionSpec
from .errors import Cancelled, ResourceExhausted, Unavailable
from .spec import ExtractionSpec, ImageResult
from .status import mapped
from .telemetry import Telemetry

if TYPE_CHECKING:  # the servicer is handed an engine; it never imports torch
    from .engine import Engine

log = logging.getLogger("hookserve.calls")


class Servicer(pb_grpc.FeatureExtractorServicer):
    """hookserve.v1.FeatureExtractor over an Engine."""

    def __init__(self, engine: Engine, telemetry: Telemetry, *, chunk_bytes: int = 2 << 20,
                 max_streams: int = 128, max_message_bytes: int = 0) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.chunk_bytes = chunk_bytes
        #: the request size limit, reported by DescribeModel (0: not reported)
        self.max_message_bytes = max_message_bytes
        self.max_streams = max_streams
        #: open streams by method ("Extract", "Attribute")
        self._active: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()

    # -- lifecycle, used by the server's shutdown ---------------------------------------
    def start_drain(self) -> None:
        """New calls get UNAVAILABLE; open streams stop taking new images."""
        with self._cond:  # no stream slips in between the check in _enter and the drain
            self.engine.start_drain()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no Extract or Attribute call is running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not +self._active, timeout)

    @property
    def open_streams(self) -> int:
        """Extract and Attribute calls running now (tests and the drain watch this)."""
        with self._cond:
            return sum(self._active.values())

    def _refuse_if_draining(self) -> None:
        # Unary calls too: during a rolling restart the SDK then asks another replica.
        if self.engine.draining:
            raise Unavailable("server is shutting down: retry on another replica")

    @contextlib.contextmanager
    def _stream_slot(self, method: str = "Extract"):
        """An open work stream (Extract or Attribute), counted for the length of the
        call; together they are capped at --max-streams. They are exempt from
        stream_caps.py's idle timeout: a stream may be silent while its batch runs."""
        with self._cond:
            self._refuse_if_draining()
            total = sum(self._active.values())
            if total >= self.max_streams:
                raise ResourceExhausted(
                    f"{total} Extract/Attribute streams are open, this server's limit "
                    "(--max-streams): retry shortly or use another replica",
                    retry_after_s=1.0)
            self._active[method] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[method] -= 1
                self._cond.notify_all()

    # -- observation -------------------------------------------------------------------
    def _model_label(self, name: str) -> str:
        """A model name fit for a metric label: unknown names collapse to "unknown"."""
        name = name or self.engine.default_model
        return name if name in self.engine.models else "unknown"

    @contextlib.contextmanager
    def _observed(self, method: str, context, stats: dict):
        """Count the call by RPC, model, code (and attribution method), and log one
        line for it (logs.py writes its fields as JSON or as text)."""
        t0 = time.monotonic()
        code = "OK"
        try:
            yield stats
        except GeneratorExit:  # the client went away mid-stream
            code = "CANCELLED"
            raise
        except Exception as exc:
            code = getattr(exc, "code", "INTERNAL")
            raise
        finally:
            attribution = stats.get("attribution_method", "")
            self.telemetry.call_done(method, stats.get("model", ""), code, attribution)
            line = {"event": "call", "method": method, "peer": context.peer(), **stats,
                    "seconds": round(time.monotonic() - t0, 4), "code": code}
            log.info(_CallLine(line), extra={"fields": line})

    def _noted(self, requests, stats: dict):
        """Pass requests through, noting the latest spec's model and layers for logs and
        metrics (names are cut short: they come from the client). A request stream that
        breaks because the client went away is the domain's Cancelled, not a fault."""
        for req in _client_gone_is_cancelled(requests):
            if isinstance(req, ExtractionSpec):
                stats["model"] = self._model_label(req.model)
                stats["layers"] = [layer.name[:100] for layer in req.layers[:32]]
            elif isinstance(req, AttributionSpec):
                stats["model"] = self._model_label(req.model)
                stats["layers"] = [req.layer[:100]] if req.layer else []
                stats["attribution_method"] = req.method.label
            yield req

    # -- RPCs ----------------------------------------------------------------------------
    @mapped
    def ListModels(self, request, context):
        with self._observed("ListModels", context, {"model": ""}):
            wire.parse(pb.ListModelsRequest, request)
            self._refuse_if_draining()
            return pb.ListModelsResponse(
                models=[wire.model_info(m) for m in self.engine.models.values()])

    @mapped
    def DescribeModel(self, request, context):
        stats = {"model": ""}
        with self._observed("DescribeModel", context, stats):
            request = wire.parse(pb.DescribeModelRequest, request)
            stats["model"] = self._model_label(request.model)
            self._refuse_if_draining()
            m, (h, w), layers = self.engine.describe(request.model, request.input_height,
                                                     request.input_width)
            return pb.DescribeModelResponse(
                model=wire.model_info(m), input_height=h, input_width=w,
                layers=[wire.layer_info(li) for li in layers],
                gradient_bytes_per_image=self.engine.gradient_bytes(m, h, w),
                max_message_bytes=self.max_message_bytes)

    @mapped
    def Extract(self, request_iterator, context):
        yield from self._stream("Extract", wire.requests(request_iterator), context,
                                wire.tensor_messages, pb.ExtractResponse)

    @mapped
    def ExtractImage(self, request, context):
        """One image, no stream kept open: its tensors, then the call's status is the
        image's (an error is raised, and mapped, before any tensor is sent)."""
        stats = _call_stats()
        with self._observed("ExtractImage", context, stats), self._stream_slot("ExtractImage"):
            spec, image = wire.image_request(request)
            stats["model"] = self._model_label(spec.model)
            stats["layers"] = [layer.name[:100] for layer in spec.layers[:32]]
            session = self.engine.session(_deadline(context))
            context.add_callback(session.cancel)
            for result in session.run_one(spec, image):
                yield from self._answer(result, stats, wire.tensor_messages)
                if result.error is not None:
                    error, result = result.error, None
                    try:
                        raise error.detached()
                    finally:
                        error = None  # (this frame must not hold what it raised)

    @mapped
    def Attribute(self, request_iterator, context):
        yield from self._stream("Attribute", wire.attribute_requests(request_iterator),
                                context, wire.attribution_messages, pb.AttributeResponse)

    def _stream(self, method: str, requests, context, messages, response_cls):
        """One Extract or Attribute call: a Session over the parsed requests, each
        image's answer as `messages(result, chunk_bytes)` then its status."""
        stats = _call_stats()
        with self._observed(method, context, stats), self._stream_slot(method):
            session = self.engine.session(_deadline(context))
            context.add_callback(session.cancel)
            for result in session.run(self._noted(requests, stats)):
                yield from self._answer(result, stats, messages)
                yield wire.status_message(result, response_cls)

    def _answer(self, result: ImageResult, stats: dict, messages) -> Iterator:
        model = stats["model"]
        stats["images"] += 1
        if result.error is not None:
            stats["failed"] += 1
            self.telemetry.image_done(model, result.error.code)
        else:
            t0 = time.perf_counter()
            yield from messages(result, self.chunk_bytes)
            nbytes = sum(o.nbytes for o in result.outputs or ())
            stats["bytes"] += nbytes
            self.telemetry.serialize_seconds(time.perf_counter() - t0)
            self.telemetry.bytes_sent(model, nbytes)
            self.telemetry.image_done(model, "OK")


class _CallLine(dict):
    """A call's log fields; as the record's message, their JSON (made only if used)."""

    def __str__(self) -> str:
        return json.dumps(self)


def _call_stats() -> dict:
    """What one work call's log line and metrics report, filled in as it runs."""
    return {"model": "", "layers": [], "images": 0, "failed": 0, "bytes": 0}


def _deadline(context) -> float | None:
    """The call's deadline as a time.monotonic() value (None: the client set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _client_gone_is_cancelled(requests):
    """grpc's request iterator raises RpcError once the client cancels or disconnects,
    sometimes before the call's cancel callback has run: say what it is."""
    try:
        yield from requests
    except grpc.RpcError:
        raise Cancelled("the client cancelled the call or went away") from None
