"""The Open Inference Protocol's REST routes (KServe v2) on `--http-port`: Starlette
routes served by uvicorn on a thread of the server's own process, over the same
`Inference` and engine as the gRPC service. No torch; starlette and uvicorn are the
`http` extra and are imported only when the port is set.

Routes: GET /v2/health/live, /v2/health/ready, /v2, /v2/models/{m}[/versions/{v}],
.../ready, .../config, .../stats; POST .../infer. Bodies are JSON tensors, or the
binary-data extension (`Inference-Header-Content-Length`: that many bytes of JSON,
then each binary input in order, as `binary_data_size` says). BYTES elements in JSON
are strings, or {"b64": "..."} objects for binary data such as images.

The same bearer token as gRPC guards every route but the two health routes; a body
over --max-message-bytes is refused. An infer whose client disconnects is cancelled:
its images not yet at the model are dropped. Domain errors become HTTP statuses here (the
REST side of status.py's mapping), with a body {"error": message}.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import socket
import threading
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError, HookserveError, InvalidArgument, ResourceExhausted
from ..status import as_domain, short_message
from . import metadata as md
from .infer import CallCancel
from .request import InferCall, InTensor, OutRequest, own_params, timeout_of
from .tensors import InferAnswer, unpack_bytes

if TYPE_CHECKING:
    from .servicer import OipServicer

HEADER_LENGTH = "Inference-Header-Content-Length"
#: HTTP statuses of the domain's codes.
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
               "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "INTERNAL": 500,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_JSON_DTYPES = {"FP32": "<f4", "FP16": "<f2", "INT64": "<i8", "UINT8": "u1"}


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


def _element(e, name: str) -> bytes:
    if isinstance(e, str):
        return e.encode()
    if isinstance(e, dict) and isinstance(e.get("b64"), str):
        try:
            return base64.b64decode(e["b64"], validate=True)
        except ValueError:
            raise InvalidArgument(f"{name}: an element's b64 is not valid base64") from None
    raise InvalidArgument(f"{name}: BYTES elements are strings or {{\"b64\": \"...\"}}")


def _json_input(t: dict, name: str):
    data = _flat(t.get("data", []))
    if t.get("datatype") == "BYTES":
        return [_element(e, name) for e in data]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise InvalidArgument(f"{name}: {t.get('datatype')} data must be integers")
    if t.get("datatype") == "UINT8" and any(not 0 <= v <= 255 for v in data):
        raise InvalidArgument(f"{name}: UINT8 data must be 0..255")
    return data


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
    if not isinstance(header, dict):
        raise InvalidArgument("the request's JSON is not an object")
    blobs = memoryview(body)[n:]
    pos = 0
    inputs = []
    for i, t in enumerate(header.get("inputs") or []):
        name = str(t.get("name", ""))[:100] or f"input {i}"
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or pos + size > len(blobs):
                raise InvalidArgument(f"{name}: binary_data_size {size!r} runs past the body")
            data, pos = blobs[pos:pos + size], pos + size
        else:
            data = _json_input(t, name)
        shape = t.get("shape") or []
        if not all(isinstance(d, int) for d in shape):
            raise InvalidArgument(f"{name}: shape must be integers")
        inputs.append(InTensor(str(t.get("name", "")), str(t.get("datatype", "")),
                               tuple(shape), data))
    params = dict(header.get("parameters") or {})
    outputs = [OutRequest(str(o.get("name", "")), dict(o.get("parameters") or {}))
               for o in header.get("outputs") or []]
    return (InferCall(model, version, str(header.get("id", "")), inputs, outputs,
                      own_params(params), timeout_of(params)),
            bool(params.get("binary_data_output")))


def _json_data(datatype: str, data: bytes) -> list:
    if datatype == "BYTES":
        return [e.decode(errors="replace") for e in unpack_bytes(data, "output")]
    if datatype == "BF16":
        bits = np.frombuffer(data, "<u2").astype("<u4") << 16
        return bits.view("<f4").tolist()
    return np.frombuffer(data, _JSON_DTYPES[datatype]).tolist()


def encode_answer(ans: InferAnswer, binary: dict[str, bool]) -> tuple[bytes, int | None]:
    """The answer's body, and its JSON part's length when binary outputs follow."""
    outputs, blobs = [], []
    for t in ans.outputs:
        o = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary.get(t.name):
            o["parameters"] = {"binary_data_size": len(t.data)}
            blobs.append(t.data)
        else:
            o["data"] = _json_data(t.datatype, t.data)
        outputs.append(o)
    head = json.dumps({"model_name": ans.model, "model_version": "1", "id": ans.id,
                       "outputs": outputs}).encode()
    return (head + b"".join(blobs), len(head)) if blobs else (head, None)


async def _on_disconnect(receive, cancel: CallCancel) -> None:
    """Cancel the call when its client goes away: with the body read, the next ASGI
    message is the disconnect (the server's Session then drops its queued images)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel()


class _Peer:
    """What the call log reads of a request's context."""

    def __init__(self, client) -> None:
        self._peer = f"http:{client.host}:{client.port}" if client else "http"

    def peer(self) -> str:
        return self._peer


def _config(m: dict) -> dict:
    types = {"BYTES": "TYPE_STRING", "UINT8": "TYPE_UINT8", "INT64": "TYPE_INT64",
             "FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "BF16": "TYPE_BF16"}
    io = lambda items, **kw: [  # noqa: E731
        {"name": t["name"], "data_type": types[t["datatype"]], "dims": t["shape"], **kw}
        for t in items]
    return {"name": m["name"], "platform": m["platform"], "backend": "hookserve",
            "max_batch_size": 0, "input": io(m["inputs"], optional=True),
            "output": io(m["outputs"])}


class OipHttp:
    """The REST front door: bound at construction, served by start(), ended by stop()."""

    def __init__(self, oip: OipServicer, host: str, port: int, *, token: str | None,
                 max_body_bytes: int, tls: tuple[str, str, str | None] | None = None
                 ) -> None:
        try:
            import uvicorn
            from starlette.applications import Starlette
            from starlette.routing import Route
        except ImportError:
            raise ConfigError("--http-port needs the http extra: pip install "
                              "'hookserve[http]' (starlette, uvicorn)") from None
        self.oip = oip
        self.inference = oip.inference
        self._token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        m = "/v2/models/{model}"
        routes = [Route("/v2/health/live", self._live), Route("/v2/health/ready", self._ready),
                  Route("/v2", self._server)]
        for base in (m, m + "/versions/{version}"):
            routes += [Route(base, self._model), Route(base + "/ready", self._model_ready),
                       Route(base + "/config", self._model_config),
                       Route(base + "/stats", self._stats),
                       Route(base + "/infer", self._infer, methods=["POST"])]
        self.app = Starlette(routes=routes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror} "
                          "(--http-port)") from None
        self.port = self.sock.getsockname()[1]
        ssl = {}
        if tls:
            import ssl as _ssl
            ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]}
            if tls[2]:
                ssl.update(ssl_ca_certs=tls[2], ssl_cert_reqs=_ssl.CERT_REQUIRED)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False,
            timeout_graceful_shutdown=5, **ssl))
        self._thread = threading.Thread(target=self._run, name="hookserve-http",
                                        daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.sock.close()

    # -- plumbing ------------------------------------------------------------------------
    @staticmethod
    def _json(body: dict, status: int = 200):
        from starlette.responses import JSONResponse
        return JSONResponse(body, status_code=status)

    def _error(self, exc: BaseException):
        err = as_domain(exc)
        return self._json({"error": short_message(err.message)},
                          HTTP_STATUS.get(err.code, 500))

    def _authorized(self, request) -> bool:
        if self._token is None:
            return True
        sent = request.headers.getlist("authorization")
        scheme, _, token = (sent[0] if len(sent) == 1 else "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(),
                                                                  self._token)

    async def _guarded(self, request, fn):
        if not self._authorized(request):
            return self._json({"error": "missing or invalid bearer token: send header "
                                        "'Authorization: Bearer <token>'"}, 401)
        from starlette.concurrency import run_in_threadpool
        try:
            return await run_in_threadpool(fn)
        except Exception as exc:
            return self._error(exc)

    def _name(self, request) -> str:
        p = request.path_params
        return self.oip._model(p["model"], p.get("version", ""))

    # -- routes --------------------------------------------------------------------------
    async def _live(self, request):
        return self._json({"live": True})

    async def _ready(self, request):
        ready = self.oip._ready() and not self.oip.engine.draining
        return self._json({"ready": ready}, 200 if ready else 503)

    async def _server(self, request):
        return await self._guarded(request, lambda: self._json(md.server_metadata()))

    async def _model(self, request):
        return await self._guarded(request, lambda: self._json(
            md.model_metadata(self.oip.engine, self._name(request))))

    async def _model_ready(self, request):
        def ready():
            self._name(request)
            ok = self.oip._ready() and not self.oip.engine.draining
            return self._json({"name": request.path_params["model"], "ready": ok},
                              200 if ok else 503)
        return await self._guarded(request, ready)

    async def _model_config(self, request):
        return await self._guarded(request, lambda: self._json(_config(
            md.model_metadata(self.oip.engine, self._name(request)))))

    async def _stats(self, request):
        def stats():
            name = self._name(request)
            c = self.inference.counts.of(name)
            dur = lambda n, ns: {"count": n, "ns": ns}  # noqa: E731
            return self._json({"model_stats": [{
                "name": name, "version": "1", "last_inference": c.last_ms,
                "inference_count": c.inferences, "execution_count": c.executions,
                "inference_stats": {"success": dur(c.success, c.success_ns),
                                    "fail": dur(c.fail, c.fail_ns),
                                    "queue": dur(c.success, 0),
                                    "compute_input": dur(c.success, 0),
                                    "compute_infer": dur(c.success, c.success_ns),
                                    "compute_output": dur(c.success, 0)}}]})
        return await self._guarded(request, stats)

    async def _infer(self, request):
        if not self._authorized(request):
            return await self._guarded(request, None)
        try:
            body = await self._body(request)
        except HookserveError as exc:
            return self._error(exc)
        p = request.path_params
        peer = _Peer(request.client)
        header_length = request.headers.get(HEADER_LENGTH)
        cancel = CallCancel()

        def infer():
            from starlette.responses import Response
            call, binary_default = to_call(p["model"], p.get("version", ""), body,
                                           header_length)
            answer = self.inference.infer(call, "HTTPInfer", peer, cancel.set, None)
            binary = {o.name: bool(o.params.get("binary_data", binary_default))
                      for o in call.outputs}
            if not call.outputs:
                binary = {t.name: binary_default for t in answer.outputs}
            data, head = encode_answer(answer, binary)
            headers = {HEADER_LENGTH: str(head)} if head is not None else {}
            kind = "application/octet-stream" if head is not None else "application/json"
            return Response(data, headers=headers, media_type=kind)
        watch = asyncio.ensure_future(_on_disconnect(request.receive, cancel))
        try:
            return await self._guarded(request, infer)
        finally:
            watch.cancel()

    async def _body(self, request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = ResourceExhausted(
            f"the request body is over {limit} bytes, this server's limit "
            "(--max-message-bytes): send fewer or smaller images per request")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return bytes(body)
