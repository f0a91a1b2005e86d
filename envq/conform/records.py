"""The oracle's records of a port: each envelope's track and attempts, a stop's run,
the coverage of checks and table rows, and the small predictions about calls that
the oracle and the in-process stateful test share."""

from __future__ import annotations

import math
from collections import deque

import attrs

from envq._machine import (
    LIFECYCLE,
    CancelCause,
    EnvState,
    LifeAction,
    QueueCall,
    QueueState,
    StopMode,
)
from envq.conform.expected import (
    hook_problem,
    require,
)
from envq.conform.hooks import Reports
from envq.conform.protocol import (
    ERRORS,
    EnvSpec,
    Plan,
)

__all__ = [
    "AttemptLog",
    "Coverage",
    "RunLog",
    "Track",
    "hooks_accounted",
    "room_in_time",
    "send_error",
    "start_result",
    "success_called",
]

ES = EnvState


@attrs.define(eq=False)
class AttemptLog:
    """One attempt of an envelope, as the driver reported it."""

    plan: Plan
    start: float
    #: The plan carried out (a released HANG takes the release's plan).
    final: Plan | None = None
    #: Model time the attempt's body saw its cancel.
    cancelled_at: float | None = None
    #: Who asked to cancel it (the last one asking wins, as in the engine).
    cancel_cause: CancelCause | None = None
    #: Model time of the first ask.
    cancel_asked: float | None = None
    #: The plan it was released with (HANG).
    release: Plan | None = None

    @property
    def hanging(self) -> bool:
        """A HANG attempt not yet released or cancelled."""
        return self.plan is Plan.HANG and self.release is None and self.cancelled_at is None

    def deadline_first(self, deadline: float, latency: float, tolerance: float) -> bool:
        """Whether its ``deadline`` may have cut it before a cancel asked for reached
        it: the port declared that a cancel takes up to ``latency`` (its
        ``cancel_latency``) to reach an attempt, and the attempt saw its cancel at its
        deadline, no later than that after the first ask."""
        if not latency or self.cancelled_at is None or self.cancel_asked is None:
            return False
        return (
            deadline > 0
            and self.cancelled_at >= self.start + deadline - tolerance
            and self.cancelled_at <= self.cancel_asked + latency + tolerance
        )


@attrs.define(eq=False)
class Track:
    """The model of one envelope, across all its stays in the queue."""

    name: str
    spec: EnvSpec
    script: deque[Plan]
    state: EnvState = ES.NEW
    stays: int = 0
    ends: int = 0
    seq: int = 0
    attempts: int = 0
    failures: int = 0
    due: float = 0.0
    remaining: float = 0.0
    sched: float = 0.0
    attempt: AttemptLog | None = None
    #: A cancel asked for after the attempt was dispatched, before its invoke began
    #: (who, and when first).
    cancel_pending: tuple[CancelCause, float] | None = None
    lent: bool = False
    #: on_failure calls (error, number) since its last attempt ended.
    hooks: list[tuple[str, int]] = attrs.Factory(list)
    #: Its reporting hooks' calls (:mod:`envq.conform.hooks`).
    reports: Reports = attrs.Factory(Reports)
    #: How its last attempt ended (for a message).
    last_end: str = ""

    def arrive(self, to: EnvState, delay: float, now: float, *, armed: bool) -> None:
        """Check the state it enters with ``delay`` to wait; note its times."""
        if armed:
            want = ES.READY if delay <= 0 else ES.DELAYED
            require(
                to is want,
                "I7",
                f"{self.name}: armed with {delay:g} s to wait, went {to.name} not {want.name}",
                "ARMED",
            )
        if to is ES.READY:
            self.sched = now
        elif to is ES.DELAYED:
            self.due = now + delay
        elif to is ES.PARKED:
            self.remaining = max(0.0, delay)


def success_called(t: Track, attempt: int) -> None:
    """An ``on_success`` call of ``t``, for its attempt number ``attempt``."""
    require(t.spec.on_success, "I7", f"{t.name}: on_success called; it has none")
    hook_problem(t.name, t.reports.success(attempt, t.stays))


def hooks_accounted(t: Track, late_batches: int) -> None:
    """At an invariant check: every hook call of ``t`` belongs with an attempt —
    ``on_failure``'s with the end of the attempt in flight, ``on_success``'s with an
    attempt's end within ``late_batches`` checks (:meth:`Reports.unmatched`)."""
    unaccounted = f"{t.name}: on_failure calls unaccounted for: {t.hooks}{t.last_end}"
    require(not t.hooks, "I7", unaccounted)
    hook_problem(t.name, t.reports.unmatched(t.state is ES.RUNNING, late_batches))


@attrs.define(eq=False)
class RunLog:
    """A stop under way, as the oracle sees it."""

    mode: StopMode
    completed: list[str] = attrs.Factory(list)
    cancelled: list[str] = attrs.Factory(list)


@attrs.define
class Coverage:
    """What the checks exercised: checks run and table rows reached."""

    checks: dict[str, int] = attrs.Factory(dict)
    rows: dict[str, int] = attrs.Factory(dict)
    #: Steps checked (one per invariant check after a step).
    steps: int = 0

    def check(self, name: str) -> None:
        """Count one check of ``name``."""
        self.checks[name] = self.checks.get(name, 0) + 1

    def row(self, name: str) -> None:
        """Count one use of table row ``name``."""
        self.rows[name] = self.rows.get(name, 0) + 1


def room_in_time(now: float, *, started: float, timeout: float, tolerance: float) -> bool:
    """Whether room freed at ``now`` for a ``send_wait`` producer first in line, which
    began waiting at ``started`` with ``timeout``, came in time: strictly before the
    timeout is due. A timeout due at the very instant room is freed wins (the room is
    too late and goes to the next producer); ``tolerance`` (a real clock's jitter)
    widens that instant, and times equal but for float rounding count as the same."""
    due = started + timeout
    return now < due - tolerance and not math.isclose(now, due)


def send_error(state: QueueState) -> str | None:
    """The error class name ``send()`` raises in ``state`` (None: accepted)."""
    row = LIFECYCLE[(state, QueueCall.SEND)]
    if row.action is LifeAction.REJECT and row.error:
        return ERRORS[row.error.__name__]
    return None


def start_result(state: QueueState) -> QueueState | str:
    """What ``start()`` does in ``state``: the next state, or the error's name."""
    row = LIFECYCLE[(state, QueueCall.START)]
    if row.action is LifeAction.REJECT:
        assert row.error is not None
        return ERRORS[row.error.__name__]
    assert row.target is not None
    return row.target
