"""The Open Inference Protocol's REST routes (KServe v2) on `--http-port`: Starlette
routes served by uvicorn on a thread of the server's own process, over the same
`Inference` and engine as the gRPC service. No torch; starlette and uvicorn are the
`http` extra and are imported only when the port is set.

Routes: GET /v2/health/live, /v2/health/ready, /v2, /v2/models/stats (every model's),
/v2/models/{m}[/versions/{v}], .../ready, .../config, .../stats; POST .../infer. The
bodies are rest_body.py's. Triton's routes for what hookserve does not do (the model
repository, shared memory, trace and log settings) answer 501; any other path 404,
and a route asked with the wrong method 405, each with an {"error"} body.

The same bearer token as gRPC guards every route but the two health routes; a body
over --max-message-bytes is refused (a gzip or deflate body also once it expands over
it). An infer whose client disconnects is cancelled:
its images not yet at the model are dropped. Domain errors become HTTP statuses here (the
REST side of status.py's mapping), with a body {"error": message}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import socket
import threading
from typing import TYPE_CHECKING

from ..errors import ConfigError, HookserveError, ResourceExhausted
from ..status import as_domain, short_message
from . import metadata as md
from .body_read import BODY_IDLE_S, encoding_of, read_body
from .infer import VERSION, CallCancel
from .rest_body import HEADER_LENGTH, encode_answer, to_call

if TYPE_CHECKING:
    from .servicer import OipServicer

#: HTTP statuses of the domain's codes.
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
               "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "INTERNAL": 500,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
ROUTES = ("GET /v2/health/live, /v2/health/ready, /v2, /v2/models/stats, "
          "/v2/models/{model}[/versions/{v}][/ready|/config|/stats]; "
          "POST /v2/models/{model}[/versions/{v}]/infer")


def unknown_route(method: str, path: str, allowed: str | None) -> tuple[int, str]:
    """The status and message for a request no route serves."""
    if allowed:
        return 405, f"{method} is not allowed on {path[:200]}: use {allowed}"
    for prefix, _methods, what, instead in md.UNSUPPORTED:
        if path == prefix or path.startswith(prefix + "/"):
            return 501, md.unsupported(what, instead)
    return 404, f"no route {method} {path[:200]}: hookserve's REST routes are {ROUTES}"


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


#: Request bodies (of up to --max-message-bytes each) the REST front door holds at once.
BODIES = 4
#: A body whose JSON is larger than this is parsed alone.
PARSE_ALONE = 1 << 20


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
        #: seconds a request body may pause (BODY_IDLE_S)
        self.body_idle_s = BODY_IDLE_S
        #: bytes of request bodies held now (read, parsed, answered): at most BODIES
        #: bodies of the largest size; their JSON is parsed one large body at a time
        self._held = 0
        self._held_lock = threading.Lock()
        self._parse_lock = threading.Lock()
        m = "/v2/models/{model}"
        routes = [Route("/v2/health/live", self._live), Route("/v2/health/ready", self._ready),
                  Route("/v2", self._server), Route("/v2/models/stats", self._stats)]
        for base in (m, m + "/versions/{version}"):
            routes += [Route(base, self._model), Route(base + "/ready", self._model_ready),
                       Route(base + "/config", self._model_config),
                       Route(base + "/stats", self._stats),
                       Route(base + "/infer", self._infer, methods=["POST"])]
        self.app = Starlette(routes=routes, exception_handlers={
            404: self._no_route, 405: self._no_route})
        # a path with a slash too many is no route (404), as any other: not a redirect
        self.app.router.redirect_slashes = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), port))
            self.sock.listen(2048)   # (a port another listener holds fails here, not later)
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
        # log_config None: uvicorn's records go to the server's own handler, in its
        # --log-format, not to handlers of uvicorn's own
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", log_config=None, lifespan="off",
            access_log=False, timeout_graceful_shutdown=5, **ssl))
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
    def _json(body: dict, status: int = 200, headers: dict | None = None):
        from starlette.responses import Response
        # a lone surrogate a request sent (JSON may escape one) and an error repeats is
        # sent as its JSON escape, not the failure to encode it as UTF-8
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return Response(text.encode("utf-8", "backslashreplace"), status,
                        headers, media_type="application/json")

    def _error(self, exc: BaseException):
        err = as_domain(exc)
        # a retry hint as HTTP clients read it (gRPC's is retry-after-ms)
        after = {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))} \
            if err.retry_after_s else None
        return self._json({"error": short_message(err.message)},
                          getattr(err, "http_status", HTTP_STATUS.get(err.code, 500)), after)

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

    async def _no_route(self, request, exc):
        allowed = getattr(exc, "headers", None) or {}
        status, message = unknown_route(request.method, request.url.path,
                                        allowed.get("Allow") if exc.status_code == 405
                                        else None)
        return self._json({"error": message}, status)

    async def _stats(self, request):
        def stats():
            names = ([self._name(request)] if "model" in request.path_params
                     else md.model_names(self.oip.engine))
            dur = lambda n, ns: {"count": n, "ns": ns}  # noqa: E731
            out = []
            for name in names:
                c = self.inference.counts.of(name)
                out.append({
                    "name": name, "version": VERSION, "last_inference": c.last_ms,
                    "inference_count": c.inferences, "execution_count": c.executions,
                    "inference_stats": {"success": dur(c.success, c.success_ns),
                                        "fail": dur(c.fail, c.fail_ns),
                                        "queue": dur(c.success, 0),
                                        "compute_input": dur(c.success, 0),
                                        "compute_infer": dur(c.success, c.success_ns),
                                        "compute_output": dur(c.success, 0)}})
            return self._json({"model_stats": out})
        return await self._guarded(request, stats)

    async def _infer(self, request):
        if not self._authorized(request):
            self.inference.servicer.calls.refused("HTTPInfer", _Peer(request.client),
                                                  "UNAUTHENTICATED")
            return await self._guarded(request, None)
        declared = request.headers.get("content-length", "")
        held = min(int(declared), self.max_body_bytes + 1) if declared.isdigit() \
            else self.max_body_bytes
        if encoding_of(request):   # and the body it expands to
            held += self.max_body_bytes
        if not self._hold(held):
            full = ResourceExhausted(
                f"this server holds {BODIES} request bodies' worth of bytes now (each up to "
                "--max-message-bytes): retry shortly, or send smaller bodies (the binary "
                "extension, not JSON lists of numbers)", retry_after_s=1.0)
            self.inference.servicer.calls.refused("HTTPInfer", _Peer(request.client),
                                                  full.code)
            return self._error(full)
        try:
            return await self._infer_held(request)
        finally:
            with self._held_lock:
                self._held -= held

    def _hold(self, n: int) -> bool:
        with self._held_lock:
            if self._held and self._held + n > BODIES * self.max_body_bytes:
                return False
            self._held += n
            return True

    async def _infer_held(self, request):
        peer = _Peer(request.client)
        try:
            with self.inference.parsing("HTTPInfer", peer):
                body = await read_body(request, self.max_body_bytes, self.body_idle_s)
        except HookserveError as exc:
            return self._error(exc)
        p = request.path_params
        header_length = request.headers.get(HEADER_LENGTH)
        cancel = CallCancel()
        json_bytes = int(header_length) if (header_length or "").isdigit() else len(body)

        def infer():
            from starlette.responses import Response
            # JSON of number lists takes about 12 times its size to parse: one large
            # body is parsed at a time
            with self.inference.parsing("HTTPInfer", peer), \
                    self._parse_lock if json_bytes > PARSE_ALONE else contextlib.nullcontext():
                call, binary_default = to_call(p["model"], p.get("version", ""), body,
                                               header_length)
            answer = self.inference.infer(call, "HTTPInfer", peer, cancel.set, None)
            binary = {o.name: bool(o.params.get("binary_data", binary_default))
                      for o in call.outputs}
            if not call.outputs:
                binary = {t.name: binary_default for t in answer.outputs}
            data, head = encode_answer(answer, binary, self.inference.answer_limit)
            headers = {HEADER_LENGTH: str(head)} if head is not None else {}
            kind = "application/octet-stream" if head is not None else "application/json"
            return Response(data, headers=headers, media_type=kind)
        watch = asyncio.ensure_future(_on_disconnect(request.receive, cancel))
        try:
            return await self._guarded(request, infer)
        finally:
            watch.cancel()
