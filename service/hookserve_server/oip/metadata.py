"""What OIP clients discover: server and model metadata, model configuration, ready
models, as plain dicts (the gRPC and REST adapters encode them). Each served model
`m` is also `m.<method>` for each attribution method.

Outputs of a model are its layers, each with its shape at the default input size;
-1 stands for the batch (N) and for any size that follows the image.
"""

from __future__ import annotations

from importlib import metadata as _dist
from typing import TYPE_CHECKING

from ..attribution_spec import Method
from .attribution import OUTPUTS as ATTRIBUTION_OUTPUTS
from .attribution import TARGET, map_rank
from .infer import VERSION
from .request import DEFAULT_DTYPE, IMAGE, PIXELS
from .tensors import DATATYPES

if TYPE_CHECKING:
    from ..engine import Engine

#: The protocol extensions this server supports.
EXTENSIONS = ("classification", "binary_tensor_data", "model_configuration",
              "statistics")
PLATFORM = "hookserve_pytorch"
#: Triton's extensions hookserve does not have: their REST route prefix, their gRPC
#: methods, what they are, and what to do instead (REST 501, gRPC UNIMPLEMENTED).
UNSUPPORTED = (
    ("/v2/repository", ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
     "the model repository (load, unload, index)",
     "it serves the models it was started with (--model, --models)"),
    ("/v2/systemsharedmemory", ("SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
                                "SystemSharedMemoryUnregister"),
     "system shared memory", "send tensors in the request"),
    ("/v2/cudasharedmemory", ("CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
                              "CudaSharedMemoryUnregister"),
     "CUDA shared memory", "send tensors in the request"),
    ("/v2/trace", ("TraceSetting",), "trace settings",
     "its call log is on stderr (--log-level)"),
    ("/v2/logging", ("LogSettings",), "log settings",
     "set --log-level and --log-format at start-up"))


def unsupported(what: str, instead: str) -> str:
    return f"hookserve does not support {what}: {instead}"


#: What an output answers when its request names no dtype.
DEFAULT_DATATYPE = DATATYPES[DEFAULT_DTYPE]
INPUTS = [{"name": IMAGE, "datatype": "BYTES", "shape": [-1]},
          {"name": PIXELS, "datatype": "UINT8", "shape": [-1, -1, -1, 3]}]


def server_version() -> str:
    try:
        return _dist.version("hookserve")
    except _dist.PackageNotFoundError:
        return "0"


def server_metadata() -> dict:
    return {"name": "hookserve", "version": server_version(),
            "extensions": list(EXTENSIONS)}


def model_names(engine: Engine) -> list[str]:
    """Every name a request may use: each model, then `<model>.<method>`."""
    return [*engine.models, *(f"{m}.{meth.label}" for m in engine.models
                              for meth in Method)]


def model_metadata(engine: Engine, name: str) -> dict:
    """A model's inputs and outputs (`name` as `Inference.served_name` spells it: a
    served model, or ``<model>.<method>``). Each output's datatype is the one a request
    gets by default (FP32: the `dtype` output parameter's default), whatever the
    model computes in."""
    base, method = (name, "") if name in engine.models else name.rpartition(".")[::2]
    m = engine.get_model(base)
    if method:
        per_map = [-1, -1] if map_rank(Method[method.upper()]) == 2 else [3, -1, -1]
        outputs = [{"name": "map", "datatype": "FP32", "shape": [-1, -1, *per_map]},
                   {"name": "logits", "datatype": "FP32", "shape": [-1, -1]},
                   {"name": "top5", "datatype": "BYTES", "shape": [-1, 5]}]
        assert [o["name"] for o in outputs] == list(ATTRIBUTION_OUTPUTS)
        inputs = [*INPUTS, {"name": TARGET, "datatype": "INT64", "shape": [-1]}]
    else:
        table = m.layer_table(*m.defaults.crop)
        outputs = [{"name": li.name, "datatype": DEFAULT_DATATYPE, "shape": [-1, *li.shape]}
                   for li in table.values()]
        inputs = list(INPUTS)
    return {"name": name, "versions": [VERSION], "platform": PLATFORM,
            "inputs": inputs, "outputs": outputs}
