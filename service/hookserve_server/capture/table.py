"""The layer table: every hookable layer of a model at an input size, in execution
order, with its output shape and size, and its input's (a forward pre-hook's view).

``"<name>:input"`` names a layer's input (:func:`entry` looks either kind up).

Built by a forward pass on the ``meta`` device (the "verbose execution" recipe: a hook
on every module records outputs), so shapes cost no real compute and never touch the
served model. Tables are cached per input size (LRU).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Container
from dataclasses import dataclass

import torch

from ..architectures import build_meta
from ..errors import InvalidArgument
from ..layouts import layout_of
from ..recent import Recent
from ..spec import DType, Layout
from .node_names import FxNode, fx_nodes
from .reduce import DTYPE_OF_TORCH
from .tracing import tracing

#: Input sizes whose table is kept per model.
CACHED_SIZES = 512
#: Architectures that run at one input size and do not say so themselves (vit's
#: `image_size` does): its side.
FIXED_SIDE = {"maxvit_t": 224}


@dataclass(frozen=True)
class LayerInfo:
    name: str       # the module path, "_k" appended for its k-th call (k > 0)
    module: str
    type: str
    shape: tuple[int, ...]   # per image, no batch dimension
    dtype: DType
    bytes_per_image: int
    order: int
    #: The module's first positional input, per image; () when it is not a tensor.
    input_shape: tuple[int, ...] = ()
    input_bytes: int = 0
    #: How `shape` and `input_shape` are laid out (layouts.py).
    layout: Layout = Layout.CHW
    input_layout: Layout = Layout.UNSPECIFIED


class LayerTable(dict):
    """Layer name -> :class:`LayerInfo`, in execution order. At an input too small for
    the whole model, the rows end before the first module that cannot run, and
    `stopped` says which and why ("" when the whole model ran)."""

    stopped: str = ""

    def past_the_end(self, name: str) -> str:
        """Why layer `name`, which is not in this (stopped) table, cannot be had."""
        last = next(reversed(self))
        return (f"layer {name} cannot be computed: {self.stopped}: send a larger input, "
                f"or ask for a layer before it, such as {last}")


#: Suffix that names a module's input instead of its output ("layer3:input").
INPUT_SUFFIX = ":input"


def split_input_name(name: str) -> tuple[str, bool]:
    """``"layer3:input"`` -> ``("layer3", True)``; ``"layer3"`` -> ``("layer3", False)``."""
    if name.endswith(INPUT_SUFFIX):
        return name[: -len(INPUT_SUFFIX)], True
    return name, False


def entry(table: dict[str, LayerInfo], name: str) -> LayerInfo:
    """The table's row for a layer name; for ``"<layer>:input"`` the row describes the
    input (name, shape and bytes are the input's; order is the layer's)."""
    base, on_input = split_input_name(name)
    li = table.get(base)
    if li is None:
        if getattr(table, "stopped", ""):
            raise InvalidArgument(table.past_the_end(name))
        raise KeyError(name)
    if not on_input:
        return li
    return dataclasses.replace(li, name=name, shape=li.input_shape,
                               bytes_per_image=li.input_bytes, layout=li.input_layout)


def layer_names(table: dict[str, LayerInfo]) -> dict[str, tuple[str, int]]:
    """Every valid layer name -> (module path, call index): outputs, then inputs."""
    names = {n: (li.module, call_index(n, li.module)) for n, li in table.items()}
    names.update({n + INPUT_SUFFIX: (li.module, call_index(n, li.module))
                  for n, li in table.items() if li.input_shape})
    return names


def call_index(name: str, module: str) -> int:
    """Which call of `module` a layer name stands for (``layer1_2`` -> 2)."""
    return 0 if name == module else int(name[len(module) + 1:])


class LayerTables:
    """Layer tables of one architecture, built on a meta-device copy of it."""

    def __init__(self, model_name: str, arch: str, dtype: torch.dtype,
                 num_classes: int | None = None, left_out: tuple[str, ...] = (),
                 transform_input: bool = False, linear_head: str = "") -> None:
        self.model_name = model_name
        self.dtype = dtype
        self._meta = build_meta(arch, num_classes, left_out, transform_input, linear_head)
        #: the one input size the architecture runs at (vit, maxvit), or None
        side = FIXED_SIDE.get(arch) or getattr(self._meta, "image_size", None)
        self.fixed = (side, side) if isinstance(side, int) else None
        self._meta.eval().requires_grad_(False).to(dtype=dtype)
        self._lock = threading.Lock()
        #: (height, width) -> its table, the CACHED_SIZES most recently used
        self._tables: Recent = Recent(CACHED_SIZES)
        #: layer name -> why a module the forward pass calls is not in the tables:
        #: its output (or, for "<name>:input", its input) is not one tensor
        self._not_tensors: dict[str, str] = {}
        #: module path -> its type's name
        self._types = {path: type(m).__name__ for path, m in self._meta.named_modules() if path}
        #: module paths a forward pass called, in the order their first call ended
        self._called: dict[str, None] = {}
        #: torchvision's feature-extraction node names that are no layer (traced once,
        #: by `trace_node_names`, when the model is set up)
        self._fx: dict[str, FxNode] = {}

    def at(self, height: int, width: int) -> LayerTable:
        """Every hookable layer at input HxW, in execution order (cached, LRU); at an
        input too small for the whole model, those before the first module that
        cannot run (:class:`LayerTable`)."""
        key = (int(height), int(width))
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                table = self._dry_run(*key)
                self._tables[key] = table
            return table

    def why_not(self, name: str) -> str | None:
        """Why `name`, a module path (``:input`` or a call suffix allowed) or a node of
        torchvision's feature-extraction graph that is in no table, cannot be captured;
        None when it names neither."""
        base, _ = split_input_name(name)
        with self._lock:
            why, called = self._not_tensors.get(name), base in self._called
            inside = [p for p in self._called if p.startswith(base + ".")]
        if why is not None:
            return why
        if base not in self._types and name in self._fx:
            return self._fx[name].reason(name, self.model_name)
        if base not in self._types or called:
            return None
        if inside:
            first = min(inside, key=lambda p: p.count("."))   # the outermost, first run
            return (f"{base} ({self._types[base]}) is a container the forward pass never "
                    f"calls itself: it calls the modules inside it, such as {first}")
        return (f"{base} is a module of {self.model_name} that its forward pass never "
                "calls (its parent uses its weights directly), so nothing passes "
                "through it to capture")

    def fx_node_names(self) -> list[str]:
        """torchvision's feature-extraction node names that are no layer here, in the
        order of its graph."""
        return list(self._fx)

    def trace_node_names(self, layers: Container[str]) -> None:
        """Find torchvision's node names that are no layer (`layers`: the valid layer
        names), once, when the model is set up (`ServedModel`), before it serves: a
        trace runs alone in the process (capture/tracing.py), so it is not left for a
        request to wait on. The trace comes first, then the lock: a trace may wait, the
        tables must not."""
        with tracing(), self._lock:   # the lock: no dry run of the copy meanwhile
            self._fx = fx_nodes(self._meta, layers)

    def _dry_run(self, height: int, width: int) -> LayerTable:
        if self.fixed and (height, width) != self.fixed:
            raise InvalidArgument(
                f"{self.model_name} runs at {self.fixed[0]}x{self.fixed[1]} only, not "
                f"{height}x{width}: leave the preprocessing at its default, or resize or "
                f"crop to {self.fixed[0]}x{self.fixed[1]}")
        found: list[tuple[str, str, str, torch.Tensor]] = []
        running: list[tuple[str, str, tuple]] = []   # module calls begun, not yet ended
        calls: dict[str, int] = {}
        inputs: dict[str, torch.Tensor] = {}   # layer name -> its input
        # layer name -> (module path, type, what it returned or took, layers found before)
        odd: dict[str, tuple[str, str, str, int]] = {}
        starts: dict[str, int] = {}   # layer name -> layers found before its call
        handles = []
        for path, mod in self._meta.named_modules():
            if not path:
                continue

            def pre_hook(m, args, path=path):
                k = calls.get(path, 0)
                name = path if k == 0 else f"{path}_{k}"
                running.append((name, type(m).__name__, tuple(args[0].shape[1:]) if args
                                and isinstance(args[0], torch.Tensor) else ()))
                if args and isinstance(args[0], torch.Tensor):
                    inputs[name] = args[0]
                    starts[name] = len(found)
                else:
                    what = _what(args[0]) if args else "keyword arguments only"
                    odd[name + INPUT_SUFFIX] = (path, type(m).__name__, what, len(found))

            def hook(m, args, out, path=path):
                running.pop()
                k = calls.get(path, 0)
                calls[path] = k + 1
                name = path if k == 0 else f"{path}_{k}"
                if isinstance(out, torch.Tensor):
                    found.append((name, path, type(m).__name__, out))
                else:
                    odd[name] = (path, type(m).__name__, _what(out), len(found))

            handles.append(mod.register_forward_pre_hook(pre_hook))
            handles.append(mod.register_forward_hook(hook))
        stopped = ""
        try:
            x = torch.empty(1, 3, height, width, device="meta", dtype=self.dtype)
            with torch.inference_mode():
                self._meta(x)
        except (RuntimeError, AssertionError) as exc:  # (torchvision asserts vit's size)
            why = str(exc).strip()[:300]
            if not found or not running:   # not even the first layer: the input is wrong
                raise InvalidArgument(f"input {height}x{width} is too small or invalid for "
                                      f"{self.model_name}: {why}") from None
            name, typ, shape = running[-1]   # the innermost module that failed
            stopped = (f"at input {height}x{width}, {name} ({typ}) of {self.model_name} "
                       f"cannot run on its input of shape [{', '.join(map(str, shape))}] "
                       f"({why})")
        finally:
            for h in handles:
                h.remove()
        table = LayerTable()
        table.stopped = stopped
        for order, (name, path, typ, out) in enumerate(found):
            shape, nbytes = _per_image(out)
            in_shape, in_bytes = _per_image(inputs[name]) if name in inputs else ((), 0)
            table[name] = LayerInfo(name, path, typ, shape,
                                    DTYPE_OF_TORCH.get(out.dtype, DType.FLOAT32),
                                    nbytes, order, in_shape, in_bytes,
                                    layout_of(shape, height, width),
                                    layout_of(in_shape, height, width) if in_shape
                                    else Layout.UNSPECIFIED)
        reasons = {name: _why(name, path, typ, what, found[before:])
                   for name, (path, typ, what, before) in odd.items()}
        for name, (_, typ, what, _) in odd.items():
            if name in inputs:   # a tensor in, something else out: neither is a layer
                ran = found[starts[name] - 1][0] if starts[name] else None
                reasons[name + INPUT_SUFFIX] = (
                    f"{name} ({typ}) returns {what}, so neither its output nor its "
                    "input is a layer" + (f"; its input is the output of the layer that "
                                          f"ran before it, {ran}" if ran else ""))
        self._not_tensors.update(reasons)   # (`at` holds the lock)
        self._called.update(dict.fromkeys(calls))
        return table


def _what(value) -> str:
    """A short description of a value that is not one tensor ("a tuple (tensor, None)")."""
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        if value and all(isinstance(v, torch.Tensor) for v in value):
            return f"a {kind} of {len(value)} tensor{'s' if len(value) > 1 else ''}"
        items = ["tensor" if isinstance(v, torch.Tensor) else
                 "None" if v is None else type(v).__name__ for v in value[:4]]
        return f"a {kind} ({', '.join(items)}{', ...' if len(value) > 4 else ''})"
    return "None" if value is None else f"a {type(value).__name__}"


def _why(name: str, path: str, typ: str, what: str, after: list) -> str:
    """Why a module call is not a layer, and the layer to ask for instead: for an
    output, the next layer to run; for an input, the first layer inside the module
    (its input is usually what the module made of the one it was given)."""
    base, on_input = split_input_name(name)
    if on_input:
        inner = next((n for n, p, _, _ in after if p.startswith(path + ".")), None)
        hint = f"; ask for a layer inside it, such as {inner}{INPUT_SUFFIX}" if inner else ""
        return f"{base} ({typ}) takes {what} as its input, not one tensor{hint}"
    hint = (f"; ask for the layer that takes what it returns: the next one to run is "
            f"{after[0][0]}" if after else "")
    return f"{base} ({typ}) returns {what}, not one tensor{hint}"


def _per_image(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(shape, bytes) of one image of a batch tensor."""
    shape = tuple(int(s) for s in t.shape[1:])
    n = 1
    for s in shape:
        n *= s
    return shape, n * t.element_size()
