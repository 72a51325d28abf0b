"""Every size a client controls, checked once, before its cost is paid.

Names and counts when a spec arrives; the input size when it is known (at the spec
when a crop fixes it, else per image after decoding the header); answer and
activation bytes from the layer table, before any forward pass. The pixel count of
an image (--max-image-pixels) is checked by the decoder, from the header, and every
size after it (the resize before a crop, the model input) by `geometry`, also from the
header: no pixel is decoded or resized before all of them passed.
"""

from __future__ import annotations

from ..capture.reduce import reduced_bytes
from ..capture.table import entry
from ..errors import InvalidArgument, ModelNotFound, ResourceExhausted
from ..models import ServedModel
from ..preprocess.geometry import Geometry
from ..spec import LayerSpec, Preprocess
from .config import EngineConfig

#: Longest image id accepted; longest model or layer name.
MAX_ID_CHARS = 1024
MAX_NAME_CHARS = 256


def size_text(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n:,} bytes"


def check_image_id(image_id: str) -> None:
    if len(image_id) > MAX_ID_CHARS:
        raise InvalidArgument(
            f"image id is {len(image_id)} characters, over the limit of {MAX_ID_CHARS}: "
            "use shorter ids (answers are also matched by image_index)")


class Limits:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def model_name(self, name: str) -> None:
        if len(name) > MAX_NAME_CHARS:
            raise ModelNotFound(f"model name is {len(name)} characters: no model has a name "
                                f"over {MAX_NAME_CHARS} (see ListModels)")

    def layer_count(self, n: int) -> None:
        if n > self.config.max_layers:
            raise InvalidArgument(
                f"{n} layers requested, over the limit of {self.config.max_layers}")

    def layer_name(self, name: str) -> None:
        if len(name) > MAX_NAME_CHARS:
            raise InvalidArgument(
                f"a layer name is {len(name)} characters, over the limit of "
                f"{MAX_NAME_CHARS}: DescribeModel lists the valid names")

    def input_size(self, what: str, *sides: int, fix: str) -> None:
        """A size in pixels (a model input side, a resize, a crop) against --max-input-side.

        `what` begins the message ("input 9000x9000 is"), `fix` ends it."""
        side = self.config.max_input_side
        if max(sides) > side:
            raise InvalidArgument(
                f"{what} over the limit of {side} pixels a side (--max-input-side): {fix}")

    def geometry(self, g: Geometry) -> None:
        """Every size an image goes through, from its header, before it is decoded:
        the decoded size is bounded by the decoder (--max-image-pixels); here the
        sides of the resized image (before a crop) and of the model input
        (--max-input-side)."""
        if g.resized is not None:
            (dh, dw), (rh, rw) = g.decoded, g.resized
            cropped = g.resized != g.input
            what = (f"resizing the {dh}x{dw} image to {g.resize} on its shorter side "
                    f"would make it {rh}x{rw}{' before the crop' if cropped else ''},")
            fix = "send an image closer to square, or ask for a smaller resize"
            self.input_size(what, rh, rw, fix=fix)
        ih, iw = g.input
        self.input_size(f"model input would be {ih}x{iw},", ih, iw,
                        fix="downscale the image or use a resize")

    def preprocess(self, pre: Preprocess) -> None:
        for name, v in (("resize", pre.resize), ("crop_height", pre.crop_height),
                        ("crop_width", pre.crop_width)):
            self.input_size(f"{name}={v} is", v, fix="ask for a smaller size")

    def answer(self, model: ServedModel, layers: tuple[LayerSpec, ...], h: int, w: int
               ) -> tuple[int, int]:
        """(response bytes, activation bytes) per image at input HxW; enforces limits."""
        table = model.layer_table(h, w)
        response = activation = 0
        for layer in layers:
            info = entry(table, layer.name)
            response += reduced_bytes(layer, info.shape)
            activation += info.bytes_per_image
        limit = self.config.max_response_bytes
        if response > limit:
            raise ResourceExhausted(
                f"the answer for one image at input {h}x{w} would be {size_text(response)}, "
                f"over this server's --max-response-bytes of {size_text(limit)}: request "
                "fewer layers, a reduction (avg/max), float16, or a smaller input size")
        # The forward pass also holds layers nobody asked for (vgg's features.0 at 8192x8192
        # is 17 GB): bound the largest output computed up to the last requested layer, so
        # no input size a client picks can exhaust host memory; batches use the same bound.
        last = max(entry(table, layer.name).order for layer in layers)
        peak, peak_name = max((li.bytes_per_image, li.name) for li in table.values()
                              if li.order <= last)
        cap = self.config.max_batch_bytes
        if peak > cap:
            raise ResourceExhausted(
                f"at input {h}x{w} layer {peak_name} of {model.name} would output "
                f"{size_text(peak)} for one image, over this server's --max-batch-bytes of "
                f"{size_text(cap)}: use a smaller input size (resize/crop) or request "
                "earlier layers")
        return response, max(activation, peak)
