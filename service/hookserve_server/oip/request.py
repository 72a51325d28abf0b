"""Protocol-neutral inference requests, and the one place their names and parameters
become hookserve's domain objects (specs and images). The gRPC and REST adapters fill
these types in; nothing past here reads protobuf or JSON.

Inputs: `IMAGE` (BYTES [N], encoded images) or `INPUT__0` (UINT8 [N, H, W, 3], RGB
pixels). Outputs are layer names; each output's parameters are `reduction`, `dtype`,
`l2_normalize` and `classification` (k: the top k as "value:index:label" strings).
The request parameter `timeout` (microseconds) is kept apart as the call's deadline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..spec import DType, ImageInput, LayerSpec, Mode, Preprocess, Reduction
from .tensors import TooMany, element_count, unpack_bytes

IMAGE = "IMAGE"
PIXELS = "INPUT__0"
#: Per-output parameters; `binary_data` is the REST binary extension's, read there.
OUTPUT_PARAMETERS = ("reduction", "dtype", "l2_normalize", "classification", "binary_data")
#: Request parameters the protocol itself uses (sequences, priority, the REST binary
#: extension): they are not hookserve's and are left alone.
RESERVED = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
            "binary_data_output", "headers")
#: An output's dtype when its request names none.
DEFAULT_DTYPE = DType.FLOAT32
#: Request parameters that set the preprocessing geometry.
GEOMETRY_PARAMETERS = ("mode", "resize", "crop_height", "crop_width")


@dataclass
class InTensor:
    """One input: raw contents (bytes), or typed elements (a list)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | list


@dataclass
class OutRequest:
    name: str
    params: dict = field(default_factory=dict)


@dataclass
class InferCall:
    model: str
    version: str = ""
    id: str = ""
    inputs: list[InTensor] = field(default_factory=list)
    outputs: list[OutRequest] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    #: the protocol's `timeout` request parameter, in microseconds (0: none)
    timeout_us: int = 0


def timeout_of(params: dict) -> int:
    """The `timeout` request parameter (microseconds; 0 or absent for none), which
    tritonclient sends for infer(timeout=...)."""
    us = as_int(params.get("timeout", 0), "request parameter timeout")
    if us < 0:
        raise InvalidArgument(f"request parameter timeout={us}: use microseconds (0 for "
                              "none)")
    return min(us, MAX_TIMEOUT_US)   # (longer is no limit: no call runs a year)


#: The longest `timeout` taken as it is, in microseconds (a year).
MAX_TIMEOUT_US = 365 * 86400 * 10**6


def own_params(params: dict) -> dict:
    """A request's parameters less the protocol's reserved ones."""
    return {k: v for k, v in params.items()
            if k not in RESERVED and not k.startswith("triton_")}


def no_shared_memory(params: dict, what: str) -> None:
    """Refuse a tensor placed in shared memory (the protocol's shared-memory extension,
    which this server does not offer)."""
    region = min((k for k in params if k.startswith("shared_memory_")),
                 key=lambda k: (k != "shared_memory_region", k), default=None)
    if region is not None:
        raise InvalidArgument(f"{what}: {region}: hookserve has no shared memory; send "
                              "the tensor in the request (and read outputs from the answer)")


#: Per-input parameters: the REST binary extension's size (read there), and a codec
#: hint some clients send (`content_type`), which changes nothing here.
INPUT_PARAMETERS = ("binary_data_size", "content_type")


def check_input_params(params: dict, name: str) -> None:
    """Refuse an input's parameter hookserve does not read (shared memory first)."""
    what = f"input {name[:100]!r}"
    no_shared_memory(params, what)
    unknown = next((k for k in params if k not in INPUT_PARAMETERS), None)
    if unknown is not None:
        raise InvalidArgument(f"{what}: unknown parameter {unknown[:100]!r}: an input takes "
                              "only binary_data_size (the REST binary extension) and "
                              "content_type; hookserve's settings are request or output "
                              "parameters")


#: The most inputs a request may name: its image input and TARGET, and a third, so that
#: a request naming both IMAGE and INPUT__0 is told about that.
MAX_INPUTS = 3


def first_repeat(names: list[str]) -> str | None:
    """The first name seen twice in `names` (in linear time), or None."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return None


def distinct_inputs(names: list[str]) -> None:
    """Refuse more inputs than the protocol's few, and an input name given twice (the
    second would be ignored): the `names` of a request's inputs."""
    if len(names) > MAX_INPUTS:
        raise InvalidArgument(f"{len(names)} inputs: a request has one image input "
                              f"({IMAGE} or {PIXELS}) and, for an attribution, TARGET")
    twice = first_repeat(names)
    if twice is not None:
        raise InvalidArgument(f"input {twice[:100]!r} is given twice: send it once")


