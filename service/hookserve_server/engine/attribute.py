"""The Attribute path of the engine: its kind of work (`AttributeJob`: a spec checked
against its model, each image's sizes and target) and its batch on the model's thread,
run pass by pass (`AttributeRun`).

An Attribute image travels the same stages as an Extract image (session window,
admission, preparation, batch queue, device worker); what differs is its job. Its
batch key is the whole spec and the call, so one batch shares method, layer,
parameters and call; targets differ per image (`WorkItem.target`). The batch becomes
an `AttributeRun`: the passes of capture/attribute.py (autograd on, no
inference_mode, no early stop), cut by `pass_plan` to --attribution-pass-cost, and
the memory it holds (engine/attribute_memory.py), which the worker counts against
--max-batch-bytes. Before each pass the call's cancel and deadline are checked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..attribution_spec import (
    MAX_SG_SIGMA,
    METHODS,
    AttributeInput,
    AttributionOutput,
    AttributionSpec,
    Method,
    Score,
)
from ..cache import key as cache_key
from ..capture.attribute import TOP, AttributionJob, ImageAttribution
from ..capture.forward import stack_inputs
from ..capture.table import entry, split_input_name
from ..capture.tap import Tap
from ..errors import Cancelled, DeadlineExceeded, HookserveError, InvalidArgument, ResourceExhausted
from ..labels import named
from ..layouts import map_shape, to_grid
from ..models import ServedModel
from ..preprocess.geometry import fixed_input_size, validate_preprocess
from ..spec import DType, ImageInput, UnitType
from .attribute_memory import attribution_memory, pass_plan
from .config import EngineConfig
from .limits import Limits, size_text
from .types import CallState, Device, ResolvedSpec, WorkItem
from .worker import batch_error, is_oom

log = logging.getLogger("hookserve.engine")

#: Bytes of an answer besides its map (summary, framing): a generous bound.
SUMMARY_BYTES = 1024
#: What an Attribute image that runs out of memory can ask for instead.
ATTRIBUTION_FIX = "a smaller top_k, or a CAM method at a later layer"


class AttributeJob:
    """An AttributionSpec's work for each image, bound to its model."""

    resumable = True
    smaller = "ask for fewer top_k maps, no upsample, or a smaller input size"

    def __init__(self, limits: Limits, config: EngineConfig, model: ServedModel,
                 spec: AttributionSpec, num_classes: int) -> None:
        self.limits = limits
        self.config = config
        self.model = model
        self.spec = spec
        #: The model's output size: valid targets are 0 .. num_classes - 1.
        self.num_classes = num_classes
        self.cost = spec.cost

    def sizes(self, h: int, w: int) -> tuple[int, int]:
        """(answer, memory) bytes per image at input HxW; refuses what cannot fit."""
        return attribution_sizes(self.limits, self.model, self.spec, h, w)

    def target_of(self, image: ImageInput) -> int | None:
        target = image.target if isinstance(image, AttributeInput) else None
        spec = self.spec
        if target is not None:
            if not 0 <= target < self.num_classes:
                raise InvalidArgument(
                    f"target {target} is out of range: {self.model.name} has "
                    f"{self.num_classes} classes (0 to {self.num_classes - 1})")
            if spec.top_k > 1:
                raise InvalidArgument(
                    f"this image sets a target and the spec asks for top_k={spec.top_k}: "
                    "leave the target unset (None) for top-k maps, or set top_k to 0 or 1")
        return target

    def batch_key(self, call: CallState) -> Hashable:
        return (self.spec, call)

    def cache_keys(self, state, image: ImageInput) -> list[bytes]:
        return [cache_key.attribution_key(state, self.spec, self.target_of(image))]

    def only(self, units: list[int]) -> AttributeJob:
        return self  # one unit: the image's answer

    def unit_types(self, h: int, w: int) -> list[UnitType]:
        spec = self.spec
        if spec.method.is_cam and not spec.upsample:
            e = entry(self.model.layer_table(h, w), spec.layer)
            per_map = tuple(map_shape(e.shape, e.layout))
        else:
            per_map = (h, w) if spec.method.is_cam else (3, h, w)
        k = spec.targets_per_image
        return [UnitType(True, spec.layer, DType.FLOAT32,
                         per_map if spec.top_k <= 1 else (k, *per_map), targets=k,
                         top=min(TOP, self.num_classes))]

    def run_batch(self, device: Device, items: list[WorkItem]) -> None:
        """Start the batch's run; its passes come in turn (`AttributeRun.step`)."""
        try:
            x = stack_inputs(items[0].model, [it.pixels for it in items], device.device)
            device.resume(start_run(items[0].model, x, items, device.room, self.config))
        except Exception as exc:
            for it in items:
                it.fail(batch_error(exc, len(items), ATTRIBUTION_FIX))


