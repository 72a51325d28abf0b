"""Tensor wire format: chunk reassembly (no torch); the dtypes are :mod:`.tables`'."""

from __future__ import annotations

import numpy as np

from .tables import NUMPY_DTYPES
from .v1 import hookserve_pb2 as pb


def bfloat16_to_float32(a: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    a = np.asarray(a)
    if a.dtype != np.uint16:
        raise TypeError(f"bfloat16_to_float32 takes bfloat16 bit patterns (a uint16 array, "
                        f"as a bfloat16 layer's answer comes), not {a.dtype}: an array "
                        "that is float already needs no widening")
    return (a.astype(np.uint32) << 16).view(np.float32)


class TensorAssembler:
    """Collects the chunks of one tensor into one writable buffer, copying each chunk once.

    The array wraps that buffer (a ``bytearray``) without a further copy, so it is
    writable and owns its memory like any array the caller made: ``a -= a.mean()``
    works in place. A message's bytes are immutable, so even a tensor that arrives in
    a single chunk is copied once: about 0.07 ms per MB, under 0.1% of an ExtractImage
    call (bench/array_copy.py).
    """

    __slots__ = ("layer", "dtype", "shape", "total", "_buf", "_got")

    def __init__(self, chunk: pb.TensorChunk) -> None:
        self.layer = chunk.layer
        if chunk.dtype not in NUMPY_DTYPES:
            raise ValueError(f"unknown dtype {chunk.dtype} for layer {chunk.layer}")
        self.dtype = NUMPY_DTYPES[chunk.dtype]
        self.shape = tuple(chunk.shape)
        self.total = chunk.total_bytes
        expected = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if expected != self.total:
            raise ValueError(
                f"layer {self.layer}: shape {self.shape} needs {expected} bytes, "
                f"header says {self.total}")
        self._buf: bytearray | None = None
        self._got = 0

    def add(self, chunk: pb.TensorChunk) -> None:
        data = chunk.data
        end = chunk.offset + len(data)
        if end > self.total:
            raise ValueError(f"layer {self.layer}: chunk past the end of the tensor")
        if chunk.offset == 0 and len(data) == self.total:
            self._buf = bytearray(data)  # the whole tensor: one copy, no zero-fill
        else:
            if self._buf is None:
                self._buf = bytearray(self.total)
            memoryview(self._buf)[chunk.offset:end] = data
        self._got += len(data)

    @property
    def complete(self) -> bool:
        return self._got >= self.total

    def array(self) -> np.ndarray:
        if self._got != self.total:
            raise ValueError(
                f"layer {self.layer}: got {self._got} of {self.total} bytes")
        buf = self._buf if self._buf is not None else bytearray()
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.shape)


class Collected:
    """The tensors of one image's answer, gathered as their chunks arrive."""

    __slots__ = ("features", "columns", "cached", "_assembling")

    def __init__(self) -> None:
        #: layer name -> its array, once all its chunks came
        self.features: dict[str, np.ndarray] = {}
        #: layer name -> the names of its last dimension's columns (stats)
        self.columns: dict[str, tuple[str, ...]] = {}
        #: the layers the server answered from its cache
        self.cached: set[str] = set()
        self._assembling: dict[str, TensorAssembler] = {}

    def add(self, c: pb.TensorChunk) -> None:
        a = self._assembling.get(c.layer)
        if a is None:
            a = self._assembling[c.layer] = TensorAssembler(c)
        a.add(c)
        if a.complete:
            self.features[c.layer] = a.array()
            if c.columns:
                self.columns[c.layer] = tuple(c.columns)
            if c.cached:
                self.cached.add(c.layer)
            del self._assembling[c.layer]

    @property
    def complete(self) -> bool:
        """No tensor is partly received."""
        return not self._assembling
