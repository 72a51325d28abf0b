"""What an Attribute image holds on the model's device, estimated before it runs, and how
a batch of them is cut into passes that fit (`pass_plan`).

The estimate rests on `capture.tap.graph_bytes` (what autograd saves for the backward
pass, counted on the meta device) and the layer table; docs/attribution.md compares it
with measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..attribution_spec import AttributionSpec
from ..capture.attribute import PassPlan
from ..capture.table import LayerInfo, entry, split_input_name
from ..capture.tap import graph_bytes
from ..layouts import map_shape
from ..models import ServedModel
from .config import EngineConfig

#: An image's logits and targets, kept by its batch: a generous bound.
_CLASSES_BYTES = 1 << 16


@dataclass(frozen=True)
class AttributionMemory:
    """What an Attribute image holds on the model's device, in bytes.

    `state` is held by each image for its whole job (its normalised input and the
    maps being accumulated, one per target); `row` by each row of a running pass (the
    graph saved for the backward pass, the gradients, the method's temporaries);
    `workspace` once per pass (the kernels' scratch memory). A job of N images run in
    passes of R rows holds `job(N, R)`; one image alone, one row a pass, `per_image`.
    """

    state: int
    row: int
    workspace: int

    @property
    def per_image(self) -> int:
        return self.state + self.row + self.workspace

    def job(self, images: int, rows: int) -> int:
        return images * self.state + rows * self.row + self.workspace


def attribution_memory(m: ServedModel, h: int, w: int, layer: str | None,
                       targets: int = 1, upsample: bool = False) -> AttributionMemory:
    """The memory of an Attribute image of `m` at input HxW (`layer` None: the
    input-space methods).

    Per row: what autograd saves for the backward pass (`capture.tap.graph_bytes`,
    counted on the meta device), the largest gradient in flight (two while the graph is
    kept for the next target's backward), the
    differentiated tensor as leaf, clone and gradient, its float32 temporaries (a CAM
    map's product, and casts from a 16-bit model), and for a CAM layer the forward up
    to it (the row's input, and the largest input plus output of one module). Per
    image: its input, `targets` float32 maps (upsampled: at the input size too) and its
    logits. Per pass: the scratch memory of the largest convolution (graph_bytes).
    """
    table = m.layer_table(h, w)
    rows = list(table.values())
    modules = {li.module for li in rows}
    leaves = [li for li in rows if not any(q.startswith(li.module + ".") for q in modules)]
    in_bytes = rows[0].input_bytes
    if layer is None:
        start, wrt, tap, maps = -1, in_bytes, None, math.prod(rows[0].input_shape)
    else:
        e = entry(table, layer)
        wrt = e.bytes_per_image
        on_input = split_input_name(layer)[1]
        start = _first_order(table, e.module) if on_input else e.order
        path, call = m.layer_index[layer]
        tap = (path, call, on_input)
        maps = math.prod(map_shape(e.shape, e.layout)) + (h * w if upsample else 0)
    after = [li.bytes_per_image for li in leaves if li.order > start]
    before = [li.bytes_per_image + (0 if getattr(m.modules[li.module], "inplace", False)
                                    else li.input_bytes)
              for li in leaves if li.order <= start]
    forward = in_bytes + max(before) if before else 0
    saved, column = graph_bytes(m.arch, m.torch_dtype, h, w, tap)
    wide = 4 // m.torch_dtype.itemsize  # float32 bytes per model-dtype byte
    temps = (wide * wrt if layer is not None else 0) + (wide - 1) * 2 * wrt
    in_flight = (2 if targets > 1 else 1) * max(after, default=0)
    row = forward + saved + in_flight + 3 * wrt + temps
    state = in_bytes + targets * maps * 4 + _CLASSES_BYTES
    workspace = column
    return AttributionMemory(state, row, workspace)


def gradient_bytes(m: ServedModel, h: int, w: int, layer: str | None = None,
                   targets: int = 1) -> int:
    """Memory one image holds alone in an Attribute job of `m` at input HxW (for the
    input-space methods: what DescribeModel reports); 0 where the input is too small
    for the whole model, so Attribute cannot run."""
    if m.layer_table(h, w).stopped:
        return 0
    return attribution_memory(m, h, w, layer, targets).per_image


def _first_order(table: dict[str, LayerInfo], module: str) -> int:
    """One before the first row that runs inside `module` (its input is taken there)."""
    inside = [li.order for li in table.values()
              if li.module == module or li.module.startswith(module + ".")]
    return min(inside) - 1


def pass_plan(spec: AttributionSpec, images: int, memory: AttributionMemory, room: int,
              cfg: EngineConfig) -> PassPlan:
    """How a job of `images` images is cut into passes: each pass costs at most
    --attribution-pass-cost forward-equivalents (rows x (1 + 2 x slots); one row
    always runs), holds at most --max-batch-size rows, and the job's memory
    (`memory.job`) stays within `room` bytes."""
    budget = cfg.attribution_pass_cost
    k = spec.targets_per_image
    slots = k if 1 + 2 * k <= budget else max(1, (budget - 1) // 2)
    rows = max(1, budget // (1 + 2 * slots))
    rows = min(rows, cfg.max_batch_size, images * spec.passes)
    rows = min(rows, max(1, (room - memory.job(images, 0)) // max(1, memory.row)))
    return PassPlan(rows=rows, slots=slots)
