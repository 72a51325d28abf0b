"""What each call leaves behind: one log line (logs.py writes its fields as JSON or as
text) and its metrics (by RPC, model, code and attribution method; per image, its
code and bytes sent).

The servicer opens `observed` around every RPC, notes the specs of a request stream
as they pass (`noted`) and sends each image's answer through `answered`. No torch, no
grpc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator

from .attribution_spec import AttributionSpec
from .spec import ExtractionSpec, ImageResult
from .telemetry import Telemetry

log = logging.getLogger("hookserve.calls")


class _CallLine(dict):
    """A call's log fields; as the record's message, their JSON (made only if used)."""

    def __str__(self) -> str:
        return json.dumps(self)


def call_stats() -> dict:
    """What one work call's log line and metrics report, filled in as it runs."""
    return {"model": "", "layers": [], "images": 0, "failed": 0, "bytes": 0}


#: grpcio's time_remaining() for a call without a deadline: about 9.2e18 s, not None.
#: Anything above this many seconds (some 30 years) is taken as no deadline.
NO_DEADLINE_S = 1e9


def _remaining(context) -> float | None:
    """Seconds left of the call's own deadline; None when it has none (a transport
    without deadlines, or a client that set none)."""
    remaining = getattr(context, "time_remaining", lambda: None)()
    return None if remaining is None or remaining > NO_DEADLINE_S else remaining


def call_deadline(context) -> float | None:
    """The call's deadline as a time.monotonic() value (None: the client set none)."""
    remaining = _remaining(context)
    return None if remaining is None else time.monotonic() + remaining


#: A client cancels at its deadline, which it reached this much before the server's
#: clock did (the request's travel): a call that ends this close to its deadline is
#: counted as having run out of time, as its client saw it.
DEADLINE_SLACK_S = 0.1


def _expired(context) -> bool:
    """Whether the call's own deadline has passed (a transport that has one)."""
    remaining = _remaining(context)
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def _gone(context) -> bool:
    """Whether the client has ended the call (cancelled, or its deadline passed): a
    stream whose client left while the server waited for its next request ends with
    no exception of its own. (grpcio's record of the client's side is read where it
    has one: is_active() turns False only once the call is torn down.)"""
    active = getattr(context, "is_active", None)
    if active is not None and not active():
        return True
    return getattr(getattr(context, "_state", None), "client", None) == "cancelled"


class Calls:
    """Logs and counts the calls of one server (`models`: the names it holds; the
    first is the default)."""

    def __init__(self, telemetry: Telemetry, models: Collection[str], default_model: str
                 ) -> None:
        self.telemetry = telemetry
        self._models = models
        self._default = default_model

    def model_label(self, name: str) -> str:
        """A model name fit for a metric label: unknown names collapse to "unknown"."""
        name = name or self._default
        return name if name in self._models else "unknown"

    def note_spec(self, spec: ExtractionSpec | AttributionSpec, stats: dict) -> None:
        """A spec's model and layers, for the log line and metrics (names are cut short:
        they come from the client)."""
        stats["model"] = self.model_label(spec.model)
        if isinstance(spec, AttributionSpec):
            stats["layers"] = [spec.layer[:100]] if spec.layer else []
            stats["attribution_method"] = spec.method.label
        else:
            stats["layers"] = [layer.name[:100] for layer in spec.layers[:32]]

    def noted(self, requests: Iterable, stats: dict) -> Iterator:
        """Pass requests through, noting the latest spec (`note_spec`)."""
        for req in requests:
            if isinstance(req, (ExtractionSpec, AttributionSpec)):
                self.note_spec(req, stats)
            yield req

    @contextlib.contextmanager
    def observed(self, method: str, context, stats: dict, *, whole_call: bool = True):
        """Count the call by RPC, model, code (and attribution method), and log one
        line for it: when its handler ends, or when the client ends the call (a cancel,
        or its deadline), whichever comes first: a stream handler the client left is
        not always resumed (gRPC drops it, and only a garbage collection closes it).
        `whole_call` False: one request of a stream (its context is the stream's, so
        the stream's end says nothing of this request)."""
        t0 = time.monotonic()
        code = "OK"
        pending = [True]

        def done(code: str) -> None:
            try:
                pending.pop()   # atomic: the handler's thread or gRPC's callback
            except IndexError:
                return
            if code == "CANCELLED" or (code == "OK" and whole_call and (
                    _gone(context) or _expired(context))):
                code = "DEADLINE_EXCEEDED" if _expired(context) else "CANCELLED"
            self._done(method, context, stats, code, t0)

        add_callback = getattr(context, "add_callback", None)
        if add_callback is not None and whole_call:
            add_callback(lambda: done("CANCELLED"))   # runs once the RPC has ended
        try:
            yield stats
        except GeneratorExit:  # the client went away mid-stream
            code = "CANCELLED"
            raise
        except Exception as exc:
            code = getattr(exc, "code", "INTERNAL")
            raise
        finally:
            done(code)

    def refused(self, method: str, context, code: str) -> None:
        """A call refused before its work began (a bad token, a request that does not
        parse, a full server): logged and counted as one call with `code`."""
        self._done(method, context, call_stats(), code, time.monotonic())

    def _done(self, method: str, context, stats: dict, code: str, t0: float) -> None:
        attribution = stats.get("attribution_method", "")
        self.telemetry.call_done(method, stats.get("model", ""), code, attribution)
        line = {"event": "call", "method": method, "peer": context.peer(), **stats,
                "seconds": round(time.monotonic() - t0, 4), "code": code}
        log.info(_CallLine(line), extra={"fields": line})

    def answered(self, result: ImageResult, stats: dict,
                 messages: Callable[[ImageResult], Iterator]) -> Iterator:
        """One image's answer messages (`messages(result)`; none for an error), counted."""
        model = stats["model"]
        stats["images"] += 1
        if result.error is not None:
            stats["failed"] += 1
            self.telemetry.image_done(model, result.error.code)
            return
        t0 = time.perf_counter()
        yield from messages(result)
        nbytes = sum(o.nbytes for o in result.outputs or ())
        stats["bytes"] += nbytes
        self.telemetry.serialize_seconds(time.perf_counter() - t0)
        self.telemetry.bytes_sent(model, nbytes)
        self.telemetry.image_done(model, "OK")
