"""The Extract streams of `hookserve batch`, with ``--timeout`` applied to them, and
the weights they answer with checked.

A batch stream may run for hours, so it has no deadline of its own. Instead
``--timeout`` bounds its silence: a stream that has images sent and unanswered, and
gets no message for ``--timeout`` seconds, is cancelled, and its unanswered images are
sent again (as after DEADLINE_EXCEEDED). And every stream, the first and each one
opened after a server went away, must come from the weights the run started with
(the server's ``hookserve-weights-bin`` header): a replica that came back with other
weights would mix their features into the output, so the run stops there (Abort)
before any of its answers is taken. :func:`extract_many` is
:meth:`hookserve.Client.extract_many` with that watch.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from .. import errors
from ..extraction import Extraction
from ..types import build_spec
from ..wire import WEIGHTS_HEADER
from .errors import Abort


def weights_of(meta: dict) -> tuple[str, str]:
    """(model, weights digest) of a run's output metadata: what its streams must serve."""
    return meta["model"], meta["weights"]["digest"]


class Watchdog:
    """One thread that cancels the silent streams of a run, and the `weights` (model,
    digest) every stream must answer with (see the module doc)."""

    def __init__(self, timeout: float | None,
                 weights: tuple[str, str] | None = None) -> None:
        self.timeout = timeout
        self.weights = weights
        self._streams: weakref.WeakSet[_Watched] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, stream: _Watched) -> None:
        if not self.timeout:
            return
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="hookserve-batch-watch")
                self._thread.start()

    def _loop(self) -> None:
        tick = min(1.0, self.timeout / 4)
        while True:
            time.sleep(tick)  # a periodic check, not a synchronisation
            now = time.monotonic()
            with self._lock:
                streams = list(self._streams)
                if not streams:  # no stream left to watch: the next one starts a thread
                    self._thread = None
                    return
            for s in streams:
                if s.call is not None and s.waiting() and now - s.last > self.timeout:
                    s.timed_out = True
                    s.call.cancel()


class _Watched(Extraction):
    """An Extraction whose call is visible to the watchdog, and that notes every
    message it receives."""

    def __init__(self, *args: Any, watchdog: Watchdog) -> None:
        super().__init__(*args)
        self.call = None
        self.last = time.monotonic()
        self.timed_out = False
        self.weights = watchdog.weights
        self._checked = None
        watchdog.watch(self)

    def _opened(self, call: Any) -> None:
        self.call = call
        self.last = time.monotonic()

    def _absorb(self, msg: Any) -> Any:
        self.last = time.monotonic()
        if self.weights is not None and self._checked is not self.call:
            self._check_weights()
        return super()._absorb(msg)

    def _check_weights(self) -> None:
        """Abort unless this call's server serves the run's weights (its first answer
        is here, so its headers are)."""
        self._checked = self.call
        model, digest = self.weights
        try:
            header = dict(self.call.initial_metadata() or ()).get(WEIGHTS_HEADER)
        except Exception:  # noqa: BLE001 - a call without headers (an older server)
            return
        if header is None:
            return
        served = json.loads(header).get(model)   # (the digest's first characters)
        if not served or not digest.startswith(served):
            where = f"serves {served[:19]}" if served else "no longer serves it"
            raise Abort(f"a server this run reconnected to {where} for model {model}, "
                        f"not the weights this output was written with ({digest[:19]}): "
                        "its features would be mixed with theirs. Nothing of it was "
                        "written; rerun once every server has the same weights")

    def waiting(self) -> bool:
        """Images were sent on this stream and are not answered yet."""
        return any(p.image is not None for p in list(self.pending))


def extract_many(client, images: Iterable[Any], layers, *, ids: Iterable[str],
                 window: int, watchdog: Watchdog, model: str | None = None,
                 **options: Any) -> Iterator:
    """:meth:`hookserve.Client.extract_many`, whose stream is cancelled after
    ``watchdog.timeout`` seconds of silence; that failure is raised as
    DEADLINE_EXCEEDED naming ``--timeout``."""
    spec = build_spec(layers, model, **options)
    run = _Watched(client._endpoints, spec, images, ids, max(1, window), None,
                   watchdog=watchdog)
    try:
        yield from run.run()
    except errors.HookserveError:
        if run.timed_out:
            raise errors.DeadlineExceeded(
                f"no answer for {watchdog.timeout:g} s while images were outstanding "
                "(--timeout); the stream was cancelled and its images are sent again"
            ) from None
        raise
