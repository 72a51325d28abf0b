"""The SDK's value types (Layer, Result, ModelInfo, ...) and their wire forms.

The reduction and dtype names come from :mod:`.tables` (derived from the proto enums),
as the CLI's choices do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import errors
from .tables import DTYPE_FROM_WIRE, DTYPES, REDUCTIONS, split_port
from .v1 import hookserve_pb2 as pb

#: A size as the SDK and the CLI take it: "480x640" (HxW), "224" or 224 (a square), (h, w).
Size = int | str | tuple[int, int]


@dataclass(frozen=True)
class Layer:
    """A requested layer with its reduction (none|avg|max|flatten|stats|cls), dtype and
    L2 option. "stats" gives float32 ``[C, 5]`` per channel (``[1, 5]`` for a vector):
    :data:`~.tables.STATS_COLUMNS`; avg, max and stats keep the channels whatever the
    layer's layout (``LayerInfo.layout``); "cls" is token 0 of a ``TD`` (ViT) layer."""

    name: str
    reduction: str = "none"
    dtype: str = "float32"
    l2_normalize: bool = False

    def to_proto(self) -> pb.LayerRequest:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, "
                             f"got {self.reduction!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_flag("l2_normalize", self.l2_normalize)
        return pb.LayerRequest(name=self.name, reduction=REDUCTIONS[self.reduction],
                               dtype=DTYPES[self.dtype], l2_normalize=self.l2_normalize)


