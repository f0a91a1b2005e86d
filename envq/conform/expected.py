"""What the model expects, as data and pure functions the oracle calls: the states and
queue moves each call allows (derived from the tables of :mod:`envq._machine`), where
an envelope's move goes in its situation (from the models), and what an attempt's plan,
deadline and policy lead to — its outcome, its target state, its delay.

The time arithmetic here is the conformance harness's own, on purpose: the next run
on the schedule grid (:func:`_next_run`) and the retry backoff (in
:func:`expected_target`) follow the contract's formulas, independently of the engine's
``envq._timers`` and ``envq._attempt``, so that a wrong delay in the engine is caught
rather than copied. A failed check raises :class:`Violation`.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Mapping
from typing import Final

import attrs

from envq._machine import (
    ARMED,
    ENVELOPE_MOVES,
    LIFECYCLE,
    LIVE_STATES,
    OPERATOR_EVENTS,
    STOP_PARKS,
    Action,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    Outcome,
    QueueCall,
    QueueState,
    Situation,
    StopMode,
)
from envq._schedule import CRON_SLACK
from envq.conform.hooks import Problem
from envq.conform.protocol import (
    EXPIRED_CAUSE,
    LONG_SECONDS,
    SLOW_SECONDS,
    EnvSpec,
    Plan,
    Policy,
)
from envq.model.envelope import EnvelopeModel
from envq.model.tables import enabled_targets, lifecycle_moves

__all__ = [
    "ALLOWED_LIVE",
    "CALL_MOVES",
    "DRAINED_MOVE",
    "DURATIONS",
    "LIFE_MODEL",
    "LIVE",
    "REPORTS",
    "Expected",
    "Violation",
    "expected_outcome",
    "expected_target",
    "first_delay",
    "hook_problem",
    "infer_event",
    "model_target",
    "require",
]

ES = EnvState
QS = QueueState
O = Outcome  # noqa: E741 - short alias like ES/QS

#: The live states (they count against capacity), in declaration order.
LIVE: Final = tuple(state for state in ES if state in LIVE_STATES)
#: The public calls a driver reports the queue moves of.
_CALLS: Final = (QueueCall.SEND, QueueCall.START, QueueCall.STOP, QueueCall.TERMINATE)


def _call_moves(call: QueueCall) -> frozenset[tuple[QueueState, QueueState]]:
    """The queue moves ``call`` makes itself, by its lifecycle rows. A terminate that
    must stop first makes the stop row's move, and one that finds a stop under way makes
    none: the rest of their way is the stop draining (:data:`DRAINED_MOVE`) and the
    hand-back of the STOPPED row."""
    moves = set()
    for (state, c), row in LIFECYCLE.items():
        if c is not call or row.target is None:
            continue
        to: QueueState | None = row.target
        if row.action is LifeAction.STOP_THEN_TERMINATE:
            to = LIFECYCLE[(state, QueueCall.STOP)].target
        elif row.action is LifeAction.ESCALATE_THEN_TERMINATE:
            to = state
        if to is not None and to is not state:
            moves.add((state, to))
    return frozenset(moves)


#: Queue moves each call may cause; STOPPING → STOPPED (the stop drained) may happen at
#: any time.
CALL_MOVES: Final[Mapping[QueueCall | None, frozenset[tuple[QueueState, QueueState]]]] = {
    None: frozenset(),
    **{call: _call_moves(call) for call in _CALLS},
}
DRAINED_MOVE: Final = next(
    (state, row.target)
    for (state, call), row in LIFECYCLE.items()
    if call is QueueCall.DRAINED and row.target is not None
)


def _allowed_live() -> dict[QueueState, frozenset[EnvState]]:
    """The live states each queue state may hold, from the tables: before the start
    what a send buffers; while running what arming makes (``ARMED``) and a dispatch;
    while stopping the same less what every stop parks (``STOP_PARKS``), plus parked;
    once stopped only parked; nothing once terminated."""
    armed = frozenset(ARMED.values())
    buffered = ENVELOPE_MOVES[(ES.NEW, EnvEvent.SEND)] - armed
    running = armed | ENVELOPE_MOVES[(ES.READY, EnvEvent.DISPATCH)]
    parked = frozenset().union(
        *(ENVELOPE_MOVES[(state, EnvEvent.STOP)] for mode in StopMode for state in STOP_PARKS[mode])
    )
    always_parked = frozenset.intersection(*STOP_PARKS.values())
    return {
        QS.INIT: buffered,
        QS.RUNNING: running,
        QS.STOPPING: (running - always_parked) | parked,
        QS.STOPPED: parked,
        QS.TERMINATED: frozenset(),
    }


#: Live states each queue state allows (invariant I6); READY while STOPPING only under
#: DRAIN (a STOP stop parks it: ``STOP_PARKS``).
ALLOWED_LIVE: Final[Mapping[QueueState, frozenset[EnvState]]] = _allowed_live()
LIFE_MODEL: Final = lifecycle_moves()
#: The actions of the rows that report an attempt's end with ``on_success``.
REPORTS: Final = frozenset({Action.SUCCEED, Action.RESCHEDULE})
#: How long the attempts that sleep before they succeed take.
DURATIONS: Final = {Plan.SLOW: SLOW_SECONDS, Plan.LONG: LONG_SECONDS}


class Violation(AssertionError):
    """A check failed: ``check`` names the invariant (``I1`` …), ``row`` the table row
    at stake (or None)."""

    def __init__(self, check: str, message: str, row: str | None = None) -> None:
        super().__init__(f"[{check}{' ' + row if row else ''}] {message}")
        self.check = check
        self.row = row
        self.message = message


def require(ok: bool, check: str, message: str, row: str | None = None) -> None:
    if not ok:
        raise Violation(check, message, row)


def hook_problem(name: str, problem: Problem | None) -> None:
    """A reporting hook's call out of place (:mod:`envq.conform.hooks`), as a
    violation of I7 (the hooks the contract calls)."""
    if problem is not None:
        raise Violation("I7", f"{name}: {problem[0]}", problem[1])


# ---------------------------------------------------------------------------------------
# The model's transitions, and what an attempt leads to
# ---------------------------------------------------------------------------------------


@functools.cache
def _model(situation: Situation) -> EnvelopeModel:
    return EnvelopeModel(situation)


@functools.cache
def model_target(
    state: EnvState, event: EnvEvent | Outcome, situation: Situation
) -> EnvState | None:
    """The one state :class:`EnvelopeModel` lets ``event`` lead to from ``state`` in
    ``situation`` (its guards evaluated on the situation); None if it allows none."""
    targets = enabled_targets(_model(situation), state, event)
    if len(targets) > 1:
        raise AssertionError(f"the model is not deterministic at {state}, {event}: {targets}")
    return targets[0] if targets else None


@attrs.frozen
class Expected:
    """Where an attempt's outcome leads, as the oracle predicts it."""

    to: EnvState
    #: Model seconds still to wait (DELAYED, PARKED).
    delay: float = 0.0
    #: The on_failure call expected: (the error's class name, the attempt number).
    hook: tuple[str, int] | None = None
    #: The class name of the event's cause (None: no cause).
    cause: str | None = None
    check_cause: bool = True


