"""Rate limiters with client-go workqueue semantics (contract §7).

One protocol, :class:`RateLimiter`: ``when(env)`` says how long to wait (and records
the request), ``forget(env)`` clears what was recorded for an envelope, ``retries(env)``
says how many failures are recorded. A queue uses one as a dispatch limit
(``Queue(rate=...)``) and one to space failure retries (``Queue(limiter=...)``).

All limiters read the running event loop's clock, so they follow virtual time in tests.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["ExponentialBackoff", "RateLimiter", "TokenBucket"]


@runtime_checkable
class RateLimiter(Protocol):
    """How long an envelope must wait, client-go style."""

    def when(self, env: object) -> float:
        """Seconds ``env`` must wait now; the call counts as one request/failure."""
        ...

    def forget(self, env: object) -> None:
        """Stop tracking ``env`` (it succeeded or ended)."""
        ...

    def retries(self, env: object) -> int:
        """How many times ``when(env)`` was called since the last ``forget(env)``."""
        ...


def _loop_clock() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be a finite {'non-negative' if allow_zero else 'positive'} "
            f"number, got {value!r}"
        )
    return v


class TokenBucket:
    """A token bucket: ``rate`` tokens per second, at most ``burst`` saved up.

    ``when()`` reserves a token and returns how long until it is available (0 when one
    is in the bucket), like client-go's ``BucketRateLimiter`` over ``rate.Limiter``.
    The bucket starts full.
    """

    def __init__(
        self, rate: float, burst: int = 1, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.rate = _positive("TokenBucket.rate", rate)
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"TokenBucket.burst must be an int >= 1, got {burst!r}")
        self.burst = burst
        self._clock = clock or _loop_clock
        self._tokens = float(burst)
        self._last: float | None = None
        self._requests = 0

    def when(self, env: object = None) -> float:
        """Reserve one token; seconds until it may be used."""
        now = self._clock()
        if self._last is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1.0
        self._requests += 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def forget(self, env: object = None) -> None:
        """Nothing to forget: the bucket is shared by every envelope."""

    def retries(self, env: object = None) -> int:
        """A bucket tracks no per-envelope failures: always 0."""
        return 0


class ExponentialBackoff:
    """``base · 2^failures`` seconds per envelope, capped at ``cap`` (client-go's
    ``ItemExponentialFailureRateLimiter``)."""

    def __init__(self, base: float = 0.005, cap: float = 1000.0) -> None:
        self.base = _positive("ExponentialBackoff.base", base)
        self.cap = _positive("ExponentialBackoff.cap", cap)
        self._failures: dict[object, int] = {}

    def when(self, env: object) -> float:
        """Record a failure of ``env``; the delay before its retry."""
        exp = self._failures.get(env, 0)
        self._failures[env] = exp + 1
        if exp > 1023:
            return self.cap
        return min(self.cap, self.base * 2.0**exp)

    def forget(self, env: object) -> None:
        """Clear ``env``'s failures."""
        self._failures.pop(env, None)

    def retries(self, env: object) -> int:
        """Failures recorded for ``env`` since it was last forgotten."""
        return self._failures.get(env, 0)
