"""Rate limiters with client-go workqueue semantics.

One protocol, :class:`RateLimiter`: ``when(env)`` says how long to wait (and records
the request), ``forget(env)`` clears what was recorded for an envelope, ``retries(env)``
says how many failures are recorded. A queue uses one as a dispatch limit
(``Queue(rate=...)``) and one to space failure retries (``Queue(limiter=...)``).

The limiters and the client-go types they follow (``k8s.io/client-go/util/workqueue``,
``default_rate_limiters.go``):

- :class:`ExponentialBackoff` — ``ItemExponentialFailureRateLimiter``: ``min(cap, base·2^n)``
  where ``n`` counts the envelope's earlier failures.
- :class:`TokenBucket` — ``BucketRateLimiter`` over ``golang.org/x/time/rate``: the time
  until a token is free.
- :class:`MaxOf` — ``MaxOfRateLimiter``: the largest answer of several limiters.
- :class:`FastSlow` — ``ItemFastSlowRateLimiter``: ``fast`` for the first
  ``fast_attempts`` failures, then ``slow``.
- :func:`default_limiter` — the older edition's default,
  ``MaxOf(ExponentialBackoff(1, 30), TokenBucket(5, burst=10))``.

All limiters read the running event loop's clock, so they follow virtual time in tests.
They are not thread-safe: use one from one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Final, Protocol, runtime_checkable

from envq import _checks
from envq._schedule import capped_exponential

__all__ = [
    "ExponentialBackoff",
    "FastSlow",
    "MaxOf",
    "RateLimiter",
    "TokenBucket",
    "ask_limiter",
    "default_limiter",
    "forget_limiter",
]

log = logging.getLogger("envq")


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


#: The largest ``TokenBucket.burst``: the bucket counts tokens in a float, exact up to 2**53.
_MAX_BURST: Final = 2**53


def _loop_clock() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class TokenBucket:
    """A token bucket: ``rate`` tokens per second, at most ``burst`` saved up.

    ``when()`` reserves a token and returns how long until it is available (0 when one
    is in the bucket), like client-go's ``BucketRateLimiter`` over
    ``golang.org/x/time/rate``'s ``Reserve().Delay()``: the bucket starts full, refills
    at ``rate`` per second up to ``burst``, and a reservation made while it is empty
    borrows from the future (the next caller waits behind it). The bucket is shared by
    every envelope: ``forget`` does nothing and ``retries`` is always 0.

    :param rate: tokens per second (> 0).
    :param burst: the bucket's size (an int ≥ 1).
    :param clock: seconds on a monotonic clock; default: the running loop's clock.
    """

    def __init__(
        self, rate: float, burst: int = 1, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.rate = _checks.finite("TokenBucket: rate", rate)
        if not self.rate > 0:
            raise ValueError(
                f"TokenBucket: rate must be a positive number, got {_checks.show(rate)}"
            )
        self.burst = _checks.integer("TokenBucket: burst", burst, minimum=1, maximum=_MAX_BURST)
        if clock is not None:
            _checks.plain_callable("TokenBucket: clock", clock, "the bucket reads it synchronously")
        self._clock = clock or _loop_clock
        self._tokens = float(burst)
        self._last: float | None = None

    def __repr__(self) -> str:
        return f"TokenBucket(rate={self.rate:g}, burst={self.burst})"

    def when(self, env: object = None) -> float:
        """Reserve one token; seconds until it may be used."""
        now = self._clock()
        if self._last is not None:
            # A clock that went backwards adds nothing (x/time/rate does the same).
            elapsed = max(0.0, now - self._last)
            self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def forget(self, env: object = None) -> None:
        """Nothing to forget: the bucket is shared by every envelope."""

    def retries(self, env: object = None) -> int:
        """A bucket tracks no per-envelope failures: always 0."""
        return 0


class ExponentialBackoff:
    """Per-envelope exponential backoff (client-go's ``ItemExponentialFailureRateLimiter``).

    The n-th call of ``when(env)`` since ``env`` was last forgotten returns
    ``min(cap, base · 2^(n−1))``: ``base``, ``2·base``, ``4·base``, … up to ``cap``.
    ``retries(env)`` is the number of failures recorded; ``forget(env)`` clears them.

    :param base: the first delay, in seconds (> 0); client-go's default is 5 ms.
    :param cap: the largest delay, in seconds (> 0); client-go's default is 1000 s.
    """

    def __init__(self, base: float = 0.005, cap: float = 1000.0) -> None:
        self.base = _checks.seconds("ExponentialBackoff: base", base, positive=True)
        self.cap = _checks.seconds("ExponentialBackoff: cap", cap, positive=True)
        self._failures: dict[object, int] = {}

    def __repr__(self) -> str:
        return f"ExponentialBackoff(base={self.base:g}, cap={self.cap:g})"

    def when(self, env: object) -> float:
        """Record a failure of ``env``; the delay before its retry."""
        exp = self._failures.get(env, 0)
        self._failures[env] = exp + 1
        return capped_exponential(self.base, exp, self.cap)

    def forget(self, env: object) -> None:
        """Clear ``env``'s failures."""
        self._failures.pop(env, None)

    def retries(self, env: object) -> int:
        """Failures recorded for ``env`` since it was last forgotten."""
        return self._failures.get(env, 0)


class FastSlow:
    """Retry quickly a few times, then slowly (client-go's ``ItemFastSlowRateLimiter``).

    The first ``fast_attempts`` calls of ``when(env)`` since ``env`` was last forgotten
    return ``fast``; every later one returns ``slow``.

    :param fast: the short delay, in seconds (≥ 0).
    :param slow: the long delay, in seconds (≥ 0).
    :param fast_attempts: how many failures get the short delay (an int ≥ 0).
    """

    def __init__(self, fast: float, slow: float, fast_attempts: int) -> None:
        self.fast = _checks.seconds("FastSlow: fast", fast)
        self.slow = _checks.seconds("FastSlow: slow", slow)
        self.fast_attempts = _checks.integer("FastSlow: fast_attempts", fast_attempts, minimum=0)
        self._failures: dict[object, int] = {}

    def __repr__(self) -> str:
        return (
            f"FastSlow(fast={self.fast:g}, slow={self.slow:g}, fast_attempts={self.fast_attempts})"
        )

    def when(self, env: object) -> float:
        """Record a failure of ``env``; ``fast`` while within ``fast_attempts``, else ``slow``."""
        n = self._failures.get(env, 0) + 1
        self._failures[env] = n
        return self.fast if n <= self.fast_attempts else self.slow

    def forget(self, env: object) -> None:
        """Clear ``env``'s failures."""
        self._failures.pop(env, None)

    def retries(self, env: object) -> int:
        """Failures recorded for ``env`` since it was last forgotten."""
        return self._failures.get(env, 0)


class MaxOf:
    """The strictest of several limiters (client-go's ``MaxOfRateLimiter``).

    ``when(env)`` asks *every* limiter (each records the request) and returns the
    largest answer; ``forget(env)`` forgets ``env`` in all of them; ``retries(env)`` is
    the largest of their counts.

    :param limiters: one or more :class:`RateLimiter` objects.
    """

    def __init__(self, *limiters: RateLimiter) -> None:
        if not limiters:
            raise ValueError("MaxOf needs at least one limiter, got none")
        for i, lim in enumerate(limiters):
            _checks.limiter(f"MaxOf: limiters[{i}]", lim)
        self.limiters: tuple[RateLimiter, ...] = limiters

    def __repr__(self) -> str:
        return f"MaxOf({', '.join(map(repr, self.limiters))})"

    def when(self, env: object) -> float:
        """The longest wait any limiter asks for (every limiter records the request)."""
        return max([lim.when(env) for lim in self.limiters])

    def forget(self, env: object) -> None:
        """Forget ``env`` in every limiter."""
        for lim in self.limiters:
            lim.forget(env)

    def retries(self, env: object) -> int:
        """The largest failure count any limiter holds for ``env``."""
        return max(lim.retries(env) for lim in self.limiters)


def default_limiter() -> MaxOf:
    """The older edition's default failure limiter, as a fresh object:
    ``MaxOf(ExponentialBackoff(1, 30), TokenBucket(5, burst=10))``.

    Per envelope, retries wait 1, 2, 4, 8, 16, 30, 30, … seconds; across all
    envelopes, at most 10 retries at once and 5 per second after that.
    """
    return MaxOf(ExponentialBackoff(1.0, 30.0), TokenBucket(5.0, burst=10))


# The queue's side: a limiter is user code, so what it answers is checked.


class Labelled(Protocol):
    """What the queue asks a limiter about: anything that names itself in a log line."""

    def label(self) -> str:
        """A short description for messages."""
        ...


def ask_limiter(name: str, limiter: RateLimiter, env: Labelled, role: str) -> float:
    """``limiter.when(env)`` as seconds to wait; a limiter that raises or answers
    with something other than a finite number >= 0 is logged and means 0."""
    try:
        wait = limiter.when(env)
        if wait.__class__ is float or wait.__class__ is int:
            if 0 <= wait < math.inf:
                return wait
        elif isinstance(wait, int | float) and not isinstance(wait, bool):
            wait = float(wait)
            if 0 <= wait < math.inf:
                return wait
        log.error(
            "queue %r: %s limiter %r answered %r for %s, not a number of seconds (0 used)",
            name,
            role,
            limiter,
            wait,
            env.label(),
        )
    except BaseException:
        log.exception(
            "queue %r: %s limiter %r failed for %s (0 used)",
            name,
            role,
            limiter,
            env.label(),
        )
    return 0.0


def forget_limiter(name: str, limiter: RateLimiter, env: Labelled) -> None:
    """``limiter.forget(env)``; a limiter that raises is logged."""
    try:
        limiter.forget(env)
    except BaseException:
        log.exception("queue %r: limiter %r failed to forget %s", name, limiter, env.label())
