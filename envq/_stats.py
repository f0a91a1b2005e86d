"""A queue's counters, its lifecycle state as its parts read it, and the stop under
way with its report.

:class:`Counters` holds what ``Queue.statistics()`` reports besides the live
envelopes: terminal states reached, outcomes, dedups and refused sends by
:class:`envq.Rejection`. :class:`StopRun` is one stop under way: what it completed and
cancelled, and the future its callers wait on; :func:`report` makes the
:class:`envq.StopReport` of it.

:class:`Status` is the queue's lifecycle state: one field, :attr:`Status.state`,
written only by the lifecycle interpreter (:class:`envq._lifecycle.Lifecycle`, through
:meth:`Status.enter`). A queue makes its status before its other parts and lends it to
each part that reads the state — admission (the SEND row), the workers (whether they
dispatch, the stop under way), the outcome interpreter (a move back into a queue that
is not RUNNING parks), the entry routines (who waits for the queue to empty), the
operator's moves — so that none of them calls back into the lifecycle for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from types import MappingProxyType

from envq import _machine
from envq._checks import show
from envq._envelope import Envelope
from envq._machine import (
    INITIAL_QUEUE,
    LIFECYCLE,
    LIVE_STATES,
    STAYING,
    TERMINAL_STATES,
    EnvState,
    LifeRow,
    Outcome,
    QueueCall,
    QueueState,
)
from envq._reports import StopReport
from envq._values import Rejection, Statistics

__all__ = [
    "Counters",
    "Status",
    "StopRun",
    "call_refused",
    "check_arrives",
    "check_stays",
    "release",
    "report",
]


class Counters:
    """Counts kept since the queue was made (plain dicts: bumped on the hot path)."""

    __slots__ = ("dedups", "outcomes", "rejections", "terminal")

    def __init__(self) -> None:
        #: Envelopes that reached each terminal state.
        self.terminal = {state: 0 for state in EnvState if state in TERMINAL_STATES}
        self.outcomes = dict.fromkeys(Outcome, 0)
        self.dedups = 0
        self.rejections = dict.fromkeys(Rejection, 0)

    def snapshot(
        self,
        state: QueueState,
        live_states: Iterable[EnvState],
        capacity_limit: int,
        stuck_threads: int,
    ) -> Statistics:
        """A frozen :class:`envq.Statistics` with these counts and the live envelopes'
        states (one item per live envelope). The attempts in flight are the RUNNING
        envelopes: a worker still finishing an attempt whose envelope has already
        moved on (a listener of that move asking) does not count."""
        by_state = {state: 0 for state in EnvState if state in LIVE_STATES}
        used = 0
        for live in live_states:
            by_state[live] += 1
            used += 1
        by_state.update(self.terminal)
        return Statistics(
            state=state,
            by_state=MappingProxyType(by_state),
            in_flight=by_state[EnvState.RUNNING],
            capacity_used=used,
            capacity_limit=capacity_limit,
            outcomes=MappingProxyType(dict(self.outcomes)),
            dedups=self.dedups,
            rejections=MappingProxyType(dict(self.rejections)),
            stuck_threads=stuck_threads,
        )


class StopRun:
    """One stop under way: its attempts, and the future its callers wait on."""

    __slots__ = ("cancelled", "completed", "done", "spared")

    def __init__(self, done: asyncio.Future[None]) -> None:
        #: Envelopes whose attempt ended during the stop, one entry per attempt.
        self.completed: list[Envelope] = []
        #: Envelopes whose attempt was cancelled during the stop.
        self.cancelled: list[Envelope] = []
        self.done = done
        #: The worker whose attempt called ``stop()`` (not cancelled, not waited for).
        self.spared: object = None


def report(run: StopRun | None, parked: Iterable[Envelope], complete: bool) -> StopReport:
    """The :class:`envq.StopReport` of ``run`` (None: no stop under way)."""
    return StopReport(
        parked=tuple(parked),
        completed=tuple(run.completed) if run else (),
        cancelled=tuple(run.cancelled) if run else (),
        complete=complete,
    )


class Status:
    """The lifecycle state of one queue, with what a stop under way needs and who
    waits for the queue to empty or to stop."""

    __slots__ = ("empty_waiters", "run", "send_row", "state", "stopped_waiters")

    def __init__(self) -> None:
        #: The queue's lifecycle state: the one field, every predicate derived from it.
        self.state: QueueState = INITIAL_QUEUE
        #: The SEND row of the current state (``send()``'s fast path reads it).
        self.send_row: LifeRow = row_for_send(INITIAL_QUEUE)
        #: The stop under way, if any.
        self.run: StopRun | None = None
        #: Callers of ``run_until_empty()``, woken when the last live envelope ends.
        self.empty_waiters: list[asyncio.Future[None]] = []
        #: Callers of ``wait_stopped()``, woken when a stop ends.
        self.stopped_waiters: list[asyncio.Future[None]] = []

    def enter(self, to: QueueState) -> QueueState:
        """The lifecycle enters ``to`` (its only writer); the state it left."""
        frm, self.state = self.state, to
        self.send_row = row_for_send(to)
        return frm

    def wake_empty(self) -> None:
        """The queue holds no live envelope: release ``run_until_empty()``'s callers."""
        waiters, self.empty_waiters = self.empty_waiters, []
        release(waiters)

    def wake_stopped(self) -> None:
        """A stop ended: release ``wait_stopped()``'s callers."""
        waiters, self.stopped_waiters = self.stopped_waiters, []
        release(waiters)


def row_for_send(state: QueueState) -> LifeRow:
    """The SEND row of ``state``, cached by ``send()``'s fast path (which then skips the
    lifecycle's ``perform``, so the strict self-loop check is made here)."""
    row = LIFECYCLE[(state, QueueCall.SEND)]
    check_stays(row, state)
    return row


def call_refused(
    name: str,
    state: QueueState,
    row: LifeRow,
    call: QueueCall,
    batch: Sequence[object],
    counts: Counters,
) -> Exception:
    """The error to raise for ``row``, a lifecycle row that rejects ``call`` in
    ``state``, naming the first envelopes of ``batch`` (counted as a refusal by
    state)."""
    assert row.error is not None
    counts.rejections[Rejection.STATE] += 1
    about = ", ".join(env.label() if isinstance(env, Envelope) else show(env) for env in batch[:3])
    return row.error(
        f"queue {name!r} is {state.name}: {call.value}() is not allowed"
        + (f" ({about}{', …' if len(batch) > 3 else ''})" if batch else "")
    )


def check_stays(row: LifeRow, state: QueueState) -> None:
    """Under STRICT: a row whose action keeps the state must name it as its target."""
    if _machine.STRICT and row.action in STAYING:
        assert row.target is state, f"{row} must leave the state unchanged"


def check_arrives(row: LifeRow, state: QueueState) -> None:
    """Under STRICT: a composite row (a stop, then a terminate) must end in its target,
    though the rows it runs through are the ones that move the state."""
    if _machine.STRICT:
        assert row.target is state, f"{row} ended in {state.name}"


def release(futures: Iterable[asyncio.Future[None]]) -> None:
    """Resolve every future not already done (cancelled waiters are skipped)."""
    for fut in futures:
        if not fut.done():
            fut.set_result(None)
