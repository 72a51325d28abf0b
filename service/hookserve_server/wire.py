"""The one place where protobuf becomes domain objects, and domain results protobuf.

Proto enums become the domain enums of spec.py here (their values are the proto
numbers), so nothing past this module compares strings or numbers from the network.
No torch, no grpc: messages only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.wire import WEIGHTS_HEADER

from .attribution_spec import (
    DEFAULT_IG_STEPS,
    DEFAULT_SG_SAMPLES,
    DEFAULT_SG_SIGMA,
    OPTION_METHODS,
    AttributeInput,
    AttributionOutput,
    AttributionSpec,
    Baseline,
    ClassScore,
    Method,
    Score,
)
from .errors import InvalidArgument
from .spec import (
    DType,
    ExtractionSpec,
    ImageInput,
    ImageResult,
    LayerOutput,
    LayerSpec,
    Mode,
    Preprocess,
    Reduction,
)
from .status import status_proto

if TYPE_CHECKING:  # torch-side types, named in signatures only
    from .capture.table import LayerInfo
    from .models import ServedModel

if sys.byteorder != "little":  # the wire format is little-endian; we send memory as is
    raise ImportError("hookserve's server supports little-endian hosts only")

_OK = status_pb2.Status(code=0)


def _enum(cls, number: int, default, what: str):
    """A proto enum number as a domain enum member (UNSPECIFIED, 0, is the default)."""
    if number == 0:
        return default
    try:
        return cls(number)
    except ValueError:
        raise InvalidArgument(f"{what}: enum value {number} is none of "
                              f"{cls.labels()}") from None


def parse(cls, request, what: str = "request"):
    """A request registered with raw bytes (see server.py), parsed here."""
    if not isinstance(request, bytes):
        return request
    try:
        return cls.FromString(request)
    except DecodeError as exc:
        raise InvalidArgument(f"{what} ({len(request)} bytes) is not a valid "
                              f"{cls.DESCRIPTOR.full_name}: {exc}") from None


def to_spec(msg: pb.ExtractionSpec) -> ExtractionSpec:
    layers = tuple(
        LayerSpec(name=lr.name,
                  reduction=_enum(Reduction, lr.reduction, Reduction.NONE,
                                  f"invalid reduction for {lr.name[:100]}"),
                  dtype=_enum(DType, lr.dtype, DType.FLOAT32, f"invalid dtype for {lr.name[:100]}"),
                  l2_normalize=lr.l2_normalize)
        for lr in msg.layers)
    return ExtractionSpec(model=msg.model, layers=layers,
                          preprocessing=to_preprocess(msg.preprocessing))


def to_preprocess(p: pb.Preprocessing) -> Preprocess:
    return Preprocess(mode=_enum(Mode, p.mode, Mode.DEFAULT, "unknown preprocessing mode"),
                      resize=p.resize, crop_height=p.crop_height, crop_width=p.crop_width)


def to_image(msg: pb.Image, cls: type[ImageInput] = ImageInput, **extra) -> ImageInput:
    """An Image message as `cls` (ImageInput, or AttributeInput with its target)."""
    which = msg.WhichOneof("data")
    if which == "raw":
        return cls(msg.id, raw=msg.raw.pixels, height=msg.raw.height, width=msg.raw.width,
                   **extra)
    return cls(msg.id, encoded=msg.encoded, **extra)


def to_attribution_spec(msg: pb.AttributionSpec) -> AttributionSpec:
    """Unset (zero) numbers take the defaults the proto documents."""
    if msg.method == 0:
        raise InvalidArgument(f"the spec sets no method: use one of {Method.labels()}")
    method = _enum(Method, msg.method, None, "invalid method")
    for field, owner in OPTION_METHODS.items():   # another method's would be ignored
        value = getattr(msg, field)
        if value and not (field == "ig_baseline" and value == pb.ATTRIBUTION_BASELINE_ZEROS) \
                and owner is not method:
            raise InvalidArgument(f"AttributionSpec.{field} is an option of {owner.label}, "
                                  f"not of {method.label}: leave it unset")
    return AttributionSpec(
        model=msg.model, layer=msg.layer,
        method=method,
        score=_enum(Score, msg.score, Score.LOGIT, "invalid score"),
        top_k=msg.top_k, preprocessing=to_preprocess(msg.preprocessing),
        relu=msg.relu if msg.HasField("relu") else None,
        normalize=msg.normalize, upsample=msg.upsample,
        ig_steps=msg.ig_steps or DEFAULT_IG_STEPS,
        ig_baseline=_enum(Baseline, msg.ig_baseline, Baseline.ZEROS, "invalid baseline"),
        sg_samples=msg.sg_samples or DEFAULT_SG_SAMPLES,
        sg_sigma=msg.sg_sigma or DEFAULT_SG_SIGMA, sg_seed=msg.sg_seed)


def attribute_requests(request_iterator: Iterable
                       ) -> Iterator[AttributionSpec | AttributeInput]:
    """An Attribute request stream (raw bytes per message) as specs and images."""
    for n, req in enumerate(request_iterator):
        req = parse(pb.AttributeRequest, req, f"request message {n}")
        if req.WhichOneof("payload") == "spec":
            yield to_attribution_spec(req.spec)
        else:  # an image, or an empty message: an empty image gets its own error
            img = req.image
            yield to_image(img.image, AttributeInput, target=img.target_class
                           if img.HasField("target_class") else None)


def requests(request_iterator: Iterable) -> Iterator[ExtractionSpec | ImageInput]:
    """An Extract request stream (raw bytes per message) as specs and images."""
    for n, req in enumerate(request_iterator):
        req = parse(pb.ExtractRequest, req, f"request message {n}")
        if req.WhichOneof("payload") == "spec":
            yield to_spec(req.spec)
        else:  # an image, or an empty message: an empty image gets its own error
            yield to_image(req.image)


def image_request(request) -> tuple[ExtractionSpec, ImageInput]:
    """An ExtractImage request (raw bytes) as its spec and its image."""
    req = parse(pb.ExtractImageRequest, request)
    if not req.HasField("spec"):
        raise InvalidArgument("ExtractImageRequest.spec is not set: name the model's layers "
                              "to extract")
    return to_spec(req.spec), to_image(req.image)


#: The length of each digest in the weights header ("sha256:" and 64 bits of it), and
#: the header's largest size (gRPC's clients refuse metadata over 8 KiB): a server of
#: so many models that it would be larger sends none.
WEIGHTS_DIGEST_CHARS = 23
WEIGHTS_HEADER_MAX = 4096


def weights_header(models) -> tuple[tuple[str, bytes], ...]:
    """The initial metadata of every Extract and Attribute stream: each of `models`'
    weights digest, shortened (WEIGHTS_HEADER, JSON {model: digest}), so a client that
    reconnects mid-run (a replica replaced in a rolling deploy) can tell whether they
    changed; none when it would be over WEIGHTS_HEADER_MAX bytes."""
    value = json.dumps({m.name: m.weights.digest[:WEIGHTS_DIGEST_CHARS] for m in models},
                       sort_keys=True).encode()
    return ((WEIGHTS_HEADER, value),) if len(value) <= WEIGHTS_HEADER_MAX else ()


def model_info(m: ServedModel) -> pb.ModelInfo:
    d = m.defaults
    w = m.weights
    return pb.ModelInfo(
        name=m.name, architecture=m.arch, device=str(m.device), dtype=m.dtype.value,
        precision=m.precision.value,
        weights=pb.WeightsInfo(source=w.source, name=w.name, digest=w.digest,
                               pretrained=w.pretrained, verified=w.verified),
        preprocessing=pb.PreprocessingInfo(
            resize=d.resize, crop_height=d.crop[0], crop_width=d.crop[1], mean=d.mean,
            std=d.std, interpolation=d.interpolation),
        num_classes=w.num_classes, labels=m.labels,
        default_cam_layer=m.default_cam_layer)


def layer_info(li: LayerInfo) -> pb.LayerInfo:
    return pb.LayerInfo(name=li.name, module=li.module, type=li.type, output_shape=li.shape,
                        dtype=li.dtype.value, bytes_per_image=li.bytes_per_image,
                        order=li.order, input_shape=li.input_shape,
                        input_bytes_per_image=li.input_bytes, layout=li.layout.value,
                        input_layout=li.input_layout.value)


def status_message(result: ImageResult, cls=pb.ExtractResponse):
    """The message (an ExtractResponse or AttributeResponse) that ends one image's
    answer: OK, or its error."""
    status = _OK if result.error is None else status_proto(result.error)
    return cls(image_id=result.id, image_index=result.index, status=status)


def tensor_messages(result: ImageResult, chunk_bytes: int) -> Iterator[pb.ExtractResponse]:
    """One image's tensors as stream messages, in chunks of at most `chunk_bytes`."""
    for out in result.outputs or ():
        yield from _chunks(result, out, chunk_bytes, pb.ExtractResponse, "tensor")


