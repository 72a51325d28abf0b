"""The gate by which a torch.fx trace runs alone in the process while compiles and
compiled graphs' calls share it (capture/tracing.py), on a gate of the test's own."""

from __future__ import annotations

import threading

from hookserve_server.capture.tracing import _Gate


def on_thread(fn) -> list:
    """fn's result, run on a thread of its own (to completion)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert not t.is_alive()
    return out


def test_a_trace_runs_alone_and_sharers_share():
    gate = _Gate()
    assert gate.share(wait=False) and on_thread(lambda: gate.share(wait=False)) == [True]
    assert on_thread(lambda: gate.trace(wait=False)) == [False]   # two sharers in
    gate.unshare()
    gate.unshare()
    assert gate.trace(wait=False) and gate.trace(wait=False)   # re-entrant
    assert on_thread(lambda: gate.share(wait=False)) == [False]
    assert on_thread(lambda: gate.trace(wait=False)) == [False]
    assert gate.share(wait=False)   # the thread that traces may share
    gate.unshare()
    gate.untrace()
    assert on_thread(lambda: gate.share(wait=False)) == [False]   # still traced once
    gate.untrace()
    assert on_thread(lambda: gate.share(wait=False)) == [True]


def test_a_waiting_trace_goes_first_and_keeps_new_sharers_out():
    """A trace that waits for a sharer to leave: meanwhile a new sharer that does not
    wait is refused (it runs eagerly), one that waits gets in after the trace."""
    gate = _Gate()
    assert gate.share(wait=False)
    order: list[str] = []

    def trace() -> None:
        gate.trace(wait=True)
        order.append("trace")
        gate.untrace()

    tracer = threading.Thread(target=trace)
    tracer.start()
    with gate._cond:   # the trace waits (it says so when it starts)
        assert gate._cond.wait_for(lambda: gate._waiting == 1, 60)
    assert on_thread(lambda: gate.share(wait=False)) == [False]
    sharer = threading.Thread(target=lambda: (gate.share(wait=True), order.append("share"),
                                              gate.unshare()))
    sharer.start()
    gate.unshare()   # the first sharer leaves: the trace, then the waiting sharer
    tracer.join(60)
    sharer.join(60)
    assert order == ["trace", "share"]
