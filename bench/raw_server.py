"""The transport ceiling: a minimal gRPC server that streams raw bytes.

No proto, no tensors, no model: a generic handler for ``/bench.Raw/Stream`` takes a
16-byte request (images, bytes per image, chunk size: three little-endian uint32
after a uint32 zero) and streams each "image" as chunk-sized ``bytes`` messages,
all pre-allocated, with identity (de)serialisers. It is the fastest Python gRPC can
move the same bytes, in the same message sizes, as hookserve streams a feature map.

Run as ``python bench/raw_server.py`` — it prints ``PORT <n>`` once it listens on
127.0.0.1 (port chosen by the OS) and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import signal
import struct
import sys
import threading
from concurrent import futures

import grpc

METHOD = "/bench.Raw/Stream"
REQUEST = struct.Struct("<IIII")
OPTIONS = [("grpc.max_send_message_length", 64 << 20),
           ("grpc.max_receive_message_length", 64 << 20)]


def request(images: int, image_bytes: int, chunk: int) -> bytes:
    return REQUEST.pack(0, images, image_bytes, chunk)


def _stream(req: bytes, context):
    _, images, image_bytes, chunk = REQUEST.unpack(req)
    full = bytes(chunk)
    tail = bytes(image_bytes % chunk)
    per_image = [full] * (image_bytes // chunk) + ([tail] if tail else [])
    for _ in range(images):
        yield from per_image


def serve_until_signal(service: str, handlers: dict, options=()) -> int:
    """Serve generic handlers on 127.0.0.1:0, print `PORT n`, stop on SIGTERM/SIGINT."""
    server = grpc.server(futures.ThreadPoolExecutor(8), options=options)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"PORT {port}", flush=True)
    stop.wait()
    server.stop(1).wait()
    return 0


def main() -> int:
    return serve_until_signal("bench.Raw", {
        "Stream": grpc.unary_stream_rpc_method_handler(
            _stream, request_deserializer=None, response_serializer=None)}, OPTIONS)


if __name__ == "__main__":
    sys.exit(main())
