"""One ``extract_many`` run: the Extract stream, its window, and the order of results.

Data flow: the caller's images are pulled lazily (at most `window` sent and not yet
answered), each turned into its request's wire bytes at once (:mod:`.wire`: an input's
bytes are copied once, and the stream keeps only that copy for a re-send), and put on
a request queue that gRPC's sender drains. The caller's side reads the answers: tensor chunks are
reassembled (:mod:`.tensors`) until the image's status message ends it, and results
are yielded in input order. If the server goes UNAVAILABLE,
:class:`~.endpoints.Endpoints` opens the stream again on another address and the
unanswered images are re-sent.

The exchange itself is written once, without I/O: :meth:`Extraction.steps` is a
generator that asks its driver to pull an image, send a request, half-close, read an
answer or hand a result out. :meth:`Extraction._stream` drives it with blocking calls
(the sync client); :mod:`.aio` drives the same steps with awaits.

The Attribute stream (:mod:`.attribution`) is the same machinery: it subclasses
:class:`Extraction` and overrides only the hooks that name the RPC, wrap the spec
and images, take in answer messages and build results.
"""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Generator, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors, wire
from .endpoints import Endpoints
from .images import TooLarge, default_id, to_image
from .tensors import Collected
from .types import Result
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc

#: What :meth:`Extraction.steps` asks of its driver, as ``(op, argument)``: PULL the
#: next image (reply: the next :class:`_Pending`, None once the images ran out); SEND a
#: request (put it on the call's request queue; :data:`END` half-closes); READ the next
#: answer (reply: the message, None once the call ended); EMIT a result to the caller.
PULL, SEND, READ, EMIT = "pull", "send", "read", "emit"
#: The request queue's end: the request stream is closed when the sender reaches it.
END = object()
Step = Generator["tuple[str, Any]", Any, None]


@dataclass
class _Pending:
    index: int
    id: str
    #: the image's request, encoded (:mod:`.wire`); None: failed locally before sending
    image: bytes | None
    error: errors.HookserveError | None = None
    #: Per-image request data a subclass sends with the image (Attribute: its target).
    extra: Any = None
    #: calls that ended before its answer, after which it was sent again
    resent: int = 0


