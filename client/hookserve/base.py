"""What :class:`hookserve.Client` and :class:`hookserve.aio.Client` share: the
connection options, how each call's request is built, and the stream runs.

A subclass supplies the I/O: ``_drive(run)`` turns an :class:`~.extraction.Extraction`
(or :class:`~.attribution.AttributionRun`) into the iterator its callers get (a
generator for the sync client, an async generator for the asyncio one). The specs,
the checks of every option, the answer decoding, the error mapping and the failover
policy are the same objects for both.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import numpy as np

from . import errors
from .attribution import (
    AUTO_LAYER,
    AttributionRun,
    Geometry,
    build_attribution_spec,
    request_geometry,
)
from .endpoints import Endpoints
from .extraction import Extraction, ImageCall
from .retry import FIRST_BACKOFF, RETRIES
from .types import EXTRACT_OPTIONS, ModelInfo, Size, build_spec, check_model
from .v1 import hookserve_pb2 as pb
from .wire import varint

_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest, encoded by hand (the SDK needs no extra
    package for two tiny messages)."""
    if not isinstance(service, str):
        raise TypeError(f"service is a service's name (a str; \"\" for the server as a "
                        f"whole), not {type(service).__name__}: {service!r}"[:200])
    svc = service.encode()
    return (b"\x0a" + varint(len(svc)) + svc) if svc else b""


def health_status(raw: bytes) -> str:
    """A HealthCheckResponse's status: "SERVING", "NOT_SERVING", ..."""
    status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
    return _HEALTH_NAMES.get(status, f"UNKNOWN({status})")


#: Longer timeouts are no limit (gRPC's deadline, in int64 nanoseconds, overflows
#: past about 292 years; a call never needs more than this).
MAX_TIMEOUT_S = 10.0 ** 8


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """A timeout as the SDK takes it: seconds above 0, or None (or infinity) for no
    limit. Raises ValueError otherwise (0 is no "no limit" here: that is None)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{what} must be seconds (a number), or None for no limit; "
                         f"got {timeout!r}")
    if not timeout > 0:   # (nan too)
        raise ValueError(f"{what} must be above 0 seconds, or None for no limit; got "
                         f"{timeout!r}")
    return None if timeout > MAX_TIMEOUT_S else float(timeout)


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic deadline `timeout` seconds from now (None: none)."""
    timeout = check_timeout(timeout)
    return None if timeout is None else time.monotonic() + timeout


def one_image_options(call: str, options: dict[str, Any]) -> None:
    """Refuse a stream's own options given to a one-image call (they would be ignored:
    the client's timeout bounds the call, and one image needs no window)."""
    for name in ("timeout", "max_in_flight"):
        if name in options:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}"
                            + (" (the client's timeout bounds it: Client(timeout=...), or "
                               f"{call}_many(..., timeout=...))" if name == "timeout"
                               else f" ({call}_many takes it)"))


def refuse_unknown(call: str, unknown: dict[str, Any], known: Sequence[str],
                   hints: dict[str, str] | None = None) -> None:
    """A keyword argument `call` does not take, as a TypeError that names its options
    (and the one likely meant), not Python's bare one."""
    if not unknown:
        return
    name = sorted(unknown)[0]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = (hints or {}).get(name) or (f" (did you mean {near[0]}?)" if near else "")
    raise TypeError(f"{call}() got an unexpected keyword argument {name!r}{hint}: its "
                    f"options are {', '.join(known)}")


@functools.cache
def options_of(fn: Any, *leave: str) -> tuple[str, ...]:
    """The keyword options of a method: its parameters but the images and private ones
    (and `leave`); read once per method (every call checks against them)."""
    return tuple(p for p in inspect.signature(fn).parameters
                 if p not in ("self", "images", "image", "unknown", *leave)
                 and not p.startswith("_"))


