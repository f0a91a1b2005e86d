"""envq — an asyncio-native, formally modelled queue and scheduler, in one process or
shared on PostgreSQL (:mod:`envq.postgres`).

Envelopes (units of work) run on a fixed worker pool with one-off and periodic
schedules, per-attempt deadlines, hooks, middleware ("stamps"), failure decisions,
retries with backoff, a capacity limit with backpressure, dedup by ``id`` (by identity
without one), and a restartable Start/Stop/Start lifecycle. The lifecycle and the
per-envelope outcomes are explicit state machines whose transition tables live, as
data, in ``envq._machine``.

Observability (``docs/observability.md``): every state change is an :class:`Event` for
the listeners of ``Queue.subscribe``; :func:`prometheus_metrics` exports client-go's
workqueue metrics and envq's own (extra ``envq[prometheus]``), :func:`serve_metrics`
serves them over HTTP, :func:`logging_stamp` logs each attempt with structured fields
and :func:`otel_stamp` traces it (extra ``envq[otel]``). The optional packages are
imported only when these functions are called.

Type aliases (for annotating your own callables):

- ``Invoke`` — an envelope's ``invoke``/``before``/``after``/``on_success``:
  ``(env) -> None``, ``async def`` or plain.
- ``FailureHook`` — ``on_failure``: ``(env, exc, attempt) -> Decision | None``.
- ``Invoker`` — what a stamp wraps: ``async (env) -> None``.
- ``Stamp`` — middleware: ``(Invoker) -> Invoker``.
- ``TaskFn`` — a task's work, called with the task's arguments: ``(*args,
  **kwargs) -> Any``, ``async def`` or plain.
- ``AfterCallback`` — a task's ``after(error)`` callback.

The dowork-style task API: ``envq.submit(fn)``, ``envq.enqueue(task)``,
``envq.Task(fn).retries(5).within(10)…``, ``envq.TaskQueue``,
``envq.BackgroundQueue`` (for synchronous programs) and ``envq.shutdown()``.
"""

from envq._background import BackgroundQueue, enqueue, shutdown, submit
from envq._envelope import Envelope, FailureHook, Invoke, Invoker, Stamp
from envq._errors import (
    AlreadyComplete,
    BadEnvelope,
    BadEnvelopeType,
    BadIntervals,
    CapacityExceeded,
    DoNotRetry,
    EnvqError,
    MaxRetriesExceeded,
    QueueNotRunning,
    QueueShuttingDown,
    QueueStopping,
    QueueTerminated,
    SendTimeout,
    StopEnvelope,
    StopType,
    TypeBlacklisted,
)
from envq._limits import (
    ExponentialBackoff,
    FastSlow,
    MaxOf,
    RateLimiter,
    TokenBucket,
    default_limiter,
)
from envq._machine import EnvState, Kind, Outcome, QueueState
from envq._metrics import MetricsServer, PrometheusMetrics, prometheus_metrics, serve_metrics
from envq._otel import otel_stamp
from envq._protocol import Count, Done, QueueProtocol
from envq._queue import Attempt, Queue, current_attempt
from envq._reports import Event, LiveEnvelope, StopReport
from envq._schedule import Cron, Timing
from envq._stamps import logging_stamp
from envq._task import AfterCallback, Task, TaskFn
from envq._tasks import TaskQueue
from envq._values import (
    FIXED_DELAY,
    FIXED_RATE,
    Decision,
    HookTimeout,
    Rejection,
    Retry,
    Schedule,
    Statistics,
    StopMode,
    drop,
    retry_after,
    retry_now,
)

__version__ = "0.1.0"

__all__ = [
    "FIXED_DELAY",
    "FIXED_RATE",
    "AfterCallback",
    "AlreadyComplete",
    "Attempt",
    "BackgroundQueue",
    "BadEnvelope",
    "BadEnvelopeType",
    "BadIntervals",
    "CapacityExceeded",
    "Count",
    "Cron",
    "Decision",
    "DoNotRetry",
    "Done",
    "EnvState",
    "Envelope",
    "EnvqError",
    "Event",
    "ExponentialBackoff",
    "FailureHook",
    "FastSlow",
    "HookTimeout",
    "Invoke",
    "Invoker",
    "Kind",
    "LiveEnvelope",
    "MaxOf",
    "MaxRetriesExceeded",
    "MetricsServer",
    "Outcome",
    "PrometheusMetrics",
    "Queue",
    "QueueNotRunning",
    "QueueProtocol",
    "QueueShuttingDown",
    "QueueState",
    "QueueStopping",
    "QueueTerminated",
    "RateLimiter",
    "Rejection",
    "Retry",
    "Schedule",
    "SendTimeout",
    "Stamp",
    "Statistics",
    "StopEnvelope",
    "StopMode",
    "StopReport",
    "StopType",
    "Task",
    "TaskFn",
    "TaskQueue",
    "Timing",
    "TokenBucket",
    "TypeBlacklisted",
    "current_attempt",
    "default_limiter",
    "drop",
    "enqueue",
    "logging_stamp",
    "otel_stamp",
    "prometheus_metrics",
    "retry_after",
    "retry_now",
    "serve_metrics",
    "shutdown",
    "submit",
]
