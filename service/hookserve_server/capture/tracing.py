"""torch.fx tracing inside a serving process.

While torch.fx traces, it replaces ``nn.Module.__call__`` and ``__getattr__`` for the
whole process. Left as they are, a module called on any other thread meanwhile (a
layer table's meta dry run for DescribeModel or a new input size, another device's
forward pass) would go to the tracer and fail with "module is not installed as a
submodule". So hookserve's tracers (`OwnThread`) record only the calls of the thread
that traces, and the others run as if no trace were on.

torch.compile's graphs are not safe beside a trace even so: dynamo guards on
``nn.Module.__call__``, so a compiled graph called during a trace recompiles on the
calling thread (seconds, and through the replaced call), and a compile traces into
the replaced call and breaks its graph there. So a trace runs alone (`tracing`), while
compiles and compiled graphs' calls share (`sharing`): the model's thread asks
without waiting and runs a batch eagerly while a trace runs, and a trace on the
model's thread likewise waits for nothing (its key is traced at a later batch).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx, nn


class _Gate:
    """Traces alone (re-entrant on the thread that traces), the rest together; a
    waiting trace keeps new sharers out, so it cannot be starved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._tracer: int | None = None   # the thread that traces
        self._depth = 0
        self._waiting = 0                 # traces waiting for the sharers to leave

    def trace(self, wait: bool) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._tracer == me:
                self._depth += 1
                return True
            free = lambda: not self._sharing and self._tracer is None  # noqa: E731
            if not free():
                if not wait:
                    return False
                self._waiting += 1
                self._cond.notify_all()   # (for whoever watches who waits)
                try:
                    self._cond.wait_for(free)
                finally:
                    self._waiting -= 1
                    self._cond.notify_all()   # sharers held back by this wait
            self._tracer, self._depth = me, 1
            return True

    def untrace(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._tracer = None
                self._cond.notify_all()

    def share(self, wait: bool) -> bool:
        me = threading.get_ident()
        with self._cond:
            busy = lambda: (self._tracer not in (None, me)  # noqa: E731
                            or (self._waiting and self._tracer != me))
            if busy():
                if not wait:
                    return False
                self._cond.wait_for(lambda: not busy())
            self._sharing += 1
            return True

    def unshare(self) -> None:
        with self._cond:
            self._sharing -= 1
            if not self._sharing:
                self._cond.notify_all()


_GATE = _Gate()


@contextmanager
def tracing(wait: bool = True) -> Iterator[bool]:
    """Around a torch.fx trace: yields whether it may run (always, when `wait`)."""
    ok = _GATE.trace(wait)
    try:
        yield ok
    finally:
        if ok:
            _GATE.untrace()


@contextmanager
def sharing(wait: bool = True) -> Iterator[bool]:
    """Around a compile or a compiled graph's call: yields whether it may run (always,
    when `wait`), that is whether no trace runs or waits."""
    ok = _GATE.share(wait)
    try:
        yield ok
    finally:
        if ok:
            _GATE.unshare()


class OwnThread(fx.Tracer):
    """A tracer (mixed in before fx.Tracer or a subclass of it) that traces the calls
    of the thread that made it; other threads' module calls run untouched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread = threading.get_ident()

    def call_module(self, m: nn.Module, forward, args, kwargs) -> Any:
        if threading.get_ident() != self._thread:   # another thread's call: run it
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)