def resolve_attribution(limits: Limits, config: EngineConfig, m: ServedModel,
                        spec: AttributionSpec) -> ResolvedSpec:
    """Validate an AttributionSpec for model `m` whose layer (if any) is known to exist
    (the engine checks names as for Extract); raises InvalidArgument."""
    if not m.has_head:
        raise InvalidArgument(
            f"model {m.name} has no classifier head (its weights file holds none), so "
            "there are no class scores to explain: Attribute needs a model with a head; "
            "Extract serves this one's layers")
    table = m.layer_table(*m.defaults.crop)
    num_classes = math.prod(list(table.values())[-1].shape)
    if num_classes == 1 and spec.score is Score.SOFTMAX:
        raise InvalidArgument(
            f"model {m.name} has one class score, whose softmax is always 1, so its "
            "gradient is 0 and every map would be blank: explain the logit (score=logit)")
    method = spec.method
    if method.is_cam:
        if not spec.layer:  # the family's default (ModelInfo.default_cam_layer)
            spec = dataclasses.replace(spec, layer=m.default_cam_layer)
        e = entry(table, spec.layer)
        if map_shape(e.shape, e.layout) is None:
            raise InvalidArgument(
                f"layer {spec.layer} gives shape {list(e.shape)} per image: {method.label} "
                f"needs a feature map ([C, h, w], [h, w, C], or [T, D] patch tokens), such as "
                f"{m.default_cam_layer}")
    elif spec.layer:
        raise InvalidArgument(
            f"method {method.label} explains the input and takes no layer: leave layer "
            f"empty (got {spec.layer[:100]!r}), or use {_cam_methods()}")
    if not 1 <= spec.targets_per_image <= num_classes:
        raise InvalidArgument(f"top_k={spec.top_k} is over the {num_classes} classes of "
                              f"{m.name}")
    if method is Method.INTEGRATED_GRADIENTS and spec.ig_steps < 1:
        raise InvalidArgument("steps must be at least 1 (0 means the default, 32)")
    if method is Method.SMOOTH_GRAD and (spec.sg_samples < 1 or not math.isfinite(spec.sg_sigma)
                                         or not 0 <= spec.sg_sigma <= MAX_SG_SIGMA):
        raise InvalidArgument(f"samples must be at least 1 and sigma, a fraction of the "
                              f"input's range, 0 to {MAX_SG_SIGMA:g} (got {spec.sg_samples}, "
                              f"{spec.sg_sigma:g})")
    if spec.upsample and not method.is_cam:
        raise InvalidArgument(f"upsample is for the CAM methods' maps ({_cam_methods()}): "
                              f"{method.label}'s map has the input's size already: drop it")
    max_cost = config.max_attribution_cost
    if spec.cost > max_cost:
        raise InvalidArgument(
            f"this spec costs {spec.cost} forward-equivalents per image ({method.label}: "
            f"{spec.cost_text()}), over this server's --max-attribution-cost of {max_cost}: "
            f"{_cost_fix(spec)}")
    validate_preprocess(spec.preprocessing)
    limits.preprocess(spec.preprocessing)
    fixed = fixed_input_size(spec.preprocessing, m.defaults.crop)
    job = AttributeJob(limits, config, m, spec, num_classes)
    answer = activation = 0  # the size follows the image: checked per image
    if fixed is not None:  # fails fast, before any image is computed
        answer, activation = job.sizes(*fixed)
    return ResolvedSpec(m, job, spec.preprocessing, fixed, answer_bytes=answer,
                        activation_bytes=activation)


def _cost_fix(spec: AttributionSpec) -> str:
    knob = METHODS[spec.method].knob
    fix = [f"fewer {knob}"] if knob else []
    if spec.top_k > 1:
        fix.append("a smaller top_k")
    if not fix:
        return "this method costs that much at one target (raise the flag to allow it)"
    return "use " + " or ".join(fix)


