"""The asyncio client: :class:`Client` over grpc.aio, the same calls with ``await``.

    import hookserve.aio

    async with hookserve.aio.Client("localhost:50051") as c:
        f = await c.extract("cat.jpg", ["layer4"], reduction="avg")
        async for r in c.extract_many(paths, ["layer4"], reduction="avg"):
            if r.ok:
                use(r.id, r.features["layer4"])

It shares everything but the I/O with :class:`hookserve.Client` (:mod:`.base`): the
options and their checks, the specs, the decoding of answers into :class:`~.Result`
and :class:`~.Attribution`, the typed errors, and the failover policy of
:class:`~.endpoints.Endpoints`. The streams run :meth:`.Extraction.steps`, the same
exchange the sync client drives, with awaits: lazy, at most `max_in_flight` images
unanswered, answers in order, a failed image as a result with ``.error``, and on
UNAVAILABLE the unanswered images re-sent to the next address.

One event loop per Client: its channels are made on its first call, in the loop that
runs it. Files named by path are read in a worker thread, not on the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np

from . import errors, wire
from .attribution import AUTO_LAYER, Attribution
from .base import (
    ClientBase,
    deadline_of,
    health_request,
    health_status,
)
from .extraction import END, PULL, READ, SEND, Extraction, _Pending, advance
from .types import ModelDescription, ModelInfo, Size, describe_request
from .v1 import hookserve_pb2 as pb
from .v1 import hookserve_pb2_grpc as pb_grpc

__all__ = ["Client"]

T = TypeVar("T")
_NONE = object()


def _is_path(obj: Any) -> bool:
    return isinstance(obj, (str, os.PathLike))


async def _send(call: Any, queue: asyncio.Queue) -> None:
    """A stream's sender (a task of its own, so that sending never waits on reading):
    the requests the exchange puts on `queue`, then the half-close at :data:`END`.

    A send that fails means the server has ended the call: the sender stops quietly
    and the reader gets the call's status. grpc.aio's own ``write()`` would replace
    that status with INTERNAL "Internal error from Core" when the two race (nearly
    always when a server refuses a stream at once: grpc/grpc#36066), so the call's
    underlying sender is used where grpc has it.
    """
    raw = getattr(call, "_cython_call", None)
    try:
        await call.wait_for_connection()
        while (item := await queue.get()) is not END:
            if raw is None:
                await call.write(item)
            else:
                await raw.send_serialized_message(wire.serialize(item))
        await (call.done_writing() if raw is None else raw.send_receive_close())
    except asyncio.CancelledError:
        raise
    except Exception:  # the call is over: its status comes with the answers
        return


async def _pull(run: Extraction) -> _Pending | None:
    """The next image of a sync or async iterable, admitted (None once it ran out);
    a file is read in a worker thread."""
    if run.source is None:
        images: Any = run.images
        run.source = aiter(images) if hasattr(images, "__aiter__") else iter(images)
    source: Any = run.source
    try:
        if hasattr(source, "__anext__"):
            try:
                obj = await anext(source)
            except StopAsyncIteration:
                run.source_error = run.leftover()
                return None
        elif (obj := next(source, _NONE)) is _NONE:
            run.source_error = run.leftover()
            return None
        return await asyncio.to_thread(run.admit, obj) if _is_path(obj) else run.admit(obj)
    except Exception as exc:  # noqa: BLE001 - the caller's (its images, or ids that ran
        run.source_error = exc   # out); raised after the answered results
        return None


class Client(ClientBase):
    __doc__ = (ClientBase.__doc__ or "") + """
    The asyncio twin of :class:`hookserve.Client`: ``async with`` it, or ``await``
    :meth:`close`. ``await`` :meth:`list_models`, :meth:`describe`, :meth:`health`,
    :meth:`extract` and :meth:`attribute`; :meth:`extract_many` and
    :meth:`attribute_many` return async iterators (``async for``). Their options,
    results and errors are the sync client's.

    Leaving an ``async for`` early (``break``) cancels the call once the iterator is
    closed: wrap it in ``contextlib.aclosing(...)`` to close it at once. Cancelling
    the task that iterates cancels the call.
    """

    _aio = True

    # -- lifetime ----------------------------------------------------------------------
    async def close(self) -> None:
        """Close every channel (cancelling calls still open). Further calls raise
        ValueError."""
        await asyncio.gather(*self._endpoints.close())

    def __enter__(self) -> Client:
        raise TypeError("hookserve.aio.Client is used with `async with`, not `with` (or "
                        "use hookserve.Client for blocking calls)")

    def __exit__(self, *exc: object) -> None:  # (never entered: see __enter__)
        return None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable[[pb_grpc.FeatureExtractorStub], Awaitable[T]]) -> T:
        """``await fn(stub)`` on the next address, moved to another one on UNAVAILABLE."""
        endpoints = self._endpoints
        for attempt in itertools.count():
            index = endpoints.pick()
            try:
                return await fn(endpoints.stubs[index])
            except grpc.RpcError as exc:
                delay = endpoints.failed(exc, index, attempt)
            except asyncio.CancelledError:
                if _closed_under(endpoints):   # the client's close, not an asyncio cancel
                    raise errors.Cancelled("the client was closed while this call ran",
                                           grpc.StatusCode.CANCELLED) from None
                raise
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _unary(self, method: str, request: Any) -> Any:
        return await self._call(lambda stub: getattr(stub, method)(
            request, timeout=self.timeout, metadata=self._endpoints.metadata))

    # -- unary calls -------------------------------------------------------------------
    async def list_models(self) -> list[ModelInfo]:
        """The models the server holds; the first is its default."""
        return self._models_of(await self._unary("ListModels", pb.ListModelsRequest()))

    async def describe(self, model: str | None = None, size: Size | None = None
                       ) -> ModelDescription:
        """Every hookable layer of `model` with its output shape at input `size`, as
        :meth:`hookserve.Client.describe`."""
        return ModelDescription.from_proto(
            await self._unary("DescribeModel", describe_request(model, size)))

    async def health(self, service: str = "") -> str:
        """grpc.health.v1 Check on the first address: "SERVING", "NOT_SERVING", ..."""
        try:
            raw = await self._health_check()(health_request(service), timeout=self.timeout,
                                             metadata=self._endpoints.metadata)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return health_status(raw)

    # -- one image ---------------------------------------------------------------------
    async def extract(self, image: Any, layers: Any, model: str | None = None,
                      **options: Any) -> dict[str, np.ndarray]:
        """Features of one image, as :meth:`hookserve.Client.extract`."""
        if _is_path(image):
            one = await asyncio.to_thread(self._image_call, image, layers, model, options)
        else:
            one = self._image_call(image, layers, model, options)
        if one is not None:
            call = one

            async def attempt(stub: pb_grpc.FeatureExtractorStub) -> dict[str, np.ndarray]:
                async for msg in call.open(stub):
                    call.take(msg)
                return call.features()

            try:
                return await self._call(attempt)
            except errors.HookserveError as exc:
                self._without_image_rpc(exc)
        results = [r async for r in self.extract_many(
            [image], layers, model=model, _deadline=deadline_of(self.timeout), **options)]
        return results[0].raise_for_error()

    async def attribute(self, image: Any, layer: str | None = AUTO_LAYER,
                        method: str = "grad_cam", target: int | None = None,
                        model: str | None = None, **options: Any) -> Attribution:
        """One image's saliency map, as :meth:`hookserve.Client.attribute`."""
        self._attribute_options(options, model)
        results = [a async for a in self.attribute_many(
            [image], layer, method, model=model, targets=[target],
            _deadline=deadline_of(self.timeout), **options)]
        return results[0].raise_for_error()

    # -- streams -----------------------------------------------------------------------
    def _drive(self, run: Extraction) -> AsyncIterator[Any]:
        return self._stream(run)

    async def _stream(self, run: Extraction) -> AsyncIterator[Any]:
        """Drive ``run.steps()`` on one call after another (failover) with awaits."""
        if getattr(run, "default_geometry", False) and self._geometries is None:
            await self.list_models()  # overlays need the model's default geometry
        endpoints = self._endpoints
        attempt = 0   # failures since the last answer (Endpoints.stream)
        while True:
            index = endpoints.pick()
            answered = False
            queue: asyncio.Queue = asyncio.Queue()
            call = getattr(endpoints.stubs[index], run.rpc)(
                timeout=run.time_left(), metadata=endpoints.metadata)
            run._opened(call)
            sender = asyncio.create_task(_send(call, queue))
            steps = run.steps()
            try:
                reply = None
                while (step := advance(steps, reply)) is not None:
                    op, arg = step
                    reply = None
                    if op is SEND:
                        queue.put_nowait(arg)
                    elif op is PULL:
                        reply = await _pull(run)
                    elif op is READ:
                        msg = await call.read()
                        reply = None if msg is grpc.aio.EOF else msg
                    else:
                        answered = True
                        yield arg
                return
            except grpc.RpcError as exc:
                attempt = 0 if answered else attempt
                delay = endpoints.failed(exc, index, attempt, stream=True)
                attempt += 1
            except asyncio.CancelledError:
                if _closed_under(endpoints):   # the client's close, not an asyncio cancel
                    raise errors.Cancelled("the client was closed while this call ran",
                                           grpc.StatusCode.CANCELLED) from None
                raise
            finally:
                sender.cancel()
                call.cancel()
            await asyncio.sleep(delay)


def _closed_under(endpoints: Any) -> bool:
    """Whether grpc.aio cancelled a call because the client was closed under it (the
    sync client's hookserve.Cancelled then), not because its task was cancelled."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)   # (Python 3.11 on; before, a task's
    return bool(endpoints.closed and cancelling is not None and not cancelling())  # own)
