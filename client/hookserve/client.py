"""The hookserve client SDK: one object, a clear lifetime, typed errors, no torch.

    >>> import hookserve
    >>> with hookserve.Client("localhost:50051") as client:
    ...     feats = client.extract("cat.jpg", layers=["layer4"], reduction="avg")
    >>> feats["layer4"].shape
    (2048,)
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from . import errors
from .images import default_id, to_image
from .tensors import DTYPE_NAMES, TensorAssembler
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc

_REDUCTIONS = {
    "none": pb.REDUCTION_NONE, "avg": pb.REDUCTION_AVG_POOL, "max": pb.REDUCTION_MAX_POOL,
    "flatten": pb.REDUCTION_FLATTEN,
}
_DTYPE_FROM_WIRE = {v: k for k, v in DTYPE_NAMES.items()}
#: Codes on which the SDK moves a call (or a stream's unanswered images) elsewhere.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
#: Client channel limits: chunks are at most 4 MiB; leave headroom.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class Layer:
    """A requested layer with its reduction (none|avg|max|flatten), dtype and L2 option."""

    name: str
    reduction: str = "none"
    dtype: str = "float32"
    l2_normalize: bool = False

    def to_proto(self) -> pb.LayerRequest:
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, "
                             f"got {self.reduction!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        return pb.LayerRequest(name=self.name, reduction=_REDUCTIONS[self.reduction],
                               dtype=DTYPE_NAMES[self.dtype], l2_normalize=self.l2_normalize)


@dataclass
class Result:
    """One image's answer from :meth:`Client.extract_many`."""

    #: Position of the image in the input iterable.
    index: int
    #: The image's id (its path, or its position as a string, unless ids were given).
    id: str
    #: Layer name -> array (read-only when it arrived in one chunk), or None on error.
    features: dict[str, np.ndarray] | None = None
    #: The typed error when this image failed; the iteration goes on regardless.
    error: errors.HookserveError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> dict[str, np.ndarray]:
        if self.error is not None:
            raise self.error
        assert self.features is not None
        return self.features


@dataclass(frozen=True)
class LayerInfo:
    """A hookable layer, as DescribeModel reports it."""

    name: str
    module: str
    type: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_image: int
    order: int


@dataclass(frozen=True)
class ModelInfo:
    """A served model: architecture, weights in use, device, dtype, preprocessing."""

    name: str
    architecture: str
    weights_source: str
    weights_name: str
    weights_digest: str
    pretrained: bool
    weights_verified: bool
    device: str
    dtype: str
    resize: int
    crop: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class ModelDescription:
    """DescribeModel's answer: the model and every layer at one input size."""

    model: ModelInfo
    input_size: tuple[int, int]
    layers: list[LayerInfo] = field(default_factory=list)

    def layer(self, name: str) -> LayerInfo:
        for li in self.layers:
            if li.name == name:
                return li
        raise KeyError(name)


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    p = m.preprocessing
    return ModelInfo(
        name=m.name, architecture=m.architecture, weights_source=m.weights.source,
        weights_name=m.weights.name, weights_digest=m.weights.digest,
        pretrained=m.weights.pretrained, weights_verified=m.weights.verified,
        device=m.device, dtype=_DTYPE_FROM_WIRE.get(m.dtype, "float32"),
        resize=p.resize, crop=(p.crop_height, p.crop_width),
        mean=tuple(p.mean), std=tuple(p.std))


def build_layers(layers: str | Layer | Sequence[str | Layer] | Mapping[str, Any], *,
                 reduction: str = "none", dtype: str = "float32",
                 l2_normalize: bool = False) -> list[Layer]:
    """Normalise the accepted `layers` forms into Layer objects.

    Accepts a name, a Layer, a list of names/Layers, or a mapping of name to None or
    to a dict of options; options not given per layer come from the keywords.
    """
    defaults = {"reduction": reduction, "dtype": dtype, "l2_normalize": l2_normalize}
    if isinstance(layers, (str, Layer)):
        layers = [layers]
    out: list[Layer] = []
    if isinstance(layers, Mapping):
        for name, opts in layers.items():
            out.append(Layer(name, **{**defaults, **(opts or {})}))
    else:
        for item in layers:
            out.append(item if isinstance(item, Layer) else Layer(str(item), **defaults))
    if not out:
        raise ValueError("give at least one layer")
    return out


def build_preprocessing(*, native: bool = False, resize: int | None = None,
                        crop: int | tuple[int, int] | None = None) -> pb.Preprocessing:
    """Default transforms, `native` resolution, or a custom resize and/or centre crop."""
    if native:
        if resize or crop:
            raise ValueError("native takes no resize or crop")
        return pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE)
    if resize is None and crop is None:
        return pb.Preprocessing(mode=pb.Preprocessing.MODE_DEFAULT)
    ch, cw = (crop, crop) if isinstance(crop, int) else (crop or (0, 0))
    return pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=resize or 0,
                            crop_height=ch, crop_width=cw)


