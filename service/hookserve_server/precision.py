"""`--precision`: the arithmetic a model's Extract forward pass runs in.

fp32 is today's path, untouched: no autocast context at all. bf16 and fp16 run the
forward pass under ``torch.autocast`` with the weights kept in float32: convolutions
and linear layers compute in the lower precision, reductions still accumulate in
float32 (`capture/reduce.py`) and each answer's dtype is the one its request asks for.
This is not ``--dtype``, which casts the weights themselves; the two do not combine.

Where it runs: bf16 on a CPU whose oneDNN has bfloat16 kernels (AVX512-BF16, AMX),
bf16 and fp16 on CUDA. fp16 on a CPU, or bf16 on a CPU without those kernels, is
refused at start-up. The Attribute path keeps float32 (gradients of a lower-precision
forward would need their own tolerances).
"""

from __future__ import annotations

import contextlib
import enum

import torch

from .config import ARCHITECTURES
from .errors import ConfigError


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


#: The autocast dtype of each lower precision.
AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def per_model(models: list[str], specs: list[str], own: dict[str, str] | None = None
              ) -> dict[str, Precision]:
    """`--precision` values -> {model: Precision}: 'P' sets all, 'MODEL=P' one, which
    wins over 'P' in any order (the same model, or every model, given two precisions is
    refused); `own`: a model file's entries (checked by model_file.py), which win over
    the flag."""
    choices = ", ".join(p.value for p in Precision)
    given: dict[str, Precision] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            name, value = "", spec
        try:
            p = Precision(value.strip().lower())
        except ValueError:
            raise ConfigError(f"--precision {spec}: {value!r} is not a precision; choose "
                              f"from {choices} (or MODEL={choices.replace(', ', '|')})") \
                from None
        if name and name not in models:
            known = "a known model" if name in ARCHITECTURES else "an architecture"
            raise ConfigError(f"--precision {spec}: {name} is not among --model "
                              f"{models} ({known})")
        if given.setdefault(name, p) is not p:
            raise ConfigError(f"--precision gives {name or 'every model'} two precisions "
                              f"({given[name].value}, {p.value}): give one")
    out = {m: given.get(m, given.get("", Precision.FP32)) for m in models}
    for m, value in (own or {}).items():
        out[m] = Precision(value.strip().lower())
    return out


def check(precision: Precision, device: torch.device, dtype: str, model: str,
          in_file: str = "") -> None:
    """ConfigError when `precision` cannot run on `device` (or with the dtype), named
    as the operator gave it: flags, or the keys of the model file `in_file`."""
    if precision is Precision.FP32:
        return
    if in_file:
        where = f"--models {in_file}: model {model}: precision = {precision.value!r}"
        keys = ("precision", "dtype = 'float32'", "dtype")
    else:
        where = f"--precision {precision.value} for {model}"
        keys = ("--precision", "--dtype float32", "--dtype")
    if dtype != "float32":
        raise ConfigError(f"{where} needs {keys[1]} ({keys[0]} autocasts float32 weights; "
                          f"{keys[2]} {dtype} casts them): set one of the two")
    if device.type == "cuda":
        if precision is Precision.BF16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{where}: {device} has no bfloat16 support; use fp16")
        return
    if precision is Precision.FP16:
        raise ConfigError(f"{where}: fp16 runs on CUDA devices only; on the CPU use bf16 "
                          "(where the CPU has bfloat16 instructions) or fp32")
    if not cpu_has_bf16():
        raise ConfigError(f"{where}: this CPU has no bfloat16 instructions (AVX512-BF16 "
                          "or AMX) for oneDNN, so bf16 would be slower than fp32; use fp32")


def cpu_has_bf16() -> bool:
    """Whether oneDNN runs bfloat16 convolutions natively on this CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def autocast(precision: Precision, device: torch.device):
    """The context a forward pass runs in: nothing at all for fp32."""
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])
