"""Prometheus metrics (`--metrics-port`): a Telemetry that records into a registry."""

from __future__ import annotations

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from .telemetry import Telemetry

_LAT = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)


class PrometheusTelemetry(Telemetry):
    """Requests and images by model and code, stage latencies, batch sizes, bytes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "hookserve_requests_total",
            "Calls by RPC (method), model, code and, for Attribute, attribution method",
            ["method", "model", "code", "attribution_method"], registry=r)
        self.images = Counter("hookserve_images_total", "Images answered by model and code",
                              ["model", "code"], registry=r)
        self.bytes = Counter("hookserve_bytes_sent_total", "Tensor bytes sent", ["model"],
                             registry=r)
        self.queue_wait = Histogram("hookserve_queue_wait_seconds",
                                    "Time an image waited in the batch queue", buckets=_LAT,
                                    registry=r)
        self.preprocess = Histogram("hookserve_preprocess_seconds",
                                    "Decode + resize + crop time per image", buckets=_LAT,
                                    registry=r)
        self.forward_s = Histogram("hookserve_forward_seconds", "Forward pass time per batch",
                                   ["model"], buckets=_LAT, registry=r)
        self.serialize = Histogram("hookserve_serialize_seconds",
                                   "Encoding one image's tensors for the wire", buckets=_LAT,
                                   registry=r)
        self.batch_size = Histogram("hookserve_batch_size", "Images per forward pass",
                                    ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                    registry=r)
        self.depth = Gauge("hookserve_queue_depth", "Images waiting for the model", ["device"],
                           registry=r)
        self.cache_events = Counter(
            "hookserve_cache_events_total",
            "Answer-cache units by tier (local, shared) and event (hit, miss, coalesced: "
            "waited on the same key's computation, eviction, error: the shared tier "
            "failed, timed out or was skipped, or a value read back did not match its key, "
            "counted as a miss too; store: written to Redis; dropped: not written, the "
            "write queue was full)",
            ["tier", "event"], registry=r)
        self.cache_size = Gauge("hookserve_cache_bytes", "Bytes the local answer cache holds",
                                ["tier"], registry=r)
        self.compile_events = Counter(
            "hookserve_compile_events_total",
            "Compiled extraction graphs by event (compile, hit: a batch ran a compiled "
            "graph, eager: it did not, eviction, failure)", ["event"], registry=r)
        self.compile_s = Counter("hookserve_compile_seconds_total",
                                 "Seconds spent compiling extraction graphs", registry=r)
        self.compiled_bytes = Gauge("hookserve_compiled_graph_bytes",
                                    "Memory estimate of the compiled graphs kept", registry=r)
        mem = Gauge("hookserve_device_memory_bytes", "Device memory allocated by tensors",
                    ["device"], registry=r)
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                mem.labels(f"cuda:{i}").set_function(
                    lambda i=i: torch.cuda.memory_allocated(i))

    def queue_depth(self, device, depth):
        self.depth.labels(device).set(depth)

    def preprocess_seconds(self, seconds):
        self.preprocess.observe(seconds)

    def queue_wait_seconds(self, seconds):
        self.queue_wait.observe(seconds)

    def forward(self, model, batch_size, seconds):
        self.forward_s.labels(model).observe(seconds)
        self.batch_size.labels(model).observe(batch_size)

    def serialize_seconds(self, seconds):
        self.serialize.observe(seconds)

    def image_done(self, model, code):
        self.images.labels(model, code).inc()

    def bytes_sent(self, model, nbytes):
        self.bytes.labels(model).inc(nbytes)

    def cache_event(self, tier, event, n=1):
        self.cache_events.labels(tier, event).inc(n)

    def cache_bytes(self, tier, nbytes):
        self.cache_size.labels(tier).set(nbytes)

    def compile_event(self, event, n=1):
        self.compile_events.labels(event).inc(n)

    def compile_state(self, seconds, nbytes):
        self.compile_s.inc(seconds)
        self.compiled_bytes.set(nbytes)

    def call_done(self, method, model, code, attribution_method=""):
        self.requests.labels(method, model, code, attribution_method).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (0 picks one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]
