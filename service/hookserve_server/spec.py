"""Domain objects the servicer hands to the engine (no protobuf, no grpc)."""

from __future__ import annotations

from dataclasses import dataclass, field

REDUCTIONS = ("none", "avg", "max", "flatten")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MODES = ("default", "resize_crop", "native")


@dataclass(frozen=True)
class LayerSpec:
    """One requested layer and what to do with its output."""

    name: str
    reduction: str = "none"
    dtype: str = "float32"
    l2_normalize: bool = False

    def reduced_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-image shape after the reduction, given the layer's per-image shape."""
        if self.reduction in ("avg", "max"):
            return (shape[0],)
        if self.reduction == "flatten":
            n = 1
            for s in shape:
                n *= s
            return (n,)
        return tuple(shape)

    def reduced_bytes(self, shape: tuple[int, ...]) -> int:
        n = 1
        for s in self.reduced_shape(shape):
            n *= s
        return n * DTYPE_SIZE[self.dtype]


@dataclass(frozen=True)
class Preprocess:
    """Geometry of preprocessing. ``default`` uses the model's own transforms."""

    mode: str = "default"
    resize: int = 0
    crop_height: int = 0
    crop_width: int = 0


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