@dataclass
class Result:
    """One image's answer from :meth:`Client.extract_many`."""

    #: Position of the image in the input iterable.
    index: int
    #: The image's id (its path, or its position as a string, unless ids were given).
    id: str
    #: Layer name -> array, or None on error. Each array is writable and owns its
    #: memory: the tensor's bytes are copied once out of the received message(s) into a
    #: buffer the array wraps, with no further copy.
    features: dict[str, np.ndarray] | None = None
    #: The typed error when this image failed; the iteration goes on regardless.
    error: errors.HookserveError | None = None
    #: Layer name -> names along its last dimension, for layers whose entries have
    #: names (reduction "stats": :data:`~.tables.STATS_COLUMNS`).
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The layers the server answered from its answer cache (the same image bytes,
    #: weights and spec were answered before) rather than computed for this image.
    cached: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def from_cache(self) -> bool:
        """Every layer of the answer came from the server's cache."""
        return bool(self.features) and self.cached >= set(self.features)

    def raise_for_error(self) -> dict[str, np.ndarray]:
        if self.error is not None:
            raise self.error
        assert self.features is not None
        return self.features


@dataclass(frozen=True)
class LayerInfo:
    """A hookable layer, as DescribeModel reports it. `shape` is its output's;
    `input_shape` what ``"<name>:input"`` returns (empty when not a tensor)."""

    name: str
    module: str
    type: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_image: int
    order: int
    input_shape: tuple[int, ...] = ()
    input_bytes_per_image: int = 0
    #: How `shape` is laid out: "CHW", "HWC", "TD" (tokens x features), "D", or "" when
    #: the server does not say; avg, max, stats and the CAM methods keep the channels.
    layout: str = ""
    input_layout: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """A served model: architecture, weights in use, device, dtype, precision,
    preprocessing."""

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
    #: Classes of the classifier head (0: the model has none, its weights file held
    #: no head; or a server that does not say).
    num_classes: int = 0
    #: Class names in index order; () when the classes have none.
    labels: tuple[str, ...] = ()
    #: The layer the CAM methods explain when none is named ("" from an older server).
    default_cam_layer: str = ""
    #: "fp32", "bf16" or "fp16": the arithmetic of its forward pass (autocast)
    precision: str = "fp32"
    #: The default preprocessing's resize interpolation: "bilinear", "bicubic", ...
    interpolation: str = "bilinear"

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> ModelInfo:
        p = m.preprocessing
        return cls(
            name=m.name, architecture=m.architecture, weights_source=m.weights.source,
            weights_name=m.weights.name, weights_digest=m.weights.digest,
            pretrained=m.weights.pretrained, weights_verified=m.weights.verified,
            device=m.device, dtype=DTYPE_FROM_WIRE.get(m.dtype, "float32"),
            resize=p.resize, crop=(p.crop_height, p.crop_width),
            mean=tuple(p.mean), std=tuple(p.std), num_classes=m.num_classes,
            labels=tuple(m.labels), default_cam_layer=m.default_cam_layer,
            precision=m.precision or "fp32", interpolation=p.interpolation or "bilinear")


def _layout(value: int) -> str:
    """A wire Layout as its name ("CHW"); "" when unspecified."""
    return "" if value == pb.LAYOUT_UNSPECIFIED else pb.Layout.Name(value).removeprefix("LAYOUT_")


@dataclass(frozen=True)
class ModelDescription:
    """DescribeModel's answer: the model and every layer at one input size."""

    model: ModelInfo
    input_size: tuple[int, int]
    layers: list[LayerInfo] = field(default_factory=list)
    #: Memory one image holds during an Attribute pass at this size (saved
    #: activations plus gradients); Attribute batches are bounded by it.
    gradient_bytes_per_image: int = 0
    #: The largest request message the server accepts (0: not reported).
    max_message_bytes: int = 0

    def layer(self, name: str) -> LayerInfo:
        for li in self.layers:
            if li.name == name:
                return li
        raise KeyError(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor shape a layer request `name` returns before any reduction:
        the output's, or for ``"<layer>:input"`` that module's input's."""
        module, is_input = split_port(name)
        return self.layer(module).input_shape if is_input else self.layer(module).shape

    def layout_of(self, name: str) -> str:
        """The layout ("CHW", "HWC", "TD", "D"; "" when not reported) of what a layer
        request `name` returns before any reduction."""
        module, is_input = split_port(name)
        li = self.layer(module)
        return li.input_layout if is_input else li.layout

    @classmethod
    def from_proto(cls, r: pb.DescribeModelResponse) -> ModelDescription:
        layers = [LayerInfo(li.name, li.module, li.type, tuple(li.output_shape),
                            DTYPE_FROM_WIRE.get(li.dtype, "float32"), li.bytes_per_image,
                            li.order, tuple(li.input_shape), li.input_bytes_per_image,
                            _layout(li.layout), _layout(li.input_layout))
                  for li in r.layers]
        return cls(ModelInfo.from_proto(r.model), (r.input_height, r.input_width), layers,
                   r.gradient_bytes_per_image, r.max_message_bytes)


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
    elif not isinstance(layers, (Mapping, Iterable)) or isinstance(layers, (bytes, bytearray)):
        raise TypeError(f"layers are a name, a list of names or Layers, or a dict of name "
                        f"to options, not {type(layers).__name__}: e.g. ['layer4'] or "
                        "{'layer4': {'reduction': 'avg'}}")
    out: list[Layer] = []
    if isinstance(layers, Mapping):
        for name, opts in layers.items():
            if opts is not None and not isinstance(opts, Mapping):
                raise TypeError(f"layer {name!r}: its options are a dict, e.g. "
                                f"{{'reduction': 'avg'}}, not {type(opts).__name__}")
            unknown = sorted(set(opts or {}) - set(defaults))
            if unknown:
                raise TypeError(f"layer {name!r}: unknown option {unknown[0]!r}: use "
                                f"{', '.join(defaults)}")
            out.append(Layer(name, **{**defaults, **(opts or {})}))
    else:
        for item in layers:
            out.append(item if isinstance(item, Layer) else Layer(_one_name(item), **defaults))
    if not out:
        raise ValueError("give at least one layer")
    return out


def _one_name(item: Any) -> str:
    """A layer name as given in a list, refused where it is the CLI's spelling of
    several layers or of a layer's options (which the SDK takes as a dict)."""
    name = str(item)
    if "," in name:
        raise ValueError(f"layer {name[:100]!r}: give several layers as a list, e.g. "
                         f"{[n.strip() for n in name.split(',')][:3]!r} (a comma "
                         "separates them on the command line only)")
    head, _, last = name.rpartition(":")
    if head and last in REDUCTIONS:
        raise ValueError(f"layer {name[:100]!r}: give a reduction as an option, e.g. "
                         f"{{{head!r}: {{'reduction': {last!r}}}}} or reduction={last!r} "
                         "(the command line's `layer:reduction` is its own spelling)")
    return name


def parse_size(value: Any, what: str = "size") -> tuple[int, int]:
    """A size as the CLI takes it -> (height, width): ``"480x640"``, ``"224"`` or ``224``
    (a square), or a pair ``(480, 640)``. Raises ValueError saying what is accepted."""
    hint = f"{what} must be HxW such as '480x640', one number for a square, or (h, w)"
    if isinstance(value, str):
        h, sep, w = value.strip().lower().partition("x")
        try:
            size = (int(h), int(w if sep else h))
        except ValueError:
            raise ValueError(f"{hint}; got {value!r}") from None
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        size = (int(value), int(value))
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        size = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{hint}; got {value!r}")
    if min(size) <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return size


def parse_side(value: Any, what: str = "resize") -> int | None:
    """A resize target (the shorter side) -> int, or None for none: an int or a numeric
    string such as ``"256"``; 0 and None mean no resize."""
    if value is None:
        return None
    try:
        side = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        side = None
    if side is None or side < 0:
        raise ValueError(f"{what} must be a number of pixels (the shorter side), got {value!r}")
    return side or None


def check_flag(what: str, value, none: str = "") -> None:
    """An on/off option is True or False (a string such as "no" would be true); None
    too when `none` says what None means."""
    if not (isinstance(value, (bool, np.bool_)) or (none and value is None)):
        raise ValueError(f"{what} is True or False" + (f" (None: {none})" if none else "")
                         + f", got {value!r:.60}")


def build_preprocessing(*, native: bool = False, resize: int | str | None = None,
                        crop: Size | None = None) -> pb.Preprocessing:
    """Default transforms, `native` resolution, or a custom resize and/or centre crop.

    `crop` takes what the CLI's ``--crop`` takes ("288x288", "224", 224, (h, w));
    `resize` the shorter side (an int or a numeric string)."""
    side = parse_side(resize)
    check_flag("native", native)
    if native:
        if side or crop:
            raise ValueError("native takes no resize or crop")
        return pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE)
    if side is None and crop is None:
        return pb.Preprocessing(mode=pb.Preprocessing.MODE_DEFAULT)
    ch, cw = parse_size(crop, "crop") if crop is not None else (0, 0)
    return pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=side or 0,
                            crop_height=ch, crop_width=cw)


