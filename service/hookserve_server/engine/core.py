"""The Engine: the servicer's only collaborator. It holds the models, validates specs
(resolve), admits images and hands them to preparation, and owns the lifecycle of
the device workers. It never imports grpc.

Data flow for one image::

    Session reader thread (ExtractImage: the handler thread) --resolve, plan (header:
        sizes, limits), reserve answer bytes (budget), admit--> Preparer pool (decode,
        geometry) --> BatchQueue of the model's device --> DeviceWorker thread: the
        image's job runs the batch (Extract: stack, normalise on the device, forward
        pass with hooks, early stop; Attribute: pass by pass)
        --> completer thread --> Future per image --> Session output, in send order.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import shlex
import threading
import time
import weakref
from concurrent.futures import Future

from ..allocator import MemoryReturn
from ..attribution_spec import AttributionSpec
from ..cache.front import AnswerCache
from ..capture.table import INPUT_SUFFIX, LayerInfo, entry, split_input_name
from ..errors import InvalidArgument, ModelNotFound
from ..models import ServedModel
from ..preprocess.geometry import fixed_input_size, validate_preprocess
from ..spec import ExtractionSpec, ImageInput, LayerSpec, Layout, Mode, Preprocess, Reduction
from ..telemetry import Telemetry
from .admission import Admission
from .attribute import resolve_attribution
from .attribute_memory import gradient_bytes
from .budget import Budget
from .compiled import CompiledGraphs
from .config import CompileSettings, EngineConfig
from .extract import ExtractJob
from .limits import Limits
from .prepare import ImagePlan, Preparer
from .session import Session
from .types import CallState, ResolvedSpec
from .worker import DeviceWorker

log = logging.getLogger("hookserve.engine")


class Engine:
    def __init__(self, models: list[ServedModel], config: EngineConfig | None = None,
                 telemetry: Telemetry | None = None, cache: AnswerCache | None = None
                 ) -> None:
        if not models:
            raise ValueError("an engine needs at least one model")
        self.config = config or EngineConfig()
        self.telemetry = telemetry or Telemetry()
        self.limits = Limits(self.config)
        self.models: dict[str, ServedModel] = {}
        for m in models:
            if m.name in self.models:
                raise ValueError(f"model {m.name} given twice")
            self.models[m.name] = m
        self.default_model = models[0].name
        self._admission = Admission(self.config.max_queue, self.config.queue_wait_s)
        #: the answer cache (--cache-bytes, --cache-url), or None
        self.cache = cache
        #: answer bytes reserved by all streams (each stream's budget is a child); the
        #: cache's bytes come out of --max-buffer-bytes too
        held = cache.capacity if cache is not None else 0
        room, each = self.config.max_buffer_bytes - held, self.config.max_stream_buffer_bytes
        # (a stream alone can still fill its own budget: an OIP request holds all of its
        # answer until it is whole)
        self.budget = Budget(room, "--max-buffer-bytes"
                             + (" less the answer cache" if held else ""),
                             headroom=max(0, min(each, room // 4, room - each)))
        #: returns freed answer and decode memory to the OS once work stops
        self.memory = MemoryReturn(busy=lambda: self._admission.admitted > 0)
        #: set by start_drain(): open streams stop taking new images
        self.draining = False
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._sessions_changed = threading.Condition()
        self._workers: dict[str, DeviceWorker] = {}
        for m in models:
            key = str(m.device)
            if key not in self._workers:
                self._workers[key] = DeviceWorker(m.device, self.config, self.telemetry)
        self._preparer = Preparer(self.config, self.limits, self.telemetry,
                                  self.memory.freed)
        self._started = False
        if self.config.gpu_decode and not any(m.device.type == "cuda" for m in models):
            log.warning("--gpu-decode has no effect: no model runs on a CUDA device")

    def compile_graphs(self, settings: CompileSettings) -> None:
        """`--compile`: each device's worker serves compiled extraction graphs as they
        become ready (engine/compiled.py); `--warm` entries are traced on every device,
        then queued."""
        traced = []
        for device, w in self._workers.items():
            w.compiled = CompiledGraphs(settings, self.telemetry)
            traced.append(w.compiled.warm({n: m for n, m in self.models.items()
                                           if str(m.device) == device}))
        for w, jobs in zip(self._workers.values(), traced, strict=True):
            w.compiled.start(jobs)

    @property
    def compiled(self) -> list[CompiledGraphs]:
        """Each device's compiled graphs (their `stats`: compiles, hits, evictions)."""
        return [w.compiled for w in self._workers.values()]

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        if not self._started:
            for w in self._workers.values():
                w.start()
            self._started = True
        return self

    def warmup(self) -> None:
        """One image through every model's full forward pass, via the normal path.

        With --gpu-decode it also probes the GPU decoder on a known-good JPEG.
        """
        cuda = [m.device for m in self.models.values() if m.device.type == "cuda"]
        if self.config.gpu_decode and cuda:
            self._preparer.probe_gpu_decode(cuda[0])
        for m in self.models.values():
            last = list(m.layer_table(*m.defaults.crop))[-1]
            h, w = m.defaults.crop
            # A 1x1 image resized and cropped to the default input size: the forward
            # pass is the usual one, and no --max-image-pixels setting can refuse it.
            pre = Preprocess(Mode.RESIZE_CROP, resize=max(h, w), crop_height=h, crop_width=w)
            spec = ExtractionSpec(m.name, (LayerSpec(last),), pre)
            img = ImageInput("warmup", raw=bytes(3), height=1, width=1)
            cache, self.cache = self.cache, None  # warm the model, not the cache
            for c in self.compiled:   # nor any compile: no client asked for this layer
                c.counting(False)
            try:
                for r in self.session().run([spec, img]):
                    if r.error:
                        raise r.error
            finally:
                self.cache = cache
                for c in self.compiled:
                    c.counting(True)

    def start_drain(self) -> None:
        """Stop taking new images on open streams; admitted ones still finish, and
        streams with nothing in flight end at once (UNAVAILABLE)."""
        self.draining = True
        for session in list(self._sessions):
            session.drain()

    def register(self, session: Session) -> None:
        """A running Session, told when a drain starts."""
        self._sessions.add(session)
        weakref.finalize(session, self._session_gone)

    def _session_gone(self) -> None:
        with self._sessions_changed:
            self._sessions_changed.notify_all()

    def wait_sessions_gone(self, timeout: float) -> bool:
        """Until no Session is alive. Sessions go by reference counting alone (nothing
        they hold points back at them), so this needs no garbage collection."""
        with self._sessions_changed:
            return self._sessions_changed.wait_for(lambda: not self._sessions, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new images, finish what is queued, stop the workers: within about
        `timeout` seconds, and the batch each model's thread runs then (images still
        queued fail UNAVAILABLE)."""
        self._admission.close()
        # Images already submitted to the pool are still prepared and queued; the
        # workers wait for them (their queue's `incoming` count) before they stop.
        self._preparer.shutdown()
        end = None if timeout is None else time.monotonic() + timeout
        for w in self._workers.values():
            w.close(end)
        self.memory.close()
        if self.cache is not None:
            self.cache.close()

    @property
    def admission(self) -> Admission:
        return self._admission

    @property
    def sessions(self) -> list[Session]:
        """Sessions still alive (a finished call's session goes with its last reference)."""
        return list(self._sessions)

    @property
    def queued(self) -> int:
        """Images admitted and not yet answered, across all calls."""
        return self._admission.admitted

    @property
    def attribution_passes(self) -> int:
        """Attribute passes run so far, on all devices."""
        return sum(w.passes for w in self._workers.values())

    @property
    def attribution_jobs(self) -> tuple[int, int]:
        """Attribute batches (`AttributeRun`s) started so far, and those running now."""
        return (sum(w.jobs_started for w in self._workers.values()),
                sum(w.jobs for w in self._workers.values()))

    def hook_count(self) -> int:
        """Forward hooks and pre-hooks registered on all served models (0 when idle)."""
        return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks)
                   for m in self.models.values() for mod in m.module.modules())

    # -- models ----------------------------------------------------------------------
    def get_model(self, name: str) -> ServedModel:
        name = name or self.default_model
        self.limits.model_name(name)
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(
                f"unknown model {name!r}: this server holds {', '.join(self.models)} "
                "(ListModels; `hookserve models` on the command line)") from None

    def describe(self, name: str, height: int = 0, width: int = 0
                 ) -> tuple[ServedModel, tuple[int, int], list[LayerInfo]]:
        m = self.get_model(name)
        if bool(height) != bool(width):
            raise InvalidArgument("give both input_height and input_width, or neither")
        h, w = (height, width) if height else m.defaults.crop
        self.limits.input_size(f"input {h}x{w} is", h, w, fix="ask for a smaller input size")
        return m, (h, w), list(m.layer_table(h, w).values())

    def resolve(self, spec: ExtractionSpec | AttributionSpec) -> ResolvedSpec:
        """Validate a spec against its model (raises InvalidArgument / ModelNotFound)."""
        m = self.get_model(spec.model)
        if isinstance(spec, AttributionSpec):
            if spec.layer:
                self._check_layer(m, spec.layer)
            return resolve_attribution(self.limits, self.config, m, spec)
        if not spec.layers:
            raise InvalidArgument(
                f"no layers requested: name at least one layer of {m.name} "
                "(hookserve describe lists them)")
        self.limits.layer_count(len(spec.layers))
        seen = set()
        for layer in spec.layers:
            if layer.name in seen:
                raise InvalidArgument(f"layer {layer.name!r} is requested twice: name it once")
            seen.add(layer.name)
            self._check_layer(m, layer.name)
        validate_preprocess(spec.preprocessing)
        self.limits.preprocess(spec.preprocessing)
        fixed = fixed_input_size(spec.preprocessing, m.defaults.crop)
        job = ExtractJob(self.limits, m, with_layouts(m, spec.layers))
        answer = activation = 0  # the size follows the image: checked per image
        if fixed is not None:  # fails fast, before any image is computed
            answer, activation = job.sizes(*fixed)
        return ResolvedSpec(m, job, spec.preprocessing, fixed,
                            answer_bytes=answer, activation_bytes=activation)

    def _check_layer(self, m: ServedModel, name: str) -> None:
        self.limits.layer_name(name)
        if name not in m.layer_index:
            raise InvalidArgument(unknown_layer_message(name, m))

    def gradient_bytes(self, m: ServedModel, h: int, w: int) -> int:
        """Memory one image holds in an Attribute pass of `m` at input HxW (the
        input-space methods' figure, the largest), as DescribeModel reports it."""
        return gradient_bytes(m, h, w)

    # -- work ------------------------------------------------------------------------
    def plan(self, spec: ResolvedSpec, image: ImageInput) -> ImagePlan:
        """An image's sizes and answer bytes from its header, checked against the limits."""
        return self._preparer.plan(spec, image)

    def submit(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan, call: CallState,
               fut: Future) -> None:
        """Admit one image and start preparing it; `fut` gets its outputs or error.
        With a cache, only what it does not hold is computed (cache/front.py)."""
        if self.cache is not None:
            self.cache.submit(spec, image, call, fut,
                              lambda part, f: self._compute(part, image, plan, call, f),
                              plan.geometry.input)
            return
        self._compute(spec, image, plan, call, fut)

    def _compute(self, spec: ResolvedSpec, image: ImageInput, plan: ImagePlan,
                 call: CallState, fut: Future) -> None:
        permit = self._admission.admit(call)
        permit.bind(fut)
        self._preparer.submit(spec, image, plan, call, fut,
                              self._workers[str(spec.model.device)].queue)

    def session(self, deadline: float | None = None) -> Session:
        """A call's Session: its answers bounded by its own budget (a child of the
        server-wide one) and window."""
        return Session(self, self.budget.child(self.config.max_stream_buffer_bytes,
                                               "--max-stream-buffer-bytes"),
                       self.config.max_inflight_per_stream, deadline)

    def freed(self, nbytes: int) -> None:
        """An answer of `nbytes` was handed on or dropped (Session)."""
        self.memory.freed(nbytes)


