"""torchvision's feature-extraction node names that are no layer here, and the layer
that holds the same values.

Users of ``torchvision.models.feature_extraction`` name what they extract by the nodes
of its graph (`get_graph_node_names`, `create_feature_extractor`). For every module
call that name is hookserve's layer name too (``layer1.0.relu_1``, the second call of
``layer1.0.relu``, in both). The other nodes are what a forward pass does between
module calls: the input ``x``, ``torch.flatten``, a residual ``+``, ``torch.cat``, a
shape lookup. No hook sees them, but many hold what a layer holds:

- the value a module returns (googlenet's ``inception3a.branch1.relu``, an ``F.relu``
  at the end of a block, is what ``inception3a.branch1`` returns);
- the value a module is called with (``flatten`` is ``fc:input``, resnet's
  ``layer1.0.add`` is ``layer1.0.relu_1:input``, ``x`` is ``conv1:input``).

`fx_nodes` traces the model once with torchvision's own tracer (on the meta device
copy the layer tables use) and says, for each such node, which layer it equals. A
value changed in place after it was made (``F.relu(t, inplace=True)``, ``t.add_(u)``)
is not matched, with one exception: a module that changes its input in place
(``ReLU(inplace=True)`` after a residual sum). Its input holds the value as made; its
output holds it changed, which is what torchvision's extractor returns for the node
whenever it also computes a later node (alone, it prunes the module away).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from .tracing import OwnThread, tracing

log = logging.getLogger("hookserve.models")

@dataclass(frozen=True)
class FxNode:
    """A node of torchvision's feature-extraction graph that is no layer here."""

    what: str                 # "the model's input", "torch.flatten", "Tensor.view", ...
    same_as: str | None       # the layer holding the same values, if one does
    #: where a module that changes its input in place (ReLU(inplace=True)) takes the
    #: node's value: that module's call, which holds what torchvision's extractor
    #: returns for the node whenever it also computes a later one (alone, it prunes
    #: the module away and returns the value as made)
    returned: str | None = None
    #: a module call that torchvision names otherwise (`same_as` is hookserve's name)
    renamed: bool = False

    def reason(self, name: str, model: str) -> str:
        """Why `name` is no layer of `model`, and the layer to ask for instead."""
        if self.renamed:
            return (f"{name} is torchvision's feature-extraction name for the layer "
                    f"{self.same_as} (torchvision renumbers modules whose own names end "
                    "in _<number>; hookserve keeps the module's name)")
        head = (f"{name} is {self.what} in {model}'s forward pass, a node of "
                "torchvision's feature-extraction graph but not a module call, so no hook "
                "sees it")
        if self.same_as is None:
            return head + ", and no layer holds its values"
        return f"{head}; the layer {self.same_as} holds its values" + (
            f", and the layer {self.returned}, an in-place module that takes them, holds "
            "them changed: torchvision's extractor returns those whenever it also "
            "computes a later node" if self.returned else "")

def fx_nodes(meta: nn.Module, layers: Container[str]) -> dict[str, FxNode]:
    """Node name -> FxNode for every node of `meta`'s eval-mode graph whose name is not
    in `layers` (the valid layer names, ``:input`` ones included). Empty when the
    model cannot be traced (some timm models)."""
    try:
        from torchvision.models.feature_extraction import (
            NodePathTracer,
            _set_default_tracer_kwargs,
        )
    except ImportError:   # a torchvision without it
        return {}

    class Tracer(OwnThread, NodePathTracer):
        """NodePathTracer, noting which module call returned each value, by hookserve's
        name for the call (a module kept whole returns its own call's node)."""

        def __init__(self) -> None:
            super().__init__(**_set_default_tracer_kwargs(None))
            self.calls: dict[str, int] = {}
            self.returned_by: dict[fx.Node, str] = {}

        def call_module(self, m: nn.Module, forward, args, kwargs) -> Any:
            if m is meta or threading.get_ident() != self._thread:   # OwnThread's
                return super().call_module(m, forward, args, kwargs)
            path = self.path_of_module(m)
            k = self.calls.get(path, 0)
            self.calls[path] = k + 1   # every call, as the layer tables count them
            out = super().call_module(m, forward, args, kwargs)
            if isinstance(out, fx.Proxy):   # the innermost module that returned it
                self.returned_by.setdefault(out.node, _call_name(path, k))
            return out

    tracer = Tracer()
    try:
        with tracing():
            graph = tracer.trace(meta.eval())
    except Exception as exc:   # untraceable control flow: no names to offer
        log.debug("no feature-extraction node names for %s: %s", type(meta).__name__, exc)
        return {}
    names, returned_by = tracer.node_to_qualname, tracer.returned_by
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = {}
    for node in graph.nodes:
        name = names.get(node)
        if name is None or name in layers or node.op in ("get_attr", "output"):
            continue
        if node.op == "call_module":
            if returned_by[node] in layers:
                out[name] = FxNode("a module call", returned_by[node], renamed=True)
            continue
        out[name] = _node(node, meta, layers, returned_by, order)
    return out


def _call_name(path: str, k: int) -> str:
    """hookserve's layer name of the k-th call of the module at `path`."""
    return path if k == 0 else f"{path}_{k}"


def _node(node: fx.Node, meta: nn.Module, layers: Container[str],
          returned_by: dict[fx.Node, str], order: dict) -> FxNode:
    what = _what(node)
    users = sorted(node.users, key=order.__getitem__)
    for u in users:
        if _in_place(u, node, meta):   # changed after it was made
            call = returned_by.get(u)
            if u.op == "call_module" and f"{call}:input" in layers and call in layers:
                return FxNode(what, f"{call}:input", call)
            return FxNode(what, None)
    module = returned_by.get(node)
    if module is not None and module in layers:
        return FxNode(what, module)
    for u in users:
        if u.op == "call_module" and u.args and u.args[0] is node:
            name = f"{returned_by[u]}:input"
            if name in layers:
                return FxNode(what, name)
    return FxNode(what, None)


def _in_place(user: fx.Node, node: fx.Node, meta: nn.Module) -> bool:
    """Whether `user` changes `node`'s value in place (an in-place method or function,
    or a module built with ``inplace=True``)."""
    first = user.args[0] if user.args else None
    if first is not node:
        return False
    if user.op == "call_method":
        return str(user.target).endswith("_") and not str(user.target).endswith("__")
    if user.op == "call_function":   # (fx records `t += u` as an out-of-place add)
        name = getattr(user.target, "__name__", "")
        return (name.endswith("_") and not name.endswith("__")
                or _bound(user).get("inplace") is True)
    if user.op == "call_module":
        return getattr(meta.get_submodule(str(user.target)), "inplace", None) is True
    return False


def _bound(call: fx.Node) -> dict[str, Any]:
    """A function call's arguments by parameter name ({} where that cannot be told)."""
    try:
        return inspect.signature(call.target).bind_partial(*call.args, **call.kwargs).arguments
    except (TypeError, ValueError):
        return dict(call.kwargs)


def _what(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "the model's input"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch") and not module.startswith("torch.nn"):
        return f"torch.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{module}.{name}" if module else name
