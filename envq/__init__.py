"""envq — an asyncio-native, formally modelled in-process queue and scheduler.

Envelopes (units of work) run on a fixed worker pool with one-off and periodic
schedules, per-attempt deadlines, hooks, middleware ("stamps"), failure decisions,
retries with backoff, a capacity limit with backpressure, dedup by identity, and a
restartable Start/Stop/Start lifecycle. The lifecycle and the per-envelope outcomes are
explicit state machines whose transition tables live, as data, in ``envq._machine``.

Type aliases (for annotating your own callables):

- ``Invoke`` — an envelope's ``invoke``/``before``/``after``/``on_success``:
  ``(env) -> None``, ``async def`` or plain.
- ``FailureHook`` — ``on_failure``: ``(env, exc, attempt) -> Decision | None``.
- ``Invoker`` — what a stamp wraps: ``async (env) -> None``.
- ``Stamp`` — middleware: ``(Invoker) -> Invoker``.
"""

from envq._envelope import Envelope, FailureHook, Invoke, Invoker, Stamp
from envq._errors import (
    AlreadyComplete,
    BadEnvelope,
    BadIntervals,
    CapacityExceeded,
    DoNotRetry,
    EnvqError,
    MaxRetriesExceeded,
    QueueNotRunning,
    QueueShuttingDown,
    QueueStopping,
    QueueTerminated,
    StopEnvelope,
    StopType,
    TypeBlacklisted,
)
from envq._limits import ExponentialBackoff, RateLimiter, TokenBucket
from envq._machine import EnvState, Kind, Outcome, QueueState
from envq._queue import Queue
from envq._stamps import logging_stamp
from envq._values import (
    FIXED_DELAY,
    FIXED_RATE,
    Decision,
    Event,
    HookTimeout,
    Retry,
    Schedule,
    Statistics,
    StopMode,
    StopReport,
    drop,
    retry_after,
    retry_now,
)

__version__ = "0.1.0"

__all__ = [
    "FIXED_DELAY",
    "FIXED_RATE",
    "AlreadyComplete",
    "BadEnvelope",
    "BadIntervals",
    "CapacityExceeded",
    "Decision",
    "DoNotRetry",
    "EnvState",
    "Envelope",
    "EnvqError",
    "Event",
    "ExponentialBackoff",
    "FailureHook",
    "HookTimeout",
    "Invoke",
    "Invoker",
    "Kind",
    "MaxRetriesExceeded",
    "Outcome",
    "Queue",
    "QueueNotRunning",
    "QueueShuttingDown",
    "QueueState",
    "QueueStopping",
    "QueueTerminated",
    "RateLimiter",
    "Retry",
    "Schedule",
    "Stamp",
    "Statistics",
    "StopEnvelope",
    "StopMode",
    "StopReport",
    "StopType",
    "TokenBucket",
    "TypeBlacklisted",
    "drop",
    "logging_stamp",
    "retry_after",
    "retry_now",
]
