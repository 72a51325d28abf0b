"""One ``extract_many`` run: the Extract stream, its window, and the order of results.

Data flow: the caller's images are pulled lazily (at most `window` sent and not yet
answered), turned into wire Images (:mod:`.images`), and put on a request queue that
gRPC's sender thread drains. The calling thread reads the answers: tensor chunks are
reassembled (:mod:`.tensors`) until the image's status message ends it, and results
are yielded in input order. If the server goes UNAVAILABLE, :class:`~.endpoints.Endpoints`
opens the stream again on another address and the unanswered images are re-sent.

The Attribute stream (:mod:`.attribution`) is the same machinery: it subclasses
:class:`Extraction` and overrides only the hooks that name the RPC, wrap the spec
and images, take in answer messages and build results.
"""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors
from .endpoints import Endpoints
from .images import default_id, to_image
from .tensors import Collected
from .types import Result
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc


@dataclass
class _Pending:
    index: int
    id: str
    image: pb.Image | None          # None: failed locally before sending
    error: errors.HookserveError | None = None
    #: Per-image request data a subclass sends with the image (Attribute: its target).
    extra: Any = None


class Extraction:
    """Owns the stream(s) of one extract_many call, the window and the order."""

    def __init__(self, endpoints: Endpoints, spec: pb.ExtractionSpec, images: Iterable[Any],
                 ids: Iterable[str] | None, window: int, deadline: float | None) -> None:
        self.endpoints = endpoints
        self.spec = spec
        self.source = iter(images)
        self.ids = iter(ids) if ids is not None else None
        self.window = window
        self.deadline = deadline
        self.pending: collections.deque[_Pending] = collections.deque()
        self.next_index = 0
        self.exhausted = False

    def run(self) -> Iterator[Any]:
        return self.endpoints.stream(self._stream)

    # -- what differs between RPCs (overridden by attribution.AttributionRun) ----------
    def _open(self, stub: pb_grpc.FeatureExtractorStub, requests: Iterator[Any],
              timeout: float | None) -> Any:
        return stub.Extract(requests, timeout=timeout, metadata=self.endpoints.metadata)

    def _spec_request(self) -> Any:
        return pb.ExtractRequest(spec=self.spec)

    def _image_request(self, p: _Pending) -> Any:
        return pb.ExtractRequest(image=p.image)

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
        return Result(p.index, p.id, features=self._got.features, columns=self._got.columns)

    def _pull(self) -> _Pending | None:
        try:
            obj = next(self.source)
        except StopIteration:
            self.exhausted = True
            return None
        index = self.next_index
        self.next_index += 1
        if self.ids is not None:
            image_id = next(self.ids, None)
            if image_id is None:
                raise ValueError(f"ids has fewer items than images (ran out at image {index})")
            wire_id = image_id
        else:
            # Answers are matched by order, so the default wire id is only the position:
            # the same path twice is not a duplicate id, and chunks stay small.
            image_id, wire_id = default_id(obj, index), str(index)
        try:
            return _Pending(index, image_id, to_image(obj, wire_id))
        except (OSError, TypeError, ValueError) as exc:
            return _Pending(index, image_id, None,
                            errors.InvalidArgument(f"could not read image {image_id!r}: {exc}"))

    def _stream(self, stub: pb_grpc.FeatureExtractorStub) -> Iterator[Result]:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        _END = object()

        def gen():
            while True:
                item = requests.get()
                if item is _END:
                    return
                yield item

        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        call = self._open(stub, gen(), timeout)
        requests.put(self._spec_request())
        sent = 0
        for p in self.pending:  # re-send what the last stream left unanswered
            if p.image is not None:
                requests.put(self._image_request(p))
                sent += 1
        try:
            responses = iter(call)
            self._reset()
            closed = False
            while True:
                while not self.exhausted and sent < self.window:
                    p = self._pull()
                    if p is None:
                        break
                    self.pending.append(p)
                    if p.image is not None:
                        requests.put(self._image_request(p))
                        sent += 1
                if self.exhausted and not closed:
                    # Half-close once the last image is sent: the server can end the
                    # call with its last answer, not one round trip after it.
                    requests.put(_END)
                    closed = True
                while self.pending and self.pending[0].image is None:
                    p = self.pending.popleft()
                    yield self._result(p, p.error)
                if not self.pending:
                    if self.exhausted:
                        if not closed:
                            requests.put(_END)
                            closed = True
                        for _ in responses:  # drain to the end of the call
                            pass
                        return
                    continue
                msg = next(responses, None)
                if msg is None:
                    raise errors.Internal(
                        "server ended the stream before answering every image")
                status = self._absorb(msg)
                if status is None:
                    continue
                p = self.pending.popleft()
                sent -= 1
                result = self._result(p, errors.from_status(status) if status.code else None)
                self._reset()
                yield result
        finally:
            requests.put(_END)
            call.cancel()


def extract_image(endpoints: Endpoints, spec: pb.ExtractionSpec, image: Any,
                  timeout: float | None) -> dict[str, np.ndarray]:
    """One image on the ExtractImage RPC: one request, its tensors back, the call's
    status as the image's. Moved to another address on UNAVAILABLE like a unary call
    (nothing of the answer is kept from a failed attempt). Raises the typed error."""
    try:
        request = pb.ExtractImageRequest(spec=spec, image=to_image(image, ""))
    except (OSError, TypeError, ValueError) as exc:
        raise errors.InvalidArgument(
            f"could not read image {default_id(image, 0)!r}: {exc}") from None
    deadline = None if timeout is None else time.monotonic() + timeout

    def call(stub: pb_grpc.FeatureExtractorStub) -> dict[str, np.ndarray]:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        got = Collected()
        for msg in stub.ExtractImage(request, timeout=left, metadata=endpoints.metadata):
            if msg.WhichOneof("payload") == "tensor":
                got.add(msg.tensor)
        if not got.complete or not got.features:
            raise errors.Internal("the server ended ExtractImage before the whole answer")
        return got.features

    return endpoints.call(call)
