"""hookserve: the client SDK for the hookserve feature-extraction service.

    import hookserve
    with hookserve.Client("localhost:50051") as client:
        feats = client.extract("cat.jpg", layers=["layer4"], reduction="avg")

    async with hookserve.aio.Client("localhost:50051") as client:   # asyncio
        feats = await client.extract("cat.jpg", layers=["layer4"], reduction="avg")

Needs only grpcio, protobuf, numpy and pillow (PIL inputs, overlays); no torch.
"""

from . import aio
from .attribution import Attribution, ClassScore, MapTarget
from .client import Client, Layer, LayerInfo, ModelDescription, ModelInfo, Result
from .errors import (
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
from .overlay import overlay
from .tables import STATS_COLUMNS
from .tensors import bfloat16_to_float32

__version__ = "0.1.0"

__all__ = [
    "Client", "Layer", "LayerInfo", "ModelDescription", "ModelInfo", "Result",
    "HookserveError", "InvalidArgument", "NotFound", "ResourceExhausted", "Unavailable",
    "DeadlineExceeded", "Cancelled", "Unauthenticated", "PermissionDenied",
    "FailedPrecondition", "Internal", "bfloat16_to_float32", "__version__",
    "Attribution", "ClassScore", "MapTarget", "overlay", "STATS_COLUMNS", "aio",
]
