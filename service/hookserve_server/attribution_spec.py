"""Domain objects of the Attribute call (no protobuf, no grpc, no torch).

Each enum member's value is its number in ``hookserve.v1`` (wire.py converts with
``Method(n)``). ``METHODS`` is the one table of what the engine needs to know of a
method (CAM or not, its passes and cost); what a method *computes* is
:mod:`hookserve_server.capture.attribute`. tests/test_value_lists.py checks that the
proto, these enums and the table agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .spec import ImageInput, Labelled, LayerOutput, Preprocess

#: Defaults for unset (zero) proto fields.
DEFAULT_IG_STEPS = 32
DEFAULT_SG_SAMPLES = 16
DEFAULT_SG_SIGMA = 0.15
#: SmoothGrad's largest noise, in units of the input's range (more only overflows:
#: every noisy copy would be infinite).
MAX_SG_SIGMA = 1000.0


class Method(Labelled):
    """How a map is computed (hookserve.v1.AttributionMethod)."""

    GRAD_CAM = 1
    HIRES_CAM = 2
    LAYER_CAM = 3
    GRADIENT = 4
    GRADIENT_X_INPUT = 5
    INTEGRATED_GRADIENTS = 6
    SMOOTH_GRAD = 7

    @property
    def is_cam(self) -> bool:
        """CAM methods weigh one layer's activation; the others explain the input."""
        return METHODS[self].cam


#: The options of one method alone (the spec's fields, the Open Inference Protocol's
#: request parameters of the same names): given for another method, they are refused.
OPTION_METHODS = {"ig_steps": Method.INTEGRATED_GRADIENTS,
                  "ig_baseline": Method.INTEGRATED_GRADIENTS,
                  "sg_samples": Method.SMOOTH_GRAD, "sg_sigma": Method.SMOOTH_GRAD,
                  "sg_seed": Method.SMOOTH_GRAD}


class Score(Labelled):
    """The class score a map explains (hookserve.v1.AttributionScore)."""

    LOGIT = 1
    SOFTMAX = 2


class Baseline(Labelled):
    """Integrated Gradients' starting point (hookserve.v1.AttributionBaseline)."""

    ZEROS = 1
    BLACK = 2


@dataclass(frozen=True)
class AttributionSpec:
    """What to attribute for the images that follow it on a stream.

    ``relu`` None means the method's default: on for the CAM methods, off otherwise.
    """

    model: str
    method: Method
    layer: str = ""
    score: Score = Score.LOGIT
    top_k: int = 1
    preprocessing: Preprocess = field(default_factory=Preprocess)
    relu: bool | None = None
    normalize: bool = False
    upsample: bool = False
    ig_steps: int = DEFAULT_IG_STEPS
    ig_baseline: Baseline = Baseline.ZEROS
    sg_samples: int = DEFAULT_SG_SAMPLES
    sg_sigma: float = DEFAULT_SG_SIGMA
    sg_seed: int = 0

    @property
    def targets_per_image(self) -> int:
        return max(1, self.top_k)

    @property
    def apply_relu(self) -> bool:
        return self.method.is_cam if self.relu is None else self.relu

    @property
    def passes(self) -> int:
        """Forward-and-backward passes of one image, per target class."""
        return METHODS[self.method].passes(self)

    @property
    def cost(self) -> int:
        """Forward-equivalents per image: a backward costs about two forwards.

        passes * (1 + 2k), plus the method's extra forwards (SmoothGrad's clean image;
        the formula the proto's Attribute comment gives clients).
        """
        rule = METHODS[self.method]
        return self.passes * (1 + 2 * self.targets_per_image) + rule.extra_forwards

    def cost_text(self) -> str:
        """How the cost adds up, in the SDK's parameter names."""
        k = self.targets_per_image
        per_point = f"(1 + 2 x {k} target{'s' if k > 1 else ''})"
        return METHODS[self.method].cost_text(self, per_point)


def _one_pass(spec: AttributionSpec) -> int:
    return 1


@dataclass(frozen=True)
class MethodRule:
    """What the engine needs to know of one attribution method."""

    #: Weighs one layer's activation (needs a [C, h, w] layer); else explains the input.
    cam: bool
    #: Forward-and-backward passes of one image per target, from the spec.
    passes: Callable[[AttributionSpec], int] = _one_pass
    #: Forwards per image besides the passes (SmoothGrad: the clean image's).
    extra_forwards: int = 0
    #: The SDK parameter that sets the passes ("steps"): lower it for a cheaper spec.
    knob: str = ""
    #: (spec, "(1 + 2 x k targets)") -> how the cost adds up, for messages.
    cost_text: Callable[[AttributionSpec, str], str] = lambda spec, per: f"1 pass x {per}"


#: The one table of methods (a new one: its proto value, a Method member, an entry
#: here, and what it computes in capture/attribute.py).
METHODS: dict[Method, MethodRule] = {
    Method.GRAD_CAM: MethodRule(cam=True),
    Method.HIRES_CAM: MethodRule(cam=True),
    Method.LAYER_CAM: MethodRule(cam=True),
    Method.GRADIENT: MethodRule(cam=False),
    Method.GRADIENT_X_INPUT: MethodRule(cam=False),
    Method.INTEGRATED_GRADIENTS: MethodRule(
        cam=False, passes=lambda spec: spec.ig_steps + 1, knob="steps",
        cost_text=lambda spec, per: f"steps={spec.ig_steps} gives {spec.passes} points "
                                    f"x {per}"),
    Method.SMOOTH_GRAD: MethodRule(
        cam=False, passes=lambda spec: spec.sg_samples, extra_forwards=1, knob="samples",
        cost_text=lambda spec, per: f"samples={spec.sg_samples} x {per} + 1"),
}


@dataclass
class AttributeInput(ImageInput):
    """One image of an Attribute stream, with its target class (None: the spec's top_k)."""

    target: int | None = None


@dataclass(frozen=True)
class ClassScore:
    """One class's logit and probability for one image."""

    class_index: int
    logit: float
    probability: float
    #: The class's name ("" when the model's classes have none).
    label: str = ""


@dataclass(frozen=True)
class TargetResult:
    """One map's target class, and the map's range before normalisation."""

    target: ClassScore
    map_min: float
    map_max: float
    #: Integrated Gradients only: sum of attributions - (f(x) - f(baseline)).
    delta: float | None = None


@dataclass(frozen=True)
class AttributionOutput(LayerOutput):
    """One image's map (float32; ``name`` is the spec's layer, "" for the input-space
    methods) with one TargetResult per map and the image's top classes."""

    targets: tuple[TargetResult, ...] = ()
    top5: tuple[ClassScore, ...] = ()