@dataclass(frozen=True)
class OutPlan:
    """How one requested output is answered: the captured layer, and top k or all."""

    name: str
    layer: LayerSpec
    classification: int = 0


def shown(value) -> str:
    """A parameter's value as messages show it: a string quoted, anything else as JSON
    writes it (null, true, 1e+30), short."""
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choice(enum_cls, value, what: str):
    if isinstance(value, str) and value.upper() in enum_cls.__members__:
        return enum_cls[value.upper()]
    raise InvalidArgument(f"{what}={shown(value)}: use one of {enum_cls.labels()}")


def _bool(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgument(f"{what}={shown(value)}: use true or false")


def as_int(value, what: str) -> int:
    """An integer parameter, given as one or as a string of at most 30 ASCII digits
    after an optional sign (no spaces or underscores, which Python's int() would take,
    nor thousands of digits, which it refuses)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"{what}={shown(value)}: use an integer")
    if isinstance(value, str):
        digits = value[1:] if value[:1] in "+-" else value
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 30):
            raise InvalidArgument(f"{what}={shown(value)}: use an integer")
    return int(value)


def output_plans(outputs: list[OutRequest], logits: str) -> list[OutPlan]:
    """Each requested output as the layer it captures (the logits when none is asked)."""
    plans = []
    for out in outputs or [OutRequest(logits)]:
        p = out.params
        unknown = sorted(set(p) - set(OUTPUT_PARAMETERS))
        if unknown:
            raise InvalidArgument(f"output {out.name[:100]!r}: unknown parameter "
                                  f"{unknown[0]!r}: use {', '.join(OUTPUT_PARAMETERS[:4])}")
        what = f"output {out.name[:100]!r}"
        layer = LayerSpec(
            out.name,
            _choice(Reduction, p.get("reduction", "none"), f"{what}: reduction"),
            _choice(DType, p.get("dtype", DEFAULT_DTYPE.label), f"{what}: dtype"),
            _bool(p.get("l2_normalize", False), f"{what}: l2_normalize"))
        k = as_int(p.get("classification", 0), f"{what}: classification")
        if k < 0:
            raise InvalidArgument(f"{what}: classification={k}: use a positive count")
        if k and layer.dtype is DType.BFLOAT16:
            raise InvalidArgument(f"{what}: classification needs dtype float32 or float16")
        plans.append(OutPlan(out.name, layer, k))
    twice = first_repeat([p.name for p in plans])
    if twice is not None:
        raise InvalidArgument(f"output {twice[:100]!r} is requested twice: name it once")
    return plans


def layer_specs(plans: list[OutPlan]) -> tuple[LayerSpec, ...]:
    return tuple(p.layer for p in plans)


def preprocess(params: dict) -> Preprocess:
    """The geometry request parameters as a Preprocess, each checked in the protocol's
    own terms (mode=resize_crop, not the proto's enum name)."""
    what = "request parameter"
    mode = _choice(Mode, params.get("mode", "default"), f"{what} mode")
    sizes = {k: as_int(params.get(k, 0), f"{what} {k}") for k in GEOMETRY_PARAMETERS[1:]}
    for k, v in sizes.items():
        if v < 0:
            raise InvalidArgument(f"{what} {k}={v}: use a size in pixels (0, or leave it "
                                  "out, for none)")
    given = [f"{k}={v}" for k, v in sizes.items() if v]
    if given and mode is not Mode.RESIZE_CROP:
        raise InvalidArgument(f"{what} mode={mode.label} takes no {given[0]}: add "
                              "mode=resize_crop to resize or crop")
    if bool(sizes["crop_height"]) != bool(sizes["crop_width"]):
        raise InvalidArgument(f"{what}s crop_height and crop_width go together (got "
                              f"{sizes['crop_height']}x{sizes['crop_width']})")
    if mode is Mode.RESIZE_CROP and not given:
        raise InvalidArgument(f"{what} mode=resize_crop needs resize, or crop_height and "
                              "crop_width (mode=native for neither)")
    return Preprocess(mode, *sizes.values())


def image_input(call: InferCall, extra: tuple[str, ...] = ()) -> InTensor:
    """The request's one image input, IMAGE or INPUT__0 (inputs named in `extra` are
    the caller's to read)."""
    images = [t for t in call.inputs if t.name in (IMAGE, PIXELS)]
    others = [t.name[:100] for t in call.inputs if t.name not in (IMAGE, PIXELS, *extra)]
    if others and others[0] == "TARGET":
        raise InvalidArgument(f"input TARGET is for attribution models only: send it to "
                              f"{call.model[:100]}.<method> (grad_cam, ...), or drop it")
    if others:
        also = "".join(f", and {e}" for e in extra)
        raise InvalidArgument(f"unknown input {others[0]!r}: send {IMAGE} (BYTES [N], "
                              f"encoded images) or {PIXELS} (UINT8 [N, H, W, 3], "
                              f"pixels){also}")
    if len(images) != 1:
        raise InvalidArgument(f"send exactly one image input, {IMAGE} (BYTES [N], encoded "
                              f"images) or {PIXELS} (UINT8 [N, H, W, 3], pixels); "
                              f"got {len(images)}")
    return images[0]


def check_params(params: dict, allowed: tuple[str, ...], what: str = "") -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise InvalidArgument(f"unknown request parameter {unknown[0][:100]!r}{what}: use "
                              f"{', '.join(allowed)}")


#: The most images one request may hold (each is an element the server keeps until
#: the answer is sent; a request of many empty elements would otherwise cost far more
#: memory than its bytes).
MAX_IMAGES = 4096


def too_many_images(n: int) -> str:
    return (f"{n} images in one request, over the limit of {MAX_IMAGES}: send them in "
            "several requests (or a stream)")


def per_image_count(t: InTensor, what: str) -> int:
    """N, for a tensor of one element per image: shape [N], or Triton's batched [N, 1]."""
    if len(t.shape) == 1 or (len(t.shape) == 2 and t.shape[1] == 1):
        return element_count(t.shape, what)
    raise InvalidArgument(f"{what}: shape {list(t.shape)}: use [N], one element per image "
                          "(or [N, 1])")


def image_count(t: InTensor) -> int:
    """How many images an IMAGE [N] or INPUT__0 [N, H, W, 3] tensor says it holds (from
    its shape, before any is unpacked)."""
    if t.name == IMAGE:
        return per_image_count(t, IMAGE)
    return t.shape[0] if t.shape and t.shape[0] >= 0 else 0


def plausible(t: InTensor, n: int) -> bool:
    """Whether the tensor's contents could hold the `n` images its shape says (each
    BYTES element takes at least its 4-byte length): a shape that claims more is the
    request's mistake, which `images` names, not an answer too large."""
    if t.name == IMAGE:
        return len(t.data) >= (n if isinstance(t.data, list) else 4 * n)
    return len(t.data) >= n * element_count(t.shape[1:], PIXELS)


def images(t: InTensor) -> list[ImageInput]:
    """An IMAGE or INPUT__0 tensor as one ImageInput per image (at least one)."""
    out = _images(t)
    if not out:
        raise InvalidArgument(f"{t.name} holds no image: send at least one")
    return out


def _images(t: InTensor) -> list[ImageInput]:
    if t.name == IMAGE:
        if t.datatype != "BYTES":
            raise InvalidArgument(f"{IMAGE} is BYTES (encoded images), not {t.datatype}")
        n = per_image_count(t, IMAGE)
        if isinstance(t.data, list) and len(t.data) == n > MAX_IMAGES:   # (JSON, typed)
            raise InvalidArgument(too_many_images(n))
        try:
            elements = (unpack_bytes(t.data, IMAGE, min(n, MAX_IMAGES))
                        if not isinstance(t.data, list) else [bytes(e) for e in t.data])
        except TooMany:
            raise InvalidArgument(
                f"{IMAGE}: shape {list(t.shape)} says {n} images, the contents hold more"
                if n <= MAX_IMAGES else too_many_images(n)) from None
        if len(elements) != n:
            raise InvalidArgument(f"{IMAGE}: shape {list(t.shape)} says {n} images, the "
                                  f"contents hold {len(elements)}")
        return [ImageInput("", encoded=e) for e in elements]
    if t.datatype != "UINT8":
        raise InvalidArgument(f"{PIXELS} is UINT8 [N, H, W, 3] pixels, not {t.datatype}")
    if len(t.shape) != 4 or t.shape[3] != 3:
        raise InvalidArgument(f"{PIXELS}: shape {list(t.shape)}: use [N, H, W, 3] "
                              "(RGB pixels, row-major)")
    n, h, w, _ = t.shape
    if n > MAX_IMAGES:
        raise InvalidArgument(too_many_images(n))
    data = bytes(t.data) if isinstance(t.data, list) else t.data
    if len(data) != element_count(t.shape, PIXELS):
        raise InvalidArgument(f"{PIXELS}: shape {list(t.shape)} needs {n * h * w * 3} "
                              f"bytes, the contents hold {len(data)}")
    size = h * w * 3
    view = memoryview(data)
    return [ImageInput("", raw=bytes(view[i * size:(i + 1) * size]), height=h, width=w)
            for i in range(n)]