def check_window(n: Any, what: str = "max_in_flight") -> int:
    """An in-flight window: a whole number of images, 1 or more."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be a whole number of images, 1 or more; got {n!r}")
    return n


def _iterable_of_images(images: Any) -> Any:
    """`images` for a ..._many call: one image passed alone is a mistake that would be
    iterated (a path's characters, an array's rows)."""
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike, np.ndarray)) \
            or type(images).__module__.startswith("PIL."):
        raise TypeError(f"images is one {type(images).__name__}: pass an iterable of "
                        "images, such as [image], or call extract/attribute for one")
    return images


class ClientBase:
    """A connection to one or more hookserve servers.

    Args:
        target: ``host:port``; ``grpcs://host:port`` for TLS; ``dns:///name:port`` to
            balance round-robin over every address the name resolves to; or several
            addresses (a list, or comma-separated), used round-robin with failover.
        timeout: seconds allowed for each unary call (list_models, describe, health)
            and each one-image call (extract, attribute). None: no limit.
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
        options: extra gRPC channel options, ``[(name, value), ...]``.
    """

    _aio = False

    def __init__(self, target: str | Sequence[str], *, timeout: float | None = 60.0,
                 token: str | None = None,
                 root_certificates: bytes | str | os.PathLike | None = None,
                 certificate_chain: bytes | str | os.PathLike | None = None,
                 private_key: bytes | str | os.PathLike | None = None,
                 max_in_flight: int = 32, retries: int = RETRIES,
                 retry_backoff: float = FIRST_BACKOFF,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        token = token if token is not None else os.environ.get("HOOKSERVE_TOKEN")
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token is the server's bearer token as a str, not "
                            f"{type(token).__name__}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries is how many times a failed call is tried again, "
                             f"0 or more, got {retries!r}")
        if isinstance(retry_backoff, bool) or not isinstance(retry_backoff, (int, float)) \
                or not 0 <= retry_backoff < float("inf"):
            raise ValueError(f"retry_backoff is the first wait in seconds before a retry, "
                             f"0 or more, got {retry_backoff!r}")
        self._endpoints = Endpoints(
            target, token=token, root_certificates=root_certificates,
            certificate_chain=certificate_chain, private_key=private_key,
            retries=retries, retry_backoff=retry_backoff, options=options, aio=self._aio)
        self.addresses = self._endpoints.addresses
        self.secure = self._endpoints.secure
        self.timeout = check_timeout(timeout)
        self.max_in_flight = check_window(max_in_flight)
        self.retries = self._endpoints.retries
        self.retry_backoff = retry_backoff
        #: model name ("" = the default) -> its default preprocessing geometry
        self._geometries: dict[str, Geometry] | None = None
        #: False once a server answered UNIMPLEMENTED to ExtractImage (it predates it)
        self._image_rpc = True

    def _drive(self, run: Extraction) -> Any:
        """The iterator of results the caller gets for `run` (a subclass's I/O)."""
        raise NotImplementedError

    # -- streams -----------------------------------------------------------------------
    def extract_many(self, images: Iterable[Any], layers: Any, model: str | None = None, *,
                     ids: Iterable[str] | None = None, reduction: str = "none",
                     dtype: str = "float32", l2_normalize: bool = False,
                     native: bool = False, resize: int | str | None = None,
                     crop: Size | None = None, max_in_flight: int | None = None,
                     timeout: float | None = None, _deadline: float | None = None,
                     **unknown: Any) -> Any:
        """Stream images through one call; yield one :class:`Result` per image, in order.

        `images` is consumed lazily, with at most `max_in_flight` images sent and not
        yet answered. A failed image yields a Result with `.error` set and the
        iteration goes on; a failure of the whole call (bad spec, unknown model or
        layer, auth, `timeout`) raises the typed error. If the server becomes
        UNAVAILABLE mid-stream, the unanswered images are re-sent to another address
        (up to `retries` times), so none is lost or answered twice.

        The stream reads ahead: it sends up to `max_in_flight` images before it reads
        the first answer, so with a slow lazy source the first result comes once that
        many images were produced (or the source ended).

        `ids` (one per image, unique) are sent to the server and become `Result.id`;
        without them `Result.id` is the path (or the position) and the wire carries the
        position only, so the same path may appear twice.

        Layers take `reduction` (none|avg|max|flatten|stats|cls; stats is ``[C, 5]`` per
        channel: mean, std, min, max, zero fraction, see ``Result.columns``; cls is a
        ViT block's class token), `dtype`
        (float32|float16|bfloat16) and `l2_normalize` unless set per layer.
        Preprocessing is the model's default unless `native=True` or `resize`/`crop`
        (the shorter side, and a centre crop given as the CLI takes it: ``"288x288"``,
        ``"224"``, ``224`` or ``(288, 288)``).

        `timeout`: seconds for the whole stream, re-sends included (None: no limit;
        the client's `timeout` is for single calls).
        """
        refuse_unknown("extract_many", unknown, options_of(ClientBase.extract_many))
        check_model(model)
        spec = build_spec(layers, model, reduction=reduction, dtype=dtype,
                          l2_normalize=l2_normalize, native=native, resize=resize, crop=crop)
        window = (self.max_in_flight if max_in_flight is None
                  else check_window(max_in_flight))
        deadline = _deadline if _deadline is not None else deadline_of(timeout)
        return self._drive(Extraction(self._endpoints, spec, _iterable_of_images(images),
                                      ids, window, deadline))

    def attribute_many(self, images: Iterable[Any], layer: str | None = AUTO_LAYER,
                       method: str = "grad_cam", model: str | None = None, *,
                       targets: Iterable[int | None] | None = None,
                       ids: Iterable[str] | None = None, score: str = "logit",
                       top_k: int = 0, relu: bool | None = None, normalize: bool = False,
                       upsample: bool = False, steps: int = 0, baseline: str = "zeros",
                       samples: int = 0, sigma: float = 0.0, seed: int = 0,
                       native: bool = False, resize: int | str | None = None,
                       crop: Size | None = None, max_in_flight: int | None = None,
                       timeout: float | None = None, _deadline: float | None = None,
                       **unknown: Any) -> Any:
        """Saliency maps of many images on one Attribute stream, one
        :class:`~hookserve.Attribution` per image, in order; lazy, windowed, with
        per-image errors, failover and `timeout` exactly as :meth:`extract_many`.

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
        refuse_unknown("attribute_many", unknown, options_of(ClientBase.attribute_many),
                       {"target": " (one class per image: targets=[...])"})
        check_model(model)
        spec = build_attribution_spec(
            layer, method, model, score=score, top_k=top_k, relu=relu, normalize=normalize,
            upsample=upsample, steps=steps, baseline=baseline, samples=samples, sigma=sigma,
            seed=seed, native=native, resize=resize, crop=crop)
        geometry = request_geometry(native, resize, crop)
        window = (self.max_in_flight if max_in_flight is None
                  else check_window(max_in_flight))
        deadline = _deadline if _deadline is not None else deadline_of(timeout)
        run = AttributionRun(
            self._endpoints, spec, _iterable_of_images(images), ids, targets, window, deadline,
            (lambda: geometry) if geometry is not None
            else (lambda: self._default_geometry(model or "")))
        run.default_geometry = geometry is None
        return self._drive(run)

    def _attribute_options(self, options: dict[str, Any], model: Any) -> None:
        """attribute()'s own check of its options: those of attribute_many but the
        stream's, named as attribute's."""
        one_image_options("attribute", options)
        known = options_of(ClientBase.attribute_many, "targets", "max_in_flight", "timeout")
        refuse_unknown("attribute", {k: v for k, v in options.items() if k not in known},
                       known, {"targets": " (one image's class is target=)"})
        check_model(model)

    # -- pieces of the one-shot calls -------------------------------------------------
    def _health_check(self) -> Any:
        """grpc.health.v1 Check on the first address, as raw bytes both ways."""
        return self._endpoints.channels[0].unary_unary(
            HEALTH_CHECK, request_serializer=lambda b: b, response_deserializer=lambda b: b)

    def _image_call(self, image: Any, layers: Any, model: str | None,
                    options: dict[str, Any]) -> ImageCall | None:
        """One image's ExtractImage call; None once a server answered that it has no
        such RPC (it predates it: the one-image calls use a stream from then on)."""
        one_image_options("extract", options)
        refuse_unknown("extract", {k: v for k, v in options.items()
                                   if k not in EXTRACT_OPTIONS}, EXTRACT_OPTIONS)
        check_model(model)
        if not self._image_rpc:
            return None
        return ImageCall(self._endpoints, build_spec(layers, model, **options), image,
                         self.timeout)

    def _without_image_rpc(self, exc: errors.HookserveError) -> None:
        """After ExtractImage failed: re-raise, unless the server lacks the RPC."""
        if exc.code != grpc.StatusCode.UNIMPLEMENTED:
            raise exc
        self._image_rpc = False

    # -- the models and their default preprocessing, for overlays ----------------------
    def _models_of(self, response: pb.ListModelsResponse) -> list[ModelInfo]:
        infos = [ModelInfo.from_proto(m) for m in response.models]
        self._remember_models(infos)
        return infos

    def _remember_models(self, infos: list[ModelInfo]) -> None:
        self._geometries = {m.name: (m.resize, m.crop) for m in infos}
        if infos:
            self._geometries[""] = self._geometries[infos[0].name]

    def _default_geometry(self, model: str) -> Geometry | None:
        """A model's default (resize, crop), from one ListModels per Client (the
        asyncio client lists the models before such a stream starts)."""
        if self._geometries is None:
            self._remember_models(self.list_models())  # type: ignore[attr-defined]
        assert self._geometries is not None
        return self._geometries.get(model)
