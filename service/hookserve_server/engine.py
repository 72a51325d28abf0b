"""The pure-Python engine: sessions, preprocessing pool, batch queue, model worker.

Data flow for one image::

    Session reader thread --admit--> preprocess pool (decode, resize, crop)
        --> BatchQueue of the model's device --> DeviceWorker thread (owns the models
        on that device: stacks a batch, normalises on the device, runs the forward
        pass with hooks on the union of requested layers, stops once all fired)
        --> Future per image --> Session output iterator, in send order.

Nothing here imports grpc: the servicer adapts protobuf to these objects.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from . import preprocess as pp
from .errors import (
    Cancelled,
    DeadlineExceeded,
    HookserveError,
    InternalError,
    InvalidArgument,
    ModelNotFound,
    ResourceExhausted,
    Unavailable,
)
from .models import TORCH_DTYPES, LayerInfo, ServedModel
from .spec import DTYPES, REDUCTIONS, ExtractionSpec, ImageInput, LayerSpec

log = logging.getLogger("hookserve.engine")


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
    #: Bytes of answers one stream may have computed but not yet sent.
    max_stream_buffer_bytes: int = 256 << 20
    max_image_pixels: int = 50_000_000
    #: Estimated response bytes for one image (all its layers, after reduction).
    max_response_bytes: int = 1 << 30
    max_layers: int = 256
    max_input_side: int = 8192
    preprocess_workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 2))
    #: Decode plain RGB JPEGs on the model's CUDA device (--gpu-decode); CPU otherwise.
    gpu_decode: bool = False


class Telemetry:
    """Observation points; the metrics module overrides these. All are no-ops here."""

    def queue_depth(self, device: str, depth: int) -> None: ...
    def preprocess_seconds(self, seconds: float) -> None: ...
    def queue_wait_seconds(self, seconds: float) -> None: ...
    def forward(self, model: str, batch_size: int, seconds: float) -> None: ...
    def serialize_seconds(self, seconds: float) -> None: ...
    def image_done(self, model: str, code: str) -> None: ...
    def bytes_sent(self, model: str, nbytes: int) -> None: ...
    def call_done(self, method: str, model: str, code: str) -> None: ...


@dataclass(frozen=True)
class ResolvedSpec:
    """A validated spec bound to its model."""

    model: ServedModel
    layers: tuple[LayerSpec, ...]
    preprocess: pp.Preprocess
    #: Model input size when it does not depend on the image.
    fixed_size: tuple[int, int] | None
    #: Answer bytes per image at fixed_size (0 when the size varies).
    answer_bytes: int = 0


@dataclass
class ImageResult:
    """The answer for one image: tensors (CPU, contiguous) or an error."""

    index: int
    id: str
    tensors: list[tuple[str, torch.Tensor]] | None = None
    error: HookserveError | None = None


class _StopForward(Exception):
    """Raised by the last hook to fire: nothing after it needs to run."""


@dataclass(eq=False)
class _WorkItem:
    model: ServedModel
    pixels: torch.Tensor            # uint8 3xHxW on the CPU
    layers: tuple[LayerSpec, ...]
    activation_bytes: int
    session: Session
    future: Future
    deadline: float | None
    enqueued: float = 0.0

    @property
    def key(self):
        return (self.model.name, self.pixels.shape[1], self.pixels.shape[2])


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    msg = str(exc)
    return isinstance(exc, oom) or "out of memory" in msg or "can't allocate memory" in msg


class _BatchQueue:
    """FIFO of preprocessed images; hands out compatible batches."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._items: collections.deque[_WorkItem] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        #: images admitted and still in preprocessing (more may arrive soon)
        self.incoming = 0

    def __len__(self) -> int:
        return len(self._items)

    def add_incoming(self, n: int) -> None:
        with self._cond:
            self.incoming += n
            if n < 0:
                self._cond.notify_all()

    def put(self, item: _WorkItem) -> None:
        with self._cond:
            item.enqueued = time.monotonic()
            self._items.append(item)
            self.incoming -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_batch(self) -> list[_WorkItem] | None:
        """Block for the next batch: same model and input size, FIFO by first item.

        Waits up to max_batch_delay_ms for more compatible images, but only while
        images are still being preprocessed; under load the queue fills while the
        previous batch runs, so no wait is needed.
        """
        cfg = self.cfg
        with self._cond:
            while not self._items:
                if self._closed and self.incoming <= 0:
                    return None
                self._cond.wait()
            first = self._items[0]
            key = first.key
            until = first.enqueued + cfg.max_batch_delay_ms / 1000.0
            while True:
                batch, nbytes = [], 0
                for it in self._items:
                    if it.key != key:
                        continue
                    if batch and (len(batch) >= cfg.max_batch_size
                                  or nbytes + it.activation_bytes > cfg.max_batch_bytes):
                        break
                    batch.append(it)
                    nbytes += it.activation_bytes
                full = (len(batch) >= cfg.max_batch_size
                        or nbytes >= cfg.max_batch_bytes
                        or len(batch) < sum(1 for it in self._items if it.key == key))
                remaining = until - time.monotonic()
                if full or self.incoming <= 0 or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            chosen = set(map(id, batch))
            self._items = collections.deque(it for it in self._items if id(it) not in chosen)
            return batch


