"""Attributions through the OIP: the model `<model>.<method>` (resnet50.grad_cam).

Request parameters: `layer`, `target` (one class for every image; or a `TARGET` INT64
[N] input, one per image), `top_k`, `score`, `relu`, `normalize`, `upsample`,
`ig_steps`, `ig_baseline`, `sg_samples`, `sg_sigma`, `sg_seed`, and the geometry ones.
Outputs: `map` (FP32 [N, maps, h, w] for the CAM methods, [N, maps, 3, H, W] for the
input-space ones), `logits` (FP32 [N, maps]: each map's class logit) and `top5`
(BYTES [N, 5], "logit:index:label"); none requested: all three. They take no
parameters (but the REST extension's `binary_data`).
The same Session, caps and errors as the Attribute RPC.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

from ..attribution_spec import (
    DEFAULT_IG_STEPS,
    DEFAULT_SG_SAMPLES,
    DEFAULT_SG_SIGMA,
    MAX_SG_SIGMA,
    OPTION_METHODS,
    AttributeInput,
    AttributionSpec,
    Baseline,
    Method,
    Score,
)
from ..errors import InvalidArgument, ModelNotFound
from . import request as rq
from .tensors import InferAnswer, OutTensor, pack_bytes, stack, unpack_ints


class Inference(Protocol):
    """What an attribution request uses of `infer.Inference` (which calls in here)."""

    engine: Any

    def results(self, spec, images, stats: dict, on_cancel, deadline, input_name: str
                ) -> list: ...

OUTPUTS = ("map", "logits", "top5")
TARGET = "TARGET"
PARAMETERS = ("layer", "target", "top_k", "score", "relu", "normalize", "upsample",
              "ig_steps", "ig_baseline", "sg_samples", "sg_sigma", "sg_seed",
              *rq.GEOMETRY_PARAMETERS)


def methods() -> list[str]:
    return [m.label for m in Method]


def map_rank(method: Method) -> int:
    """The rank of one map: [h, w] for the CAM methods, [3, H, W] for the others."""
    return 2 if method.is_cam else 3


def check_method(name: str, method: str) -> Method:
    if method.upper() not in Method.__members__:
        raise ModelNotFound(f"unknown model {name[:100]!r}: an attribution model is "
                            f"<model>.<method>, the method one of {Method.labels()}")
    return Method[method.upper()]


def _float(value, what: str) -> float:
    if isinstance(value, bool):
        raise InvalidArgument(f"{what}={rq.shown(value)}: use a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what}={rq.shown(value)}: use a number") from None


def spec_of(call: rq.InferCall, model: str, method: Method) -> AttributionSpec:
    p = call.params
    rq.check_params(p, PARAMETERS, " for an attribution")
    for key in p:   # options of another method would be ignored: say so
        owner = OPTION_METHODS.get(key)
        if owner is not None and owner is not method:
            raise InvalidArgument(f"request parameter {key} is an option of "
                                  f"{owner.label}, not of {method.label}: drop it, or use "
                                  f"{model}.{owner.label}")
    num = {k: rq.as_int(p[k], k) for k in ("top_k", "ig_steps", "sg_samples", "sg_seed")
           if k in p}
    for k in ("top_k", "ig_steps", "sg_samples"):
        if num.get(k, 1) < 1:
            raise InvalidArgument(f"request parameter {k}={num[k]}: use 1 or more (or "
                                  "leave it out for the default)")
    if not 0 <= num.get("sg_seed", 0) < 2**64:   # (the native API's uint64)
        raise InvalidArgument(f"request parameter sg_seed={str(num['sg_seed'])[:40]}: use "
                              "0 to 2^64-1")
    sigma = _float(p.get("sg_sigma", DEFAULT_SG_SIGMA), "sg_sigma")
    if not 0 <= sigma <= MAX_SG_SIGMA:
        raise InvalidArgument(f"request parameter sg_sigma={rq.shown(p['sg_sigma'])}: use "
                              f"0 to {MAX_SG_SIGMA:g}, a fraction of the input's range (0, or "
                              "leave it out, for the default)")
    flags = {k: rq._bool(p[k], k) for k in ("relu", "normalize", "upsample") if k in p}
    return AttributionSpec(
        model=model, method=method, layer=str(p.get("layer", "")),
        score=rq._choice(Score, p.get("score", "logit"), "score"),
        top_k=num.get("top_k", 1), preprocessing=rq.preprocess(p),
        relu=flags.get("relu"), normalize=flags.get("normalize", False),
        upsample=flags.get("upsample", False),
        ig_steps=num.get("ig_steps") or DEFAULT_IG_STEPS,
        ig_baseline=rq._choice(Baseline, p.get("ig_baseline", "zeros"), "ig_baseline"),
        sg_samples=num.get("sg_samples") or DEFAULT_SG_SAMPLES,
        sg_sigma=sigma or DEFAULT_SG_SIGMA,
        sg_seed=num.get("sg_seed", 0))


def targets(call: rq.InferCall, n: int) -> list[int | None]:
    """Each image's target class: the TARGET input, the `target` parameter, or None
    (the spec's top_k classes)."""
    given = [t for t in call.inputs if t.name == TARGET]
    if given and "target" in call.params:
        raise InvalidArgument(f"both the {TARGET} input and the target parameter name the "
                              "classes: send one of them")
    if given:
        t = given[0]
        if t.datatype not in ("INT64", "INT32"):
            raise InvalidArgument(f"{TARGET} is INT64 (or INT32) [N], a class per image, "
                                  f"not {t.datatype}")
        count = rq.per_image_count(t, TARGET)
        values = (unpack_ints(t.data, t.datatype, TARGET) if not isinstance(t.data, list)
                  else [int(v) for v in t.data])
        if len(values) != count:
            raise InvalidArgument(f"{TARGET}: shape {list(t.shape)} says {count} targets, "
                                  f"the contents hold {len(values)}")
        if count != n:
            raise InvalidArgument(f"{TARGET}: {count} targets for {n} images: send one "
                                  "class per image")
        return list(values)
    if "target" in call.params:
        return [rq.as_int(call.params["target"], "target")] * n
    return [None] * n


def check_targets(call: rq.InferCall, per_target: list[int | None], classes: int,
                  model: str) -> None:
    """Refuse a class out of range before any image runs, naming where it was given."""
    bad = next(((i, t) for i, t in enumerate(per_target)
                if t is not None and not 0 <= t < classes), None)
    if bad is not None:
        where = "target" if "target" in call.params else f"{TARGET}[{bad[0]}]"
        raise InvalidArgument(f"{where}={bad[1]} is out of range: {model} has {classes} "
                              f"classes (0 to {classes - 1})")


def attribute(inf: Inference, call: rq.InferCall, model: str, method_name: str,
              stats: dict, on_cancel, deadline):
    method = check_method(call.model, method_name)
    spec = spec_of(call, model, method)
    stats["layers"] = [spec.layer[:100]] if spec.layer else []
    stats["attribution_method"] = method.label
    wanted = [o.name for o in call.outputs] or list(OUTPUTS)
    bad = [w for w in wanted if w not in OUTPUTS]
    if bad:
        raise InvalidArgument(f"unknown output {bad[0][:100]!r} of {call.model[:100]}: "
                              f"use {', '.join(OUTPUTS)}")
    if len(set(wanted)) != len(wanted):
        raise InvalidArgument(f"an output of {call.model[:100]} is requested twice: name "
                              "each once")
    for o in call.outputs:
        extra = sorted(set(o.params) - {"binary_data"})
        if extra:
            raise InvalidArgument(f"output {o.name!r} of {call.model[:100]} takes no "
                                  f"parameters (got {extra[0][:100]!r}): the request "
                                  "parameters set the attribution")
    tensor = rq.image_input(call, extra=(TARGET,))
    resolved = inf.check_fits(spec, tensor)
    images = rq.images(tensor)
    per_target = targets(call, len(images))
    check_targets(call, per_target, resolved.job.num_classes, model)
    images = [AttributeInput(i.id, i.encoded, i.raw, i.height, i.width, target=t)
              for i, t in zip(images, per_target, strict=True)]
    results = inf.results(spec, images, stats, on_cancel, deadline, tensor.name)
    outs = [r.outputs[0] for r in results]
    served = inf.engine.get_model(model)
    labels = served.labels
    answer = []
    for name in wanted:
        if name == "map":
            t = stack("map", outs)
            if len(t.shape) == 1 + map_rank(method):  # one map an image: still [N, maps, ...]
                t = OutTensor("map", t.datatype, (t.shape[0], 1, *t.shape[1:]), t.data)
        elif name == "logits":
            k = len(outs[0].targets)
            if any(len(o.targets) != k for o in outs):
                raise InvalidArgument("the images have different numbers of maps")
            data = b"".join(struct_floats([t.target.logit for t in o.targets])
                            for o in outs)
            t = OutTensor("logits", "FP32", (len(outs), k), data)
        else:
            rows = [f"{s.logit:f}:{s.class_index}"
                    f"{':' + labels[s.class_index] if s.class_index < len(labels) else ''}"
                    .encode() for o in outs for s in o.top5]
            t = OutTensor("top5", "BYTES", (len(outs), len(rows) // len(outs)),
                          pack_bytes(rows))
        answer.append(t)
    return InferAnswer(call.model, call.id, answer)


def struct_floats(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)
