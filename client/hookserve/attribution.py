"""Saliency maps over the Attribute RPC: the :class:`Attribution` type and the stream.

    >>> a = client.attribute("cat.jpg", layer="layer4", method="grad_cam")
    >>> a.map.shape, a.target, round(a.prob, 3)
    ((7, 7), 281, 0.412)

The stream is :class:`~.extraction.Extraction`'s (lazy input, bounded window, answers
in order, failover re-sends only unanswered images); :class:`AttributionRun` only
names the RPC, wraps each image with its target, and builds Attributions from the
summary and map messages. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import errors, wire
from .endpoints import Endpoints
from .extraction import Extraction, _Pending, per_image
from .tables import BASELINES, CAM_METHODS, METHODS, SCORES
from .types import Size, build_preprocessing, check_flag, parse_side, parse_size
from .v1 import hookserve_pb2 as pb

#: The layer a CAM method explains when none is given: sent empty, the server picks the
#: model's default (`ModelInfo.default_cam_layer`: resnet "layer4", vgg its last
#: convolution, vit the last block's "ln_1").
DEFAULT_LAYER = ""


class _DefaultLayer(str):
    """The `layer` default: the model's default CAM layer for the CAM methods, none for
    the others."""

    def __repr__(self) -> str:
        return "the model's default_cam_layer for CAM methods, None otherwise"


AUTO_LAYER = _DefaultLayer(DEFAULT_LAYER)
#: Geometry of the preprocessing: (resize of the shorter side or 0, crop HxW or None).
Geometry = tuple[int, "tuple[int, int] | None"]


@dataclass(frozen=True)
class ClassScore:
    """One class's score for one image. Unpacks as ``(index, label, prob)``:
    ``for index, label, prob in a.top5``."""

    index: int
    logit: float
    prob: float
    #: The class's name ("" when the model's classes have none: ``--labels``).
    label: str = ""

    def __iter__(self):
        return iter((self.index, self.label, self.prob))


@dataclass(frozen=True)
class MapTarget:
    """What one map explains: its class, the map's range before normalisation, and
    (Integrated Gradients only) the completeness delta."""

    target: ClassScore
    min: float
    max: float
    delta: float | None = None


@dataclass
class Attribution:
    """One image's saliency map from :meth:`Client.attribute` / :meth:`Client.attribute_many`.

    ``map`` is float32: ``[h, w]`` at the layer's resolution for the CAM methods
    (``[H, W]`` with ``upsample=True``), ``[3, H, W]`` over the preprocessed input for
    the input-space methods, with a leading ``top_k`` dimension when ``top_k >= 2``.
    The scalar properties (``target``, ``logit``, ``prob``, ``min``, ``max``,
    ``delta``) describe the first map; ``targets`` lists every map's.
    """

    #: Position of the image in the input iterable.
    index: int
    #: The image's id (its path, or its position as a string, unless ids were given).
    id: str
    #: The map, or None on error: writable, owning its memory (copied once out of the
    #: received message(s), as ``Result.features``).
    map: np.ndarray | None = None
    #: One entry per map (one, or top_k in the order of the map's leading dimension).
    targets: list[MapTarget] = field(default_factory=list)
    #: The five most probable classes, highest first; each unpacks as
    #: ``(index, label, prob)``.
    top5: list[ClassScore] = field(default_factory=list)
    #: The preprocessing geometry the map refers to, for :func:`hookserve.overlay`:
    #: (resize of the shorter side or 0, centre crop HxW or None); None if unknown.
    geometry: Geometry | None = None
    #: The typed error when this image failed; the iteration goes on regardless.
    error: errors.HookserveError | None = None
    #: The server answered from its answer cache (the same image bytes, weights, spec
    #: and target were answered before) rather than computing the map for this image.
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> Attribution:
        if self.error is not None:
            raise self.error
        return self

    def _first(self) -> MapTarget:
        if not self.targets:
            raise ValueError(f"image {self.id!r} has no map: {self.error}")
        return self.targets[0]

    @property
    def target(self) -> int:
        """The class the (first) map explains."""
        return self._first().target.index

    @property
    def label(self) -> str:
        """The name of that class ("" when the model's classes have none)."""
        return self._first().target.label

    @property
    def logit(self) -> float:
        return self._first().target.logit

    @property
    def prob(self) -> float:
        return self._first().target.prob

    @property
    def min(self) -> float:
        """The map's minimum after ReLU (when on), before normalisation."""
        return self._first().min

    @property
    def max(self) -> float:
        """The map's maximum after ReLU (when on), before normalisation."""
        return self._first().max

    @property
    def delta(self) -> float | None:
        """Integrated Gradients' completeness delta; None for the other methods."""
        return self._first().delta


def _score(c: pb.ClassScore) -> ClassScore:
    return ClassScore(int(c.class_index), float(c.logit), float(c.probability), c.label)


def resolve_layer(layer: str | None, method: str) -> str | None:
    """The layer to send: `layer` as given, or for :data:`AUTO_LAYER` the default."""
    if layer is AUTO_LAYER:
        return DEFAULT_LAYER if method in CAM_METHODS else None
    return layer


#: The options of one method alone: option -> that method.
METHOD_OPTIONS = {"steps": "integrated_gradients", "baseline": "integrated_gradients",
                  "samples": "smooth_grad", "sigma": "smooth_grad", "seed": "smooth_grad"}


def other_methods_option(method: str, **given: object) -> tuple[str, str] | None:
    """(option, its method) of the first option given (truthy) that belongs to
    another method than `method`, which would ignore it; None when there is none."""
    return next(((o, METHOD_OPTIONS[o]) for o, on in given.items()
                 if on and METHOD_OPTIONS[o] != method), None)


#: SmoothGrad's noise, a fraction of the input's range, as the server takes it (a float32
#: on the wire: smaller values would round to 0, the default).
MIN_SG_SIGMA, MAX_SG_SIGMA = 1e-6, 1000.0


def build_attribution_spec(layer: str | None, method: str, model: str | None, *,
                           score: str = "logit", top_k: int = 0, relu: bool | None = None,
                           normalize: bool = False, upsample: bool = False,
                           steps: int = 0, baseline: str = "zeros", samples: int = 0,
                           sigma: float = 0.0, seed: int = 0, native: bool = False,
                           resize: int | str | None = None,
                           crop: Size | None = None) -> pb.AttributionSpec:
    """The wire AttributionSpec (raises ValueError on options that cannot be encoded;
    the server checks the rest: the layer, method/layer pairing, the cost cap)."""
    if layer is not None and not isinstance(layer, str):
        raise TypeError(f"layer {layer!r:.60}: an attribution explains one layer, named "
                        "by a string (layer=\"layer4\"), or None for the method's default")
    if isinstance(layer, str) and layer in METHODS and method == "grad_cam":
        raise ValueError(f"{layer!r} is an attribution method, given where the layer goes: "
                         f"attribute(image, method={layer!r})")
    for what, value, table in (("method", method, METHODS), ("score", score, SCORES),
                               ("baseline", baseline, BASELINES)):
        if value not in table:
            raise ValueError(f"{what} must be one of {', '.join(table)}, got {value!r}")
    for what, value, top in (("top_k", top_k, 2**32 - 1), ("steps", steps, 2**32 - 1),
                             ("samples", samples, 2**32 - 1), ("seed", seed, 2**64 - 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 0 <= value <= top:
            raise ValueError(f"{what} must be a whole number from 0 to {top}, got {value!r}")
    check_flag("relu", relu, none="the method's default")
    check_flag("normalize", normalize)
    check_flag("upsample", upsample)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.floating)) \
            or not (sigma == 0 or MIN_SG_SIGMA <= sigma <= MAX_SG_SIGMA):
        raise ValueError(f"sigma is a fraction of the input's range, {MIN_SG_SIGMA:g} to "
                         f"{MAX_SG_SIGMA:g} (0: the default, 0.15), got {sigma!r}")
    if upsample and method not in CAM_METHODS:
        raise ValueError(f"upsample is for the CAM methods' maps ({', '.join(CAM_METHODS)}): "
                         f"{method}'s map has the input's size already: drop it")
    # options of another method would be ignored: say so
    found = other_methods_option(method, steps=steps, baseline=baseline != "zeros",
                                 samples=samples, sigma=sigma, seed=seed)
    if found:
        what, owner = found
        raise ValueError(f"{what} is an option of {owner}, not of {method}: drop it, or "
                         f"use method={owner!r}")
    spec = pb.AttributionSpec(
        model=model or "", layer=resolve_layer(layer, method) or "", method=METHODS[method],
        score=SCORES[score],
        top_k=int(top_k), normalize=normalize, upsample=upsample, ig_steps=int(steps),
        ig_baseline=BASELINES[baseline], sg_samples=int(samples), sg_sigma=float(sigma),
        sg_seed=int(seed),
        preprocessing=build_preprocessing(native=native, resize=resize, crop=crop))
    if relu is not None:
        spec.relu = bool(relu)
    return spec


def request_geometry(native: bool, resize: int | str | None,
                     crop: Size | None) -> Geometry | None:
    """The geometry the options ask for; None for the model's default (ask the server)."""
    if native:
        return (0, None)
    side = parse_side(resize)
    if side is None and crop is None:
        return None
    return (side or 0, parse_size(crop, "crop") if crop is not None else None)


class AttributionRun(Extraction):
    """Owns the stream(s) of one attribute_many call; yields :class:`Attribution`s."""

    rpc = "Attribute"

    def __init__(self, endpoints: Endpoints, spec: pb.AttributionSpec, images: Iterable[Any],
                 ids: Iterable[str] | None, targets: Iterable[int | None] | None, window: int,
                 deadline: float | None, geometry: Callable[[], Geometry | None]) -> None:
        super().__init__(endpoints, spec, images, ids, window, deadline)  # type: ignore[arg-type]
        self._targets_given = targets
        self.targets = (iter(per_image("targets", targets, "class index (or None)"))
                        if targets is not None else None)
        self.geometry = geometry
        #: True when `geometry` needs the model's default preprocessing (ListModels)
        self.default_geometry = False

    def _per_image(self) -> list[tuple[str, Any]]:
        return [*super()._per_image(), ("targets", self._targets_given)]

    def _extra(self, index: int) -> int | None:
        """Image `index`'s target: a class index, or None."""
        if self.targets is None:
            return None
        missing = object()
        t = next(self.targets, missing)
        if t is missing:
            raise ValueError(f"targets has fewer items than images (ran out at image {index})")
        if hasattr(t, "item") and getattr(t, "ndim", None) == 0:   # a 0-d tensor or array
            t = t.item()
        if t is not None and (isinstance(t, bool) or not isinstance(
                t, (int, float, np.integer, np.floating)) or not np.isfinite(t)
                or int(t) != t):
            raise ValueError(f"target of image {index} must be a class index or None, "
                             f"got {t!r} (`hookserve describe` and ModelInfo.labels give "
                             "each class's index)")
        return None if t is None else int(t)

    def _encode(self, obj: Any, wire_id: str, extra: int | None) -> bytes:
        return wire.attribute_request(obj, wire_id, extra, self.endpoints.max_send)

    def _spec_request(self) -> Any:
        return pb.AttributeRequest(spec=self.spec)

    def _reset(self) -> None:
        super()._reset()
        self._summary: pb.AttributionSummary | None = None

    def _absorb(self, msg: Any) -> Any:
        which = msg.WhichOneof("payload")
        if which == "summary":
            self._summary = msg.summary
        elif which == "map":
            self._add_tensor(msg.map)
        return msg.status if which == "status" else None

    def _result(self, p: _Pending, error: errors.HookserveError | None) -> Attribution:
        if error is not None:
            return Attribution(p.index, p.id, error=error)
        amap = next(iter(self._got.features.values()), None)
        s = self._summary
        if amap is None or s is None:
            return Attribution(p.index, p.id, error=errors.Internal(
                "the server ended the image without its "
                + ("map" if s is not None else "summary")))
        targets = [MapTarget(_score(t.target), float(t.map_min), float(t.map_max),
                             float(t.completeness_delta)
                             if t.HasField("completeness_delta") else None)
                   for t in s.targets]
        return Attribution(p.index, p.id, map=amap, targets=targets,
                           top5=[_score(c) for c in s.top5], geometry=self.geometry(),
                           cached=bool(self._got.cached))