def with_layouts(m: ServedModel, layers) -> tuple[LayerSpec, ...]:
    """The requested layers with their layouts (capture/reduce.py reduces by them);
    the cls reduction is refused on a layer that is not [T, D]."""
    table = m.layer_table(*m.defaults.crop)
    out = []
    for spec in layers:
        layout = entry(table, spec.name).layout
        if spec.reduction is Reduction.CLS and layout is not Layout.TD:
            raise InvalidArgument(
                f"reduction cls takes token 0 of a [T, D] layer (a transformer block); "
                f"layer {spec.name} of {m.name} is {layout.name}: use avg, max or stats")
        out.append(dataclasses.replace(spec, layout=layout))
    return tuple(out)


def unknown_layer_message(name: str, model: ServedModel) -> str:
    names = list(model.layer_index)
    why = model.tables.why_not(name)
    if why is not None:
        return (f"layer {name!r} of {model.name} cannot be captured: {why}. DescribeModel "
                f"(hookserve describe {shlex.quote(model.name)}) lists the layers that can")
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"closest valid layers: {', '.join(close)}" if close else (
        f"valid layers start with: {', '.join(names[:5])}")
    outputs = sum(1 for n in names if not split_input_name(n)[1])
    return (f"unknown layer {name!r} for model {model.name}; {hint}. "
            f"DescribeModel (hookserve describe {shlex.quote(model.name)}) lists all "
            f"{outputs} layers "
            f"('<layer>{INPUT_SUFFIX}' names a layer's input)")
