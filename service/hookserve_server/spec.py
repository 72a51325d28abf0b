"""Domain objects passed between the servicer and the engine (no protobuf, grpc, torch).

The enums are the domain side of the proto's enums: each member's value is its
number in ``hookserve.v1`` (wire.py converts with ``Reduction(n)``), and ``label`` is
the short name used in messages and logs. What a reduction or dtype *does* is one
entry in :mod:`hookserve_server.capture.reduce`; tests/test_value_lists.py checks that
the proto, these enums, the parser and that table agree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import HookserveError


class Labelled(enum.Enum):
    """A domain enum: its values are proto numbers, its label the lower-case name."""

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def labels(cls) -> str:
        return ", ".join(m.label for m in cls)


class Reduction(Labelled):
    """What is done to a layer's output per image (hookserve.v1.Reduction)."""

    NONE = 1
    AVG = 2
    MAX = 3
    FLATTEN = 4
    STATS = 5
    CLS = 6


class Layout(Labelled):
    """How a layer's per-image output is laid out (hookserve.v1.Layout; layouts.py)."""

    UNSPECIFIED = 0
    CHW = 1
    HWC = 2
    TD = 3
    D = 4


class DType(Labelled):
    """Element type of a returned tensor (hookserve.v1.DType)."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3


class Mode(Labelled):
    """Preprocessing geometry (hookserve.v1.Preprocessing.Mode)."""

    DEFAULT = 1
    RESIZE_CROP = 2
    NATIVE = 3


@dataclass(frozen=True)
class LayerSpec:
    """One requested layer and what to do with its output."""

    name: str
    reduction: Reduction = Reduction.NONE
    dtype: DType = DType.FLOAT32
    l2_normalize: bool = False
    #: The layer's layout, set when the spec is resolved against its model.
    layout: Layout = Layout.CHW


@dataclass(frozen=True)
class Preprocess:
    """Geometry of preprocessing. ``DEFAULT`` uses the model's own transforms.

    ``mode`` may also be given as a Mode's label ("resize_crop"); it is stored as a Mode.
    """

    mode: Mode = Mode.DEFAULT
    resize: int = 0
    crop_height: int = 0
    crop_width: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):
            object.__setattr__(self, "mode", Mode[self.mode.upper()])


@dataclass(frozen=True)
class ExtractionSpec:
    """What to extract from the images that follow it on a stream."""

    model: str
    layers: tuple[LayerSpec, ...]
    preprocessing: Preprocess = field(default_factory=Preprocess)


@dataclass
class ImageInput:
    """One image: encoded bytes, or raw HxWx3 uint8 RGB pixels."""

    id: str
    encoded: bytes | None = None
    raw: bytes | None = None
    height: int = 0
    width: int = 0


@dataclass(frozen=True)
class LayerOutput:
    """One layer's answer for one image: row-major little-endian bytes, as sent."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    #: A zero-copy view of the (contiguous, CPU) tensor's bytes; keeps it alive.
    data: memoryview
    #: Names of the last dimension's entries, when they have names (stats).
    columns: tuple[str, ...] = ()
    #: Served from the answer cache, not computed for this image (cache/front.py).
    cached: bool = False

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class UnitType:
    """What one unit of an image's answer is, known before it is computed: what the
    answer cache checks a value it reads back against (a value that differs in any of
    these is another answer's, or damaged)."""

    #: an Attribute answer (AttributionOutput, with `targets` of them), or a layer's
    attribution: bool
    #: the layer's name (an Attribute answer: the spec's layer, "" for the input)
    name: str
    dtype: DType
    shape: tuple[int, ...]
    columns: tuple[str, ...] = ()
    #: an Attribute answer's targets (maps) and top classes
    targets: int = 0
    top: int = 0


@dataclass
class ImageResult:
    """The answer for one image: its layers' outputs, or an error."""

    index: int
    id: str
    outputs: list[LayerOutput] | None = None
    error: HookserveError | None = None
