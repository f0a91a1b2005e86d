"""Stamps (middleware) shipped with envq, and what they share.

A stamp wraps the invoker chain of one attempt (contract §1), so it sees the chain's
result or exception but not the queue's own verdict. :func:`attempt_outcome` maps
what a stamp saw to the :class:`envq.Outcome` the queue gives the attempt, by the
contract's §4 rules; :func:`envq.logging_stamp` and :func:`envq.otel_stamp` report it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Final

from envq._envelope import Envelope, Invoker, Stamp
from envq._errors import DoNotRetry, StopEnvelope, StopType
from envq._machine import Outcome, QueueState

__all__ = ["AttemptCounter", "attempt_outcome", "logging_stamp", "queue_name_of"]

#: Outcomes a stamp reports as failures (the span status ERROR, a failed log record).
FAILURES: Final = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.NO_RETRY})


def queue_name_of(env: Envelope) -> str:
    """The name of the queue ``env`` is live in, or ``""`` when it is in none."""
    # The owner slot is set by the queue only (envq._envelope); reading it here keeps
    # the stamps free of any hook into the queue.
    owner: Any = env._owner
    return owner.name if owner is not None else ""


def _stopping(env: Envelope) -> bool:
    owner: Any = env._owner
    return owner is not None and owner.state is QueueState.STOPPING


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
        if env.deadline and now - started >= env.deadline:
            return Outcome.TIMEOUT
        if _stopping(env):
            return Outcome.CANCELLED
        return Outcome.TIMEOUT if env.deadline else Outcome.CANCELLED
    return Outcome.ERROR


class AttemptCounter:
    """Counts the attempts one stamp has run, per envelope (weakly keyed, so it never
    keeps an envelope alive)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: weakref.WeakKeyDictionary[Envelope, int] = weakref.WeakKeyDictionary()

    def next(self, env: Envelope) -> int:
        """Count one more attempt of ``env``; return its number (1 for the first)."""
        n = self._counts.get(env, 0) + 1
        self._counts[env] = n
        return n


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
    ``envq_attempt``          how many times this stamp has run this envelope (1, 2, …)
    ``envq_outcome``          the attempt's outcome, an :class:`envq.Outcome` value
                              (``"ok"``, ``"error"``, ``"timeout"``, …; see
                              :func:`attempt_outcome` for how it is told from inside)
    ``envq_duration``         seconds of the invoker chain, on the event loop's clock
    ``envq_error``            ``repr`` of the exception, or ``None``
    ========================  =========================================================

    envq adds no log handlers: nothing is printed unless the application configures
    logging. When the level is disabled the stamp only counts the attempt.
    """
    log = logger or logging.getLogger("envq.stamp")
    counter = AttemptCounter()

    def stamp(next_: Invoker) -> Invoker:
        async def invoker(env: Envelope) -> None:
            attempt = counter.next(env)
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
                    "envq_attempt": attempt,
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
