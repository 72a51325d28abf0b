"""The Attribute path of the engine: validating a spec, sizing its memory, and running
a batch on the model's thread.

An Attribute image travels the same stages as an Extract image (session window,
admission, preparation, batch queue, device worker); what differs is carried by its
WorkItem's ``task``: the resolved spec and the image's target class. Its batch key
includes the whole spec, so one batch shares method, layer and parameters; targets
differ per image. The pass runs with autograd on (no inference_mode, no early stop)
in capture/attribute.py; the batch is bounded by `gradient_bytes`, which counts what
autograd saves for the backward pass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..attribution_spec import AttributeInput, AttributionOutput, AttributionSpec, Method
from ..capture.attribute import ImageAttribution, attribute
from ..capture.gradients import Tap
from ..capture.table import LayerInfo, entry, split_input_name
from ..errors import InvalidArgument, ResourceExhausted
from ..models import ServedModel
from ..preprocess.geometry import fixed_input_size, validate_preprocess
from ..spec import DType, ImageInput
from .limits import Limits, size_text
from .types import ResolvedSpec, WorkItem

#: Bytes of an answer besides its map (summary, framing): a generous bound.
SUMMARY_BYTES = 1024


@dataclass(frozen=True)
class ResolvedAttribution(ResolvedSpec):
    """A validated AttributionSpec bound to its model (layers is empty)."""

    attribution: AttributionSpec | None = None
    #: The model's output size: valid targets are 0 .. num_classes - 1.
    num_classes: int = 0

    def sizes(self, limits: Limits, h: int, w: int) -> tuple[int, int]:
        return attribution_sizes(limits, self.model, self.attribution, h, w)

    def task_for(self, image: ImageInput) -> AttributeTask:
        target = image.target if isinstance(image, AttributeInput) else None
        spec = self.attribution
        if target is not None:
            if not 0 <= target < self.num_classes:
                raise InvalidArgument(
                    f"target_class {target} is out of range: {self.model.name} has "
                    f"{self.num_classes} classes (0 to {self.num_classes - 1})")
            if spec.top_k > 1:
                raise InvalidArgument(
                    f"this image sets target_class and the spec asks for top_k={spec.top_k}: "
                    "leave target_class unset for top-k maps, or set top_k to 0 or 1")
        return AttributeTask(self, target)


@dataclass(frozen=True)
class AttributeTask:
    """What an Attribute image's work item carries: its resolved spec and target."""

    spec: ResolvedAttribution
    target: int | None

    @property
    def batch_key(self) -> AttributionSpec:
        return self.spec.attribution


def resolve_attribution(limits: Limits, max_cost: int, m: ServedModel,
                        spec: AttributionSpec) -> ResolvedAttribution:
    """Validate an AttributionSpec for model `m` whose layer (if any) is known to exist
    (the engine checks names as for Extract); raises InvalidArgument."""
    table = m.layer_table(*m.defaults.crop)
    num_classes = math.prod(list(table.values())[-1].shape)
    method = spec.method
    if method.is_cam:
        if not spec.layer:
            raise InvalidArgument(
                f"method {method.label} needs a layer: name a convolutional layer of "
                f"{m.name} such as {_last_conv_like(table)} (DescribeModel lists them)")
        shape = entry(table, spec.layer).shape
        if len(shape) != 3:
            raise InvalidArgument(
                f"layer {spec.layer} gives shape {list(shape)} per image: {method.label} needs "
                f"a [C, h, w] feature map, such as {_last_conv_like(table)}")
    elif spec.layer:
        raise InvalidArgument(
            f"method {method.label} explains the input and takes no layer: leave layer "
            f"empty (got {spec.layer[:100]!r}), or use grad_cam, hires_cam or layer_cam")
    if not 1 <= spec.targets_per_image <= num_classes:
        raise InvalidArgument(f"top_k={spec.top_k} is over the {num_classes} classes of "
                              f"{m.name}")
    if method is Method.INTEGRATED_GRADIENTS and spec.ig_steps < 1:
        raise InvalidArgument("ig_steps must be at least 1 (0 means the default, 32)")
    if method is Method.SMOOTH_GRAD and (spec.sg_samples < 1 or not math.isfinite(spec.sg_sigma)
                                         or spec.sg_sigma < 0):
        raise InvalidArgument("sg_samples must be at least 1 and sg_sigma a finite "
                              f"number >= 0 (got {spec.sg_samples}, {spec.sg_sigma})")
    if spec.cost > max_cost:
        raise InvalidArgument(
            f"this spec costs {spec.cost} forward-equivalents per image ({method.label}, "
            f"{spec.targets_per_image} target(s), {spec.passes} pass(es)), over this "
            f"server's --max-attribution-cost of {max_cost}: use fewer ig_steps, "
            "sg_samples or top_k")
    validate_preprocess(spec.preprocessing)
    limits.preprocess(spec.preprocessing)
    fixed = fixed_input_size(spec.preprocessing, m.defaults.crop)
    resolved = ResolvedAttribution(m, (), spec.preprocessing, fixed, attribution=spec,
                                   num_classes=num_classes)
    if fixed is not None:  # fails fast, before any image is computed
        answer, activation = resolved.sizes(limits, *fixed)
        resolved = dataclasses.replace(resolved, answer_bytes=answer,
                                       activation_bytes=activation)
    return resolved


