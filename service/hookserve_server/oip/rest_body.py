"""The REST routes' bodies: a request's JSON (and the binary-data extension's blobs)
checked field by field into an InferCall, and an answer encoded as JSON (and binary
outputs), held to the server's answer limit as it will be sent.

A request is `{"id", "parameters", "inputs": [{"name", "datatype", "shape",
"parameters", "data"}], "outputs": [{"name", "parameters"}]}`; with the binary-data
extension, `Inference-Header-Content-Length` bytes of that JSON come first, then each
input whose `binary_data_size` parameter is set, in order. BYTES elements in JSON are
strings, or {"b64": "..."} objects for binary data such as images. Every field that
has the wrong JSON type is INVALID_ARGUMENT naming it. No torch.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator

import numpy as np

from ..errors import InvalidArgument, ResourceExhausted
from .infer import VERSION
from .request import (
    MAX_INPUTS,
    InferCall,
    InTensor,
    OutRequest,
    check_input_params,
    distinct_inputs,
    no_shared_memory,
    own_params,
    shown,
    timeout_of,
)
from .tensors import InferAnswer, unpack_bytes

HEADER_LENGTH = "Inference-Header-Content-Length"
_JSON_DTYPES = {"FP32": "<f4", "FP16": "<f2", "INT64": "<i8", "UINT8": "u1"}
_INTEGER_TYPES = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
#: The most bytes one element takes in a JSON answer, separator included (a float32
#: as Python writes it: "-1.2345678901234567e-05, ").
_JSON_ELEMENT_BYTES = {"FP32": 26, "FP16": 26, "BF16": 26, "INT64": 22, "UINT8": 5}
#: Elements encoded at a time: a JSON answer never holds more than this as Python objects.
_CHUNK = 1 << 16


def _kind(v) -> str:
    if isinstance(v, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(v), "a number")


def _object(v, what: str, required: bool = False) -> dict:
    if v is None and not required:
        return {}
    if not isinstance(v, dict):
        raise InvalidArgument(f"{what} must be a JSON object, not {_kind(v)}")
    return v


def _list(v, what: str) -> list:
    if v is None:
        return []
    if not isinstance(v, list):
        raise InvalidArgument(f"{what} must be a JSON list, not {_kind(v)}")
    return v


def _text(v, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise InvalidArgument(f"{what} must be a non-empty string, not "
                              + ("an empty one" if v == "" else _kind(v)))
    return v


def _flag(params: dict, key: str, what: str) -> bool | None:
    v = params.get(key)
    if v is not None and not isinstance(v, bool):
        raise InvalidArgument(f"{what} parameter {key} must be true or false, not {shown(v)}"
                              [:300])
    return v


def _flat(data) -> list:
    out: list = []
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(reversed(x))
        else:
            out.append(x)
    return out


#: How base64 of an image file starts (JPEG, PNG, GIF, WebP, TIFF): a JSON string that
#: does is an image the client forgot to wrap as {"b64": ...}.
_BASE64_IMAGES = ("/9j/", "iVBORw0KGgo", "R0lGOD", "UklGR", "SUkqA", "TU0AK")


def _element(e, name: str) -> bytes:
    if isinstance(e, str):
        if e.startswith(_BASE64_IMAGES):
            raise InvalidArgument(
                f"{name}: an element is a JSON string of base64 (it starts {e[:12]!r}): wrap "
                'it as {"b64": "..."}; a plain string is sent as the bytes themselves')
        try:
            return e.encode()
        except UnicodeEncodeError:   # a lone surrogate, which JSON can escape
            raise InvalidArgument(
                f"{name}: an element is a JSON string that is not valid text (a lone "
                'surrogate escape): send its bytes as {"b64": "..."}') from None
    if isinstance(e, dict) and isinstance(e.get("b64"), str):
        try:
            return base64.b64decode(e["b64"], validate=True)
        except ValueError:
            raise InvalidArgument(f"{name}: an element's b64 is not valid base64") from None
    raise InvalidArgument(f"{name}: BYTES elements are strings or {{\"b64\": \"...\"}}")


def _json_data(data, datatype: str, name: str) -> list:
    """An input's JSON "data" as a flat list, each element checked against its
    datatype; whether the datatype suits the input is request.py's to say."""
    if data is None:
        raise InvalidArgument(f"input {name!r} has no \"data\": send its elements, or "
                              "the binary extension's binary_data_size parameter")
    flat = _flat(_list(data, f"input {name!r}: \"data\""))
    if datatype == "BYTES":
        return [_element(e, name) for e in flat]
    if datatype in _INTEGER_TYPES:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise InvalidArgument(f"input {name!r}: {datatype} data must be integers")
        if datatype == "UINT8" and any(not 0 <= v <= 255 for v in flat):
            raise InvalidArgument(f"input {name!r}: UINT8 data must be 0..255")
        return flat
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise InvalidArgument(f"input {name!r}: {datatype} data must be numbers")
    return flat


def _shape(v, name: str) -> tuple[int, ...]:
    if v is None:
        raise InvalidArgument(f"input {name!r} has no \"shape\": give its dimensions, "
                              "e.g. [1] for one encoded image")
    dims = _list(v, f"input {name!r}: \"shape\"")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InvalidArgument(f"input {name!r}: \"shape\" must be a list of "
                              f"non-negative integers, not {json.dumps(dims)[:100]}")
    return tuple(dims)


