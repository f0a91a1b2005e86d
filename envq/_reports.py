"""What a queue reports: the events of its state changes, what a stop did, and the
story an envelope keeps (its last error, its attempts)."""

from __future__ import annotations

import traceback
from typing import Final

import attrs

from envq._envelope import Envelope
from envq._machine import EnvState, Kind, Outcome, QueueState

__all__ = ["AttemptRecord", "ErrorInfo", "Event", "LiveEnvelope", "StopReport"]

#: The most characters of an error's message and of its traceback an envelope keeps
#: (the traceback's end: where it was raised).
ERROR_MESSAGE_LIMIT: Final = 1000
TRACEBACK_LIMIT: Final = 8000
#: The most attempts an envelope's story keeps (the last ones).
STORY_LIMIT: Final = 20


@attrs.frozen
class ErrorInfo:
    """An error an attempt ended with, as an envelope keeps it for an operator: the
    error's class, its message and its traceback, each cut to a bound (the message's
    start, the traceback's end)."""

    #: The error's class, qualified (``builtins.ValueError``, ``app.jobs.Bounce``).
    type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        """``error`` summarised (its traceback formatted once, here)."""
        kind = type(error)
        try:
            message = str(error)
        except Exception:  # a __str__ that fails
            message = object.__repr__(error)
        text = "".join(traceback.format_exception(error))
        return cls(
            f"{kind.__module__}.{kind.__qualname__}",
            message[:ERROR_MESSAGE_LIMIT],
            text[-TRACEBACK_LIMIT:],
        )


@attrs.frozen
class AttemptRecord:
    """One attempt in an envelope's story: its number, how it ended, when, and the
    error it ended with (if any). In process the times are the loop's; on PostgreSQL
    they are the database's clock (epoch seconds), and ``node`` names who ran it."""

    attempt: int
    outcome: Outcome
    #: When the attempt ended.
    ended: float
    error: ErrorInfo | None = None
    #: When the attempt started (None: not kept).
    started: float | None = None
    #: The node that ran it (PostgreSQL; None in process).
    node: str | None = None


@attrs.frozen
class Event:
    """One state change of a queue (``envelope is None``) or of an envelope in it."""

    #: Loop time of the change.
    time: float
    #: The queue's name.
    queue: str
    envelope: Envelope | None
    #: ``EnvState.NEW`` for an envelope entering the queue.
    from_state: QueueState | EnvState
    to_state: QueueState | EnvState
    #: The attempt's outcome when the change ends an attempt.
    outcome: Outcome | None = None
    #: The error behind the change, if any (the attempt's error, ``MaxRetriesExceeded``…).
    cause: BaseException | None = None


@attrs.frozen
class StopReport:
    """What a stop did: how it ended and what it left parked or running.

    ``complete`` is True iff the queue was STOPPED (or TERMINATED) when the report was
    made.
    """

    #: Envelopes held back, in admission order.
    parked: tuple[Envelope, ...] = ()
    #: Envelopes whose attempt finished during the stop, one entry per attempt.
    completed: tuple[Envelope, ...] = ()
    #: Envelopes whose attempt was cancelled during the stop, one entry per attempt.
    cancelled: tuple[Envelope, ...] = ()
    complete: bool = False


@attrs.frozen
class LiveEnvelope:
    """A snapshot of one envelope in a queue (:meth:`envq.Queue.envelopes`): live, or
    ended FAILED or STOPPED and kept for an operator. A copy of its queue-side record
    when it was taken, not a view that follows it."""

    envelope: Envelope
    #: The number of this stay in the queue: admissions are numbered from 1, in order.
    seq: int
    state: EnvState
    #: The row group of the outcome table its attempts are looked up in.
    kind: Kind
    #: Attempts started in this stay.
    attempts: int
    #: The loop time a DELAYED envelope becomes ready; None in any other state.
    due: float | None = None
    #: The last error an attempt of it ended with (None: none so far).
    error: ErrorInfo | None = None
    #: Its story: the attempts that ended with an error, and the last one (at most
    #: ``STORY_LIMIT``, the latest), kept across an operator's retry.
    history: tuple[AttemptRecord, ...] = ()
