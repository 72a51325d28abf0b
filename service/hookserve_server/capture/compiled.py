"""The pruned extraction graph of a model for a set of capture points.

The model is traced with torch.fx, with each captured module kept whole (a leaf), so
its call is one node: an OUTPUT point is that node's value, an INPUT point its first
argument; the k-th node calling a module is its k-th call, as in the layer table. The
graph returns a copy of each captured value (taken right after it is made, so a later
in-place ReLU or residual ``+=`` cannot change it, as the eager hooks guarantee), and
everything after the last captured value is dead code, removed: the early stop comes
for free. Reductions stay outside the graph (`capture/reduce.py`, on its outputs), so
one graph serves every reduction, dtype and L2 choice of the same layers.

A point set where one captured module contains another cannot keep both whole; such a
set is not built (`build_graph` returns None) and is served by the eager hooks.

The trace is torch.fx's, made safe beside the serving threads (`capture/tracing.py`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import torch
from torch import fx, nn

from .plan import CapturePoint, Kind
from .tracing import OwnThread, tracing

log = logging.getLogger("hookserve.compile")


class _Tracer(OwnThread):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def nested(paths: set[str]) -> tuple[str, str] | None:
    """A module path and one inside it (the root "" contains all), or None."""
    return next(((a, b) for a in paths for b in paths
                 if a != b and (a == "" or b.startswith(a + "."))), None)


def build_graph(module: nn.Module, points: tuple[CapturePoint, ...]
                ) -> fx.GraphModule | None:
    """A GraphModule whose forward(x) returns one tensor per point, in `points` order;
    None when the points cannot be captured this way (nested modules, a point the
    trace does not reach)."""
    paths = {p.module for p in points}
    if nested(paths) is not None:
        return None
    with tracing():   # (re-entrant: the engine may hold it already)
        graph = _Tracer(paths).trace(module)
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in paths:
            calls.setdefault(node.target, []).append(node)
    sources = []
    for p in points:
        nodes = calls.get(p.module, [])
        if p.call >= len(nodes):
            return None
        node = nodes[p.call]
        src = node if p.kind is Kind.OUTPUT else (node.args[0] if node.args else None)
        if not isinstance(src, fx.Node):
            return None
        sources.append(src)
    copies: dict[fx.Node, fx.Node] = {}
    for src in sources:
        if src not in copies:
            with graph.inserting_after(src):
                copies[src] = graph.call_method("clone", (src,))
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (tuple(copies[s] for s in sources),)
    gm = fx.GraphModule(module, graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


#: Memory a frozen graph holds per byte of the weights it reaches. Measured on a CPU
#: (torch 2.14, inductor, freezing): four resnet50 `layer4` graphs (batch 1, 2, 4, 8;
#: 90 MiB of weights each) added 832 MiB of resident memory, 94 MiB of it the one
#: copy of the model the graphs are traced over: 185 MiB a graph, 2.0 times its
#: weights (freezing keeps the folded weights and oneDNN a packed copy); in bf16,
#: 1.6 times.
FROZEN_COPIES = 2


def graph_bytes(gm: fx.GraphModule, frozen: bool = True) -> int:
    """The memory estimate the compiled-graph cache is bounded by: the weights and
    buffers the graph reaches, `FROZEN_COPIES` times over when it is frozen."""
    used: set[int] = set()
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        for t in (*gm.get_submodule(node.target).parameters(),
                  *gm.get_submodule(node.target).buffers()):
            if id(t) not in used:
                used.add(id(t))
                total += t.numel() * t.element_size()
    return (FROZEN_COPIES if frozen else 1) * total


def bucket(n: int) -> int:
    """The batch bucket of `n` images: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


def split(n: int) -> list[int]:
    """The powers of two that sum to `n`, largest first: 7 -> [4, 2, 1]."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def to_bucket(x: torch.Tensor, rows: int, channels_last: bool) -> torch.Tensor:
    """`x` padded with zero images to `rows` (rows of a batch never mix in eval mode),
    always a new tensor in the layout the graph was compiled for, made under the
    caller's inference mode: torch.compile guards on layout and on whether a tensor
    is an inference tensor, so the compile's input and every batch's must agree."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device,
                      memory_format=fmt)
    n = x.shape[0]
    out[:n].copy_(x)
    if rows > n:
        out[n:].zero_()
    return out


def point_order(p: CapturePoint) -> tuple:
    """The order of a graph's capture points in its key."""
    return (p.module, p.call, p.kind.value)


def point_name(p: CapturePoint) -> str:
    """A capture point as the logs name it (``layer1#1``, ``fc:input``)."""
    return p.module + (f"#{p.call}" if p.call else "") + ":input" * (p.kind is Kind.INPUT)


@contextlib.contextmanager
def loaded_modules(mods: list) -> Iterator[list]:
    """Add to `mods` the Python modules inductor loads meanwhile, when the block ends
    (found by identity: a module freed meanwhile leaves no gap): a frozen graph's
    weights are their attributes. With several devices compiling at once a graph may
    also list another's modules; forgetting those only drops inductor's record."""
    from torch._inductor.codecache import PyCodeCache

    before = {id(m) for m in list(PyCodeCache.modules)}
    try:
        yield mods
    finally:
        mods.extend(m for m in list(PyCodeCache.modules) if id(m) not in before)


def forget_graph(fn, mods: list) -> None:
    """Free a dropped graph: what torch keeps of it process-wide otherwise (dynamo's
    compiled code, kept with the code object of the graph's `forward`; inductor's list
    of every module it loaded, and sys.modules) holds its frozen weights for good.
    Never raises: a graph that cannot be freed is logged and left as it is."""
    try:
        forward = getattr(type(getattr(fn, "_orig_mod", None)), "forward", None)
        code = getattr(forward, "__code__", None)
        reset_code = getattr(torch._dynamo, "reset_code", None)
        if code is not None and reset_code is not None:
            reset_code(code)   # (each graph has its own code object: build_graph)
        if not mods:
            return
        from torch._inductor.codecache import PyCodeCache

        for m in mods:   # one item at a time: a compile elsewhere may be appending
            with contextlib.suppress(ValueError):
                PyCodeCache.modules.remove(m)
        ids = {id(m) for m in mods}
        for path, m in list(PyCodeCache.modules_no_attr.items()):
            if id(m) in ids:
                PyCodeCache.modules_no_attr.pop(path, None)
        for m in mods:
            if sys.modules.get(m.__name__) is m:
                sys.modules.pop(m.__name__, None)
    except Exception as exc:   # torch's internals moved: keep serving
        log.warning("a dropped compiled graph could not be freed: %s: %s",
                    type(exc).__name__, exc)
