"""Stamps (middleware) shipped with envq, and what they share.

A stamp wraps the invoker chain of one attempt (its middleware), so it sees the chain's
result or exception but not the queue's own verdict. :func:`attempt_outcome` maps
what a stamp saw to the :class:`envq.Outcome` the queue gives the attempt, by the
rules of the outcome table; :func:`envq.logging_stamp` and :func:`envq.otel_stamp` report it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from envq import _checks
from envq._envelope import Envelope, Invoker, Stamp
from envq._errors import DoNotRetry, StopEnvelope, StopType
from envq._machine import Outcome
from envq._queue import current_attempt

__all__ = ["attempt_number", "attempt_outcome", "logging_stamp", "queue_name_of"]

#: Outcomes a stamp reports as failures (the span status ERROR, a failed log record):
#: those whose rows decide a failure or report one. EXPIRED is among them, though a
#: stamp never tells it: it runs inside the attempt, and the lease of an attempt is
#: found expired by another process.
FAILURES: Final = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.EXPIRED, Outcome.NO_RETRY})


def queue_name_of(env: Envelope) -> str:
    """The name of the queue running ``env``'s current attempt, or ``""`` outside one."""
    attempt = current_attempt()
    return attempt.queue.name if attempt is not None and attempt.envelope is env else ""


def attempt_number(env: Envelope) -> int:
    """The queue's number for ``env``'s current attempt (1-based), or 0 outside one."""
    attempt = current_attempt()
    return attempt.number if attempt is not None and attempt.envelope is env else 0


def attempt_outcome(
    env: Envelope, error: BaseException | None, started: float, now: float
) -> Outcome:
    """The outcome of an attempt whose invoker chain, entered at loop time ``started``,
    ended at ``now`` with ``error`` (``None``: it returned).

    Control signals map as the queue maps them. A ``CancelledError`` that comes from
    outside the attempt (the task is being cancelled) is ``TIMEOUT`` when the
    envelope's deadline has certainly passed, ``CANCELLED`` while the queue is
    STOPPING (``stop(cancel=True)`` / ``terminate()``), otherwise ``TIMEOUT`` if the
    envelope has a deadline; one raised by user code is ``ERROR``. A stamp runs after
    ``before``, so it cannot see a ``before`` that overran its budget: that attempt
    never reaches the stamp.
    """
    if error is None:
        return Outcome.OK
    if isinstance(error, StopType):
        return Outcome.STOP_TYPE if env.type else Outcome.STOP
    if isinstance(error, StopEnvelope):
        return Outcome.STOP
    if isinstance(error, DoNotRetry):
        return Outcome.NO_RETRY
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or not task.cancelling():
            return Outcome.ERROR
        # Cancelled from outside: by the envelope's deadline if it has expired, else
        # by the queue (stop(cancel=True) / terminate()).
        attempt = current_attempt()
        deadline_at = attempt.deadline_at if attempt is not None else None
        if deadline_at is None and env.deadline:
            deadline_at = started + env.deadline
        if deadline_at is not None and now >= deadline_at:
            return Outcome.TIMEOUT
        return Outcome.CANCELLED
    return Outcome.ERROR


def logging_stamp(logger: logging.Logger | None = None, level: int = logging.INFO) -> Stamp:
    """A stamp that logs one record per attempt: its envelope, outcome and duration.

    Records go to ``logger`` (default: the ``envq.stamp`` logger, a child of ``envq``)
    at ``level`` for every outcome, with the message ``envelope TYPE/ID OUTCOME in
    S s`` (plus the error) and these structured ``extra`` fields, for formatters and
    JSON log handlers:

    ========================  =========================================================
    ``envq_queue``            name of the queue running the attempt (``""`` if none)
    ``envq_type``             the envelope's ``type``
    ``envq_id``               the envelope's ``id``
    ``envq_attempt``          the queue's number for this attempt (1, 2, …)
    ``envq_outcome``          the attempt's outcome, an :class:`envq.Outcome` value
                              (``"ok"``, ``"error"``, ``"timeout"``, …; see
                              :func:`attempt_outcome` for how it is told from inside)
    ``envq_duration``         seconds of the invoker chain, on the event loop's clock
    ``envq_error``            ``repr`` of the exception, or ``None``
    ========================  =========================================================

    envq adds no log handlers: nothing is printed unless the application configures
    logging. When the level is disabled the stamp only counts the attempt.
    """
    if logger is not None and not isinstance(logger, logging.Logger | logging.LoggerAdapter):
        raise TypeError(
            "logging_stamp: logger must be a logging.Logger, a logging.LoggerAdapter or "
            f"None, got {_checks.show(logger)}"
        )
    level = _checks.integer("logging_stamp: level", level, minimum=0)
    log = logger or logging.getLogger("envq.stamp")

    def stamp(next_: Invoker) -> Invoker:
        async def invoker(env: Envelope) -> None:
            if not log.isEnabledFor(level):
                await next_(env)
                return
            loop = asyncio.get_running_loop()
            started = loop.time()
            error: BaseException | None = None
            try:
                await next_(env)
            except BaseException as exc:
                error = exc
                raise
            finally:
                now = loop.time()
                took = now - started
                outcome = attempt_outcome(env, error, started, now)
                extra = {
                    "envq_queue": queue_name_of(env),
                    "envq_type": env.type,
                    "envq_id": env.id,
                    "envq_attempt": attempt_number(env),
                    "envq_outcome": outcome.value,
                    "envq_duration": took,
                    "envq_error": repr(error) if error is not None else None,
                }
                if error is None:
                    log.log(level, "envelope %s ok in %.6f s", env.label(), took, extra=extra)
                else:
                    log.log(
                        level,
                        "envelope %s %s in %.6f s: %r",
                        env.label(),
                        outcome.value,
                        took,
                        error,
                        extra=extra,
                    )

        return invoker

    return stamp
