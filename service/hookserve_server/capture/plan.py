"""Which modules of a model get hooks for a batch, and where the forward pass may stop.

A capture point is (module path, call index, kind). A layer name from the layer table
("layer1", "layer1_2" for a module's third call) names an OUTPUT point;
"<layer>:input" names that call's INPUT point (a forward pre-hook). A new kind is a
new `Kind` member, a way to name it (`point_of`), and a hook for it in forward.py;
the plan and the early stop stay as they are.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..spec import LayerSpec
from .table import split_input_name

if TYPE_CHECKING:  # a type only: models build on capture's table, not back
    from ..models import ServedModel


class Kind(enum.Enum):
    OUTPUT = "output"   # what the module returns (a forward hook)
    INPUT = "input"     # its first positional argument (a forward pre-hook)


@dataclass(frozen=True)
class CapturePoint:
    module: str
    call: int
    kind: Kind = Kind.OUTPUT


def point_of(model: ServedModel, spec: LayerSpec) -> CapturePoint:
    module, call = model.layer_index[spec.name]
    _, on_input = split_input_name(spec.name)
    return CapturePoint(module, call, Kind.INPUT if on_input else Kind.OUTPUT)


@dataclass
class CapturePlan:
    """The union of the layers a batch asks for, grouped by capture point."""

    points: dict[CapturePoint, list[LayerSpec]] = field(default_factory=dict)
    #: Stop the forward pass once every point has fired (no later layer is needed).
    stop_early: bool = True

    @classmethod
    def for_batch(cls, model: ServedModel,
                  layer_sets: Iterable[tuple[LayerSpec, ...]]) -> CapturePlan:
        wanted: set[LayerSpec] = set()
        for layers in layer_sets:
            wanted.update(layers)
        plan = cls()
        for spec in wanted:
            plan.points.setdefault(point_of(model, spec), []).append(spec)
        return plan

    @property
    def specs(self) -> list[LayerSpec]:
        return [s for specs in self.points.values() for s in specs]

    def hooks(self) -> dict[tuple[str, Kind], dict[int, list[LayerSpec]]]:
        """(module path, kind) -> call index -> specs: one hook per module and kind."""
        out: dict[tuple[str, Kind], dict[int, list[LayerSpec]]] = {}
        for p, specs in self.points.items():
            out.setdefault((p.module, p.kind), {})[p.call] = specs
        return out