class _DeviceWorker:
    """The one thread that runs the models of one device."""

    def __init__(self, device: torch.device, cfg: EngineConfig, telemetry: Telemetry,
                 release: Callable[[int], None]) -> None:
        self.device = device
        self.cfg = cfg
        self.telemetry = telemetry
        self.queue = _BatchQueue(cfg)
        self._release = release
        self._cuda = device.type == "cuda"
        # Finished batches go to a completer thread, which waits for the device-to-host
        # copy (CUDA) and hands each image its own answer, off the model's thread.
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"hookserve-{device}",
                                        daemon=True)
        self._completer = threading.Thread(target=self._complete_loop,
                                           name=f"hookserve-{device}-done", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._completer.start()

    def close(self, end: float | None = None) -> None:
        """Finish the queue, then stop; `end` is a time.monotonic() deadline."""
        def left():
            return None if end is None else max(0.0, end - time.monotonic())
        self.queue.close()
        self._thread.join(left())
        self._done.put(None)
        self._completer.join(left())

    # -- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            batch = self.queue.next_batch()
            if batch is None:
                return
            try:
                self._serve_batch(batch)
            except Exception:  # never let the model's only thread die
                log.exception("device worker failed on a batch of %d", len(batch))
                for it in batch:
                    if not it.future.done():
                        self._finish(it, error=InternalError(
                            "internal error while running the model"))
            # Let go before blocking for the next batch: an idle worker must not pin
            # the last batch's pixels, answers (via its futures) and sessions.
            batch = it = None

    def _serve_batch(self, batch: list[_WorkItem]) -> None:
        self.telemetry.queue_depth(str(self.device), len(self.queue))
        live = []
        now = time.monotonic()
        for it in batch:
            if it.session.cancelled:
                self._finish(it, error=Cancelled("the call was cancelled"))
            elif it.deadline is not None and now > it.deadline:
                self._finish(it, error=DeadlineExceeded(
                    "the call's deadline passed while the image was queued"))
            else:
                self.telemetry.queue_wait_seconds(now - it.enqueued)
                live.append(it)
        if live:
            self._run(live)

    def _run(self, items: list[_WorkItem]) -> None:
        try:
            outputs = self._forward(items)
        except Exception as exc:
            if _is_oom(exc):
                if self._cuda:
                    torch.cuda.empty_cache()
                if len(items) > 1:
                    log.warning("out of memory on a batch of %d: splitting", len(items))
                    half = len(items) // 2
                    self._run(items[:half])
                    self._run(items[half:])
                    return
                err: HookserveError = ResourceExhausted(
                    "this image needs more device memory than is free: use a smaller "
                    "input size (preprocessing) or request fewer or earlier layers")
            elif isinstance(exc, HookserveError):
                err = exc
            else:
                log.exception("forward pass failed for a batch of %d", len(items))
                err = InternalError("internal error while running the model")
            for it in items:
                self._finish(it, error=err)
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._done.put((event, items, outputs))

    def _complete_loop(self) -> None:
        while True:
            job = self._done.get()
            if job is None:
                return
            event, items, outputs = job
            try:
                if event is not None:
                    event.synchronize()
                for it, out in zip(items, outputs, strict=True):
                    if len(items) > 1:
                        # A row is a view of the whole batch tensor: copy it, so a slow
                        # reader holding one answer does not pin the batch's answers.
                        out = [(name, t.clone()) for name, t in out]
                    self._finish(it, tensors=out)
            except Exception:
                log.exception("handing out a batch's answers failed")
                for it in items:
                    if not it.future.done():
                        self._finish(it, error=InternalError(
                            "internal error while handing out the answer"))
            # As in _loop: don't pin the last batch's buffers while idle.
            job = event = items = outputs = it = out = None

    def _finish(self, it: _WorkItem, *, tensors=None, error=None) -> None:
        self._release(1)
        if not it.future.done():
            if error is not None:
                it.future.set_exception(error)
            else:
                it.future.set_result(tensors)

    # -- one forward pass ----------------------------------------------------------
    def _forward(self, items: list[_WorkItem]) -> list[list[tuple[str, torch.Tensor]]]:
        model = items[0].model
        t0 = time.perf_counter()
        wanted: set[LayerSpec] = set()
        for it in items:
            wanted.update(it.layers)
        # module path -> call index -> specs captured at that call
        plan: dict[str, dict[int, list[LayerSpec]]] = {}
        for spec in wanted:
            path, call = model.layer_index[spec.name]
            plan.setdefault(path, {}).setdefault(call, []).append(spec)
        captured: dict[LayerSpec, torch.Tensor] = {}
        calls: dict[str, int] = dict.fromkeys(plan, 0)
        remaining = [sum(len(c) for c in plan.values())]

        def make_hook(path: str, by_call: dict[int, list[LayerSpec]]):
            def hook(module, args, out):
                k = calls[path]
                calls[path] = k + 1
                specs = by_call.get(k)
                if not specs:
                    return None
                remaining[0] -= 1
                last = remaining[0] == 0
                for spec in specs:
                    captured[spec] = _reduce(out, spec, may_alias=last)
                if last:
                    raise _StopForward
                return None
            return hook

        if any(it.pixels.is_cuda for it in items):  # --gpu-decode put some on the device
            x = torch.stack([it.pixels.to(self.device, non_blocking=True) for it in items])
        else:
            x = torch.stack([it.pixels for it in items])
            if self._cuda:
                x = x.pin_memory().to(self.device, non_blocking=True)
        x = x.to(torch.float32).div_(255.0).sub_(model.mean).div_(model.std)
        x = x.to(model.torch_dtype)
        if model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with ExitStack() as stack, torch.inference_mode():
            for path, by_call in plan.items():
                handle = model.modules[path].register_forward_hook(make_hook(path, by_call))
                stack.enter_context(handle)
            try:
                model.module(x)
            except _StopForward:
                pass
        if remaining[0] != 0:
            missing = sorted(s.name for s in wanted if s not in captured)
            raise InternalError(f"layers did not run in the forward pass: {missing}")
        if self._cuda:
            host = {}
            for spec, t in captured.items():
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host[spec] = buf
            captured = host
        self.telemetry.forward(model.name, len(items), time.perf_counter() - t0)
        return [[(s.name, captured[s][i]) for s in it.layers] for i, it in enumerate(items)]


def _reduce(out: torch.Tensor, spec: LayerSpec, *, may_alias: bool) -> torch.Tensor:
    """Apply a layer's reduction, L2 and dtype to a whole batch, on its device.

    The result never shares memory with `out` unless `may_alias` (the forward pass
    stops right after this hook): later in-place ops (ReLU(inplace=True), `+=` in a
    residual block) would otherwise change what we captured.
    """
    if not isinstance(out, torch.Tensor):
        raise InternalError(f"layer {spec.name} does not output a tensor")
    t = out
    if spec.reduction in ("avg", "max") and t.dim() > 2:
        dims = tuple(range(2, t.dim()))
        t = t.mean(dim=dims, dtype=torch.float32) if spec.reduction == "avg" else t.amax(dim=dims)
    elif spec.reduction == "flatten":
        t = t.flatten(1)
    if spec.l2_normalize:
        t = t.float()
        norm = t.flatten(1).norm(dim=1).clamp_min(1e-12)
        t = t / norm.view(-1, *([1] * (t.dim() - 1)))
    t = t.to(TORCH_DTYPES[spec.dtype]).contiguous()
    if not may_alias and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        t = t.clone()
    return t


#: Duplicate ids are detected among the last this-many ids of a stream (~5 MB a stream).
ID_HISTORY = 65_536
#: Longest image id accepted; longest model or layer name.
MAX_ID_CHARS = 1024
MAX_NAME_CHARS = 256


class Session:
    """One Extract call: reads requests, keeps a bounded window, answers in order.

    The window bounds images admitted and not yet yielded, by count
    (``max_inflight_per_stream``) and by answer bytes (``max_stream_buffer_bytes``).
    Per-image answer bytes come from the spec when the input size is fixed, else from
    the largest answer seen so far on this stream (one image at a time until then).
    """

    def __init__(self, engine: Engine, deadline: float | None = None) -> None:
        self.engine = engine
        self.deadline = deadline
        self.cancelled = False
        self._cond = threading.Condition()
        self._inflight = 0
        self._largest_answer = 0   # bytes of the largest answer seen on this stream
        self._reader_done = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        # 64-bit digests of the last ID_HISTORY non-empty ids, oldest first.
        self._ids: set[int] = set()
        self._id_order: collections.deque[int] = collections.deque()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    def drain(self) -> None:
        """Shutdown began: end the call now if nothing of it is in flight."""
        with self._cond:
            if self._inflight == 0 and not self._reader_done:
                self._out.put(_drain_error())

    def _limit(self, spec: ResolvedSpec) -> int:
        cfg = self.engine.config
        per_image = spec.answer_bytes if spec.fixed_size else self._largest_answer
        if per_image <= 0:  # size varies and nothing seen yet: one image to learn it
            return 1
        return max(1, min(cfg.max_inflight_per_stream,
                          cfg.max_stream_buffer_bytes // per_image))

    def _acquire(self, spec: ResolvedSpec) -> bool:
        with self._cond:
            while self._inflight >= self._limit(spec) and not self.cancelled:
                self._cond.wait()
            if self.cancelled:
                return False
            self._inflight += 1
            return True

    def _release(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _observe(self, fut: Future) -> None:
        if fut.exception() is None:
            n = sum(t.numel() * t.element_size() for _, t in fut.result())
            with self._cond:
                if n > self._largest_answer:
                    self._largest_answer = n
                    self._cond.notify_all()  # the window may grow

    def _check_id(self, image_id: str) -> None:
        if not image_id:
            return
        if len(image_id) > MAX_ID_CHARS:
            raise InvalidArgument(
                f"image id is {len(image_id)} characters, over the limit of {MAX_ID_CHARS}: "
                "use shorter ids (answers are also matched by image_index)")
        h = int.from_bytes(hashlib.blake2b(image_id.encode(), digest_size=8).digest(), "little")
        if h in self._ids:
            raise InvalidArgument(
                f"duplicate image id {image_id!r} in this stream: ids must be unique "
                "per stream (or empty)")
        self._ids.add(h)
        self._id_order.append(h)
        if len(self._id_order) > ID_HISTORY:  # bounded memory on endless streams
            self._ids.discard(self._id_order.popleft())

    def run(self, requests: Iterable[ExtractionSpec | ImageInput]) -> Iterator[ImageResult]:
        """Consume requests on a reader thread; yield one ImageResult per image, in order.

        A bad spec ends the iteration by raising its HookserveError, after the images
        sent before it have been yielded. So does shutdown (Unavailable), once the
        images already admitted have been yielded.
        """
        self.engine._register(self)
        reader = threading.Thread(target=self._read, args=(requests,),
                                  name="hookserve-reader", daemon=True)
        reader.start()
        try:
            while True:
                entry = self._out.get()
                if entry is None:
                    return
                if isinstance(entry, HookserveError):
                    raise entry
                index, image_id, fut = entry
                try:
                    result = ImageResult(index, image_id, tensors=fut.result())
                except HookserveError as exc:
                    result = ImageResult(index, image_id, error=exc)
                try:
                    yield result
                finally:
                    self._release()
                    if self.engine.draining:
                        self.drain()
        finally:
            self.cancel()

    def _read(self, requests) -> None:
        out = self._out
        spec: ResolvedSpec | None = None
        index = 0
        try:
            for req in requests:
                if self.cancelled:
                    break
                if isinstance(req, ExtractionSpec):
                    spec = self.engine.resolve(req)
                    continue
                if spec is None:
                    raise InvalidArgument(
                        "an image came before any ExtractionSpec: send a spec first")
                if self.engine.draining:
                    raise _drain_error()
                if not self._acquire(spec):
                    break
                fut: Future = Future()
                fut.add_done_callback(self._observe)
                try:
                    self._check_id(req.id)
                    self.engine.submit(spec, req, self, fut)
                except HookserveError as exc:
                    fut.set_exception(exc)
                # An over-long id is not echoed back (the answer carries image_index).
                out.put((index, req.id if len(req.id) <= MAX_ID_CHARS else "", fut))
                index += 1
        except HookserveError as exc:
            out.put(exc)
        except Exception:
            if not self.cancelled:  # a bug, not the client going away: say so
                log.exception("reading the request stream failed")
                out.put(InternalError("internal error while reading the request stream"))
        finally:
            with self._cond:
                self._reader_done = True
            out.put(None)


def _drain_error() -> Unavailable:
    return Unavailable("server is shutting down: images from here on were not taken; "
                       "send them to another replica")


class Engine:
    """Holds the models and the workers; the servicer's only collaborator."""

    def __init__(self, models: list[ServedModel], config: EngineConfig | None = None,
                 telemetry: Telemetry | None = None) -> None:
        if not models:
            raise ValueError("an engine needs at least one model")
        self.config = config or EngineConfig()
        self.telemetry = telemetry or Telemetry()
        self.models: dict[str, ServedModel] = {}
        for m in models:
            if m.name in self.models:
                raise ValueError(f"model {m.name} given twice")
            self.models[m.name] = m
        self.default_model = models[0].name
        self._admit = threading.Condition()
        self._admitted = 0
        self._closing = False
        #: set by start_drain(): open streams stop taking new images
        self.draining = False
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._workers: dict[str, _DeviceWorker] = {}
        for m in models:
            key = str(m.device)
            if key not in self._workers:
                self._workers[key] = _DeviceWorker(m.device, self.config, self.telemetry,
                                                   self._release)
        self._pool = ThreadPoolExecutor(self.config.preprocess_workers,
                                        thread_name_prefix="hookserve-pre")
        self._started = False
        # --gpu-decode state (counters are advisory: races only delay the switch-off)
        # Set by warmup() when the GPU decoder fails on a known-good JPEG.
        self._gpu_decode_off = False
        if self.config.gpu_decode and not any(m.device.type == "cuda" for m in models):
            log.warning("--gpu-decode has no effect: no model runs on a CUDA device")

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        if not self._started:
            for w in self._workers.values():
                w.start()
            self._started = True
        return self

    def warmup(self) -> None:
        """One image through every model's full forward pass, via the normal path.

        With --gpu-decode it also tries the GPU decoder on a known-good JPEG: when that
        fails (no nvjpeg), decoding stays on the CPU. Per-image failures later never
        switch it off, so corrupt uploads cannot turn it off for everyone.
        """
        cuda = [m.device for m in self.models.values() if m.device.type == "cuda"]
        if self.config.gpu_decode and cuda and not self._gpu_decode_off:
            import io

            from PIL import Image

            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (120, 60, 30)).save(buf, "JPEG")
            try:
                decode_jpeg_on_device(ImageInput("probe", encoded=buf.getvalue()),
                                      self.config.max_image_pixels, cuda[0])
            except Exception as exc:
                log.warning("--gpu-decode: the GPU JPEG decoder does not work here (%s); "
                            "decoding on the CPU", exc)
                self._gpu_decode_off = True
        for m in self.models.values():
            last = list(m.layer_table(*m.defaults.crop))[-1]
            h, w = m.defaults.crop
            # A 1x1 image resized and cropped to the default input size: the forward
            # pass is the usual one, and no --max-image-pixels setting can refuse it.
            pre = pp.Preprocess("resize_crop", resize=max(h, w), crop_height=h, crop_width=w)
            spec = ExtractionSpec(m.name, (LayerSpec(last),), pre)
            img = ImageInput("warmup", raw=bytes(3), height=1, width=1)
            for r in Session(self).run([spec, img]):
                if r.error:
                    raise r.error

    def start_drain(self) -> None:
        """Stop taking new images on open streams; admitted ones still finish, and
        streams with nothing in flight end at once (UNAVAILABLE)."""
        self.draining = True
        for session in list(self._sessions):
            session.drain()

    def _register(self, session: Session) -> None:
        self._sessions.add(session)

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new images, finish what is queued, stop the workers; returns within
        about `timeout` seconds (threads still busy then are daemons, ended at exit)."""
        with self._admit:
            self._closing = True
            self._admit.notify_all()
        # Images already submitted to the pool are still decoded and queued; the
        # workers wait for them (their queue's `incoming` count) before they stop.
        self._pool.shutdown(wait=False)
        end = None if timeout is None else time.monotonic() + timeout
        for w in self._workers.values():
            w.close(end)

    @property
    def queued(self) -> int:
        with self._admit:
            return self._admitted

    def hook_count(self) -> int:
        """Forward hooks currently registered on all served models (0 when idle)."""
        return sum(len(mod._forward_hooks) for m in self.models.values()
                   for mod in m.module.modules())

    # -- models ----------------------------------------------------------------------
    def get_model(self, name: str) -> ServedModel:
        name = name or self.default_model
        if len(name) > MAX_NAME_CHARS:
            raise ModelNotFound(f"model name is {len(name)} characters: no model has a name "
                                f"over {MAX_NAME_CHARS} (see ListModels)")
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(
                f"unknown model {name!r}: this server holds {', '.join(self.models)} "
                "(see ListModels)") from None

    def describe(self, name: str, height: int = 0, width: int = 0
                 ) -> tuple[ServedModel, tuple[int, int], list[LayerInfo]]:
        m = self.get_model(name)
        if bool(height) != bool(width):
            raise InvalidArgument("give both input_height and input_width, or neither")
        h, w = (height, width) if height else m.defaults.crop
        side = self.config.max_input_side
        if h > side or w > side:
            raise InvalidArgument(f"input {h}x{w} is over the limit of {side} pixels a side")
        return m, (h, w), list(m.layer_table(h, w).values())

    def resolve(self, spec: ExtractionSpec) -> ResolvedSpec:
        """Validate a spec against its model (raises InvalidArgument / ModelNotFound)."""
        m = self.get_model(spec.model)
        if not spec.layers:
            raise InvalidArgument(
                f"no layers requested: name at least one layer of {m.name} "
                "(hookserve describe lists them)")
        if len(spec.layers) > self.config.max_layers:
            raise InvalidArgument(
                f"{len(spec.layers)} layers requested, over the limit of {self.config.max_layers}")
        seen = set()
        for layer in spec.layers:
            if layer.name in seen:
                raise InvalidArgument(f"layer {layer.name!r} is requested twice: name it once")
            seen.add(layer.name)
            if len(layer.name) > MAX_NAME_CHARS:
                raise InvalidArgument(
                    f"a layer name is {len(layer.name)} characters, over the limit of "
                    f"{MAX_NAME_CHARS}: DescribeModel lists the valid names")
            if layer.name not in m.layer_index:
                raise InvalidArgument(unknown_layer_message(layer.name, m))
            if layer.reduction not in REDUCTIONS:
                raise InvalidArgument(
                    f"invalid reduction {layer.reduction!r} for {layer.name}: "
                    f"use one of {', '.join(REDUCTIONS)}")
            if layer.dtype not in DTYPES:
                raise InvalidArgument(
                    f"invalid dtype {layer.dtype!r} for {layer.name}: "
                    f"use one of {', '.join(DTYPES)}")
        pp.validate_preprocess(spec.preprocessing, self.config.max_input_side)
        fixed = pp.fixed_input_size(spec.preprocessing, m.defaults.crop)
        resolved = ResolvedSpec(m, tuple(spec.layers), spec.preprocessing, fixed)
        if fixed is not None:  # fails fast, before any image is computed
            answer, _ = self._estimate(resolved, *fixed)
            resolved = dataclasses.replace(resolved, answer_bytes=answer)
        return resolved

    def _estimate(self, spec: ResolvedSpec, h: int, w: int) -> tuple[int, int]:
        """(response bytes, activation bytes) per image at input HxW; enforces limits."""
        table = spec.model.layer_table(h, w)
        response = activation = 0
        for layer in spec.layers:
            info = table[layer.name]
            response += layer.reduced_bytes(info.shape)
            activation += info.bytes_per_image
        limit = self.config.max_response_bytes
        if response > limit:
            raise ResourceExhausted(
                f"the answer for one image at input {h}x{w} would be {_size(response)}, "
                f"over this server's --max-response-bytes of {_size(limit)}: request "
                "fewer layers, a reduction (avg/max), float16, or a smaller input size")
        # The forward pass also holds layers nobody asked for (vgg's features.0 at 8192x8192
        # is 17 GB): bound the largest output computed up to the last requested layer, so
        # no input size a client picks can exhaust host memory; batches use the same bound.
        last = max(table[layer.name].order for layer in spec.layers)
        peak, peak_name = max((li.bytes_per_image, li.name) for li in table.values()
                              if li.order <= last)
        cap = self.config.max_batch_bytes
        if peak > cap:
            raise ResourceExhausted(
                f"at input {h}x{w} layer {peak_name} of {spec.model.name} would output "
                f"{_size(peak)} for one image, over this server's --max-batch-bytes of "
                f"{_size(cap)}: use a smaller input size (resize/crop) or request "
                "earlier layers")
        return response, max(activation, peak)

    # -- work ------------------------------------------------------------------------
    def _release(self, n: int) -> None:
        with self._admit:
            self._admitted -= n
            self._admit.notify_all()

    def submit(self, spec: ResolvedSpec, image: ImageInput, session: Session,
               fut: Future) -> None:
        """Admit one image and start its preprocessing; `fut` gets its tensors or error."""
        cfg = self.config
        with self._admit:
            end = time.monotonic() + cfg.queue_wait_s
            while self._admitted >= cfg.max_queue and not self._closing:
                left = end - time.monotonic()
                if left <= 0 or session.cancelled:
                    raise ResourceExhausted(
                        f"server overloaded: {self._admitted} images queued (--max-queue "
                        f"{cfg.max_queue}); retry after a short delay",
                        retry_after_s=0.5)
                self._admit.wait(left)
            if self._closing:
                raise Unavailable("server is shutting down: retry on another replica")
            self._admitted += 1
        worker = self._workers[str(spec.model.device)]
        worker.queue.add_incoming(1)
        try:
            self._pool.submit(self._preprocess, spec, image, session, fut, worker)
        except RuntimeError:  # pool shut down
            worker.queue.add_incoming(-1)
            self._release(1)
            raise Unavailable("server is shutting down: retry on another replica") from None

    def _preprocess(self, spec: ResolvedSpec, image: ImageInput, session: Session,
                    fut: Future, worker: _DeviceWorker) -> None:
        t0 = time.perf_counter()
        try:
            if session.cancelled:
                raise Cancelled("the call was cancelled")
            if session.deadline is not None and time.monotonic() > session.deadline:
                raise DeadlineExceeded("the call's deadline passed before the image was "
                                       "decoded")
            m = spec.model
            on_device = self._decode_on_device(m, image)
            if on_device is None:
                arr = pp.decode(image, self.config.max_image_pixels)
                ih, iw = arr.shape[0], arr.shape[1]
            else:
                ih, iw = on_device.shape[1], on_device.shape[2]
            h, w = pp.geometry_size(spec.preprocess, m.defaults.resize, m.defaults.crop,
                                    ih, iw)
            side = self.config.max_input_side
            if h > side or w > side:
                raise InvalidArgument(
                    f"model input would be {h}x{w}, over the limit of {side} pixels a side: "
                    "downscale the image or use a resize")
            _, activation = self._estimate(spec, h, w)
            if on_device is None:
                pixels = pp.apply_geometry(arr, spec.preprocess, m.defaults.resize,
                                           m.defaults.crop)
            else:
                pixels = geometry_on_tensor(on_device, spec.preprocess, m.defaults.resize,
                                            m.defaults.crop)
            item = _WorkItem(m, pixels, spec.layers, activation, session, fut,
                             session.deadline)
        except Exception as exc:
            worker.queue.add_incoming(-1)
            self._release(1)
            if not isinstance(exc, HookserveError):
                log.exception("preprocessing failed")
                exc = InternalError("internal error while preprocessing the image")
            fut.set_exception(exc)
            return
        self.telemetry.preprocess_seconds(time.perf_counter() - t0)
        worker.queue.put(item)

    def _decode_on_device(self, m: ServedModel, image: ImageInput) -> torch.Tensor | None:
        """--gpu-decode: a plain RGB JPEG decoded on the model's CUDA device, else None.

        None means "use the CPU path": other formats, CPU models, the flag off, a GPU
        decoder that failed its warm-up probe, and any failure on this image (the CPU
        path then decodes it, or reports it as corrupt with its usual message).
        """
        if not self.config.gpu_decode or m.device.type != "cuda" or self._gpu_decode_off:
            return None
        try:
            return decode_jpeg_on_device(image, self.config.max_image_pixels, m.device)
        except Exception as exc:
            log.debug("GPU JPEG decoding failed for one image, decoding on the CPU: %s", exc)
            return None

    def session(self, deadline: float | None = None) -> Session:
        return Session(self, deadline)


def decode_jpeg_on_device(image: ImageInput, max_pixels: int,
                          device: torch.device) -> torch.Tensor | None:
    """Decode a plain RGB JPEG with torchvision on `device`: a 3xHxW uint8 tensor.

    Returns None for anything the CPU path should handle so that both paths mean
    the same pixels: not a JPEG, not 3-channel (grayscale, CMYK), an EXIF block (the
    CPU path applies its orientation), over `max_pixels` (the CPU path words the
    error). Only the header is parsed here (PIL, lazily). Raises if the decoder
    fails. Decoders differ slightly (nvjpeg vs libjpeg IDCT): pixels may differ
    by a few levels from the CPU path's.
    """
    import io

    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    data = image.encoded
    if not data or not data.startswith(b"\xff\xd8"):
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode != "RGB" or "exif" in img.info:
                return None
            w, h = img.size
    except Exception:
        return None
    if w * h > max_pixels:
        return None
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)


def geometry_on_tensor(t: torch.Tensor, pre: pp.Preprocess, default_resize: int,
                       default_crop: tuple[int, int]) -> torch.Tensor:
    """`preprocess.apply_geometry` for a 3xHxW uint8 tensor already on its device.

    Resizes in float32 and rounds back (antialiased uint8 resize is CPU-only in
    some torch versions), so values may differ by one level from the CPU path.
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    resize, crop = pp._params(pre, default_resize, default_crop)
    if resize:
        t = F.resize(t.float(), [resize], interpolation=InterpolationMode.BILINEAR,
                     antialias=True).round_().clamp_(0, 255).to(torch.uint8)
    if crop:
        t = F.center_crop(t, list(crop))
    return t.contiguous()


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n:,} bytes"


def unknown_layer_message(name: str, model: ServedModel) -> str:
    import difflib

    names = list(model.layer_index)
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"closest valid layers: {', '.join(close)}" if close else (
        f"valid layers start with: {', '.join(names[:5])}")
    return (f"unknown layer {name!r} for model {model.name}; {hint}. "
            f"DescribeModel (hookserve describe {model.name}) lists all {len(names)} layers")