def check_model(model: Any) -> None:
    """A model argument is a served model's name (or None: the server's default)."""
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model is a model's name (a str, as list_models() gives them), "
                        f"not {type(model).__name__}: {model!r}"[:200])


def describe_request(model: str | None, size: Size | None) -> pb.DescribeModelRequest:
    """DescribeModel's request: `size` as :func:`parse_size` takes it (None: the model's
    default input size)."""
    check_model(model)
    h, w = parse_size(size) if size is not None else (0, 0)
    return pb.DescribeModelRequest(model=model or "", input_height=h, input_width=w)


#: The keyword options of one extraction (Client.extract, extract_many's spec).
EXTRACT_OPTIONS = ("reduction", "dtype", "l2_normalize", "native", "resize", "crop")


def build_spec(layers: Any, model: str | None, *, reduction: str = "none",
               dtype: str = "float32", l2_normalize: bool = False, native: bool = False,
               resize: int | str | None = None,
               crop: Size | None = None) -> pb.ExtractionSpec:
    """The wire ExtractionSpec of one extract_many call (raises ValueError on bad options)."""
    return pb.ExtractionSpec(
        model=model or "",
        layers=[layer.to_proto() for layer in build_layers(
            layers, reduction=reduction, dtype=dtype, l2_normalize=l2_normalize)],
        preprocessing=build_preprocessing(native=native, resize=resize, crop=crop))