class Extraction:
    """Owns the stream(s) of one extract_many call, the window and the order."""

    #: The RPC, a method of the FeatureExtractor stub.
    rpc = "Extract"

    def __init__(self, endpoints: Endpoints, spec: pb.ExtractionSpec, images: Iterable[Any],
                 ids: Iterable[str] | None, window: int, deadline: float | None) -> None:
        self.endpoints = endpoints
        #: the caller's images: an iterable (an async iterable too, for :mod:`.aio`)
        self.images = images
        self.source: Iterator[Any] | None = None
        self.spec = spec
        self._ids_given = ids
        self.ids = iter(per_image("ids", ids, "str")) if ids is not None else None
        self.window = window
        self.deadline = deadline
        self.pending: collections.deque[_Pending] = collections.deque()
        self.next_index = 0
        self.exhausted = False
        #: what the caller's images raised: raised once every image before it is out
        self.source_error: BaseException | None = None

    def run(self) -> Iterator[Any]:
        return self.endpoints.stream(self._stream)

    def time_left(self) -> float | None:
        """Seconds to the deadline (the timeout of the next call), None: no limit."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- what differs between RPCs (overridden by attribution.AttributionRun) ----------
    def _spec_request(self) -> Any:
        return pb.ExtractRequest(spec=self.spec)

    def _extra(self, index: int) -> Any:
        """Per-image request data for image `index`, taken before it is encoded."""
        return None

    def _encode(self, obj: Any, wire_id: str, extra: Any) -> bytes:
        """The wire bytes of the image's request."""
        return wire.extract_request(obj, wire_id, self.endpoints.max_send)

    def _opened(self, call: Any) -> None:
        """A new call of this run has started (a hook for watchers: it can be cancelled)."""

    def _reset(self) -> None:
        """Forget a partly received answer (a new image, or a new stream)."""
        self._got = Collected()

    def _add_tensor(self, c: pb.TensorChunk) -> None:
        self._got.add(c)

    def _absorb(self, msg: Any) -> Any:
        """Take in one answer message; return its status when it ends an image."""
        which = msg.WhichOneof("payload")
        if which == "tensor":
            self._add_tensor(msg.tensor)
        return msg.status if which == "status" else None

    def _result(self, p: _Pending, error: errors.HookserveError | None) -> Any:
        if error is not None:
            return Result(p.index, p.id, error=error)
        return Result(p.index, p.id, features=self._got.features, columns=self._got.columns,
                      cached=frozenset(self._got.cached))

    def admit(self, obj: Any) -> _Pending:
        """The next image of the caller's: its id, and its wire form (or the local
        error that keeps it from being sent)."""
        index = self.next_index
        self.next_index += 1
        if self.ids is not None:
            image_id = next(self.ids, None)
            if image_id is None:
                raise ValueError(f"ids has fewer items than images (ran out at image {index})")
            if not isinstance(image_id, str):
                raise TypeError(f"ids are strings: id {index} is {image_id!r}")
            wire_id = image_id
        else:
            # Answers are matched by order, so the default wire id is only the position:
            # the same path twice is not a duplicate id, and chunks stay small.
            image_id, wire_id = default_id(obj, index), str(index)
        extra = self._extra(index)
        try:
            p = _Pending(index, image_id, self._encode(obj, wire_id, extra), extra=extra)
        except (OSError, TypeError, ValueError) as exc:
            return _Pending(index, image_id, None, unreadable(image_id, exc), extra)
        self._hold_if_too_large(p)
        return p

    def leftover(self) -> ValueError | None:
        """Once the images ran out: a list given per image (ids, targets) that was
        longer than the images (a misaligned list), as the error raised after the
        answered results. An iterator of unknown length is not counted."""
        for name, given in self._per_image():
            if isinstance(given, Sized) and len(given) > self.next_index:
                return ValueError(f"{name} has {len(given)} items but there were "
                                  f"{self.next_index} images: give one per image")
        return None

    def _per_image(self) -> list[tuple[str, Any]]:
        return [("ids", self._ids_given)]

    def _hold_if_too_large(self, p: _Pending) -> None:
        """Fail an image whose request is over the server's size limit here (once
        the limit is known): sent, it would end the whole stream."""
        limit = self.endpoints.send_limit
        if p.image is not None and limit is not None and len(p.image) > limit:
            p.error = errors.ResourceExhausted(errors.over_limit_message(
                f"image {p.id!r}: its request", len(p.image), limit,
                self.endpoints.send_limit_own))
            p.image = None

    def pull(self) -> _Pending | None:
        """The next image admitted from a (sync) iterable, None once it ran out (or
        raised: :attr:`source_error`, raised once the answered images are out)."""
        if self.source is None:
            self.source = iter(self.images)
        try:
            obj = next(self.source)
            return self.admit(obj)
        except StopIteration:
            self.source_error = self.leftover()
            return None
        except Exception as exc:  # noqa: BLE001 - the caller's (its images, or ids that
            self.source_error = exc   # ran out); raised after the answered results
            return None

    # -- the exchange, without I/O -----------------------------------------------------
    def steps(self) -> Step:
        """One stream's exchange: spec, re-sent and new images within the window, then
        answers in order. Yields ``(op, arg)``; see :data:`PULL` and the others."""
        yield SEND, self._spec_request()
        sent = 0
        most = max(2, self.endpoints.policy.retries)
        for p in self.pending:  # re-send what the last stream left unanswered
            self._hold_if_too_large(p)
            p.resent += p.image is not None
            if p.image is not None and p.resent > most:   # (an image a server fails on
                p.error = errors.Unavailable(             # each time: not sent again)
                    f"image {p.id!r}: {p.resent} calls ended before its answer; it is not "
                    "sent again (does it make the server fail? try it alone)")
                p.image = None
            if p.image is not None:
                yield SEND, p.image
                sent += 1
        self._reset()
        closed = False
        while True:
            while not self.exhausted and sent < self.window:
                p = yield PULL, None
                if p is None:
                    self.exhausted = True
                    break
                self.pending.append(p)
                if p.image is not None:
                    yield SEND, p.image
                    sent += 1
            if self.exhausted and not closed:
                # Half-close once the last image is sent: the server can end the call
                # with its last answer, not one round trip after it.
                yield SEND, END
                closed = True
            while self.pending and self.pending[0].image is None:
                p = self.pending.popleft()
                yield EMIT, self._result(p, p.error)
            if not self.pending:
                if self.exhausted:
                    while (yield READ, None) is not None:  # drain to the end of the call
                        pass
                    if self.source_error is not None:
                        raise self.source_error
                    return
                continue
            msg = yield READ, None
            if msg is None:
                raise errors.Internal("server ended the stream before answering every image")
            status = self._absorb(msg)
            if status is None:
                continue
            p = self.pending.popleft()
            sent -= 1
            result = self._result(p, errors.from_status(status) if status.code else None)
            self._reset()
            yield EMIT, result

    def _stream(self, stub: pb_grpc.FeatureExtractorStub) -> Iterator[Any]:
        """Drive :meth:`steps` on one call with blocking I/O: a queue feeds gRPC's
        sender thread, the calling thread pulls images and reads answers."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        # A callable's iterator keeps no reference to a request once it is handed on.
        call = getattr(stub, self.rpc)(iter(requests.get, END), timeout=self.time_left(),
                                       metadata=self.endpoints.metadata)
        self._opened(call)
        responses = iter(call)
        steps = self.steps()
        try:
            reply = None
            while (step := advance(steps, reply)) is not None:
                op, arg = step
                reply = None
                if op is SEND:
                    requests.put(arg)
                elif op is PULL:
                    reply = self.pull()
                elif op is READ:
                    reply = next(responses, None)
                else:
                    yield arg
        finally:
            requests.put(END)
            call.cancel()


def advance(steps: Step, reply: Any) -> tuple[str, Any] | None:
    """The next ``(op, arg)`` of `steps` after sending it `reply`; None once it ended."""
    try:
        return steps.send(reply)
    except StopIteration:
        return None


class ImageCall:
    """One image on the ExtractImage RPC: one request, its tensors back, the call's
    status as the image's. Moved to another address on UNAVAILABLE like a unary call
    (nothing of the answer is kept from a failed attempt). Calling it runs one attempt
    with blocking I/O (``endpoints.call(one)``); the asyncio client iterates
    :meth:`open`'s answer with ``async for``, each message to :meth:`take`, then
    :meth:`features`."""

    def __init__(self, endpoints: Endpoints, spec: pb.ExtractionSpec, image: Any,
                 timeout: float | None) -> None:
        try:
            pixels = to_image(image, "", endpoints.max_send)
            self.request = pb.ExtractImageRequest(spec=spec, image=pixels)
        except (OSError, TypeError, ValueError) as exc:
            raise unreadable(default_id(image, 0), exc) from None
        self.endpoints = endpoints
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._got = Collected()

    def open(self, stub: pb_grpc.FeatureExtractorStub) -> Any:
        """Start one attempt on `stub`: its answer messages, to iterate."""
        self._got = Collected()
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return stub.ExtractImage(self.request, timeout=left, metadata=self.endpoints.metadata)

    def take(self, msg: pb.ExtractResponse) -> None:
        if msg.WhichOneof("payload") == "tensor":
            self._got.add(msg.tensor)

    def features(self) -> dict[str, np.ndarray]:
        """The answer once the call ended OK."""
        if not self._got.complete or not self._got.features:
            raise errors.Internal("the server ended ExtractImage before the whole answer")
        return self._got.features

    def __call__(self, stub: pb_grpc.FeatureExtractorStub) -> dict[str, np.ndarray]:
        for msg in self.open(stub):
            self.take(msg)
        return self.features()


def per_image(name: str, values: Any, kind: str) -> Any:
    """A list given one item per image (ids, targets), checked to be one: a lone str,
    number or non-iterable is refused (a str would give each character to an image)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} takes one {kind} per image (a list, say); got one "
                        f"{type(values).__name__}: {values!r}"[:300])
    return values


def unreadable(image_id: str, exc: Exception) -> errors.HookserveError:
    """An image the client could not read, as that image's error (read here, before
    any call: not the server's answer)."""
    if isinstance(exc, TooLarge):
        return errors.ResourceExhausted(errors.over_limit_message(
            f"image {image_id!r}: its file", exc.size, exc.limit, own=True))
    if isinstance(exc, IsADirectoryError):
        return errors.InvalidArgument(
            f"could not read image {image_id!r}: it is a folder; give image files (for a "
            "folder of images, `hookserve batch` reads it)")
    return errors.InvalidArgument(f"could not read image {image_id!r}: {exc}")
