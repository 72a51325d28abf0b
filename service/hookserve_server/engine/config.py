"""The engine's configuration: its limits and batching knobs, and the settings of the
compiled graphs (`engine/compiled.py`), which `app.py` sets from `hookserve serve`'s
flags (`hookserve_server/config.py`)."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

from ..capture.compiled import nested
from ..capture.table import split_input_name
from ..errors import ConfigError


@dataclass
class EngineConfig:
    """Limits and batching knobs. Every size a client controls is bounded here."""

    max_batch_size: int = 32
    max_batch_delay_ms: float = 5.0
    #: Cap on activation bytes (full, unreduced outputs of the requested layers) per batch.
    max_batch_bytes: int = 1 << 30
    #: Images admitted (being preprocessed or queued for the model) across all calls.
    max_queue: int = 1024
    #: How long an image waits for room in a full queue before RESOURCE_EXHAUSTED.
    queue_wait_s: float = 2.0
    #: Images of one stream admitted but not yet answered (backpressure beyond that).
    max_inflight_per_stream: int = 64
    #: Bytes of answers one stream may have reserved and not yet sent.
    max_stream_buffer_bytes: int = 256 << 20
    #: The same across all streams (--max-buffer-bytes).
    max_buffer_bytes: int = 2 << 30
    #: Estimated peak memory of the images being decoded and resized at once.
    max_preprocess_bytes: int = 4 << 30
    max_image_pixels: int = 50_000_000
    #: Estimated response bytes for one image (all its layers, after reduction).
    max_response_bytes: int = 1 << 30
    max_layers: int = 256
    max_input_side: int = 8192
    preprocess_workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 2))
    #: Decode plain RGB JPEGs on the model's CUDA device (--gpu-decode); CPU otherwise.
    gpu_decode: bool = False
    #: Largest Attribute request, in forward-equivalents (AttributionSpec.cost) per image,
    #: per batch and per call at once on the model's thread.
    max_attribution_cost: int = 1024
    #: Forward-equivalents of one Attribute pass; other work runs between passes.
    attribution_pass_cost: int = 16


@dataclass(frozen=True)
class Warm:
    """A `--warm` entry: compile this layer set at start-up."""

    model: str
    layers: tuple[str, ...]
    size: tuple[int, int] | None = None   # None: the model's default crop
    batch: int = 1


def parse_warm(text: str, max_batch: int | None = None, max_side: int | None = None
               ) -> Warm:
    """`MODEL=LAYER[+LAYER...][@HxW][#BATCH]`, e.g. `resnet50=layer4+layer3:input@224x224#8`;
    a batch over `max_batch` (--max-batch-size) or a side over `max_side`
    (--max-input-side) is refused: no such batch is ever run."""
    model, sep, rest = text.partition("=")
    rest, _, batch = rest.partition("#")
    rest, _, size = rest.partition("@")
    layers = tuple(x.strip() for x in rest.split("+") if x.strip())
    if not sep or not model.strip() or not layers:
        raise ConfigError(f"--warm {text!r}: write MODEL=LAYER[+LAYER...][@HxW][#BATCH], "
                          "e.g. resnet50=layer4+layer3:input@224x224#8")
    hw = None
    if size:
        h, _, w = size.lower().partition("x")
        hw = (_whole(h, text, "a side"), _whole(w or h, text, "a side"))
    warm = Warm(model.strip(), layers, hw, _whole(batch, text, "the batch") if batch else 1)
    inner = nested({split_input_name(name)[0] for name in layers})
    if inner:
        raise ConfigError(f"--warm {text}: {inner[0]} holds {inner[1]}, and a compiled "
                          "graph keeps each captured module whole: warm them in two entries")
    # (graphs are kept per power-of-two batch: the one that holds --max-batch-size runs)
    if max_batch is not None and warm.batch > 1 << max(0, max_batch - 1).bit_length():
        raise ConfigError(f"--warm {text}: batch {warm.batch} is over --max-batch-size "
                          f"{max_batch}, so no batch of it ever runs")
    if max_side is not None and hw and max(hw) > max_side:
        raise ConfigError(f"--warm {text}: a side of {max(hw)} is over --max-input-side "
                          f"{max_side}, so no image of it is ever taken")
    return warm


def _whole(value: str, text: str, what: str) -> int:
    """A --warm number: a whole number of 1 or more."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--warm {text}: {what} {value.strip()!r} is not a whole number "
                          "of 1 or more")
    return n


@dataclass(frozen=True)
class CompileSettings:
    mode: str = "off"                  # "auto" | "off"
    after: int = 2
    max_graphs: int = 8
    max_bytes: int = 2 << 30
    warm: tuple[Warm, ...] = ()
    #: torch.compile backend; "inductor" serves, others ("eager": dynamo alone) are for
    #: checking the machinery without code generation
    backend: str = "inductor"
    #: input sizes compiled per layer set; batches of any other size stay eager
    max_sizes: int = 2
    #: keys and layer sets whose batch counts, input sizes, estimates and failures are
    #: remembered (each; the least recently used are forgotten first)
    max_tracked: int = 4096


@dataclass
class CompileStats:
    """What /metrics and tests read: compiles done, their seconds, graph hits,
    eager batches, evictions, failed layer sets, and the graphs' memory estimate."""

    compiles: int = 0
    compile_seconds: float = 0.0
    hits: int = 0
    eager: int = 0
    evictions: int = 0
    failures: int = 0
    graph_bytes: int = 0
    pending: int = 0
    #: the keys of the most recent compiles (RECENT_COMPILES of them)
    compiled_keys: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_COMPILES))


#: How many compiled keys `CompileStats.compiled_keys` keeps.
RECENT_COMPILES = 256
