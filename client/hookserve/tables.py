"""The SDK's value lists, each derived from its proto enum, and the layer-name rule.

Every list the SDK, the CLI, the Ray adapter and `hookserve batch` take a value from
is built here from the generated enum (every member but ``*_UNSPECIFIED``, in the
proto's order, named by its member name without the prefix, in lower case):

- :data:`REDUCTIONS` (``avg`` and ``max`` are the short names of ``AVG_POOL`` and
  ``MAX_POOL``), with the per-image shape each gives (:data:`REDUCED_SHAPES`, the
  rule the proto documents; :func:`reduced_shape`, :func:`follows_size`);
- :data:`DTYPES`, with the numpy type each arrives as (:data:`NUMPY_DTYPES`);
- :data:`METHODS`, with whether each explains a layer (:data:`TAKES_LAYER`);
  :data:`SCORES`; :data:`BASELINES`.

A proto value with no entry in a table here, or an entry with no proto value, fails
``tests/test_client_tables.py``.

A layer request's name is a module's name, or ``"<module>:input"`` for that module's
input: :func:`split_port` is the one place that reads the suffix.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np

from .v1 import hookserve_pb2 as pb

Shape = tuple[int, ...]


def enum_names(enum: Any, prefix: str, short: dict[str, str] | None = None
               ) -> dict[str, int]:
    """Name -> wire value of every member of a proto `enum` but UNSPECIFIED, in the
    proto's order: the member's name without `prefix`, lower case (`short` renames)."""
    out = {}
    for member, number in enum.items():
        name = member.removeprefix(prefix).lower()
        if name != "unspecified":
            out[(short or {}).get(name, name)] = number
    return out


# -- reductions --------------------------------------------------------------------------
#: Reduction name -> wire enum, in the order the CLI lists them.
REDUCTIONS = enum_names(pb.Reduction, "REDUCTION_", {"avg_pool": "avg", "max_pool": "max"})
#: Columns of a "stats" result ``[C, 5]`` (the server also names them on the wire).
STATS_COLUMNS = ("mean", "std", "min", "max", "zero_fraction")


def _channels(shape: Shape) -> int:
    return shape[0] if len(shape) > 1 else 1


#: Wire reduction -> the per-image shape it gives a tensor of `shape` (C, H, W) or (F,),
#: as the proto documents it.
REDUCED_SHAPES: dict[int, Callable[[Shape], Shape]] = {
    pb.REDUCTION_NONE: lambda shape: tuple(shape),
    pb.REDUCTION_AVG_POOL: lambda shape: tuple(shape[:1]),
    pb.REDUCTION_MAX_POOL: lambda shape: tuple(shape[:1]),
    pb.REDUCTION_FLATTEN: lambda shape: (prod(shape),),
    pb.REDUCTION_STATS: lambda shape: (_channels(shape), len(STATS_COLUMNS)),
    pb.REDUCTION_CLS: lambda shape: tuple(shape[-1:]),  # token 0 of (T, D): (D,)
}
#: The reductions that keep the channels (features) whatever the layer's layout: their
#: rule above sees the shape channels first.
PER_CHANNEL = {pb.REDUCTION_AVG_POOL, pb.REDUCTION_MAX_POOL, pb.REDUCTION_STATS}


def channels_first(shape: Shape, layout: str) -> Shape:
    """A per-image shape with its channels (features) first: (H, W, C) -> (C, H, W) for
    "HWC", (T, D) -> (D, T) for "TD"; others as they are."""
    if layout == "HWC" and len(shape) == 3:
        return (shape[2], shape[0], shape[1])
    if layout == "TD" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


def reduced_shape(reduction: str, shape: Shape, layout: str = "") -> Shape:
    """The per-image shape `reduction` (a name) gives a tensor of `shape` laid out as
    `layout` (``LayerInfo.layout``; "" is channels first)."""
    wire = REDUCTIONS[reduction]
    if wire in PER_CHANNEL:
        shape = channels_first(tuple(shape), layout)
    return REDUCED_SHAPES[wire](tuple(shape))


def follows_size(reduction: str) -> bool:
    """Whether `reduction`'s result changes shape with the image's size (``none`` and
    ``flatten`` keep the spatial dimensions; the pools, ``stats`` and ``cls`` do not).
    Derived from :data:`REDUCED_SHAPES`: the shapes of two sizes of one tensor (a
    token map for ``cls``, whose token count follows the size)."""
    if REDUCTIONS[reduction] == pb.REDUCTION_CLS:
        return reduced_shape(reduction, (6, 2), "TD") != reduced_shape(reduction, (10, 2), "TD")
    return reduced_shape(reduction, (2, 3, 5)) != reduced_shape(reduction, (2, 7, 11))


# -- dtypes ------------------------------------------------------------------------------
#: Dtype name -> wire enum ("float32", "float16", "bfloat16").
DTYPES = enum_names(pb.DType, "DTYPE_")
#: Wire dtype -> dtype name.
DTYPE_FROM_WIRE = {v: k for k, v in DTYPES.items()}
#: Wire dtype -> numpy dtype. bfloat16 has no numpy dtype: it arrives as uint16 bit
#: patterns (see :func:`~.tensors.bfloat16_to_float32`).
NUMPY_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a dtype name (:data:`DTYPES`) arrives as."""
    return NUMPY_DTYPES[DTYPES[name]]


