"""hookserve: the client SDK for the hookserve feature-extraction service.

    import hookserve
    with hookserve.Client("localhost:50051") as client:
        feats = client.extract("cat.jpg", layers=["layer4"], reduction="avg")

    async with hookserve.aio.Client("localhost:50051") as client:   # asyncio
        feats = await client.extract("cat.jpg", layers=["layer4"], reduction="avg")

Needs only grpcio, protobuf, numpy and pillow (PIL inputs, overlays); no torch.

The public names are imported when first used (`import hookserve` itself loads no
gRPC): the `hookserve` command starts at once, and Ctrl-C while it loads is one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Each public name -> the module of this package that defines it.
_HOMES = {
    **dict.fromkeys(("Client", "Layer", "LayerInfo", "ModelDescription", "ModelInfo",
                     "Result"), "client"),
    **dict.fromkeys(("HookserveError", "InvalidArgument", "NotFound", "ResourceExhausted",
                     "Unavailable", "DeadlineExceeded", "Cancelled", "Unauthenticated",
                     "PermissionDenied", "FailedPrecondition", "Internal"), "errors"),
    **dict.fromkeys(("Attribution", "ClassScore", "MapTarget"), "attribution"),
    "overlay": "overlays", "STATS_COLUMNS": "tables", "bfloat16_to_float32": "tensors",
}

__all__ = [*_HOMES, "aio", "__version__"]


def __getattr__(name: str):
    """A public name (or a module of the package) on first use."""
    home = _HOMES.get(name)
    if home is None:
        try:
            return importlib.import_module(f".{name}", __name__)   # hookserve.aio, ...
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":   # a module it needs is missing
                raise
            raise AttributeError(f"module 'hookserve' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see
    from . import aio  # noqa: F401
    from .attribution import Attribution, ClassScore, MapTarget  # noqa: F401
    from .client import (  # noqa: F401
        Client,
        Layer,
        LayerInfo,
        ModelDescription,
        ModelInfo,
        Result,
    )
    from .errors import (  # noqa: F401
        Cancelled,
        DeadlineExceeded,
        FailedPrecondition,
        HookserveError,
        Internal,
        InvalidArgument,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
    )
    from .overlays import overlay  # noqa: F401
    from .tables import STATS_COLUMNS  # noqa: F401
    from .tensors import bfloat16_to_float32  # noqa: F401
