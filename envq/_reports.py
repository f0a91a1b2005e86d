"""What a queue reports: the events of its state changes, and what a stop did."""

from __future__ import annotations

import attrs

from envq._envelope import Envelope
from envq._machine import EnvState, Kind, Outcome, QueueState

__all__ = ["Event", "LiveEnvelope", "StopReport"]


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
    """A snapshot of one envelope live in a queue (:meth:`envq.Queue.envelopes`): a copy
    of its queue-side record when it was taken, not a view that follows it."""

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