def _last_conv_like(table: dict[str, LayerInfo]) -> str:
    """A CAM layer to suggest: the last [C, h, w] output that is not a pooling
    layer's (nor a container's that ends in one): resnet "layer4", vgg "features.19"."""
    rows = list(table.values())

    def pooled(li: LayerInfo) -> bool:
        inner = [r for r in rows if r.module.startswith(li.module + ".")]
        last = max(inner, key=lambda r: r.order) if inner else li
        return "Pool" in last.type

    names = [li.name for li in rows
             if len(li.shape) == 3 and "_" not in li.name and not pooled(li)]
    return (names or ["layer4"])[-1]


def gradient_bytes(table: dict[str, LayerInfo], layer: str | None, targets: int = 1) -> int:
    """Memory one image holds in an Attribute pass at the table's input size.

    What autograd saves: the output of every leaf module that runs after the
    differentiated tensor (the input for layer None, else `layer`), which bounds the
    tensors ops save for backward; plus the two largest live gradients, the
    differentiated tensor twice (leaf and clone) and one accumulated gradient per
    target (IG and SmoothGrad sum them over passes).
    """
    rows = list(table.values())
    modules = {li.module for li in rows}
    leaves = [li for li in rows if not any(q.startswith(li.module + ".") for q in modules)]
    if layer is None:
        start, wrt = -1, rows[0].input_bytes
    else:
        e = entry(table, layer)
        wrt = e.bytes_per_image
        start = _first_order(table, e.module) if split_input_name(layer)[1] else e.order
    after = [li.bytes_per_image for li in leaves if li.order > start]
    peak = max(after, default=0)
    return sum(after) + 2 * peak + (2 + targets) * wrt


def _first_order(table: dict[str, LayerInfo], module: str) -> int:
    """One before the first row that runs inside `module` (its input is taken there)."""
    inside = [li.order for li in table.values()
              if li.module == module or li.module.startswith(module + ".")]
    return min(inside) - 1


def attribution_sizes(limits: Limits, m: ServedModel, spec: AttributionSpec, h: int, w: int
                      ) -> tuple[int, int]:
    """(answer, memory) bytes per image at input HxW; refuses what cannot fit."""
    limits.input_size(f"model input {h}x{w} is", h, w, fix="downscale the image or resize")
    table = m.layer_table(h, w)
    k = spec.targets_per_image
    if spec.method.is_cam:
        per_map = h * w if spec.upsample else math.prod(entry(table, spec.layer).shape[1:])
    else:
        per_map = 3 * h * w
    answer = k * per_map * 4 + SUMMARY_BYTES
    memory = gradient_bytes(table, spec.layer or None, k)
    cap = limits.config.max_batch_bytes
    if memory > cap:
        raise ResourceExhausted(
            f"an Attribute pass of {m.name} at input {h}x{w} holds about "
            f"{size_text(memory)} per image (the graph saved for the backward pass), "
            f"over this server's --max-batch-bytes of {size_text(cap)}: use a smaller "
            "input size (resize/crop), or a CAM method at a later layer")
    if answer > limits.config.max_response_bytes:
        raise ResourceExhausted(
            f"the maps for one image at input {h}x{w} would be {size_text(answer)}, over "
            f"this server's --max-response-bytes of "
            f"{size_text(limits.config.max_response_bytes)}: ask for fewer top_k maps, "
            "no upsample, or a smaller input size")
    return answer, memory


def run_batch(model: ServedModel, x: torch.Tensor, items: list[WorkItem]
              ) -> list[list[AttributionOutput]]:
    """Maps for one batch on the model's thread: per image, its one AttributionOutput."""
    task = items[0].task
    spec = task.spec.attribution
    tap = None
    if spec.method.is_cam:
        path, call = model.layer_index[spec.layer]
        tap = Tap(model.modules[path], call, split_input_name(spec.layer)[1], spec.layer)
    black = ((0.0 - model.mean) / model.std).to(x.dtype)
    results = attribute(model.module, x, spec, [it.task.target for it in items], tap=tap,
                        black=black)
    return [[_output(spec, r)] for r in results]


def _output(spec: AttributionSpec, r: ImageAttribution) -> AttributionOutput:
    t = r.map
    return AttributionOutput(spec.layer, DType.FLOAT32, tuple(t.shape),
                             memoryview(t.reshape(-1).view(torch.uint8).numpy()),
                             targets=tuple(r.targets), top5=tuple(r.top5))
