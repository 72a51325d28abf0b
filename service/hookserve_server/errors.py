"""Typed domain errors of the engine.

The engine never imports grpc. Each error carries the *name* of the gRPC status
code it stands for (``code``); :mod:`hookserve_server.status` is the one place
that turns these into real gRPC status codes.
"""

from __future__ import annotations


class HookserveError(Exception):
    """Base class: a failure the client should hear about, with a clear message."""

    code = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: For overload errors: how long the client should wait before retrying.
        self.retry_after_s = retry_after_s

    def detached(self) -> HookserveError:
        """This error without the frames it was raised through, fit to be stored (in a
        Future): a raised error's traceback holds its frames, whose locals hold the
        future it is stored in, a reference cycle that keeps the frames' images and
        answers alive until a garbage collection, which an idle server never runs."""
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self


class InvalidArgument(HookserveError):
    """The request or image is malformed; the message says what to change."""

    code = "INVALID_ARGUMENT"


class ModelNotFound(HookserveError):
    """The spec names a model this server does not hold."""

    code = "NOT_FOUND"


class ResourceExhausted(HookserveError):
    """A size limit, the queue, or device memory would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(HookserveError):
    """The server is shutting down or otherwise not taking work."""

    code = "UNAVAILABLE"


class DeadlineExceeded(HookserveError):
    """The call's deadline passed before the image was processed."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(HookserveError):
    """The call was cancelled by the client."""

    code = "CANCELLED"


class InternalError(HookserveError):
    """An unexpected fault. The message sent to clients stays generic."""

    code = "INTERNAL"


class ConfigError(Exception):
    """A start-up problem (bad flag, missing weights file): printed, not traced."""
