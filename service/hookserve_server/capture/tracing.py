"""torch.fx tracing inside a serving process.

While torch.fx traces, it replaces ``nn.Module.__call__`` and ``__getattr__`` for the
whole process. Left as they are, a module called on any other thread meanwhile (a
layer table's meta dry run for DescribeModel or a new input size, another device's
forward pass) would go to the tracer and fail with "module is not installed as a
submodule". So hookserve's tracers (`OwnThread`) record only the calls of the thread
that traces, and the others run as if no trace were on. And a trace holds `TRACING`,
which the engine also holds while it compiles: traces run one at a time in the process
(two nested replacements, undone out of order, would leave one in place), and never
beside a compile (torch.compile would trace into the replaced call and break its graph
there).
"""

from __future__ import annotations

import threading
from typing import Any

from torch import fx, nn

#: Held while a graph is traced or compiled, by one thread of the process at a time.
TRACING = threading.RLock()


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
