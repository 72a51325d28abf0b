"""The hookserve client SDK: one object, a clear lifetime, typed errors, no torch.

    >>> import hookserve
    >>> with hookserve.Client("localhost:50051") as client:
    ...     feats = client.extract("cat.jpg", layers=["layer4"], reduction="avg")
    >>> feats["layer4"].shape
    (2048,)

:class:`Client` is a small facade: :mod:`.endpoints` holds the channels and the
failover, :mod:`.extraction` runs the Extract stream, :mod:`.attribution` the
Attribute stream on the same machinery, :mod:`.types` the value types.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from . import errors
from .attribution import (
    AUTO_LAYER,
    Attribution,
    AttributionRun,
    Geometry,
    build_attribution_spec,
    request_geometry,
)
from .endpoints import RETRYABLE, Endpoints
from .extraction import Extraction, extract_image
from .types import (
    Layer,
    LayerInfo,
    ModelDescription,
    ModelInfo,
    Result,
    build_layers,
    build_preprocessing,
    build_spec,
)
from .v1 import hookserve_pb2 as pb

__all__ = ["Attribution", "Client", "Layer", "LayerInfo", "ModelDescription", "ModelInfo", "Result",
           "RETRYABLE", "build_layers", "build_preprocessing"]

_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


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
        token = token if token is not None else os.environ.get("HOOKSERVE_TOKEN")
        self._endpoints = Endpoints(
            target, token=token, root_certificates=root_certificates,
            certificate_chain=certificate_chain, private_key=private_key,
            retries=retries, retry_backoff=retry_backoff, options=options)
        self.addresses = self._endpoints.addresses
        self.secure = self._endpoints.secure
        self.timeout = timeout
        self.max_in_flight = max(1, int(max_in_flight))
        self.retries = self._endpoints.retries
        self.retry_backoff = retry_backoff
        #: model name ("" = the default) -> its default preprocessing geometry
        self._geometries: dict[str, Geometry] | None = None
        #: False once a server answered UNIMPLEMENTED to ExtractImage (it predates it)
        self._image_rpc = True

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Close every channel. Further calls raise ValueError."""
        self._endpoints.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: str, request: Any) -> Any:
        return self._endpoints.call(lambda stub: getattr(stub, method)(
            request, timeout=self.timeout, metadata=self._endpoints.metadata))

    # -- unary calls -------------------------------------------------------------------
    def list_models(self) -> list[ModelInfo]:
        """The models the server holds; the first is its default."""
        return [ModelInfo.from_proto(m)
                for m in self._unary("ListModels", pb.ListModelsRequest()).models]

    def describe(self, model: str | None = None,
                 size: int | tuple[int, int] | None = None) -> ModelDescription:
        """Every hookable layer of `model` with its output shape at input `size` (HxW)."""
        h, w = (size, size) if isinstance(size, int) else (size or (0, 0))
        return ModelDescription.from_proto(self._unary("DescribeModel", pb.DescribeModelRequest(
            model=model or "", input_height=h, input_width=w)))

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check on the first address: "SERVING", "NOT_SERVING", ...

        Encodes the two tiny health messages by hand so the SDK needs no extra package.
        """
        svc = service.encode()
        request = (b"\x0a" + _varint(len(svc)) + svc) if svc else b""
        check = self._endpoints.channels[0].unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            raw = check(request, timeout=self.timeout, metadata=self._endpoints.metadata)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
        return _HEALTH_NAMES.get(status, f"UNKNOWN({status})")

    # -- extraction --------------------------------------------------------------------
    def extract(self, image: Any, layers: Any, model: str | None = None, **options: Any
                ) -> dict[str, np.ndarray]:
        """Features of one image: layer name -> array. Raises the typed error on failure.

        `options` are those of :meth:`extract_many` (reduction, dtype, l2_normalize,
        native, resize, crop). It uses the ExtractImage RPC (one request, no stream
        kept open: the fastest call for a lone image), or an Extract stream with a
        server too old to have it.
        """
        if self._image_rpc:
            spec = build_spec(layers, model, **options)
            try:
                return extract_image(self._endpoints, spec, image, self.timeout)
            except errors.HookserveError as exc:
                if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._image_rpc = False  # an older server: use the stream from now on
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

        Layers take `reduction` (none|avg|max|flatten|stats; stats is ``[C, 5]`` per
        channel: mean, std, min, max, zero fraction, see ``Result.columns``), `dtype`
        (float32|float16|bfloat16) and `l2_normalize` unless set per layer.
        Preprocessing is the model's default unless `native=True` or `resize`/`crop`.
        """
        spec = build_spec(layers, model, reduction=reduction, dtype=dtype,
                          l2_normalize=l2_normalize, native=native, resize=resize, crop=crop)
        window = max(1, int(max_in_flight or self.max_in_flight))
        return Extraction(self._endpoints, spec, images, ids, window, _deadline).run()

    # -- attribution -------------------------------------------------------------------
    def attribute(self, image: Any, layer: str | None = AUTO_LAYER, method: str = "grad_cam",
                  target: int | None = None, model: str | None = None, **options: Any
                  ) -> Attribution:
        """One image's saliency map. Raises the typed error on failure.

        `layer` defaults to "layer4" for the CAM methods (grad_cam, hires_cam,
        layer_cam) and to None for the input-space methods (gradient,
        gradient_x_input, integrated_gradients, smooth_grad), which take none.
        `target` is the class to explain (default: the predicted one). `options` are
        those of :meth:`attribute_many`.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        (a,) = self.attribute_many([image], layer, method, model=model, targets=[target],
                                   _deadline=deadline, **options)
        return a.raise_for_error()

    def attribute_many(self, images: Iterable[Any], layer: str | None = AUTO_LAYER,
                       method: str = "grad_cam", model: str | None = None, *,
                       targets: Iterable[int | None] | None = None,
                       ids: Iterable[str] | None = None, score: str = "logit",
                       top_k: int = 0, relu: bool | None = None, normalize: bool = False,
                       upsample: bool = False, steps: int = 0, baseline: str = "zeros",
                       samples: int = 0, sigma: float = 0.0, seed: int = 0,
                       native: bool = False, resize: int | None = None,
                       crop: int | tuple[int, int] | None = None,
                       max_in_flight: int | None = None,
                       _deadline: float | None = None) -> Iterator[Attribution]:
        """Saliency maps of many images on one Attribute stream, one
        :class:`~hookserve.Attribution` per image, in order; lazy, windowed, with
        per-image errors and failover exactly as :meth:`extract_many`.

        - `targets`: one class index (or None: the predicted class) per image.
        - `score`: "logit" (default) or "softmax", the class score explained.
        - `top_k`: maps for the k most likely classes (images must not set a target).
        - Post-processing, each off unless asked: `relu` (None: on for the CAM methods),
          `normalize` (min-max to [0, 1]), `upsample` (CAM maps to the input size).
        - Integrated Gradients: `steps` (0: 32), `baseline` "zeros" or "black".
        - SmoothGrad: `samples` (0: 16), `sigma` (0: 0.15 of the input's range), `seed`.
        - Preprocessing as in :meth:`extract_many` (`native`, `resize`, `crop`).

        The server refuses a request costing more forward-equivalents per image than
        its ``--max-attribution-cost`` (see docs/attribution.md).
        """
        spec = build_attribution_spec(
            layer, method, model, score=score, top_k=top_k, relu=relu, normalize=normalize,
            upsample=upsample, steps=steps, baseline=baseline, samples=samples, sigma=sigma,
            seed=seed, native=native, resize=resize, crop=crop)
        geometry = request_geometry(native, resize, crop)
        window = max(1, int(max_in_flight or self.max_in_flight))
        return AttributionRun(
            self._endpoints, spec, images, ids, targets, window, _deadline,
            (lambda: geometry) if geometry is not None
            else (lambda: self._default_geometry(model or ""))).run()

    def _default_geometry(self, model: str) -> Geometry | None:
        """A model's default (resize, crop), from one ListModels per Client."""
        if self._geometries is None:
            infos = self.list_models()
            self._geometries = {m.name: (m.resize, m.crop) for m in infos}
            if infos:
                self._geometries[""] = self._geometries[infos[0].name]
        return self._geometries.get(model)