def _parse_targets(target: str | Sequence[str]) -> tuple[list[str], bool]:
    """-> (addresses, secure). Accepts host:port, grpc://, grpcs://, dns:///, or a list."""
    items = [target] if isinstance(target, str) else list(target)
    if len(items) == 1 and "," in items[0] and not items[0].startswith(("dns:", "ipv4:", "ipv6:")):
        items = [t.strip() for t in items[0].split(",") if t.strip()]
    secure = None
    addrs = []
    for t in items:
        s = t.startswith("grpcs://")
        if t.startswith(("grpcs://", "grpc://")):
            t = t.split("://", 1)[1]
        if secure is not None and s != secure:
            raise ValueError("mix of grpcs:// and plain targets")
        secure = s
        addrs.append(t)
    if not addrs:
        raise ValueError("no target given")
    return addrs, bool(secure)


_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read(v: bytes | str | os.PathLike | None) -> bytes | None:
    if v is None or isinstance(v, bytes):
        return v
    with open(v, "rb") as fh:
        return fh.read()


class Client:
    """A connection to one or more hookserve servers.

    Args:
        target: ``host:port``; ``grpcs://host:port`` for TLS; ``dns:///name:port`` to
            balance round-robin over every address the name resolves to; or several
            addresses (a list, or comma-separated), used round-robin with failover.
        timeout: seconds allowed for each unary call and each :meth:`extract`.
        token: bearer token sent as ``authorization: Bearer ...``; defaults to the
            ``HOOKSERVE_TOKEN`` environment variable.
        root_certificates, certificate_chain, private_key: PEM bytes or file paths for
            TLS (CA to trust; client certificate and key for mutual TLS).
        max_in_flight: images sent but not yet answered per stream.
        retries: how many times a call that fails with UNAVAILABLE is moved to another
            address (streams re-send only their unanswered images). An address that
            answered UNAVAILABLE is skipped for a while (at least 1 s) while others are up.
        retry_backoff: first backoff in seconds, slept when no other address is up; it
            doubles per retry, capped at 5 s.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, target: str | Sequence[str], *, timeout: float | None = 60.0,
                 token: str | None = None,
                 root_certificates: bytes | str | os.PathLike | None = None,
                 certificate_chain: bytes | str | os.PathLike | None = None,
                 private_key: bytes | str | os.PathLike | None = None,
                 max_in_flight: int = 32, retries: int = 3, retry_backoff: float = 0.1,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.addresses, self.secure = _parse_targets(target)
        self.timeout = timeout
        self.max_in_flight = max(1, int(max_in_flight))
        self.retries = max(0, int(retries))
        self.retry_backoff = retry_backoff
        token = token if token is not None else os.environ.get("HOOKSERVE_TOKEN")
        self._metadata = (("authorization", f"Bearer {token.strip()}"),) if token else ()
        opts = list(_CHANNEL_OPTIONS) + list(options)
        creds = None
        if self.secure or root_certificates or certificate_chain:
            self.secure = True
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates),
                private_key=_read(private_key), certificate_chain=_read(certificate_chain))
        self._channels: list[grpc.Channel] = []
        for addr in self.addresses:
            o = list(opts)
            # Names that resolve to several addresses (a headless Service via dns:///,
            # or gRPC's static ipv4:a:p,b:p list) balance per call over all of them.
            if addr.startswith(("dns:", "ipv4:", "ipv6:")):
                o.append(("grpc.lb_policy_name", "round_robin"))
            ch = (grpc.secure_channel(addr, creds, options=o) if creds
                  else grpc.insecure_channel(addr, options=o))
            self._channels.append(ch)
        self._stubs = [pb_grpc.FeatureExtractorStub(c) for c in self._channels]
        self._rr = itertools.count(random.randrange(len(self._stubs)))
        #: monotonic time until which an address that answered UNAVAILABLE is skipped
        self._down_until = [0.0] * len(self._stubs)
        self._lock = threading.Lock()
        self._closed = False

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Close every channel. Further calls raise ValueError."""
        self._closed = True
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pick(self) -> int:
        """Next address round-robin, skipping those recently found UNAVAILABLE."""
        if self._closed:
            raise ValueError("client is closed")
        with self._lock:
            n = len(self._stubs)
            now = time.monotonic()
            for _ in range(n):
                i = next(self._rr) % n
                if self._down_until[i] <= now:
                    return i
            return min(range(n), key=self._down_until.__getitem__)  # all down: soonest back

    def _delay(self, attempt: int) -> float:
        return min(5.0, self.retry_backoff * (2 ** attempt)) * (0.5 + random.random() / 2)

    def _unavailable(self, index: int, attempt: int, *, retry: bool) -> None:
        """After UNAVAILABLE from address `index`: skip it for a while. Before a retry,
        sleep the backoff only when no other address is up."""
        delay = self._delay(attempt)
        with self._lock:
            now = time.monotonic()
            self._down_until[index] = now + max(delay, 1.0)
            others_up = any(t <= now for i, t in enumerate(self._down_until) if i != index)
        if retry and not others_up:
            time.sleep(delay)

    def _unary(self, method: str, request: Any) -> Any:
        for attempt in itertools.count():
            index = self._pick()
            try:
                return getattr(self._stubs[index], method)(
                    request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() in RETRYABLE:
                    retry = attempt < self.retries
                    self._unavailable(index, attempt, retry=retry)
                    if retry:
                        continue
                raise errors.from_rpc_error(exc) from None
        raise AssertionError("unreachable")

    # -- unary calls -------------------------------------------------------------------
    def list_models(self) -> list[ModelInfo]:
        """The models the server holds; the first is its default."""
        return [_model_info(m) for m in self._unary("ListModels", pb.ListModelsRequest()).models]

    def describe(self, model: str | None = None,
                 size: int | tuple[int, int] | None = None) -> ModelDescription:
        """Every hookable layer of `model` with its output shape at input `size` (HxW)."""
        h, w = (size, size) if isinstance(size, int) else (size or (0, 0))
        r = self._unary("DescribeModel", pb.DescribeModelRequest(
            model=model or "", input_height=h, input_width=w))
        layers = [LayerInfo(li.name, li.module, li.type, tuple(li.output_shape),
                            _DTYPE_FROM_WIRE.get(li.dtype, "float32"), li.bytes_per_image,
                            li.order) for li in r.layers]
        return ModelDescription(_model_info(r.model), (r.input_height, r.input_width), layers)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check on the first address: "SERVING", "NOT_SERVING", ...

        Encodes the two tiny health messages by hand so the SDK needs no extra package.
        """
        svc = service.encode()
        request = (b"\x0a" + _varint(len(svc)) + svc) if svc else b""
        check = self._channels[0].unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            raw = check(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
        return _HEALTH_NAMES.get(status, f"UNKNOWN({status})")

    # -- extraction --------------------------------------------------------------------
    def extract(self, image: Any, layers: Any, model: str | None = None, **options: Any
                ) -> dict[str, np.ndarray]:
        """Features of one image: layer name -> array. Raises the typed error on failure.

        `options` are those of :meth:`extract_many` (reduction, dtype, l2_normalize,
        native, resize, crop).
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        # Run the stream to its end (not just to the first result): abandoning it would
        # cancel the call, and the server would log and count a success as CANCELLED.
        (result,) = self.extract_many([image], layers, model=model, _deadline=deadline,
                                      **options)
        return result.raise_for_error()

    def extract_many(self, images: Iterable[Any], layers: Any, model: str | None = None, *,
                     ids: Iterable[str] | None = None, reduction: str = "none",
                     dtype: str = "float32", l2_normalize: bool = False,
                     native: bool = False, resize: int | None = None,
                     crop: int | tuple[int, int] | None = None,
                     max_in_flight: int | None = None,
                     _deadline: float | None = None) -> Iterator[Result]:
        """Stream images through one call; yield one :class:`Result` per image, in order.

        `images` is consumed lazily, with at most `max_in_flight` images sent and not
        yet answered. A failed image yields a Result with `.error` set and the
        iteration goes on; a failure of the whole call (bad spec, unknown model or
        layer, auth) raises the typed error. If the server becomes UNAVAILABLE
        mid-stream, the unanswered images are re-sent to another address (up to
        `retries` times), so none is lost or answered twice.

        The stream reads ahead: it sends up to `max_in_flight` images before it reads
        the first answer, so with a slow lazy source the first result comes once that
        many images were produced (or the source ended).

        `ids` (one per image, unique) are sent to the server and become `Result.id`;
        without them `Result.id` is the path (or the position) and the wire carries the
        position only, so the same path may appear twice.

        Layers take `reduction` (none|avg|max|flatten), `dtype`
        (float32|float16|bfloat16) and `l2_normalize` unless set per layer.
        Preprocessing is the model's default unless `native=True` or `resize`/`crop`.
        """
        spec = pb.ExtractionSpec(
            model=model or "",
            layers=[layer.to_proto() for layer in build_layers(
                layers, reduction=reduction, dtype=dtype, l2_normalize=l2_normalize)],
            preprocessing=build_preprocessing(native=native, resize=resize, crop=crop))
        window = max(1, int(max_in_flight or self.max_in_flight))
        return _Extraction(self, spec, images, ids, window, _deadline).run()


@dataclass
class _Pending:
    index: int
    id: str
    image: pb.Image | None          # None: failed locally before sending
    error: errors.HookserveError | None = None


class _Extraction:
    """One extract_many run: owns the stream(s), the window and the order."""

    def __init__(self, client: Client, spec: pb.ExtractionSpec, images: Iterable[Any],
                 ids: Iterable[str] | None, window: int, deadline: float | None) -> None:
        self.client = client
        self.spec = spec
        self.source = iter(images)
        self.ids = iter(ids) if ids is not None else None
        self.window = window
        self.deadline = deadline
        self.pending: collections.deque[_Pending] = collections.deque()
        self.next_index = 0
        self.exhausted = False

    def _pull(self) -> _Pending | None:
        try:
            obj = next(self.source)
        except StopIteration:
            self.exhausted = True
            return None
        index = self.next_index
        self.next_index += 1
        if self.ids is not None:
            image_id = next(self.ids, None)
            if image_id is None:
                raise ValueError(f"ids has fewer items than images (ran out at image {index})")
            wire_id = image_id
        else:
            # Answers are matched by order, so the default wire id is only the position:
            # the same path twice is not a duplicate id, and chunks stay small.
            image_id, wire_id = default_id(obj, index), str(index)
        try:
            return _Pending(index, image_id, to_image(obj, wire_id))
        except (OSError, TypeError, ValueError) as exc:
            return _Pending(index, image_id, None,
                            errors.InvalidArgument(f"could not read image {image_id!r}: {exc}"))

    def run(self) -> Iterator[Result]:
        attempt = 0
        while True:
            index = self.client._pick()
            try:
                yield from self._stream(index)
                return
            except grpc.RpcError as exc:
                if exc.code() in RETRYABLE:
                    retry = attempt < self.client.retries
                    self.client._unavailable(index, attempt, retry=retry)
                    if retry:
                        attempt += 1
                        continue
                raise errors.from_rpc_error(exc) from None

    def _stream(self, index: int) -> Iterator[Result]:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        _END = object()

        def gen():
            while True:
                item = requests.get()
                if item is _END:
                    return
                yield item

        stub = self.client._stubs[index]
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        call = stub.Extract(gen(), timeout=timeout, metadata=self.client._metadata)
        requests.put(pb.ExtractRequest(spec=self.spec))
        sent = 0
        for p in self.pending:  # re-send what the last stream left unanswered
            if p.image is not None:
                requests.put(pb.ExtractRequest(image=p.image))
                sent += 1
        # Maps a server-side image_index on this stream to our pending entries.
        try:
            responses = iter(call)
            assembling: dict[str, TensorAssembler] = {}
            features: dict[str, np.ndarray] = {}
            closed = False
            while True:
                while not self.exhausted and sent < self.window:
                    p = self._pull()
                    if p is None:
                        break
                    self.pending.append(p)
                    if p.image is not None:
                        requests.put(pb.ExtractRequest(image=p.image))
                        sent += 1
                while self.pending and self.pending[0].image is None:
                    p = self.pending.popleft()
                    yield Result(p.index, p.id, error=p.error)
                if not self.pending:
                    if self.exhausted:
                        if not closed:
                            requests.put(_END)
                            closed = True
                        for _ in responses:  # drain to the end of the call
                            pass
                        return
                    continue
                msg = next(responses, None)
                if msg is None:
                    raise errors.Internal(
                        "server ended the stream before answering every image")
                which = msg.WhichOneof("payload")
                if which == "tensor":
                    c = msg.tensor
                    a = assembling.get(c.layer)
                    if a is None:
                        a = assembling[c.layer] = TensorAssembler(c)
                    a.add(c)
                    if a.complete:
                        features[c.layer] = a.array()
                        del assembling[c.layer]
                    continue
                if which != "status":
                    continue
                p = self.pending.popleft()
                sent -= 1
                if msg.status.code == 0:
                    yield Result(p.index, p.id, features=features)
                else:
                    retry = None
                    for d in msg.status.details:
                        if d.type_url.endswith("google.rpc.RetryInfo"):
                            from google.rpc import error_details_pb2
                            info = error_details_pb2.RetryInfo()
                            d.Unpack(info)
                            retry = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
                    yield Result(p.index, p.id, error=errors.error_for(
                        msg.status.code, msg.status.message, retry_after_s=retry))
                features = {}
                assembling = {}
        finally:
            requests.put(_END)
            call.cancel()
