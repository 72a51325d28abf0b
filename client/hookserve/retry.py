"""The one retry policy of the SDK and `hookserve batch`: which codes are tried again,
how long to wait before the next try, and how many tries there are.

- The SDK's failover (:class:`~.endpoints.Endpoints`): a call, or a stream's unanswered
  images, that fails with a :data:`RETRYABLE` code moves to another address, up to
  `retries` times.
- `hookserve batch` sends an image again after a per-image answer that
  :meth:`RetryPolicy.image_delay` accepts (UNAVAILABLE, or overload: RESOURCE_EXHAUSTED
  with the server's retry hint; the size limits' RESOURCE_EXHAUSTED would fail again),
  and a stream's unanswered images after the call ended with a :data:`RETRY_STREAM`
  code, each image up to `retries` times.
- The wait: the server's hint when it gave one, else :meth:`RetryPolicy.backoff`, which
  doubles from `first_backoff` per try, up to :data:`MAX_BACKOFF`, times a jitter of
  one half to one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import grpc

#: Codes on which the SDK moves a call (or a stream's unanswered images) elsewhere.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
#: Per-image codes worth another try (possibly on another server); RESOURCE_EXHAUSTED
#: only with a retry hint (:meth:`RetryPolicy.image_delay`).
RETRY_IMAGE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
#: Call-level codes after which a stream's unanswered images are sent again.
RETRY_STREAM = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
#: Tries after the first one (the SDK's `retries` default).
RETRIES = 3
#: The first wait, in seconds (the SDK's `retry_backoff` default).
FIRST_BACKOFF = 0.1
#: The longest wait between two tries, in seconds.
MAX_BACKOFF = 5.0


@dataclass(frozen=True)
class RetryPolicy:
    """How many more tries a failure gets, and how long to wait before each."""

    #: Tries after the first one.
    retries: int = RETRIES
    #: The first backoff in seconds; it doubles per try, up to MAX_BACKOFF.
    first_backoff: float = FIRST_BACKOFF

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try number `attempt` (1 for the first retry)."""
        base = min(MAX_BACKOFF, self.first_backoff * (2 ** attempt))
        return base * (0.5 + random.random() / 2)

    def again(self, attempt: int) -> bool:
        """Whether a failure at try `attempt` (0 for the first try) gets another one."""
        return attempt < self.retries

    @staticmethod
    def retryable(error: Any) -> bool:
        """Whether a per-image error (a :class:`~.errors.HookserveError`) is worth
        another try: UNAVAILABLE, or RESOURCE_EXHAUSTED from overload (with a hint)."""
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return error.retry_after_s is not None
        return error.code in RETRY_IMAGE

    def image_delay(self, error: Any, attempt: int) -> float | None:
        """After an image's error at try `attempt`: the seconds to wait before sending
        it again (the server's hint, else the backoff), or None when it is final."""
        if error is None or not self.retryable(error) or not self.again(attempt):
            return None
        return error.retry_after_s or self.backoff(attempt + 1)
