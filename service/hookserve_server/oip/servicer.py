"""Triton's `inference.GRPCInferenceService` over the engine: a thin adapter, protobuf
in, `Inference` (infer.py) and `metadata.py`, protobuf out. No torch.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, ModelInfer and ModelStreamInfer; the repository, shared-memory, trace
and log RPCs are not registered, so they answer UNIMPLEMENTED. Requests arrive as raw
bytes and are parsed here (a message that does not parse is INVALID_ARGUMENT), as for
hookserve's own service (server.py says why).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from .. import wire
from ..calls import call_deadline
from ..errors import (
    HookserveError,
    InternalError,
    InvalidArgument,
    ModelNotFound,
    Unavailable,
)
from ..status import mapped, short_message
from . import grpc_service_pb2 as pb
from . import metadata as md
from . import model_config_pb2 as mc
from .infer import VERSION, CallCancel, Inference
from .request import (
    MAX_IMAGES,
    InferCall,
    InTensor,
    OutRequest,
    check_input_params,
    distinct_inputs,
    no_shared_memory,
    own_params,
    timeout_of,
    too_many_images,
)
from .tensors import InferAnswer, element_count

log = logging.getLogger("hookserve.oip")

if TYPE_CHECKING:
    from ..servicer import Servicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_CONFIG_TYPES = {"BYTES": mc.TYPE_STRING, "UINT8": mc.TYPE_UINT8, "INT64": mc.TYPE_INT64,
                 "FP32": mc.TYPE_FP32, "FP16": mc.TYPE_FP16, "BF16": mc.TYPE_BF16}


def params_of(m) -> dict:
    """An InferParameter map as plain values."""
    return {k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in m.items()}


def _typed(t) -> list | bytes:
    """An input's typed contents, once their count is the one its shape says (counted
    before any element is copied out: a few bytes on the wire each, far more as
    Python objects)."""
    c = t.contents
    name = {"BYTES": "bytes_contents", "UINT8": "uint_contents", "INT64": "int64_contents",
            "INT32": "int_contents"}.get(t.datatype)
    if name is None:
        raise InvalidArgument(f"input {t.name[:100]!r}: datatype {t.datatype[:20]} is not "
                              "one this server reads (BYTES, UINT8, INT64, INT32)")
    field = getattr(c, name)
    want = element_count(tuple(t.shape), f"input {t.name[:100]!r}")
    held = [f.name for f, _ in c.ListFields()]
    if not field and want and held:   # the values sent in another type's field
        raise InvalidArgument(f"input {t.name[:100]!r}: a {t.datatype} input's values go in "
                              f"{name}, not {held[0]} (or send raw_input_contents)")
    if len(field) != want:
        raise InvalidArgument(f"input {t.name[:100]!r}: shape {list(t.shape)} says {want} "
                              f"elements, its typed contents hold {len(field)}")
    if t.datatype != "UINT8" and want > MAX_IMAGES:   # (one element an image)
        raise InvalidArgument(f"input {t.name[:100]!r}: " + too_many_images(want))
    if t.datatype == "UINT8":
        try:
            return bytes(field)   # (one byte a value, not a list of ints)
        except ValueError:
            raise InvalidArgument(f"{t.name[:100]}: UINT8 contents hold a value over 255"
                                  ) from None
    return list(field)


def to_call(req: pb.ModelInferRequest) -> InferCall:
    raw = req.raw_input_contents
    for t in req.inputs:
        check_input_params(params_of(t.parameters), t.name)
    if raw and len(raw) != len(req.inputs):
        raise InvalidArgument(f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs: "
                              "send one per input, or typed contents for all")
    both = next((t.name for t in req.inputs if raw and t.contents.ByteSize()), None)
    if both is not None:
        raise InvalidArgument(f"input {both[:100]!r} has typed contents beside "
                              "raw_input_contents: send every input one way")
    distinct_inputs([t.name for t in req.inputs])
    inputs = [InTensor(t.name, t.datatype, tuple(t.shape), raw[i] if raw else _typed(t))
              for i, t in enumerate(req.inputs)]
    outputs = [OutRequest(o.name, params_of(o.parameters)) for o in req.outputs]
    for o in outputs:
        no_shared_memory(o.params, f"output {o.name[:100]!r}")
    params = params_of(req.parameters)
    return InferCall(req.model_name, req.model_version, req.id, inputs, outputs,
                     own_params(params), timeout_of(params))


def to_response(ans: InferAnswer) -> pb.ModelInferResponse:
    """Every output in raw_output_contents (what tritonclient's as_numpy reads)."""
    resp = pb.ModelInferResponse(model_name=ans.model, model_version=VERSION, id=ans.id)
    for t in ans.outputs:
        o = resp.outputs.add()
        o.name = t.name
        o.datatype = t.datatype
        o.shape.extend(t.shape)
        resp.raw_output_contents.append(t.data)
    return resp


def _tensors(items: list[dict]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [pb.ModelMetadataResponse.TensorMetadata(**t) for t in items]


def _config_io(cls, items: list[dict], **extra) -> list:
    return [cls(name=t["name"], data_type=_CONFIG_TYPES[t["datatype"]], dims=t["shape"],
                **extra) for t in items]



class OipServicer:
    """inference.GRPCInferenceService over an Engine, beside hookserve's servicer."""

    def __init__(self, inference: Inference, servicer: Servicer,
                 ready: Callable[[], bool]) -> None:
        self.inference = inference
        self.engine = inference.engine
        self.servicer = servicer
        self._ready = ready
        #: the open ModelStreamInfer calls' contexts -> whether each waits for its next
        #: request (idle: ended at drain, `end_idle_streams`)
        self._streams: dict = {}
        self._streams_lock = threading.Lock()

    def end_idle_streams(self) -> None:
        """(At drain) end each ModelStreamInfer stream that waits for its next request:
        it would hold the drain until its client closed it or the grace period ended.
        A stream answering a request ends once it has answered it."""
        with self._streams_lock:
            idle = [ctx for ctx, waiting in self._streams.items() if waiting]
        for ctx in idle:
            ctx.cancel()

    def _waiting(self, context, waiting: bool) -> None:
        with self._streams_lock:
            self._streams[context] = waiting

    def _parse(self, cls, request):
        return wire.parse(cls, request)

    def _model(self, name: str, version: str = "") -> str:
        """A requested model as its one spelling (NOT_FOUND for no served model)."""
        self.inference.check_version(version)
        return self.inference.served_name(name)

    @mapped
    def ServerLive(self, request, context):
        self._parse(pb.ServerLiveRequest, request)
        return pb.ServerLiveResponse(live=True)

    @mapped
    def ServerReady(self, request, context):
        self._parse(pb.ServerReadyRequest, request)
        return pb.ServerReadyResponse(ready=self._ready() and not self.engine.draining)

    @mapped
    def ModelReady(self, request, context):
        req = self._parse(pb.ModelReadyRequest, request)
        try:
            self._model(req.name, req.version)
        except ModelNotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._ready() and not self.engine.draining)

    @mapped
    def ServerMetadata(self, request, context):
        self._parse(pb.ServerMetadataRequest, request)
        return pb.ServerMetadataResponse(**md.server_metadata())

    @mapped
    def ModelMetadata(self, request, context):
        req = self._parse(pb.ModelMetadataRequest, request)
        m = md.model_metadata(self.engine, self._model(req.name, req.version))
        return pb.ModelMetadataResponse(
            name=m["name"], versions=m["versions"], platform=m["platform"],
            inputs=_tensors(m["inputs"]), outputs=_tensors(m["outputs"]))

    @mapped
    def ModelConfig(self, request, context):
        """The parts clients read: inputs (all optional), outputs, no batch dimension
        of Triton's own (max_batch_size 0: shapes carry N)."""
        req = self._parse(pb.ModelConfigRequest, request)
        m = md.model_metadata(self.engine, self._model(req.name, req.version))
        return pb.ModelConfigResponse(config=mc.ModelConfig(
            name=m["name"], platform=m["platform"], backend="hookserve", max_batch_size=0,
            input=_config_io(mc.ModelInput, m["inputs"], optional=True),
            output=_config_io(mc.ModelOutput, m["outputs"])))

    @mapped
    def ModelStatistics(self, request, context):
        req = self._parse(pb.ModelStatisticsRequest, request)
        names = ([self._model(req.name, req.version)] if req.name
                 else md.model_names(self.engine))
        out = pb.ModelStatisticsResponse()
        for name in names:
            c = self.inference.counts.of(name)
            s = out.model_stats.add(name=name, version=VERSION, last_inference=c.last_ms,
                                    inference_count=c.inferences,
                                    execution_count=c.executions)
            st = s.inference_stats
            st.success.count, st.success.ns = c.success, c.success_ns
            st.fail.count, st.fail.ns = c.fail, c.fail_ns
            # Each request is one execution: perf_analyzer wants the same count in each
            # stage; the time is all "infer" (queue and copies are inside it).
            for stage in (st.queue, st.compute_input, st.compute_output):
                stage.count = c.success
            st.compute_infer.count, st.compute_infer.ns = c.success, c.success_ns
        return out

    @mapped
    def ModelInfer(self, request, context):
        with self.inference.parsing("ModelInfer", context):
            call = to_call(self._parse(pb.ModelInferRequest, request))
        answer = self.inference.infer(call, "ModelInfer", context, context.add_callback,
                                      call_deadline(context))
        return to_response(answer)

    @mapped
    def ModelStreamInfer(self, request_iterator, context) -> Iterator:
        """Each request answered in turn; a failed request's answer is its
        error_message and the stream goes on. Once the server drains, the request
        running is answered and the stream ends (a last UNAVAILABLE says so), or the
        next request read is refused (UNAVAILABLE, with its id) and the stream ends, and
        a stream waiting for its next request is ended (`end_idle_streams`): no open
        stream holds the drain for its grace period."""
        cancel = CallCancel()
        context.add_callback(cancel)
        with self.inference.parsing("ModelStreamInfer", context), \
                self.servicer.streams.work_slot("ModelStreamInfer"):
            try:
                yield from self._answer_each(request_iterator, context, cancel)
            finally:
                with self._streams_lock:
                    self._streams.pop(context, None)

    def _answer_each(self, request_iterator, context, cancel: CallCancel) -> Iterator:
        self._waiting(context, True)
        for n, raw in enumerate(_requests(request_iterator)):
            self._waiting(context, False)
            request = None
            try:
                with self.inference.parsing("ModelStreamInfer", context):
                    request = wire.parse(pb.ModelInferRequest, raw, f"request message {n}")
                    call = to_call(request)
                    if self.engine.draining:
                        raise Unavailable("server is shutting down: send this request "
                                          "and the rest to another replica")
                answer = self.inference.infer(call, "ModelStreamInfer", context, cancel.set,
                                              call_deadline(context), slot=False)
                yield pb.ModelStreamInferResponse(infer_response=to_response(answer))
            except Exception as exc:  # noqa: BLE001 - one request fails, not the stream
                if not isinstance(exc, HookserveError):
                    log.exception("ModelStreamInfer: request %d failed", n)
                    exc = InternalError("internal error while answering this request; the "
                                        "server log has the details")
                # The request's id and model go with its error, as Triton does, so a
                # client with several requests in flight knows which one failed.
                yield pb.ModelStreamInferResponse(
                    error_message=short_message(f"[{exc.code}] {exc.message}"),
                    infer_response=pb.ModelInferResponse(
                        id=request.id[:200], model_name=request.model_name[:200],
                        model_version=request.model_version[:20])
                    if request is not None else None)
                if isinstance(exc, Unavailable) and self.engine.draining:
                    return
            self._waiting(context, True)   # (before the check: a drain from now on ends it)
            if self.engine.draining:   # answered what was running: end here
                yield _DRAINING
                return


_DRAINING = pb.ModelStreamInferResponse(
    error_message="[UNAVAILABLE] server is shutting down: requests sent after the last "
                  "answer were not read; send them to another replica")


def _requests(request_iterator):
    try:
        yield from request_iterator
    except grpc.RpcError:  # the client went away
        return


def add_to_server(servicer: OipServicer, server: grpc.Server) -> None:
    """Register the service's implemented methods, each taking raw request bytes."""
    unary = {"ServerLive": pb.ServerLiveResponse, "ServerReady": pb.ServerReadyResponse,
             "ModelReady": pb.ModelReadyResponse,
             "ServerMetadata": pb.ServerMetadataResponse,
             "ModelMetadata": pb.ModelMetadataResponse,
             "ModelConfig": pb.ModelConfigResponse,
             "ModelStatistics": pb.ModelStatisticsResponse,
             "ModelInfer": pb.ModelInferResponse}
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request_deserializer=None,
        response_serializer=cls.SerializeToString) for name, cls in unary.items()}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        servicer.ModelStreamInfer, request_deserializer=None,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString)
    for _prefix, methods, what, instead in md.UNSUPPORTED:
        for name in methods:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unimplemented(md.unsupported(what, instead)))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _unimplemented(message: str):
    """A handler for a protocol method hookserve does not have: UNIMPLEMENTED saying
    what to do instead (grpc's own answer is "Method not found!")."""
    def handler(request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
    return handler
