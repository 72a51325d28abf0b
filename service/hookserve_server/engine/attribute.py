"""The Attribute path of the engine: validating a spec, sizing its memory, and running
a batch on the model's thread, pass by pass.

An Attribute image travels the same stages as an Extract image (session window,
admission, preparation, batch queue, device worker); what differs is carried by its
WorkItem's ``task``: the resolved spec and the image's target class. Its batch key
includes the whole spec and the call, so one batch shares method, layer, parameters
and call; targets differ per image. The batch becomes a job (`start_job`): the
passes of capture/attribute.py (autograd on, no inference_mode, no early stop), cut
by `pass_plan` to --attribution-pass-cost, and the memory it holds
(`attribution_memory`), which the worker counts against --max-batch-bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..attribution_spec import AttributeInput, AttributionOutput, AttributionSpec, Method
from ..capture.attribute import AttributionJob, ImageAttribution, PassPlan
from ..capture.table import LayerInfo, entry, split_input_name
from ..capture.tap import Tap, graph_bytes
from ..errors import InvalidArgument, ResourceExhausted
from ..models import ServedModel
from ..preprocess.geometry import fixed_input_size, validate_preprocess
from ..spec import DType, ImageInput
from .limits import Limits, size_text
from .types import CallState, EngineConfig, ResolvedSpec, WorkItem

#: Bytes of an answer besides its map (summary, framing): a generous bound.
SUMMARY_BYTES = 1024
#: An image's logits and targets, kept by its job: a generous bound.
_CLASSES_BYTES = 1 << 16


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
                    f"target {target} is out of range: {self.model.name} has "
                    f"{self.num_classes} classes (0 to {self.num_classes - 1})")
            if spec.top_k > 1:
                raise InvalidArgument(
                    f"this image sets a target and the spec asks for top_k={spec.top_k}: "
                    "leave the target unset (None) for top-k maps, or set top_k to 0 or 1")
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
        raise InvalidArgument("steps must be at least 1 (0 means the default, 32)")
    if method is Method.SMOOTH_GRAD and (spec.sg_samples < 1 or not math.isfinite(spec.sg_sigma)
                                         or spec.sg_sigma < 0):
        raise InvalidArgument("samples must be at least 1 and sigma a finite "
                              f"number >= 0 (got {spec.sg_samples}, {spec.sg_sigma})")
    if spec.cost > max_cost:
        raise InvalidArgument(
            f"this spec costs {spec.cost} forward-equivalents per image ({method.label}: "
            f"{_cost_text(spec)}), over this server's --max-attribution-cost of {max_cost}: "
            f"{_cost_fix(spec)}")
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


def _cost_text(spec: AttributionSpec) -> str:
    """How a spec's cost adds up, in the SDK's parameter names."""
    k = spec.targets_per_image
    per_point = f"(1 + 2 x {k} target{'s' if k > 1 else ''})"
    if spec.method is Method.INTEGRATED_GRADIENTS:
        return f"steps={spec.ig_steps} gives {spec.passes} points x {per_point}"
    if spec.method is Method.SMOOTH_GRAD:
        return f"samples={spec.sg_samples} x {per_point} + 1"
    return f"1 pass x {per_point}"


def _cost_fix(spec: AttributionSpec) -> str:
    knobs = {Method.INTEGRATED_GRADIENTS: "fewer steps", Method.SMOOTH_GRAD: "fewer samples"}
    fix = [knobs[spec.method]] if spec.method in knobs else []
    if spec.top_k > 1:
        fix.append("a smaller top_k")
    if not fix:
        return "this method costs that much at one target (raise the flag to allow it)"
    return "use " + " or ".join(fix)


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
        maps = math.prod(e.shape[1:]) + (h * w if upsample else 0)
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
    input-space methods: what DescribeModel reports)."""
    return attribution_memory(m, h, w, layer, targets).per_image


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
    memory = attribution_memory(m, h, w, spec.layer or None, k, spec.upsample).per_image
    cap = limits.config.max_batch_bytes
    if memory > cap:
        raise ResourceExhausted(
            f"an Attribute image of {m.name} at input {h}x{w} holds about "
            f"{size_text(memory)} (its maps, the graph saved for the backward pass, "
            f"scratch memory), over this server's --max-batch-bytes of {size_text(cap)}: "
            "use a smaller input size (resize/crop), a smaller top_k, or a CAM method at "
            "a later layer")
    if answer > limits.config.max_response_bytes:
        raise ResourceExhausted(
            f"the maps for one image at input {h}x{w} would be {size_text(answer)}, over "
            f"this server's --max-response-bytes of "
            f"{size_text(limits.config.max_response_bytes)}: ask for fewer top_k maps, "
            "no upsample, or a smaller input size")
    return answer, memory


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


@dataclass(eq=False)
class AttributeJob:
    """One Attribute batch on the model's thread: its images (all of one call), the
    resumable computation, and the bytes it holds (`memory`, reserved while it runs)."""

    items: list[WorkItem]
    job: AttributionJob
    memory: int

    @property
    def call(self) -> CallState:
        return self.items[0].call

    def outputs(self) -> list[list[AttributionOutput]]:
        """Per image, its one AttributionOutput (the job's state is freed)."""
        spec = self.items[0].task.spec.attribution
        return [[_output(spec, r)] for r in self.job.finish()]


def start_job(model: ServedModel, x: torch.Tensor, items: list[WorkItem], room: int,
              cfg: EngineConfig) -> AttributeJob:
    """A job for one batch of prepared Attribute images (`x`: their normalised input)."""
    spec = items[0].task.spec.attribution
    h, w = x.shape[2:]
    memory = attribution_memory(model, h, w, spec.layer or None, spec.targets_per_image,
                                spec.upsample)
    plan = pass_plan(spec, len(items), memory, room, cfg)
    tap = None
    if spec.method.is_cam:
        path, call = model.layer_index[spec.layer]
        tap = Tap(model.modules[path], call, split_input_name(spec.layer)[1], spec.layer)
    black = ((0.0 - model.mean) / model.std).to(x.dtype)
    job = AttributionJob(model.module, x, spec, [it.task.target for it in items], plan,
                         tap=tap, black=black)
    return AttributeJob(items, job, memory.job(len(items), plan.rows))


def _output(spec: AttributionSpec, r: ImageAttribution) -> AttributionOutput:
    t = r.map
    return AttributionOutput(spec.layer, DType.FLOAT32, tuple(t.shape),
                             memoryview(t.reshape(-1).view(torch.uint8).numpy()),
                             targets=tuple(r.targets), top5=tuple(r.top5))