def _cam_methods() -> str:
    """"grad_cam, hires_cam or layer_cam"."""
    *rest, last = [m.label for m in Method if m.is_cam]
    return f"{', '.join(rest)} or {last}"


def attribution_sizes(limits: Limits, m: ServedModel, spec: AttributionSpec, h: int, w: int
                      ) -> tuple[int, int]:
    """(answer, memory) bytes per image at input HxW; refuses what cannot fit."""
    limits.input_size(f"model input {h}x{w} is", h, w, fix="downscale the image or resize")
    table = m.layer_table(h, w)
    if table.stopped:   # the class scores need the whole model
        raise InvalidArgument(f"Attribute explains the model's class scores, which need "
                              f"the whole model: {table.stopped}: send a larger input")
    k = spec.targets_per_image
    if spec.method.is_cam:
        e = entry(table, spec.layer)
        per_map = h * w if spec.upsample else math.prod(map_shape(e.shape, e.layout))
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
            f"{size_text(limits.config.max_response_bytes)}: {AttributeJob.smaller}")
    return answer, memory


@dataclass(eq=False)
class AttributeRun:
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
        spec = self.items[0].job.spec
        labels = self.items[0].model.labels
        return [[_output(spec, r, labels)] for r in self.job.finish()]

    def step(self, device: Device) -> bool:
        """One pass, unless its call ended; True when the batch is over."""
        job, call = self.job, self.call
        if call.cancelled or call.expired():
            done, total = job.passes, job.total_passes()
            err: HookserveError = Cancelled(
                f"the call was cancelled after {done} of its {total} attribution passes")
            if not call.cancelled:
                err = DeadlineExceeded(
                    f"the call's deadline passed after {done} of the {total} attribution "
                    "passes of its batch: allow more time, or ask for fewer steps, "
                    "samples or top_k")
            for it in self.items:
                it.fail(err)
            return True
        t0 = time.perf_counter()
        try:
            done = job.run_pass()
            outputs = self.outputs() if done else None
        except Exception as exc:
            if is_oom(exc) and device.device.type == "cuda":
                torch.cuda.empty_cache()
            if is_oom(exc) and job.plan.rows > 1:
                log.warning("out of memory in an attribution pass of %d rows: restarting "
                            "its batch with half the rows", job.plan.rows)
                job.restart(job.plan.rows // 2)
                return False
            for it in self.items:
                it.fail(batch_error(exc, len(self.items), ATTRIBUTION_FIX))
            return True
        device.ran_pass(self.items[0].model.name, job.plan.rows, time.perf_counter() - t0)
        if not done:
            return False
        for it, out in zip(self.items, outputs, strict=True):
            if not it.future.done():
                it.future.set_result(out)
        return True


def start_run(model: ServedModel, x: torch.Tensor, items: list[WorkItem], room: int,
              cfg: EngineConfig) -> AttributeRun:
    """The run of one batch of prepared Attribute images (`x`: their normalised input)."""
    spec = items[0].job.spec
    h, w = x.shape[2:]
    memory = attribution_memory(model, h, w, spec.layer or None, spec.targets_per_image,
                                spec.upsample)
    plan = pass_plan(spec, len(items), memory, room, cfg)
    tap = grid = None
    if spec.method.is_cam:
        path, call = model.layer_index[spec.layer]
        tap = Tap(model.modules[path], call, split_input_name(spec.layer)[1], spec.layer)
        layout = entry(model.layer_table(*x.shape[2:]), spec.layer).layout
        grid = functools.partial(to_grid, layout=layout)
    black = ((0.0 - model.mean) / model.std).to(x.dtype)
    job = AttributionJob(model.module, x, spec, [it.target for it in items], plan,
                         tap=tap, black=black, grid=grid)
    return AttributeRun(items, job, memory.job(len(items), plan.rows))


def _output(spec: AttributionSpec, r: ImageAttribution, labels: tuple[str, ...]
            ) -> AttributionOutput:
    t = r.map
    return AttributionOutput(spec.layer, DType.FLOAT32, tuple(t.shape),
                             memoryview(t.reshape(-1).view(torch.uint8).numpy()),
                             targets=tuple(dataclasses.replace(x, target=named(x.target, labels))
                                           for x in r.targets),
                             top5=tuple(named(s, labels) for s in r.top5))
