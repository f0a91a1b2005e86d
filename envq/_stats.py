"""A queue's counters, and the stop under way with its report.

:class:`Counters` holds what ``Queue.statistics()`` reports besides the live
envelopes: terminal states reached, outcomes, dedups and refused sends by
:class:`envq.Rejection`. :class:`StopRun` is one stop under way: what it completed and
cancelled, and the future its callers wait on; :func:`report` makes the
:class:`envq.StopReport` of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import MappingProxyType
from typing import TYPE_CHECKING

from envq._machine import LIVE_STATES, TERMINAL_STATES, EnvState, Outcome, QueueState
from envq._reports import StopReport
from envq._values import Rejection, Statistics

if TYPE_CHECKING:
    from envq._envelope import Envelope

__all__ = ["Counters", "StopRun", "report"]


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
