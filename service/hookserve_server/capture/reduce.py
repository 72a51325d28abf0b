"""The one table of reductions and the one of dtypes: what each reduction does, the
shape it gives and its columns' names; each dtype's torch type.

Adding a reduction is its value in ``hookserve.v1.Reduction``, the member with that
number in :class:`~hookserve_server.spec.Reduction`, and one entry in ``REDUCTIONS``
(its function on a batch tensor and its shape rule, which the limits use);
tests/test_value_lists.py checks that the three agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch

from ..errors import InternalError
from ..layouts import channels_first, channels_first_shape
from ..spec import DType, LayerSpec, Reduction


@dataclass(frozen=True)
class ReductionRule:
    #: A batch tensor [N, ...] -> the reduced batch tensor, on its device.
    apply: Callable[[torch.Tensor], torch.Tensor]
    #: A per-image output shape -> the per-image reduced shape.
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    #: Names of the last dimension's entries, sent with the tensor (empty: unnamed).
    columns: tuple[str, ...] = ()
    #: Applied with the channels (features) first, whatever the layer's layout: it
    #: reduces over the spatial or token axis (layouts.channels_first).
    channels_first: bool = False


def _spatial(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, t.dim()))


#: Columns of the stats reduction, in order.
STATS_COLUMNS = ("mean", "std", "min", "max", "zero_fraction")


def _stats(t: torch.Tensor) -> torch.Tensor:
    """[N, C, ...] -> [N, C, 5] per channel over the rest; [N, F] -> [N, 1, 5]."""
    t = t.float()
    flat = t.flatten(2) if t.dim() > 2 else t.unsqueeze(1)
    std, mean = torch.std_mean(flat, dim=2, correction=0)
    return torch.stack([mean, std, flat.amin(dim=2), flat.amax(dim=2),
                        (flat == 0).float().mean(dim=2)], dim=2)


def _pool(fn: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]):
    # A [N, C] output (a Linear layer) has nothing to pool: it passes as is.
    return lambda t: fn(t, _spatial(t)) if t.dim() > 2 else t


REDUCTIONS: dict[Reduction, ReductionRule] = {
    Reduction.NONE: ReductionRule(apply=lambda t: t, shape=tuple),
    Reduction.AVG: ReductionRule(
        apply=_pool(lambda t, dims: t.mean(dim=dims, dtype=torch.float32)),
        shape=lambda s: (s[0],), channels_first=True),
    Reduction.MAX: ReductionRule(apply=_pool(lambda t, dims: t.amax(dim=dims)),
                                 shape=lambda s: (s[0],), channels_first=True),
    Reduction.FLATTEN: ReductionRule(apply=lambda t: t.flatten(1), shape=lambda s: (prod(s),)),
    Reduction.STATS: ReductionRule(apply=_stats, shape=lambda s: (s[0] if len(s) > 1 else 1, 5),
                                   columns=STATS_COLUMNS, channels_first=True),
    # token 0 of a [N, T, D] batch (the engine allows it on TD layers only)
    Reduction.CLS: ReductionRule(apply=lambda t: t[:, 0], shape=lambda s: (s[-1],)),
}

#: The torch dtype of each wire dtype.
DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}
DTYPE_OF_TORCH: dict[torch.dtype, DType] = {v: k for k, v in DTYPES.items()}


def reduced_shape(spec: LayerSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-image shape after the reduction, given the layer's per-image shape."""
    rule = REDUCTIONS[spec.reduction]
    if rule.channels_first:
        shape = channels_first_shape(tuple(shape), spec.layout)
    return tuple(rule.shape(tuple(shape)))


def reduced_bytes(spec: LayerSpec, shape: tuple[int, ...]) -> int:
    return prod(reduced_shape(spec, shape)) * DTYPES[spec.dtype].itemsize


def reduce(out: torch.Tensor, spec: LayerSpec, *, may_alias: bool) -> torch.Tensor:
    """Apply a layer's reduction, L2 and dtype to a whole batch, on its device.

    The result never shares memory with `out` unless `may_alias` (the forward pass
    stops right after this hook): later in-place ops (ReLU(inplace=True), `+=` in a
    residual block) would otherwise change what we captured.
    """
    if not isinstance(out, torch.Tensor):
        raise InternalError(f"layer {spec.name} does not output a tensor")
    rule = REDUCTIONS[spec.reduction]
    t = rule.apply(channels_first(out, spec.layout) if rule.channels_first else out)
    if spec.l2_normalize:
        t = t.float()
        norm = t.flatten(1).norm(dim=1).clamp_min(1e-12)
        t = t / norm.view(-1, *([1] * (t.dim() - 1)))
    t = t.to(DTYPES[spec.dtype]).contiguous()
    if not may_alias and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        t = t.clone()
    return t
