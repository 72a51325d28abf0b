"""One inference request through the engine: the same Session as Extract (batching,
budgets, admission, deadline, cancel, drain), then one answer with every image's
outputs stacked. Counts kept per model for ModelStatistics. No torch, no protobuf."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..calls import call_stats
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    HookserveError,
    ModelNotFound,
    ResourceExhausted,
)
from ..spec import DType, ExtractionSpec, ImageResult
from . import request as rq
from .attribution import attribute, check_method
from .tensors import InferAnswer, OutTensor, pack_bytes, stack

if TYPE_CHECKING:
    from ..engine import Engine
    from ..engine.types import ResolvedSpec
    from ..servicer import Servicer

VERSION = "1"


@dataclass
class ModelCounts:
    """What ModelStatistics reports for one model (counts only rise)."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    inferences: int = 0
    executions: int = 0
    last_ms: int = 0


@dataclass
class Counts:
    models: dict[str, ModelCounts] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, model: str, images: int, ok: bool, ns: int) -> None:
        with self.lock:
            c = self.models.setdefault(model, ModelCounts())
            if ok:
                c.success += 1
                c.success_ns += ns
                c.inferences += images
                c.executions += 1
            else:
                c.fail += 1
                c.fail_ns += ns
            c.last_ms = int(time.time() * 1000)

    def of(self, model: str) -> ModelCounts:
        with self.lock:
            c = self.models.get(model, ModelCounts())
            return ModelCounts(**vars(c))


