"""One ``extract_many`` run: the Extract stream, its window, and the order of results.

Data flow: the caller's images are pulled lazily (at most `window` sent and not yet
answered), turned into wire Images (:mod:`.images`), and put on a request queue that
gRPC's sender thread drains. The calling thread reads the answers: tensor chunks are
reassembled (:mod:`.tensors`) until the image's status message ends it, and results
are yielded in input order. If the server goes UNAVAILABLE, :class:`~.endpoints.Endpoints`
opens the stream again on another address and the unanswered images are re-sent.
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
from .tensors import TensorAssembler
from .types import Result
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc


@dataclass
class _Pending:
    index: int
    id: str
    image: pb.Image | None          # None: failed locally before sending
    error: errors.HookserveError | None = None


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

    def run(self) -> Iterator[Result]:
        return self.endpoints.stream(self._stream)

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
        call = stub.Extract(gen(), timeout=timeout, metadata=self.endpoints.metadata)
        requests.put(pb.ExtractRequest(spec=self.spec))
        sent = 0
        for p in self.pending:  # re-send what the last stream left unanswered
            if p.image is not None:
                requests.put(pb.ExtractRequest(image=p.image))
                sent += 1
        try:
            responses = iter(call)
            assembling: dict[str, TensorAssembler] = {}
            features: dict[str, np.ndarray] = {}
            closed = False
            while True:
                while not self.exhausted and sent < self.window:
                    p = self._pull()
                    if p is None:
                        break
                    self.pending.append(p)
                    if p.image is not None:
                        requests.put(pb.ExtractRequest(image=p.image))
                        sent += 1
                while self.pending and self.pending[0].image is None:
                    p = self.pending.popleft()
                    yield Result(p.index, p.id, error=p.error)
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
                which = msg.WhichOneof("payload")
                if which == "tensor":
                    c = msg.tensor
                    a = assembling.get(c.layer)
                    if a is None:
                        a = assembling[c.layer] = TensorAssembler(c)
                    a.add(c)
                    if a.complete:
                        features[c.layer] = a.array()
                        del assembling[c.layer]
                    continue
                if which != "status":
                    continue
                p = self.pending.popleft()
                sent -= 1
                if msg.status.code == 0:
                    yield Result(p.index, p.id, features=features)
                else:
                    yield Result(p.index, p.id, error=errors.from_status(msg.status))
                features = {}
                assembling = {}
        finally:
            requests.put(_END)
            call.cancel()