def attribution_messages(result: ImageResult, chunk_bytes: int
                         ) -> Iterator[pb.AttributeResponse]:
    """One image's Attribute answer: its summary, then its map in chunks."""
    for out in result.outputs or ():
        yield pb.AttributeResponse(image_id=result.id, image_index=result.index,
                                   summary=_summary(out))
        yield from _chunks(result, out, chunk_bytes, pb.AttributeResponse, "map")


def _score(s: ClassScore) -> pb.ClassScore:
    return pb.ClassScore(class_index=s.class_index, logit=s.logit, probability=s.probability,
                         label=s.label)


def _summary(out: AttributionOutput) -> pb.AttributionSummary:
    return pb.AttributionSummary(
        targets=[pb.AttributionTarget(target=_score(t.target), map_min=t.map_min,
                                      map_max=t.map_max, completeness_delta=t.delta)
                 for t in out.targets],
        top5=[_score(s) for s in out.top5])


def _chunks(result: ImageResult, out: LayerOutput, chunk_bytes: int, cls, field: str):
    """One tensor as `cls` messages whose TensorChunk `field` holds at most
    `chunk_bytes` of it each."""
    total = out.nbytes
    for off in range(0, max(total, 1), chunk_bytes):
        # Fields are set one by one: passing a built TensorChunk (or its bytes)
        # as a constructor keyword costs ~5 ms per 2 MiB chunk with upb
        # protobuf (measured; docs/performance.md), this ~0.1 ms.
        msg = cls(image_id=result.id, image_index=result.index)
        c = getattr(msg, field)
        c.layer = out.name
        c.dtype = out.dtype.value
        c.shape.extend(out.shape)
        c.columns.extend(out.columns)
        if out.cached:
            c.cached = True
        c.total_bytes = total
        c.offset = off
        c.data = out.data[off:off + chunk_bytes].tobytes()
        yield msg
