"""`hookserve serve` with timing probes, for bench/stages.py (one image in flight).

    python bench/trace_server.py TRACE.jsonl serve --port 0 ...   # any serve flags

Wraps a few of the server's own functions (no change to the server) and appends one
JSON line per Extract or ExtractImage call to TRACE.jsonl: [[probe, time.perf_counter()], ...]. On
Linux perf_counter is CLOCK_MONOTONIC, the same clock in every process, so the
client's timestamps line up with these. Probes that no longer exist (the server was
refactored) are skipped and listed on stderr.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import sys
import threading
import time

OUT = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
_lock = threading.Lock()
_current: list = []


def mark(name: str) -> None:
    _current.append((name, time.perf_counter()))


def _wrap(module: str, attr: str, before: str | None, after: str | None) -> bool:
    """Mark `before` on entry and `after` on return of module.attr ("Class.method")."""
    try:
        mod = importlib.import_module(module)
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(mod, owner_name) if owner_name else mod
        fn = getattr(owner, name)
    except (ImportError, AttributeError):
        print(f"trace_server: no probe {module}.{attr}", file=sys.stderr)
        return False
    if inspect.isgeneratorfunction(inspect.unwrap(fn)):
        @functools.wraps(fn)
        def gen(*a, **kw):
            if before:
                mark(before)
            for x in fn(*a, **kw):
                if after:
                    mark(after)
                yield x
    else:
        @functools.wraps(fn)
        def gen(*a, **kw):
            if before:
                mark(before)
            try:
                return fn(*a, **kw)
            finally:
                if after:
                    mark(after)
    setattr(owner, name, gen)
    return True


def _wrap_calls() -> None:
    """Extract and ExtractImage: mark the call's start, its last message handed to gRPC
    ("answer_out") and its end; write the call's marks as one line."""
    from hookserve_server.servicer import Servicer

    def traced(fn):
        @functools.wraps(fn)
        def call(self, request, context):
            global _current
            with _lock:
                _current = mine = [("call_start", time.perf_counter())]
            last = None
            try:
                for msg in fn(self, request, context):
                    yield msg
                    last = time.perf_counter()
            finally:
                if last is not None:
                    mine.append(("answer_out", last))
                mine.append(("call_end", time.perf_counter()))
                OUT.write(json.dumps(mine) + "\n")
        return call

    Servicer.Extract = traced(Servicer.Extract)
    Servicer.ExtractImage = traced(Servicer.ExtractImage)


PROBES = [  # (module, attribute, mark on entry, mark on each return/yield)
    ("hookserve_server.wire", "requests", None, "request_parsed"),
    ("hookserve_server.wire", "image_request", None, "request_parsed"),
    ("hookserve_server.engine.session", "Session._read", "reader_start", None),
    ("hookserve_server.engine.prepare", "Preparer.submit", "submit", None),
    ("hookserve_server.engine.prepare", "Preparer._prepare", "prepare_start", "prepare_end"),
    ("hookserve_server.engine.queue", "BatchQueue.next_batch", None, "batch_taken"),
    ("hookserve_server.engine.extract", "_forward", "forward_start", "forward_end"),
    ("hookserve_server.engine.extract", "stack_inputs", None, "stacked"),
    ("hookserve_server.engine.compiled", "to_bucket", None, "graph_start"),
    ("hookserve_server.engine.prepare", "decode", "dec_start", "dec_end"),
    ("hookserve_server.engine.prepare", "apply_geometry", "geo_start", "geo_end"),
    ("hookserve_server.engine.compiled", "reduce", "graph_end", None),
    ("hookserve_server.engine.extract", "layer_output", "completer", None),
    ("hookserve_server.engine.session", "Session.run", None, "result_seen"),
    ("hookserve_server.engine.session", "Session.run_one", None, "result_seen"),
    ("hookserve_server.wire", "tensor_messages", "encode_start", "encoded"),
]

if __name__ == "__main__":
    for probe in PROBES:
        _wrap(*probe)
    _wrap_calls()
    from hookserve.cli import main

    sys.exit(main(sys.argv[2:]))