def to_call(model: str, version: str, body: bytes, header_length: str | None
            ) -> tuple[InferCall, bool]:
    """A request body as an InferCall, and whether outputs default to binary."""
    try:
        n = int(header_length) if header_length is not None else len(body)
        if not 0 <= n <= len(body):
            raise ValueError
        header = json.loads(bytes(body[:n]))
    except ValueError:
        raise InvalidArgument(f"the request is not JSON (or {HEADER_LENGTH} is not the "
                              "JSON part's length)") from None
    except RecursionError:
        raise InvalidArgument("the request's JSON is nested too deeply") from None
    header = _object(header, "the request", required=True)
    blobs = memoryview(body)[n:]
    pos = 0
    inputs = []
    listed = _list(header.get("inputs"), "\"inputs\"")
    if len(listed) > MAX_INPUTS:   # (counted before each is read)
        distinct_inputs([f"input {i}" for i in range(len(listed))])
    for i, t in enumerate(listed):
        t = _object(t, f"inputs[{i}]", required=True)
        name = _text(t.get("name"), f"inputs[{i}]: \"name\"")[:100]
        datatype = t.get("datatype")
        if not isinstance(datatype, str) or not datatype:
            what = ("has no \"datatype\"" if datatype in (None, "") else
                    f"has a \"datatype\" that is {_kind(datatype)}, not a string")
            raise InvalidArgument(f"input {name!r} {what}: BYTES for IMAGE (encoded "
                                  "images), UINT8 for INPUT__0 (pixels)")
        shape = _shape(t.get("shape"), name)
        params = _object(t.get("parameters"), f"input {name!r}: \"parameters\"")
        check_input_params(params, name)
        size = params.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input {name!r}: binary_data_size must be a byte "
                                      f"count, not {size!r}"[:300])
            if t.get("data") is not None:
                raise InvalidArgument(f"input {name!r} has both \"data\" and "
                                      "binary_data_size: send its elements one way")
            if pos + size > len(blobs):
                raise InvalidArgument(f"input {name!r}: binary_data_size {size} runs past "
                                      "the body")
            data, pos = blobs[pos:pos + size], pos + size
        else:
            data = _json_data(t.get("data"), datatype, name)
        inputs.append(InTensor(str(t["name"]), datatype, shape, data))
    distinct_inputs([t.name for t in inputs])
    if pos != len(blobs):
        raise InvalidArgument(f"the body has {len(blobs) - pos} bytes after the JSON part "
                              "that no input's binary_data_size accounts for")
    params = _object(header.get("parameters"), "the request's \"parameters\"")
    binary = _flag(params, "binary_data_output", "the request's")
    outputs = []
    for i, o in enumerate(_list(header.get("outputs"), "\"outputs\"")):
        o = _object(o, f"outputs[{i}]", required=True)
        name = _text(o.get("name"), f"outputs[{i}]: \"name\"")
        oparams = _object(o.get("parameters"), f"output {name[:100]!r}: \"parameters\"")
        no_shared_memory(oparams, f"output {name[:100]!r}")
        _flag(oparams, "binary_data", f"output {name[:100]!r}:")
        outputs.append(OutRequest(name, dict(oparams)))
    call_id = header.get("id", "")
    if not isinstance(call_id, str):
        raise InvalidArgument(f"the request's \"id\" must be a string, not {_kind(call_id)}")
    return (InferCall(model, version, call_id, inputs, outputs, own_params(params),
                      timeout_of(params)), bool(binary))


def _json_numbers(datatype: str, data: bytes) -> Iterator[bytes]:
    """An output's elements as JSON numbers (or strings), comma-separated, in chunks."""
    if datatype == "BYTES":
        values = [e.decode(errors="replace") for e in unpack_bytes(data, "output")]
        yield json.dumps(values)[1:-1].encode()
        return
    if datatype == "BF16":
        arr = (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")
    else:
        arr = np.frombuffer(data, _JSON_DTYPES[datatype])
    for start in range(0, len(arr), _CHUNK):
        yield (b"," if start else b"") + json.dumps(
            arr[start:start + _CHUNK].tolist())[1:-1].encode()


def answer_bytes_bound(ans: InferAnswer, binary: dict[str, bool]) -> int:
    """The most bytes the answer's outputs can take: binary ones as they are, the
    others as JSON."""
    total = 0
    for t in ans.outputs:
        if binary.get(t.name):
            total += len(t.data)
            continue
        if t.datatype == "BYTES":
            total += 6 * len(t.data)   # each byte escaped at worst; quotes, commas
        else:
            total += math.prod(t.shape) * _JSON_ELEMENT_BYTES[t.datatype]
    return total


def encode_answer(ans: InferAnswer, binary: dict[str, bool], limit: int
                  ) -> tuple[bytes, int | None]:
    """The answer's body, and its JSON part's length when binary outputs follow.
    Outputs sent as JSON grow about fourfold: over `limit` bytes that way, the answer
    is RESOURCE_EXHAUSTED before it is encoded."""
    bound = answer_bytes_bound(ans, binary)
    if bound > limit:
        raise ResourceExhausted(
            f"the answer with JSON outputs could take {bound} bytes, over {limit} bytes, this "
            "server's limit for one answer (--max-stream-buffer-bytes): ask for "
            "binary outputs (request parameter binary_data_output=true), fewer images "
            "or outputs, or a reduction (reduction=avg)")
    parts = [json.dumps({"model_name": ans.model, "model_version": VERSION,
                         "id": ans.id})[:-1].encode(), b', "outputs": [']
    blobs = []
    for i, t in enumerate(ans.outputs):
        o = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        sep = b", " if i else b""
        if binary.get(t.name):
            o["parameters"] = {"binary_data_size": len(t.data)}
            blobs.append(t.data)
            parts.append(sep + json.dumps(o).encode())
        else:   # the object without its closing brace, then its data
            parts += [sep + json.dumps(o).encode()[:-1] + b', "data": [',
                      *_json_numbers(t.datatype, t.data), b"]}"]
    parts.append(b"]}")
    head = b"".join(parts)
    return (head + b"".join(blobs), len(head)) if blobs else (head, None)
