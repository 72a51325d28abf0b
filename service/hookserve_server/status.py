"""The one place where domain errors become gRPC status codes.

Used for both per-image statuses (google.rpc.Status inside the stream) and
call-level failures (the RPC's own status). Anything that is not a
HookserveError becomes INTERNAL with a generic message; the traceback is logged
on the server, never sent.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from .errors import HookserveError, InternalError

log = logging.getLogger("hookserve.status")

GRPC_CODES: dict[str, grpc.StatusCode] = {c.name: c for c in grpc.StatusCode}


def grpc_code(err: HookserveError) -> grpc.StatusCode:
    return GRPC_CODES.get(err.code, grpc.StatusCode.INTERNAL)


def as_domain(exc: BaseException) -> HookserveError:
    if isinstance(exc, HookserveError):
        return exc
    log.error("unexpected error", exc_info=exc)
    return InternalError("internal server error; the server log has the details")


#: Longest status message sent. A call's message travels in the grpc-message trailer,
#: percent-encoded (up to 12 bytes per character), and trailers over gRPC's 16 KiB hard
#: limit turn the answer into a transport error; messages echo client-sent names.
MAX_MESSAGE_CHARS = 600


def short_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut in the middle to at most `limit` characters (head and tail kept)."""
    if len(message) <= limit:
        return message
    cut = f" ...[message shortened from {len(message)} characters]... "
    head = (limit - len(cut)) // 2
    return message[:head] + cut + message[len(message) - (limit - len(cut) - head):]


def status_proto(err: HookserveError) -> status_pb2.Status:
    """A google.rpc.Status for one image, with RetryInfo when there is a retry hint."""
    st = status_pb2.Status(code=grpc_code(err).value[0], message=short_message(err.message))
    if err.retry_after_s is not None:
        info = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(nanos=int(err.retry_after_s * 1e9) % 10**9,
                                              seconds=int(err.retry_after_s)))
        detail = any_pb2.Any()
        detail.Pack(info)
        st.details.append(detail)
    return st


def abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    """End the call with the status for `exc` (raises, as context.abort does)."""
    err = as_domain(exc)
    if err.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(err.retry_after_s * 1000))),))
    context.abort(grpc_code(err), short_message(err.message))


def mapped(method):
    """Decorate a servicer method (unary or generator) so errors map to statuses.

    Servicer methods never call context.abort themselves: they raise domain errors.
    """
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def gen_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:
                abort(context, exc)
        return gen_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:
            abort(context, exc)
    return wrapper
