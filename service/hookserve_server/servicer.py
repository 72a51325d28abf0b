"""The gRPC servicer: a thin adapter between protobuf and the engine.

Protobuf in -> domain objects -> Engine -> domain results -> protobuf out. Errors
are raised as domain errors and mapped to statuses by :mod:`.status`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator

import torch
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from .engine import Engine, ImageResult
from .errors import InvalidArgument, ResourceExhausted, Unavailable
from .models import LayerInfo, ServedModel
from .spec import ExtractionSpec, ImageInput, LayerSpec, Preprocess
from .status import mapped, status_proto

log = logging.getLogger("hookserve.calls")

_REDUCTION = {pb.REDUCTION_UNSPECIFIED: "none", pb.REDUCTION_NONE: "none",
              pb.REDUCTION_AVG_POOL: "avg", pb.REDUCTION_MAX_POOL: "max",
              pb.REDUCTION_FLATTEN: "flatten"}
_DTYPE = {pb.DTYPE_UNSPECIFIED: "float32", pb.DTYPE_FLOAT32: "float32",
          pb.DTYPE_FLOAT16: "float16", pb.DTYPE_BFLOAT16: "bfloat16"}
_WIRE_DTYPE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16,
               "bfloat16": pb.DTYPE_BFLOAT16}
_MODE = {pb.Preprocessing.MODE_UNSPECIFIED: "default", pb.Preprocessing.MODE_DEFAULT: "default",
         pb.Preprocessing.MODE_RESIZE_CROP: "resize_crop", pb.Preprocessing.MODE_NATIVE: "native"}
_TORCH_TO_WIRE = {torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16,
                  torch.bfloat16: pb.DTYPE_BFLOAT16}

_OK = status_pb2.Status(code=0)

if sys.byteorder != "little":  # the wire format is little-endian; we send memory as is
    raise ImportError("hookserve's server supports little-endian hosts only")


def to_spec(msg: pb.ExtractionSpec) -> ExtractionSpec:
    layers = tuple(
        LayerSpec(name=lr.name,
                  reduction=_REDUCTION.get(lr.reduction, f"<unknown enum {lr.reduction}>"),
                  dtype=_DTYPE.get(lr.dtype, f"<unknown enum {lr.dtype}>"),
                  l2_normalize=lr.l2_normalize)
        for lr in msg.layers)
    p = msg.preprocessing
    pre = Preprocess(mode=_MODE.get(p.mode, f"<unknown enum {p.mode}>"), resize=p.resize,
                     crop_height=p.crop_height, crop_width=p.crop_width)
    return ExtractionSpec(model=msg.model, layers=layers, preprocessing=pre)


def to_image(msg: pb.Image) -> ImageInput:
    which = msg.WhichOneof("data")
    if which == "raw":
        return ImageInput(msg.id, raw=msg.raw.pixels, height=msg.raw.height,
                          width=msg.raw.width)
    return ImageInput(msg.id, encoded=msg.encoded)


def _parse(cls, request, what: str = "request"):
    """A request as registered with raw bytes (see server.py), parsed here."""
    if not isinstance(request, bytes):
        return request
    try:
        return cls.FromString(request)
    except DecodeError as exc:
        raise InvalidArgument(f"{what} ({len(request)} bytes) is not a valid "
                              f"{cls.DESCRIPTOR.full_name}: {exc}") from None


def _requests(request_iterator) -> Iterator[ExtractionSpec | ImageInput]:
    for n, req in enumerate(request_iterator):
        req = _parse(pb.ExtractRequest, req, f"request message {n}")
        if req.WhichOneof("payload") == "spec":
            yield to_spec(req.spec)
        else:  # an image, or an empty message: an empty image gets its own error
            yield to_image(req.image)


def model_info(m: ServedModel) -> pb.ModelInfo:
    d = m.defaults
    w = m.weights
    return pb.ModelInfo(
        name=m.name, architecture=m.arch, device=str(m.device), dtype=_WIRE_DTYPE[m.dtype],
        weights=pb.WeightsInfo(source=w.source, name=w.name, digest=w.digest,
                               pretrained=w.pretrained, verified=w.verified),
        preprocessing=pb.PreprocessingInfo(
            resize=d.resize, crop_height=d.crop[0], crop_width=d.crop[1], mean=d.mean,
            std=d.std, interpolation=d.interpolation))


def layer_info(li: LayerInfo) -> pb.LayerInfo:
    return pb.LayerInfo(name=li.name, module=li.module, type=li.type, output_shape=li.shape,
                        dtype=_WIRE_DTYPE.get(li.dtype, pb.DTYPE_FLOAT32),
                        bytes_per_image=li.bytes_per_image, order=li.order)


class Servicer(pb_grpc.FeatureExtractorServicer):
    """hookserve.v1.FeatureExtractor over an Engine."""

    def __init__(self, engine: Engine, *, chunk_bytes: int = 2 << 20,
                 max_streams: int = 128) -> None:
        self.engine = engine
        self.chunk_bytes = chunk_bytes
        self.max_streams = max_streams
        _keep_large_buffers_on_heap()
        self.telemetry = engine.telemetry
        self._draining = False
        self._active = 0
        self._cond = threading.Condition()

    # -- lifecycle, used by the server's shutdown ---------------------------------------
    def start_drain(self) -> None:
        """New calls get UNAVAILABLE; open streams stop taking new images."""
        with self._cond:
            self._draining = True
        self.engine.start_drain()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no Extract call is running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._active == 0, timeout)

    def _enter(self) -> None:
        with self._cond:
            if self._draining:
                raise Unavailable("server is shutting down: retry on another replica")
            if self._active >= self.max_streams:
                raise ResourceExhausted(
                    f"{self._active} Extract streams are open, this server's limit "
                    "(--max-streams): retry shortly or use another replica",
                    retry_after_s=1.0)
            self._active += 1

    def _refuse_if_draining(self) -> None:
        # Unary calls too: during a rolling restart the SDK then asks another replica.
        if self._draining:
            raise Unavailable("server is shutting down: retry on another replica")

    def _exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    # -- RPCs ----------------------------------------------------------------------------
    def _model_label(self, name: str) -> str:
        """A model name fit for a metric label: unknown names collapse to "unknown"."""
        name = name or self.engine.default_model
        return name if name in self.engine.models else "unknown"

    @contextlib.contextmanager
    def _observed(self, method: str, context, stats: dict):
        """Count the call by model and code, and log one JSON line for it."""
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
            self.telemetry.call_done(method, stats.get("model", ""), code)
            line = {"event": "call", "method": method, "peer": context.peer(), **stats,
                    "seconds": round(time.monotonic() - t0, 4), "code": code}
            log.info(json.dumps(line))

    @mapped
    def ListModels(self, request, context):
        with self._observed("ListModels", context, {"model": ""}):
            _parse(pb.ListModelsRequest, request)
            self._refuse_if_draining()
            return pb.ListModelsResponse(
                models=[model_info(m) for m in self.engine.models.values()])

    @mapped
    def DescribeModel(self, request, context):
        stats = {"model": ""}
        with self._observed("DescribeModel", context, stats):
            request = _parse(pb.DescribeModelRequest, request)
            stats["model"] = self._model_label(request.model)
            self._refuse_if_draining()
            m, (h, w), layers = self.engine.describe(request.model, request.input_height,
                                                     request.input_width)
            return pb.DescribeModelResponse(model=model_info(m), input_height=h,
                                            input_width=w,
                                            layers=[layer_info(li) for li in layers])

    @mapped
    def Extract(self, request_iterator, context):
        stats = {"model": "", "layers": [], "images": 0, "failed": 0, "bytes": 0}
        with self._observed("Extract", context, stats):
            self._enter()
            try:
                remaining = context.time_remaining()
                deadline = None if remaining is None else time.monotonic() + remaining
                session = self.engine.session(deadline)
                context.add_callback(session.cancel)
                requests = _observe_spec(_requests(request_iterator), stats, self)
                for result in session.run(requests):
                    yield from self._encode(result, stats)
            finally:
                self._exit()

    def _encode(self, result: ImageResult, stats: dict) -> Iterator[pb.ExtractResponse]:
        stats["images"] += 1
        model = stats["model"]
        if result.error is not None:
            stats["failed"] += 1
            self.telemetry.image_done(model, result.error.code)
            yield pb.ExtractResponse(image_id=result.id, image_index=result.index,
                                     status=status_proto(result.error))
            return
        t0 = time.perf_counter()
        chunk = self.chunk_bytes
        nbytes = 0
        for name, t in result.tensors or ():
            dtype = _TORCH_TO_WIRE[t.dtype]
            shape = tuple(t.shape)
            # A zero-copy byte view of the (contiguous, CPU) tensor.
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            total = len(view)
            nbytes += total
            for off in range(0, max(total, 1), chunk):
                # Fields are set one by one: passing a built TensorChunk (or its bytes)
                # as a constructor keyword costs ~5 ms per 2 MiB chunk with upb
                # protobuf (measured; docs/performance.md), this ~0.1 ms.
                msg = pb.ExtractResponse(image_id=result.id, image_index=result.index)
                c = msg.tensor
                c.layer = name
                c.dtype = dtype
                c.shape.extend(shape)
                c.total_bytes = total
                c.offset = off
                c.data = view[off:off + chunk].tobytes()
                yield msg
        stats["bytes"] += nbytes
        self.telemetry.serialize_seconds(time.perf_counter() - t0)
        self.telemetry.bytes_sent(model, nbytes)
        self.telemetry.image_done(model, "OK")
        yield pb.ExtractResponse(image_id=result.id, image_index=result.index,
                                 status=_OK)


def _keep_large_buffers_on_heap(threshold: int = 32 << 20) -> None:
    """glibc only: serve allocations under `threshold` from the heap and keep it.

    Every streamed chunk makes a few chunk-sized (2 MiB) buffers: the bytes of the
    tensor slice, protobuf's copy, the serialised message, gRPC's copy. Above glibc's
    default mmap threshold each one is a fresh mmap, page faults on first touch and a
    munmap; on the 2-core dev VM that made streaming a 12.8 MB feature map several
    times slower (docs/performance.md). 32 MiB is glibc's largest allowed threshold;
    freed memory up to 4x that stays in the process. Elsewhere (musl, macOS) a no-op.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    mallopt(m_mmap_threshold, threshold)
    mallopt(m_trim_threshold, 4 * threshold)


def _observe_spec(requests, stats: dict, servicer: Servicer):
    """Pass requests through, noting the latest spec's model and layers for logs/metrics
    (names are cut short: they come from the client)."""
    for req in requests:
        if isinstance(req, ExtractionSpec):
            stats["model"] = servicer._model_label(req.model)
            stats["layers"] = [layer.name[:100] for layer in req.layers[:32]]
        yield req
