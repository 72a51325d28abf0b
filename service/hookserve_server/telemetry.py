"""Observation points of the engine and the servicer; metrics.py records them."""

from __future__ import annotations


class Telemetry:
    """All no-ops here: PrometheusTelemetry (metrics.py) overrides them."""

    def queue_depth(self, device: str, depth: int) -> None: ...
    def preprocess_seconds(self, seconds: float) -> None: ...
    def queue_wait_seconds(self, seconds: float) -> None: ...
    def forward(self, model: str, batch_size: int, seconds: float) -> None: ...
    def serialize_seconds(self, seconds: float) -> None: ...
    def image_done(self, model: str, code: str) -> None: ...
    def bytes_sent(self, model: str, nbytes: int) -> None: ...
    def cache_event(self, tier: str, event: str, n: int = 1) -> None:
        """Answer-cache units by tier (local, shared) and event (hit, miss, coalesced,
        eviction, error, store)."""
    def cache_bytes(self, tier: str, nbytes: int) -> None: ...
    def compile_event(self, event: str, n: int = 1) -> None:
        """Compiled extraction graphs (engine/compiled.py) by event: compile, hit (a
        batch ran a compiled graph), eager (it did not), eviction, failure."""
    def compile_state(self, seconds: float, nbytes: int) -> None:
        """Seconds one compile took; the memory estimate of the graphs kept."""
    def call_done(self, method: str, model: str, code: str,
                  attribution_method: str = "") -> None:
        """One finished call: `method` is the RPC (Extract, Attribute, ...);
        `attribution_method` the Attribute call's method (grad_cam, ...), else ""."""
