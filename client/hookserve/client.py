"""The hookserve client SDK: one object, a clear lifetime, typed errors, no torch.

    >>> import hookserve
    >>> with hookserve.Client("localhost:50051") as client:
    ...     feats = client.extract("cat.jpg", layers=["layer4"], reduction="avg")
    >>> feats["layer4"].shape
    (2048,)

:class:`Client` is a small facade over what it shares with the asyncio client
(:mod:`.base`): :mod:`.endpoints` holds the channels and the failover,
:mod:`.extraction` runs the Extract stream, :mod:`.attribution` the Attribute stream on
the same machinery, :mod:`.types` the value types.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from . import errors
from .attribution import AUTO_LAYER, Attribution
from .base import (
    ClientBase,
    deadline_of,
    health_request,
    health_status,
)
from .extraction import Extraction
from .retry import RETRYABLE
from .types import (
    Layer,
    LayerInfo,
    ModelDescription,
    ModelInfo,
    Result,
    Size,
    build_layers,
    build_preprocessing,
    describe_request,
)
from .v1 import hookserve_pb2 as pb

__all__ = ["Attribution", "Client", "Layer", "LayerInfo", "ModelDescription", "ModelInfo", "Result",
           "RETRYABLE", "build_layers", "build_preprocessing"]


class Client(ClientBase):
    __doc__ = (ClientBase.__doc__ or "") + """
    Use it as a context manager, or call :meth:`close`. For asyncio applications,
    :class:`hookserve.aio.Client` offers the same calls with ``await``.
    """

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

    def _drive(self, run: Extraction) -> Iterator[Any]:
        return run.run()

    # -- unary calls -------------------------------------------------------------------
    def list_models(self) -> list[ModelInfo]:
        """The models the server holds; the first is its default."""
        return self._models_of(self._unary("ListModels", pb.ListModelsRequest()))

    def describe(self, model: str | None = None, size: Size | None = None
                 ) -> ModelDescription:
        """Every hookable layer of `model` with its output shape at input `size`:
        ``"480x640"`` (HxW), ``"224"`` or ``224`` (a square), or ``(480, 640)``;
        None: the model's default input size."""
        return ModelDescription.from_proto(
            self._unary("DescribeModel", describe_request(model, size)))

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check on the first address: "SERVING", "NOT_SERVING", ..."""
        try:
            raw = self._health_check()(health_request(service), timeout=self.timeout,
                                       metadata=self._endpoints.metadata)
        except grpc.RpcError as exc:
            err = errors.from_rpc_error(exc)
            if isinstance(err, errors.NotFound) and not err.message:
                err = errors.NotFound(
                    f"the server keeps no health status for service {service[:100]!r}: "
                    "ask for '' (the whole server) or 'hookserve.v1.FeatureExtractor'",
                    err.code)
            raise err from None
        return health_status(raw)

    # -- one image ---------------------------------------------------------------------
    def extract(self, image: Any, layers: Any, model: str | None = None, **options: Any
                ) -> dict[str, np.ndarray]:
        """Features of one image: layer name -> array. Raises the typed error on failure.

        `options` are those of :meth:`extract_many` (reduction, dtype, l2_normalize,
        native, resize, crop). It uses the ExtractImage RPC (one request, no stream
        kept open: the fastest call for a lone image), or an Extract stream with a
        server too old to have it. The client's `timeout` bounds the call.
        """
        one = self._image_call(image, layers, model, options)
        if one is not None:
            try:
                return self._endpoints.call(one)
            except errors.HookserveError as exc:
                self._without_image_rpc(exc)
        # Run the stream to its end (not just to the first result): abandoning it would
        # cancel the call, and the server would log and count a success as CANCELLED.
        (result,) = self.extract_many([image], layers, model=model,
                                      _deadline=deadline_of(self.timeout), **options)
        return result.raise_for_error()

    def attribute(self, image: Any, layer: str | None = AUTO_LAYER, method: str = "grad_cam",
                  target: int | None = None, model: str | None = None, **options: Any
                  ) -> Attribution:
        """One image's saliency map. Raises the typed error on failure.

        `layer` defaults to the model's default CAM layer (`ModelInfo.default_cam_layer`:
        resnet "layer4", vgg its last convolution, vit the last block's "ln_1") for the
        CAM methods (grad_cam, hires_cam, layer_cam) and to None for the input-space
        methods (gradient, gradient_x_input, integrated_gradients, smooth_grad), which
        take none.
        `target` is the class to explain (default: the predicted one). `options` are
        those of :meth:`attribute_many`. The client's `timeout` bounds the call.
        """
        self._attribute_options(options, model)
        (a,) = self.attribute_many([image], layer, method, model=model, targets=[target],
                                   _deadline=deadline_of(self.timeout), **options)
        return a.raise_for_error()