def _decision(spec: EnvSpec) -> DecisionKind:
    return {
        Policy.RETRY_NOW: DecisionKind.RETRY_NOW,
        Policy.RETRY_AFTER: DecisionKind.RETRY_AFTER,
    }.get(spec.policy, DecisionKind.DROP)


def _cron_after(expr: str, t: float) -> float:
    """The first fire of ``expr`` strictly after model time ``t``: the calendar is UTC
    and model second 0 is the Unix epoch; a fire within envq's slack of ``t`` counts
    as at it."""
    from cronsim import CronSim  # noqa: PLC0415 - needed only by ports declaring cron

    start = math.floor(t + CRON_SLACK)
    fire = next(CronSim(expr, dt.datetime.fromtimestamp(start, dt.UTC)))
    return fire.timestamp()


def first_delay(spec: EnvSpec, now: float, delay: float) -> float:
    """Model seconds from ``now`` to the first run of an envelope armed with
    ``delay`` to wait: a calendar waits further, for its first fire after that."""
    if not spec.cron:
        return delay
    return _cron_after(spec.cron, math.ceil(now + delay - CRON_SLACK) - 1) - now


def _next_run(spec: EnvSpec, sched: float, now: float) -> float:
    if spec.cron:
        return _cron_after(spec.cron, max(sched, now)) - now
    if not spec.fixed_rate:
        return spec.interval
    slots = math.floor((now - sched) / spec.interval + 1e-9) + 1
    return sched + slots * spec.interval - now


