"""A REST request body as the front door reads it: held to --max-message-bytes as it
arrives (and as it expands, for a gzip or deflate body), and to BODY_IDLE_S between
its pieces and MIN_BODY_RATE on average after that, so a client that stalls or
trickles mid-body lets go of what its body holds."""

from __future__ import annotations

import asyncio
import time
import zlib

from ..errors import DeadlineExceeded, InvalidArgument, ResourceExhausted

#: The longest a request body may pause between two of its pieces: a client stalled
#: mid-body lets go of what its body holds of the bodies the server takes at once, so
#: stalled uploads cannot keep REST infer from everyone (HTTP 408).
BODY_IDLE_S = 30.0
#: ...and the slowest it may arrive on average once that long has passed (bytes a
#: second): a body trickled in a byte at a time lets go as a stalled one does, while
#: the largest body at this rate still takes a quarter of an hour.
MIN_BODY_RATE = 64 << 10


class BodyStalled(DeadlineExceeded):
    """No byte of a request body arrived for BODY_IDLE_S (answered 408)."""

    http_status = 408


async def read_body(request, limit: int, idle_s: float) -> bytes:
    """The body of a Starlette `request`, as sent before compression."""
    encoding = encoding_of(request)
    if encoding not in ("", *INFLATE):   # refused before its bytes are read
        raise InvalidArgument(f"Content-Encoding {encoding[:40]} is not one this "
                              "server reads: send the body as it is, or gzip or deflate")
    declared = request.headers.get("content-length")
    too_big = ResourceExhausted(
        f"the request body is over {limit} bytes, this server's limit "
        "(--max-message-bytes): send fewer or smaller images per request")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    pieces = request.stream().__aiter__()
    start = time.monotonic()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), idle_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyStalled(f"no byte of the request body arrived for {idle_s:g} s "
                              f"({len(body)} bytes read): send the body without "
                              "pausing") from None
        body += chunk
        if len(body) > limit:
            raise too_big
        elapsed = time.monotonic() - start
        if elapsed > idle_s and len(body) < MIN_BODY_RATE * elapsed:
            raise BodyStalled(f"the request body arrives at {len(body) / elapsed:.0f} bytes "
                              f"a second, under {MIN_BODY_RATE} ({len(body)} bytes in "
                              f"{elapsed:.0f} s): send it without pausing")
    if not encoding:
        return bytes(body)
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(inflate, body, encoding, limit)   # (off the loop)


#: The Content-Encodings a request body may have (besides none).
INFLATE = ("gzip", "deflate")
#: The most members a gzip body may hold, and the slice it is fed to zlib in.
MAX_MEMBERS = 64
INFLATE_SLICE = 1 << 16


def encoding_of(request) -> str:
    """The body's Content-Encoding, lower case; "" for none (or identity)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    return "" if encoding == "identity" else encoding


def inflate(body: bytes | bytearray, encoding: str, limit: int) -> bytes:
    """A gzip or deflate (zlib) body as sent before compression (tritonclient's
    request_compression_algorithm), every member of it (at most MAX_MEMBERS), held to
    `limit` bytes as it expands; bytes after the last member are refused. The body is
    fed in slices, so the time is linear in its size, however many members it holds."""
    if encoding not in INFLATE:
        raise InvalidArgument(f"Content-Encoding {encoding[:40]} is not one this server "
                              "reads: send the body as it is, or gzip or deflate")
    view, pos, out, members = memoryview(body), 0, bytearray(), 0
    while pos < len(view):
        members += 1
        if members > MAX_MEMBERS:
            raise InvalidArgument(f"the {encoding} body has over {MAX_MEMBERS} members: "
                                  "compress it as one")
        inflater = zlib.decompressobj(47)   # a zlib or gzip header, read from the data
        while not inflater.eof and pos < len(view):
            piece = view[pos:pos + INFLATE_SLICE]
            try:
                out += inflater.decompress(piece, limit + 1 - len(out))
            except zlib.error as exc:
                raise InvalidArgument(f"the body is not the {encoding} data its "
                                      f"Content-Encoding says ({exc})") from None
            if len(out) > limit:   # (the output bound reached: more was left to expand)
                raise ResourceExhausted(
                    f"the request body expands to over {limit} bytes, this server's "
                    "limit (--max-message-bytes): send fewer or smaller images per request")
            pos += len(piece) - len(inflater.unused_data)
        if not inflater.eof:
            raise InvalidArgument(f"the {encoding} body is cut short: send all of it")
    return bytes(out)
