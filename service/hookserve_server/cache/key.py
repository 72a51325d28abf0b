"""Cache keys: sha256 over everything that defines an answer, never a client's id.

One key per (image, layer spec) for Extract, so a request for layers A and B reuses an
earlier answer for A and computes only B; one key per (image, spec, target) for
Attribute. A key is the digest of, in order:

- a format tag (a change of layout never reads an old value);
- the image's own bytes (encoded, or raw pixels with their height and width);
- what computes: architecture, weights digest (sha256 of the state dict), whether the
  model re-normalises its input (googlenet's and inception_v3's transform_input), the
  class names (an Attribute answer's top 5 carries them), dtype, precision (`--precision`),
  memory format, device type; the versions of hookserve, torch, torchvision and
  Pillow; whether JPEGs are decoded on the model's GPU (``--gpu-decode``);
- the resolved preprocessing: the resize and crop the geometry rule gives for the
  requested mode, and the model's mean, std and interpolation;
- the answer's own spec: the layer, reduction, dtype and L2 flag (Extract), or every
  field of the Attribute spec and the image's target.

Keys are 32 raw bytes; ``hex()`` is the Redis key's suffix.
"""

from __future__ import annotations

import hashlib

import PIL
import torch
import torchvision

from .. import __version__
from ..attribution_spec import AttributionSpec
from ..models import ServedModel
from ..preprocess.geometry import geometry_params
from ..spec import ImageInput, LayerSpec, Preprocess

#: Bumped whenever the layout below, the encoded value or an answer for the same key
#: changes (v4: models whose weights resize bicubically are now resized so).
FORMAT = b"hookserve-cache-v4"

#: The code that decodes, preprocesses and computes: another version may answer
#: differently.
VERSIONS = (__version__, torch.__version__, torchvision.__version__, PIL.__version__)


def _field(h, *parts: object) -> None:
    """Each part as its repr, length-prefixed: no two different tuples hash alike."""
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)


def image_digest(image: ImageInput) -> bytes:
    """sha256 of an image's bytes, tagged with their kind (and a raw image's size)."""
    h = hashlib.sha256()
    if image.raw is not None:
        _field(h, b"raw", image.height, image.width, image.raw)
    else:
        _field(h, b"encoded", image.encoded or b"")
    return h.digest()


def model_part(m: ServedModel, gpu_decode: bool = False) -> tuple:
    """What computes the answer: a different entry means a different key."""
    return (m.arch, m.weights.digest, m.transform_input, m.labels_digest, m.dtype.name,
            m.precision.value, m.channels_last, m.device.type, *VERSIONS,
            gpu_decode and m.device.type == "cuda")


def preprocess_part(m: ServedModel, pre: Preprocess) -> tuple:
    """The preprocessing as resolved for `m`: the mode only through what it gives."""
    d = m.defaults
    resize, crop = geometry_params(pre, d.resize, d.crop)
    return (resize, crop, tuple(d.mean), tuple(d.std), d.interpolation)


def base(image: bytes, m: ServedModel, pre: Preprocess, gpu_decode: bool = False):
    """The hash state shared by every answer of one image under one model and
    preprocessing; each answer's key continues a copy of it."""
    h = hashlib.sha256(FORMAT)
    _field(h, image, *model_part(m, gpu_decode), *preprocess_part(m, pre))
    return h


def layer_key(state, layer: LayerSpec) -> bytes:
    h = state.copy()
    _field(h, b"layer", layer.name, layer.reduction.name, layer.dtype.name,
           bool(layer.l2_normalize))
    return h.digest()


def attribution_key(state, spec: AttributionSpec, target: int | None) -> bytes:
    """Every field of the spec but the model's name (the model is in `state`), and
    the image's target."""
    h = state.copy()
    _field(h, b"attribution", spec.method.name, spec.layer, spec.score.name, spec.top_k,
           spec.apply_relu, spec.normalize, spec.upsample, spec.ig_steps,
           spec.ig_baseline.name, spec.sg_samples, float(spec.sg_sigma), spec.sg_seed,
           target)
    return h.digest()