class CallCancel:
    """A call's cancel, pointed at the Session running now: `set` is what
    Inference.infer is handed as `on_cancel`; calling the object cancels that Session,
    or the next one at once if it comes later (a stream's, a request's whose client
    went away before its Session began)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fn: Callable[[], None] | None = None
        self._done = False

    def set(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._fn = fn
            done = self._done
        if done:
            fn()

    def __call__(self) -> None:
        with self._lock:
            self._done = True
            fn = self._fn
        if fn is not None:
            fn()


class Inference:
    """Runs InferCalls on the engine, observed and counted like the work RPCs."""

    def __init__(self, engine: Engine, servicer: Servicer, answer_limit: int) -> None:
        self.engine = engine
        self.servicer = servicer
        #: the largest answer (all images, all outputs): --max-stream-buffer-bytes
        self.answer_limit = answer_limit
        self.counts = Counts()

    def model_names(self, name: str) -> tuple[str, str]:
        """A model name as (served model, attribution method's label or ""): a served
        model's own name (``timm:resnet50.a1_in1k`` holds a dot), else
        ``<model>.<method>`` (the method in any case: ``GRAD_CAM`` is ``grad_cam``)."""
        if name in self.engine.models:
            return name, ""
        base, dot, method = name.rpartition(".")
        if not dot or base not in self.engine.models:
            raise ModelNotFound(f"unknown model {name[:100]!r}: name one of "
                                f"{', '.join(self.engine.models)}"[:400] + " (or "
                                "<model>.<method> for an attribution)")
        return base, check_method(name, method).label

    def served_name(self, name: str) -> str:
        """The one spelling of a model name: what its statistics are kept under."""
        base, method = self.model_names(name)
        return f"{base}.{method}" if method else base

    @contextlib.contextmanager
    def parsing(self, method: str, context):
        """Read a request inside this: one refused before `infer` runs (a body or
        message that does not parse, a full server, a drain) is logged and counted as
        a call too, with its code."""
        try:
            yield
        except HookserveError as exc:
            self.servicer.calls.refused(method, context, exc.code)
            raise

    def check_version(self, version: str) -> None:
        if version not in ("", VERSION):
            raise ModelNotFound(f"model version {version[:20]!r}: hookserve serves "
                                f"version {VERSION} of each model (or leave it empty)")

    def infer(self, call: rq.InferCall, method: str, context,
              on_cancel: Callable[[Callable[[], None]], object],
              deadline: float | None, *, slot: bool = True) -> InferAnswer:
        """The call's answer; a bad request or image raises its HookserveError.
        `slot`: count the call in --max-streams (a stream's requests share its own).
        `deadline` (the transport's) and the call's `timeout` parameter: the earlier
        one ends it."""
        if call.timeout_us:
            own = time.monotonic() + call.timeout_us / 1e6
            deadline = own if deadline is None else min(deadline, own)
        stats = call_stats()
        t0 = time.perf_counter_ns()
        ok, served = False, ""
        try:
            with self.servicer.calls.observed(method, context, stats, whole_call=slot), \
                    (self.servicer.streams.work_slot(method) if slot
                     else contextlib.nullcontext()):
                self.check_version(call.version)
                base, attribution = self.model_names(call.model)
                # counted from here, under the name's one spelling: names from the
                # network are not kept
                served = f"{base}.{attribution}" if attribution else base
                stats["model"] = self.servicer.calls.model_label(base)
                if attribution:
                    answer = attribute(self, call, base, attribution, stats, on_cancel,
                                       deadline)
                else:
                    answer = self._extract(call, base, stats, on_cancel, deadline)
                ok = True
                return answer
        finally:
            if served:
                self.counts.record(served, stats["images"], ok,
                                   time.perf_counter_ns() - t0)

    def check_fits(self, spec, tensor: rq.InTensor) -> ResolvedSpec:
        """Refuse, before any image runs, a request whose images' answers cannot fit
        the limit: where every image's answer has one size (the default geometry, or a
        resize and crop), that size times the images the tensor says it holds. -> the
        spec resolved against its model."""
        resolved = self.engine.resolve(spec)
        per_image = resolved.answer_bytes   # (0: it varies per image)
        n = rq.image_count(tensor)
        if per_image and n * per_image > self.answer_limit and rq.plausible(tensor, n):
            raise ResourceExhausted(
                f"{n} images of {per_image} bytes of answer each make "
                f"{n * per_image} bytes, over {self.answer_limit}, this server's limit for "
                f"one answer (--max-stream-buffer-bytes): {OVER_LIMIT_FIX}")
        return resolved

    def results(self, spec, images, stats: dict, on_cancel, deadline, input_name: str
                ) -> list[ImageResult]:
        """Every image's result, in order, through one Session; the first image to fail
        fails the call at once, naming its index, and the images queued behind it do
        not run. Room in the queue is taken for all the images together before any
        runs. The answer's size is held to the limit."""
        session = self.engine.session(deadline)
        on_cancel(session.cancel)
        admission = self.engine.admission
        model = stats["model"]
        telemetry = self.engine.telemetry
        out: list[ImageResult] = []
        result = None
        with admission.room_for(len(images), session.call):
            run = (session.run_one(spec, images[0]) if len(images) == 1
                   else session.run(iter([spec, *images]), fail_fast=True))
            with contextlib.closing(run):
                for result in run:
                    if result.error is not None:
                        break
                    stats["images"] += 1
                    nbytes = sum(o.nbytes for o in result.outputs or ())
                    stats["bytes"] += nbytes
                    if stats["bytes"] > self.answer_limit:
                        raise ResourceExhausted(
                            f"the answer is over {self.answer_limit} bytes, this server's "
                            f"limit for one answer (--max-stream-buffer-bytes): "
                            f"{OVER_LIMIT_FIX}")
                    telemetry.bytes_sent(model, nbytes)
                    telemetry.image_done(model, "OK")
                    out.append(result)
                    result = None
        # the error the loop met, unless it is the Cancelled of the first failure's cancel
        failed = session.failure
        if result is not None and not (failed and isinstance(result.error, Cancelled)):
            failed = (result.index, result.error)
        if failed:
            index, error = failed
            stats["images"] += 1
            stats["failed"] += 1
            telemetry.image_done(model, error.code)
            raise _at_index(error, input_name, index, len(images))
        if len(out) < len(images):   # the session stopped early: the call ended under it
            expired = deadline is not None and time.monotonic() >= deadline
            why = "its deadline passed" if expired else "it was cancelled"
            raise (DeadlineExceeded if expired else Cancelled)(
                f"the call ended before its answer: {why} with {len(out)} of "
                f"{len(images)} images answered")
        return out

    def _extract(self, call: rq.InferCall, model: str, stats: dict, on_cancel,
                 deadline) -> InferAnswer:
        m = self.engine.get_model(model)
        self.engine.limits.layer_count(len(call.outputs))   # (before each is read)
        plans = rq.output_plans(call.outputs, logits_layer(m))
        layers = rq.layer_specs(plans)
        stats["layers"] = [layer.name[:100] for layer in layers[:32]]
        spec = ExtractionSpec(model, layers, rq.preprocess(call.params))
        rq.check_params(call.params, rq.GEOMETRY_PARAMETERS)
        tensor = rq.image_input(call)
        self.check_fits(spec, tensor)
        images = rq.images(tensor)
        results = self.results(spec, images, stats, on_cancel, deadline, tensor.name)
        outputs = []
        room = self.answer_limit - stats["bytes"]
        for plan in plans:
            values = [_output(r, plan.name) for r in results]
            if plan.classification:
                outputs.append(classify(plan, values, m.labels, room))
                room -= len(outputs[-1].data)
            else:
                outputs.append(stack(plan.name, values))
        return InferAnswer(call.model, call.id, outputs)


def logits_layer(m) -> str:
    """The model's last layer (fc, classifier.6): what an empty `outputs` returns."""
    return list(m.layer_table(*m.defaults.crop))[-1]


def _at_index(err: HookserveError, input_name: str, index: int, n: int) -> HookserveError:
    """An image's error as the call's, naming the image."""
    return type(err)(f"{input_name}[{index}] (image {index + 1} of {n}): {err.message}",
                     retry_after_s=err.retry_after_s)


def _output(result: ImageResult, name: str):
    return next(o for o in result.outputs if o.name == name)


#: What to do about an answer over --max-stream-buffer-bytes.
OVER_LIMIT_FIX = ("ask for fewer images or outputs, a reduction (reduction=avg) or a "
                  "smaller classification; or use hookserve's Extract stream (the SDK's "
                  "Client.extract_many), which sends tensors in chunks")
#: The most bytes one "value:index:" entry of a classification takes, label aside: a
#: float32 written with "%f" (up to 46 characters), the index, and its length prefix.
ENTRY_BYTES = 64


def classify(plan: rq.OutPlan, per_image: list, labels: tuple[str, ...],
             room: int) -> OutTensor:
    """The top k values of each image as Triton's "value:index:label" BYTES [N, k]
    (no label part where the model's classes have no names: `labels`, the served
    model's class names, do not count one per value). Refused before the strings are
    made when they could take more than `room` bytes."""
    arrays = [_values(o) for o in per_image]
    k = min([plan.classification, *(len(a) for a in arrays)])
    named = bool(labels) and all(len(labels) == len(a) for a in arrays)
    longest = max(len(x.encode()) for x in labels) if named else 0
    bound = len(arrays) * k * (ENTRY_BYTES + longest)
    if bound > room:
        raise ResourceExhausted(
            f"output {plan.name[:100]} with classification={k} makes up to {bound} bytes "
            f"of names, over what is left of this server's limit for one answer "
            f"(--max-stream-buffer-bytes): {OVER_LIMIT_FIX}")
    rows = []
    for values in arrays:
        top = np.argsort(-values, kind="stable")[:k]   # ties: the lower index first
        rows.extend((f"{float(values[i]):f}:{i}:{labels[i]}" if named
                     else f"{float(values[i]):f}:{i}").encode() for i in top)
    return OutTensor(plan.name, "BYTES", (len(per_image), k), pack_bytes(rows))


def _values(o) -> np.ndarray:
    return np.frombuffer(o.data, dtype="<f4" if o.dtype is DType.FLOAT32 else "<f2")
