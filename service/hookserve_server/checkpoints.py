"""Weights files as users save them: a state_dict read without running code from the
file, normalised, its classifier head's size read off, and checked against the model.

- The file is read without running code from it (`weights_file.read_file`:
  safetensors, or ``torch.load(weights_only=True)``, its archive's checksums checked).
- A training checkpoint that nests the state_dict (``{"state_dict": ...}``,
  ``{"model": ...}``, ``{"model_state_dict": ...}``) is unwrapped, torchvision's
  reference scripts' (``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``, the
  args an ``argparse.Namespace``) included. Keys under a prefix
  are found by the architecture's own key names (`under_prefix`): ``module.``
  ((Distributed)DataParallel), ``_orig_mod.`` (``torch.compile``), a Lightning
  module's attribute (``model.``, ``net.``), or several of these; keys outside that
  prefix (a loss's weights, say) are left out, and logged, but a head beside a
  headless backbone (`lone_head`). Two copies of the model
  under two prefixes (a teacher and a student) are refused: which one is meant is
  the user's to say.
- The number of classes comes from the checkpoint's head (`head_classes`): the model
  is built with that many outputs, so a fine-tuned head loads, or without a head when
  the file holds none; the backbone must match, and a head of another shape is named
  as such (`load_into`). Module versions a file lacks (safetensors keeps none) are the
  current code's, and so is batch norm's step counter (``num_batches_tracked``, which
  checkpoints of older torch lack; evaluation never reads it).
- A pickled whole model is refused with one line that says how to save a state_dict.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from .errors import ConfigError
from .weights_file import SAVE_HINT, read_file

log = logging.getLogger(__name__)

#: Keys under which training scripts nest the state_dict, tried in this order.
NESTED_KEYS = ("state_dict", "model_state_dict", "model",
               # an exponential moving average alone (torchvision's reference scripts,
               # timm): served when the file holds no plain weights beside it
               "model_ema", "state_dict_ema", "ema_state_dict", "ema")
#: The buffer batch norm counts its training steps in, which a file may lack.
BN_COUNTER = ".num_batches_tracked"
#: How many dot-separated parts a prefix (`under_prefix`) may have.
PREFIX_DEPTH = 3


class HeadSlot(NamedTuple):
    """Where an architecture's head ends: its last Linear's state_dict keys and the
    features it reads (`architectures.head_slot`); the container that Linear ends (a
    classifier of more layers), if any, and the features its first Linear reads, which
    a Linear fine-tuned in place of the whole container reads too."""
    weight: str
    bias: str
    in_features: int
    container: str = ""
    container_in: int = 0


def lone_head(own: Collection[str], outside: dict[str, torch.Tensor],
              slot: HeadSlot | None) -> dict[str, str]:
    """{key: the head key it is} when the tensors `outside` the model's `own` keys hold
    one Linear (a weight, and maybe a bias) that reads the head's features, and `own`
    holds no head; else {}. A Linear that reads what the head's container reads, when
    `own` holds none of that container, takes the container's place (the keys
    ``classifier.weight`` and ``.bias``, as a file fine-tuned so holds them). Beside
    it may lie scalars and vectors of one value a class
    of other modules (a loss's class weights), not any other layer: no vector over the
    features (a norm before the Linear), nor anything of a module that holds it (a
    Sequential head of more layers is not one Linear)."""
    if slot is None or slot.weight in own:
        return {}
    fits = {slot.in_features}
    if slot.container_in and not any(k.startswith(slot.container + ".") for k in own):
        fits.add(slot.container_in)   # (the whole container left out: Identity)
    modules = {k.rsplit(".", 1)[0] for k, v in outside.items()
               if k.endswith(".weight") and v.ndim == 2 and v.shape[1] in fits}
    if len(modules) != 1:
        return {}
    (module,) = modules
    weight, bias = outside[f"{module}.weight"], outside.get(f"{module}.bias")
    if weight.shape[1] != slot.in_features:   # in place of the container: `linear_head`
        slot = slot._replace(weight=f"{slot.container}.weight",
                             bias=f"{slot.container}.bias")
    parent = module.rpartition(".")[0]
    others = set(outside) - {f"{module}.weight", f"{module}.bias"}
    per_class = (weight.shape[0],)
    if ((bias is not None and tuple(bias.shape) != per_class)
            or any(outside[k].ndim > 0 and tuple(outside[k].shape) != per_class
                   or (parent and k.startswith(parent + ".")) for k in others)):
        return {}
    return {f"{module}.weight": slot.weight,
            **({f"{module}.bias": slot.bias} if bias is not None else {})}


def _holds_weights(obj: object, depth: int = 3) -> bool:
    """A state_dict, or a dict that nests one under NESTED_KEYS (up to `depth` down)."""
    return _is_tensor_dict(obj) or depth > 0 and isinstance(obj, dict) and any(
        _holds_weights(obj.get(k), depth - 1) for k in NESTED_KEYS)


def _is_tensor_dict(obj: object) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def normalise(obj: object, path: Path, keys: Collection[str] = (),
              slot: HeadSlot | None = None) -> dict[str, torch.Tensor]:
    """The state_dict in what a file held: unnested, and, given the architecture's
    own `keys`, the part of it under the prefix that holds them (`under_prefix`),
    with a lone head beside it that fits `slot`."""
    for _ in range(3):   # ({"state_dict": {"model": ...}}: nested more than once)
        if not isinstance(obj, dict) or _is_tensor_dict(obj):
            break
        # (in NESTED_KEYS' order: plain weights two levels down before an EMA one down)
        inner = next((obj[k] for k in NESTED_KEYS if _holds_weights(obj.get(k))), None)
        if inner is None:
            break
        obj = inner
    if _is_tensor_dict(obj) and any("._orig_mod." in k for k in obj):
        # a torch.compile'd submodule (model.features = torch.compile(model.features))
        obj = type(obj)((k.replace("._orig_mod.", "."), v) for k, v in obj.items())
    quantized = _quantized(obj)
    if quantized:
        raise ConfigError(f"weights file {path} holds quantized (or quantization-aware) "
                          f"weights ({quantized!r}), which hookserve does not serve: save the "
                          "float model's state_dict, before prepare/convert")
    if not _is_tensor_dict(obj):
        raise ConfigError(f"weights file {path} holds {_held(obj)}; it is not a state_dict "
                          f"(a dict of tensors): {SAVE_HINT}")
    return under_prefix(obj, frozenset(keys), path, slot) if keys else obj


#: Key parts that only quantized or quantization-aware (QAT) models' state_dicts hold.
_QUANTIZED = ("_packed_params", "activation_post_process", "weight_fake_quant",
              ".zero_point")


def _quantized(obj) -> str:
    """A key that shows `obj` to be a quantized model's state_dict, or ""."""
    if not isinstance(obj, dict):
        return ""
    return next((k for k in obj if isinstance(k, str) and any(q in k for q in _QUANTIZED)),
                "")


def _held(obj) -> str:
    """What a weights file held instead of a state_dict, naming what to change: the
    key that holds the tensors, or the entry that is no tensor."""
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    if not obj:
        return "an empty dict"
    inner = [k for k, v in obj.items() if isinstance(v, dict) and v
             and sum(isinstance(t, torch.Tensor) for t in v.values()) > len(v) // 2]
    if inner:
        return (f"a dict whose {inner[0]!r} holds the weights (with other entries): save "
                f"that dict alone")
    odd = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if odd and len(odd) < len(obj):
        return f"a dict of tensors with {odd[0]!r}, which is no tensor: drop it"
    return f"a dict with keys {', '.join(map(repr, list(obj)[:5]))}"


def under_prefix(sd: dict[str, torch.Tensor], keys: frozenset[str], path: Path,
                 slot: HeadSlot | None = None) -> dict[str, torch.Tensor]:
    """`sd` with the prefix dropped under which most of its keys are the architecture's
    `keys` (up to PREFIX_DEPTH parts: ``module.``, ``model.``, ``module._orig_mod.``);
    `sd` itself when its own keys are as good. Keys outside the prefix are left out
    and logged, but a `lone_head` that fits `slot`, kept as the head; two prefixes
    that hold as many (two copies of the model) are refused. A checkpoint of another
    architecture matches nothing and is returned as it is, for `load_into` to
    report."""
    counts: dict[str, int] = {"": sum(1 for k in sd if k in keys)}
    for k in sd:
        parts = k.split(".")
        for i in range(1, min(len(parts), PREFIX_DEPTH + 1)):
            prefix = ".".join(parts[:i]) + "."
            if k[len(prefix):] in keys:
                counts[prefix] = counts.get(prefix, 0) + 1
    prefix = max(counts, key=lambda p: (counts[p], -len(p)))
    if counts[prefix] == 0:
        return sd
    if not prefix:   # the model's own keys, maybe with a head of its own beside them
        outside = {k: v for k, v in sd.items() if k not in keys}
        roots = {k.split(".", 1)[0] for k in keys}
        if any(k.split(".", 1)[0] in roots for k in outside):
            return sd   # the model's own layers reshaped (a head of another shape)
        head = lone_head(sd, outside, slot)
        if not head:
            return sd
        return _with_head({k: v for k, v in sd.items() if k in keys or k in head}, head,
                          path, [k for k in outside if k not in head])
    rivals = sorted(p for p in counts if counts[p] == counts[prefix])
    if len(rivals) > 1:   # two copies of the model (a teacher and a student, an EMA)
        raise ConfigError(
            f"weights file {path} holds the model's weights under {len(rivals)} prefixes "
            f"({', '.join(rivals)}), and which one to serve is not clear: save that one "
            f"alone, e.g. torch.save(model.{rivals[0].rstrip('.')}.state_dict(), PATH)")
    kept = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    left = [k for k in sd if not k.startswith(prefix)]
    head = lone_head(kept, {k: sd[k] for k in left}, slot)
    if head:
        return _with_head({**kept, **{k: sd[k] for k in head}}, head, path,
                          [k for k in left if k not in head])
    if left:
        log.info("weights file %s: the model's weights are under %r; %d other keys left "
                 "out (e.g. %s)", path, prefix, len(left), ", ".join(left[:3]))
    return kept


def _with_head(sd: dict[str, torch.Tensor], head: dict[str, str], path: Path,
               left: list[str]) -> dict[str, torch.Tensor]:
    """`sd` with the `lone_head` keys renamed to the head's (the `left` ones out)."""
    log.warning("weights file %s: %s, beside a backbone without its head, served as its "
                "classifier head (%s); if it is no classifier (a projection), save the "
                "backbone alone%s", path, ", ".join(head), ", ".join(head.values()),
                f"; {len(left)} other keys left out ({', '.join(left[:3])})" if left else "")
    return {head.get(k, k): v for k, v in sd.items()}


def read_state_dict(path: Path, arch: str, keys: Collection[str] = (),
                    slot: HeadSlot | None = None) -> dict[str, torch.Tensor]:
    """The state_dict in a weights file (`normalise`d with the architecture's own
    `keys` and its head's `slot`); ConfigError in one line."""
    if path.is_dir():
        raise ConfigError(f"weights file {path} is a folder (for model {arch}): name the "
                          "file in it")
    if not path.is_file():
        raise ConfigError(f"weights file {path} does not exist (for model {arch})")
    return normalise(read_file(path), path, keys, slot)


def head_keys(model: nn.Module, num_classes: int) -> list[str]:
    """The state_dict keys of the layers whose outputs are the classes: every Linear
    (or 1x1 Conv2d, as in squeezenet) with `num_classes` outputs, the last one last."""
    keys = []
    for path, mod in model.named_modules():
        out = (mod.out_features if isinstance(mod, nn.Linear)
               else mod.out_channels if isinstance(mod, nn.Conv2d) else None)
        if out == num_classes:
            keys += [f"{path}.{name}" for name, _ in mod.named_parameters(recurse=False)]
    return keys


def head_classes(sd: dict[str, torch.Tensor], keys: list[str]) -> int | None:
    """The number of classes of a checkpoint: the leading size of its last head weight
    (`head_keys` of the architecture); None when the checkpoint has no such key."""
    weights = [k for k in keys if k.endswith(".weight") and k in sd and sd[k].ndim >= 1]
    return int(sd[weights[-1]].shape[0]) if weights else None


def head_modules(keys) -> tuple[str, ...]:
    """The module paths of a head's state_dict keys."""
    return tuple(sorted({k.rsplit(".", 1)[0] for k in keys}))


def _head_mismatch(missing: list[str], unexpected: list[str], head: Collection[str],
                   arch: str) -> str | None:
    """Whether only the classifier differs from the architecture's: a head of another
    shape, said in one line; else None."""
    modules = head_modules(head)
    # the head's layers, and the container they sit in (``classifier``, which a file may
    # hold as other layers: ``classifier.weight`` of a Linear put in its place)
    within = {*modules, *(m.rsplit(".", 1)[0] for m in modules if "." in m)}
    if unexpected and all(k in head or any(k.startswith(m + ".") for m in within)
                          for k in missing) and all(
            any(k.startswith(m + ".") for m in within) for k in unexpected):
        return (f"its classifier head ({', '.join(unexpected[:4])}) is not torchvision's "
                f"{arch} head ({', '.join(head)}), and a head of another shape (an "
                "nn.Sequential, say) cannot be rebuilt from its weights: save the model with "
                "torchvision's head, or without a head to serve the backbone's features")
    return None


def classifier_left_out(own: Collection[str], sd: dict, head: tuple[str, ...]
                        ) -> tuple[str, ...]:
    """(the classifier,) when a file without a head holds none of the container its
    head sits in (``model.classifier = nn.Identity()`` on a mobilenet or a vgg, whose
    classifier has hidden layers too), else (): `own` is the architecture's state_dict
    keys without its head's, `head` the head's module paths."""
    parents = {m.rsplit(".", 1)[0] for m in head if "." in m}
    if len(parents) != 1:
        return ()
    (parent,) = parents
    inside = parent + "."
    if any(k.startswith(inside) for k in own) and not any(k.startswith(inside) for k in sd):
        return (parent,)
    return ()


def linear_head(model: nn.Module, sd: dict, head: tuple[str, ...]) -> str:
    """The container of the head (``classifier``) when the file holds it as one
    Linear (``classifier.weight`` and ``.bias``, nothing inside it), as
    ``model.classifier = nn.Linear(...)`` fine-tunes a mobilenet, an efficientnet or a
    vgg; else "". Only a container whose first layer is its first Linear (dropout
    aside) can be: it is then fed what that Linear was, so the file's Linear is served
    in its place. `head` is the head's module paths."""
    parents = {m.rsplit(".", 1)[0] for m in head if "." in m}
    if len(parents) != 1:
        return ""
    (parent,) = parents
    weight = sd.get(f"{parent}.weight")
    own = {f"{parent}.weight", f"{parent}.bias"}
    if getattr(weight, "ndim", 0) != 2 or any(k.startswith(parent + ".") and k not in own
                                              for k in sd):
        return ""
    container = model.get_submodule(parent)
    for m in container.children():
        if isinstance(m, nn.Linear):
            return parent if m.in_features == weight.shape[1] else ""
        if not isinstance(m, nn.Dropout):
            return ""
    return ""


def _reparametrized(unexpected: list[str]) -> str | None:
    """Why keys of a pruned or reparametrized module do not load, said with the fix."""
    # ("_orig" and "_mask" are both five characters)
    bases = {k[:-5] for k in unexpected if k.endswith("_orig") and k[:-5] + "_mask" in unexpected}
    if pruned := [k for k in unexpected if k.endswith(("_orig", "_mask")) and k[:-5] in bases]:
        return ("it holds pruned weights (" + ", ".join(pruned[:2]) + "): make the "
                "pruning permanent before saving, torch.nn.utils.prune.remove(module, "
                "'weight') for each pruned module")
    if norm := [k for k in unexpected if k.endswith("_g") and k[:-2] + "_v" in unexpected]:
        return ("it holds weight-normalised weights (" + ", ".join(
            [norm[0], norm[0][:-2] + "_v"]) + "): torch.nn.utils.remove_weight_norm(module) "
                "for each such module before saving")
    if kept := [k for k in unexpected if ".parametrizations." in k and ".original" in k]:
        return ("it holds reparametrized weights (" + ", ".join(kept[:2]) + "): "
                "remove the parametrization before saving, torch.nn.utils.parametrize."
                "remove_parametrizations(module, 'weight')")
    return None


def _completed(sd: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
               ) -> collections.OrderedDict:
    """`sd` with what a file may lack taken from the model's own state_dict `own`:
    batch norm's step counters (older torch saved none; evaluation never reads them)
    and the module versions (lost when keys were renamed; safetensors keeps none)."""
    out = collections.OrderedDict(sd)
    out.update((k, own[k]) for k in own if k.endswith(BN_COUNTER) and k not in sd)
    out._metadata = (getattr(sd, "_metadata", None)  # type: ignore[attr-defined]
                     or getattr(own, "_metadata", None))
    return out


def load_into(model: nn.Module, sd: dict[str, torch.Tensor], where: str, arch: str,
              head: Collection[str] = ()) -> None:
    """Load `sd` strictly, or raise one line naming what does not match (`head`: the
    architecture's head keys, to say so when only the head differs)."""
    own = model.state_dict()
    sd = _completed(sd, own)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    wrong = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}"
             for k in own if k in sd and sd[k].shape != own[k].shape]
    why = _reparametrized(unexpected) or (
        None if wrong else _head_mismatch(missing, unexpected, head, arch))
    if why:
        raise ConfigError(f"{where}: {why}")
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatches (e.g. {'; '.join(wrong[:3])})")
        raise ConfigError(
            f"{where} does not match architecture {arch}: " + "; ".join(parts)
            + ". Is it the state_dict of a torchvision " + arch + "?"
        )
    cast = next((k for k, t in own.items()
                 if t.is_floating_point() and not sd[k].is_floating_point()), None)
    if cast is not None:   # load_state_dict would cast it: served, but not as trained
        raise ConfigError(f"{where}: {cast} holds {str(sd[cast].dtype).removeprefix('torch.')} "
                          f"values where {arch}'s are floating point: save the float "
                          "model's state_dict (an integer or complex copy is not its "
                          "weights)")
    try:
        model.load_state_dict(sd, strict=True)
    except Exception as exc:   # a module's own checks (versions, say)
        raise ConfigError(f"{where} could not be loaded into {arch}: "
                          + " ".join(str(exc).split())) from None
    # a NaN anywhere; an infinity in the weights and batch norm's statistics (a buffer
    # may hold one on purpose: an attention mask's -inf)
    weights = {k for k, _ in model.named_parameters()} | {
        k for k, _ in model.named_buffers() if k.endswith(("running_mean", "running_var"))}
    bad = next((k for k, t in model.state_dict().items() if t.is_floating_point() and (
        bool(torch.isnan(t).any()) or k in weights and not bool(torch.isfinite(t).all()))),
        None)
    if bad is not None:   # every answer would be NaN
        raise ConfigError(f"{where}: {bad} holds NaN or infinite values (a training run "
                          "that diverged?): save weights from before that")
