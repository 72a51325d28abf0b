"""The gRPC servicer: a thin adapter between protobuf and the engine, RPC methods only.

Each method parses (wire.py), calls the engine, and encodes (wire.py): protobuf in ->
domain objects -> Engine -> domain results -> protobuf out. Errors are raised as
domain errors and mapped to statuses by status.py (`mapped`). Beside it,
stream_caps.py counts the open work calls (--max-streams, the drain) and calls.py logs
and counts each call.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import grpc

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from . import wire
from .calls import Calls, call_deadline, call_stats
from .errors import Cancelled
from .status import mapped

if TYPE_CHECKING:  # the servicer is handed an engine; it never imports torch
    from .engine import Engine
    from .stream_caps import StreamCaps


class Servicer(pb_grpc.FeatureExtractorServicer):
    """hookserve.v1.FeatureExtractor over an Engine."""

    def __init__(self, engine: Engine, calls: Calls, streams: StreamCaps, *,
                 chunk_bytes: int = 2 << 20, max_message_bytes: int = 0) -> None:
        self.engine = engine
        self.calls = calls
        #: the work-call gate (--max-streams) and the drain
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        #: the request size limit, reported by DescribeModel (0: not reported)
        self.max_message_bytes = max_message_bytes

    @functools.cached_property
    def _weights_header(self) -> tuple:
        """Every stream's initial metadata (the served models do not change)."""
        return wire.weights_header(self.engine.models.values())

    @mapped
    def ListModels(self, request, context):
        with self.calls.observed("ListModels", context, {"model": ""}):
            wire.parse(pb.ListModelsRequest, request)
            self.streams.refuse_if_draining()
            return pb.ListModelsResponse(
                models=[wire.model_info(m) for m in self.engine.models.values()])

    @mapped
    def DescribeModel(self, request, context):
        stats = {"model": ""}
        with self.calls.observed("DescribeModel", context, stats):
            request = wire.parse(pb.DescribeModelRequest, request)
            stats["model"] = self.calls.model_label(request.model)
            self.streams.refuse_if_draining()
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
        stats = call_stats()
        with (self.calls.observed("ExtractImage", context, stats),
              self.streams.work_slot("ExtractImage")):
            spec, image = wire.image_request(request)
            self.calls.note_spec(spec, stats)
            session = self.engine.session(call_deadline(context))
            context.add_callback(session.cancel)
            messages = functools.partial(wire.tensor_messages, chunk_bytes=self.chunk_bytes)
            for result in session.run_one(spec, image):
                yield from self.calls.answered(result, stats, messages)
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
        stats = call_stats()
        with self.calls.observed(method, context, stats), self.streams.work_slot(method):
            if self._weights_header:
                context.send_initial_metadata(self._weights_header)
            session = self.engine.session(call_deadline(context))
            context.add_callback(session.cancel)
            encode = functools.partial(messages, chunk_bytes=self.chunk_bytes)
            noted = self.calls.noted(_client_gone_is_cancelled(requests), stats)
            for result in session.run(noted):
                yield from self.calls.answered(result, stats, encode)
                yield wire.status_message(result, response_cls)



def _client_gone_is_cancelled(requests):
    """grpc's request iterator raises RpcError once the client cancels or disconnects,
    sometimes before the call's cancel callback has run: say what it is."""
    try:
        yield from requests
    except grpc.RpcError:
        raise Cancelled("the client cancelled the call or went away") from None