def expected_target(
    spec: EnvSpec,
    outcome: Outcome,
    *,
    blacklisted: bool,
    queue: QueueState,
    cancel_cause: CancelCause | None,
    attempts: int,
    failures: int,
    sched: float,
    now: float,
) -> tuple[Expected, int]:
    """Where an attempt of an envelope with ``spec`` that ended with ``outcome`` goes,
    with the delay, hook call and cause the contract gives; and the envelope's count
    of consecutive failures afterwards (periodic envelopes).

    The state comes from the model (:func:`model_target`) in the attempt's situation;
    the delay, hook and cause follow the outcome table and the retry policy.
    """
    kind = Kind.BLACKLISTED if blacklisted else Kind.PERIODIC if spec.periodic else Kind.ONE_OFF
    decision: DecisionKind | None = None
    hook: tuple[str, int] | None = None
    cause: str | None = None
    delay = 0.0
    check_cause = not blacklisted
    error = {O.ERROR: "error", O.TIMEOUT: "timeout", O.EXPIRED: EXPIRED_CAUSE}.get(outcome)
    if blacklisted:
        pass
    elif outcome is O.CANCELLED:
        cause = "cancelled"
    elif outcome is O.STOP:
        cause = "stop"
    elif outcome is O.STOP_TYPE:
        cause = "stop_type"
    elif outcome is O.NO_RETRY:
        number = failures + 1 if spec.periodic else attempts
        hook = ("no_retry", number) if spec.policy.has_on_failure else None
        cause = "no_retry"
    elif outcome is O.OK:
        if spec.periodic:
            failures = 0
            delay = _next_run(spec, sched, now)
    else:
        assert error is not None
        cause = error
        if spec.periodic:
            failures += 1
            if spec.policy.has_on_failure:
                hook = (error, failures)
                decision = _decision(spec)
            else:
                delay = _next_run(spec, sched, now)
        elif spec.policy.has_on_failure:
            hook = (error, attempts)
            decision = _decision(spec)
        elif spec.policy is Policy.RETRY:
            if spec.attempts == -1 or attempts < spec.attempts:
                decision = DecisionKind.RETRY_AFTER
            else:
                cause = "max_retries"
        if decision is DecisionKind.RETRY_AFTER:
            if spec.policy is Policy.RETRY:
                delay = min(spec.cap, spec.base * 2.0 ** (attempts - 1))
            else:
                delay = spec.retry_after if spec.retry_after > 0 else 1.0
    situation = Situation(kind=kind, queue=queue, decision=decision, cause=cancel_cause)
    to = model_target(ES.RUNNING, outcome, situation)
    require(to is not None, "I7", f"the model has no transition for {outcome.name} in {situation}")
    assert to is not None
    return Expected(to, delay, hook, cause, check_cause), failures


def expected_outcome(
    spec: EnvSpec,
    final: Plan | None,
    *,
    started: float,
    cancelled_at: float | None,
    cancel_cause: CancelCause | None,
    tolerance: float,
) -> Outcome:
    """The outcome of an attempt that carried out ``final`` (None: it never finished
    its plan) or was cancelled at ``cancelled_at``: CANCELLED by a stop or terminate,
    else TIMEOUT by its deadline (which must have passed)."""
    if cancelled_at is not None:
        if cancel_cause is not None:
            return O.CANCELLED
        nobody = f"attempt started at {started:g} cancelled at {cancelled_at:g} by nobody"
        require(spec.deadline > 0, "I7", nobody)
        require(cancelled_at >= started + spec.deadline - tolerance, "I7", nobody)
        return O.TIMEOUT
    require(final is not None, "I3", "an attempt ended before its plan was carried out")
    if final is Plan.STOP_TYPE:
        return O.STOP_TYPE if spec.type else O.STOP
    return {
        Plan.OK: O.OK,
        Plan.ERROR: O.ERROR,
        Plan.STOP: O.STOP,
        Plan.NO_RETRY: O.NO_RETRY,
    }[final]  # type: ignore[index]


def infer_event(frm: EnvState, to: EnvState) -> EnvEvent | None:
    """The queue-side event behind an envelope move that carries no outcome: the one
    :class:`EnvEvent` whose ``ENVELOPE_MOVES`` row leads ``frm`` to ``to`` (None: no
    queue-side event makes that move). An operator's move (``OPERATOR_EVENTS``) is not
    among them: the protocol has no command that makes one."""
    events = [
        event
        for (state, event), targets in ENVELOPE_MOVES.items()
        if state is frm
        and isinstance(event, EnvEvent)
        and event not in OPERATOR_EVENTS
        and to in targets
    ]
    if len(events) > 1:
        raise AssertionError(f"ENVELOPE_MOVES: {frm} -> {to} by more than one event {events}")
    return events[0] if events else None
