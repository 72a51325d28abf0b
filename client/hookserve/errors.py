"""Typed errors of the hookserve SDK. Every error keeps its gRPC status code.

This is the one place that reads the server's retry hint: ``retry-after-ms`` trailing
metadata on a failed call (:func:`from_rpc_error`), ``google.rpc.RetryInfo`` in a
per-image status (:func:`from_status`).
"""

from __future__ import annotations

import re

import grpc


class HookserveError(Exception):
    """Base class. ``code`` is the :class:`grpc.StatusCode`; ``message`` the server's text."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None, *,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        #: Set on overload errors: the server's hint of when to retry.
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(HookserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(HookserveError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(HookserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(HookserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(HookserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(HookserveError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(HookserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(HookserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(HookserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Internal(HookserveError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled,
    Unauthenticated, PermissionDenied, FailedPrecondition, Internal)}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code: grpc.StatusCode | int, message: str, *,
              retry_after_s: float | None = None) -> HookserveError:
    """The typed error for a status code (a grpc.StatusCode or its integer value)."""
    if isinstance(code, int):
        code = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, HookserveError)
    return cls(message, code, retry_after_s=retry_after_s)


def from_rpc_error(exc: grpc.RpcError, receive_limit: int | None = None) -> HookserveError:
    """Convert a grpc.RpcError raised by a call into the typed error. `receive_limit`:
    the client's own grpc.max_receive_message_length (gRPC words an answer over it as
    it words a request over the server's limit)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    retry = None
    for key, value in (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ():
        if key == "retry-after-ms":
            try:
                retry = int(value) / 1000.0
            except ValueError:
                pass
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and (
            not details or details.endswith("Deadline Exceeded")
            or details.endswith("(Deadline Exceeded)")):
        details = CLIENT_DEADLINE  # gRPC's own words: the client's deadline, not the server's
    found = _over_limit(code, details)
    if found is not None:
        details = over_limit_message("a request", *found)
        if not found[2] and found[1] == receive_limit:   # (or an answer over ours)
            details += (f"; or, if it was an answer, it is over this client's receive "
                        f"limit of {receive_limit} bytes: raise it, Client(..., options="
                        "{'grpc.max_receive_message_length': BYTES}), or lower the "
                        "server's --chunk-bytes")
    if code == grpc.StatusCode.UNAVAILABLE:
        details = (details or "") + _connect_hint(details or "")
    return error_for(code, details or "", retry_after_s=retry)


def _connect_hint(details: str) -> str:
    """What to change when a connection failed: TLS on one side only, nothing
    listening, an HTTP/1 port, a name that does not resolve."""
    if "WRONG_VERSION_NUMBER" in details:
        return (" (the server does not speak TLS on this port: address it without "
                "grpcs://, and drop --ca/--cert/--key)")
    if "handshake" in details.lower() or "CERTIFICATE_VERIFY_FAILED" in details:
        return (" (the TLS handshake failed: give the server's CA with --ca, "
                "root_certificates= in the SDK)")
    if details.rstrip().endswith("Socket closed"):
        return (" (if the server uses TLS, address it as grpcs://host:port, with --ca, "
                "root_certificates= in the SDK, for a private CA; if it asks for client "
                "certificates, give one it trusts: --cert and --key, certificate_chain= "
                "and private_key= in the SDK)")
    if "http1.x server" in details or "Failed parsing HTTP/2" in details:
        return (" (that port speaks HTTP/1, not gRPC: give the server's --port, not its "
                "--http-port or --metrics-port)")
    if "Connection refused" in details:
        return (" (nothing listens there: start `hookserve serve`, or give the host and "
                "port it serves on; its port is 50051 unless --port says otherwise)")
    if any(words in details for words in ("DNS resolution failed", "errors resolving",
                                          "Domain name not found", "hostname lookup")):
        return " (the host name does not resolve: check its spelling)"
    return ""


#: gRPC's words when a message is over a limit: the server's --max-message-bytes
#: ("Received"), or this client's own send limit ("Sent").
_TOO_LARGE = re.compile(r"(Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")


def _over_limit(code: grpc.StatusCode | None, details: str | None
                ) -> tuple[int, int, bool] | None:
    """(size, limit, whether the limit is the client's own) of gRPC's refusal."""
    m = _TOO_LARGE.search(details or "") if code == grpc.StatusCode.RESOURCE_EXHAUSTED \
        else None
    return None if m is None else (int(m.group(2)), int(m.group(3)), m.group(1) == "Sent")


def send_limit(exc: grpc.RpcError) -> tuple[int, bool] | None:
    """(the largest message in bytes, whether it is the client's own limit) when `exc`
    is gRPC's refusal of a larger one (which ends the whole call)."""
    found = _over_limit(exc.code() if hasattr(exc, "code") else None,
                        exc.details() if hasattr(exc, "details") else None)
    return None if found is None else found[1:]


def over_limit_message(what: str, size: int, limit: int, own: bool = False) -> str:
    """Why `what` (a request of `size` bytes on the wire) was not sent or taken."""
    fix = ("send a smaller image (fewer pixels, or encoded as JPEG or PNG rather than raw "
           "pixels), or raise ")
    if own:
        return (f"{what} of {size} bytes is over this client's limit of {limit} bytes: "
                f"{fix}it: Client(..., options=[('grpc.max_send_message_length', BYTES)])")
    return (f"{what} of {size} bytes is over the server's limit of {limit} bytes (its "
            f"--max-message-bytes): {fix}the server's --max-message-bytes")


#: What a call that ran past the client's own timeout says.
CLIENT_DEADLINE = ("no answer within the client's timeout: allow more time (the CLI's "
                   "--timeout, 0 for no limit; in the SDK, Client(timeout=...), or the "
                   "timeout= of extract_many and attribute_many), or send less work per "
                   "call")


def from_status(status) -> HookserveError:
    """The typed error for one image's ``google.rpc.Status`` (code != 0) in a stream."""
    retry = None
    for d in status.details:
        if d.type_url.endswith("google.rpc.RetryInfo"):
            from google.rpc import error_details_pb2
            info = error_details_pb2.RetryInfo()
            d.Unpack(info)
            retry = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return error_for(status.code, status.message, retry_after_s=retry)