# -- attribution -------------------------------------------------------------------------
#: Method name -> wire enum.
METHODS = enum_names(pb.AttributionMethod, "ATTRIBUTION_METHOD_")
#: Wire method -> whether it explains a layer (the CAM methods: a map per layer) rather
#: than the input (a map over the input's pixels).
TAKES_LAYER = {
    pb.ATTRIBUTION_METHOD_GRAD_CAM: True,
    pb.ATTRIBUTION_METHOD_HIRES_CAM: True,
    pb.ATTRIBUTION_METHOD_LAYER_CAM: True,
    pb.ATTRIBUTION_METHOD_GRADIENT: False,
    pb.ATTRIBUTION_METHOD_GRADIENT_X_INPUT: False,
    pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS: False,
    pb.ATTRIBUTION_METHOD_SMOOTH_GRAD: False,
}
#: The methods that explain a layer.
CAM_METHODS = tuple(name for name, wire in METHODS.items() if TAKES_LAYER[wire])
#: Score name -> wire enum ("logit", "softmax").
SCORES = enum_names(pb.AttributionScore, "ATTRIBUTION_SCORE_")
#: Baseline name -> wire enum ("zeros", "black").
BASELINES = enum_names(pb.AttributionBaseline, "ATTRIBUTION_BASELINE_")


# -- layer names -------------------------------------------------------------------------
#: The suffix port of a layer request's name that asks for the module's input.
INPUT_PORT = "input"


def split_port(name: str) -> tuple[str, bool]:
    """A layer request's name -> (module name, whether it asks for the module's input):
    ``"layer3:input"`` -> ``("layer3", True)``, ``"layer3"`` -> ``("layer3", False)``."""
    base, sep, port = name.rpartition(":")
    if sep and port == INPUT_PORT:
        return base, True
    return name, False


def split_reduction(item: str) -> tuple[str, str | None]:
    """One ``--layers`` item -> (layer name, its reduction or None when it names none):
    ``"layer4:avg"`` -> ``("layer4", "avg")``, ``"layer3:input"`` -> ``("layer3:input",
    None)``, ``"layer3:input:stats"`` -> ``("layer3:input", "stats")``. A ValueError
    names the reductions when the part after the last ':' is none of them."""
    name, sep, red = item.rpartition(":")
    if not sep or split_port(item)[1]:
        return item, None
    if red not in REDUCTIONS:
        raise ValueError(f"--layers {item}: a reduction after ':' is one of "
                         f"{', '.join(REDUCTIONS)} (or ':{INPUT_PORT}' for a module's input)")
    return name, red
