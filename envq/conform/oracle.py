"""The executable oracle: the model, driven step by step beside a port.

:class:`Oracle` follows a queue through what a driver reports — every state change
of the queue and of each envelope, every attempt's start, cancel and ``on_failure``
call, every call's result — and checks each against the contract:

* each envelope move is a transition of :class:`envq.model.EnvelopeModel` and goes to
  the one state the model allows in its situation (:func:`model_target`), the attempt's
  outcome is the one its scripted plan, its deadline or its cancel makes (or EXPIRED,
  at any point, from a port that declared ``leases``: decided as a TIMEOUT is), and the
  hook calls, delays and causes are the ones the contract says (the calls of the
  hooks that only report an end are matched with it by :mod:`envq.conform.hooks`);
* each queue move is a transition of :class:`envq.model.LifecycleModel` caused by the
  call under way (or the stop draining);
* each call answers as the lifecycle table says (its error, by name), a stop's report
  and terminate's hand-back list what the events say;
* after every step the invariants of ``specs/invariants.md`` hold against the port's
  statistics.

A failed check raises :class:`Violation`, tagged with the invariant (``I1`` … ``I8``)
and, where one is at stake, the table row. The oracle also records which checks and
rows it exercised (:class:`Coverage`) for the conformance report.

Times are model seconds; ``tolerance`` widens every timing check for a port on the
real clock.

Which states and moves the oracle allows — :data:`LIVE`, :data:`CALL_MOVES`,
:data:`DRAINED_MOVE`, :data:`ALLOWED_LIVE`, :func:`infer_event` — is derived from the
tables of :mod:`envq._machine`, and where a move goes from the models. Its time
arithmetic is its own, on purpose: the next run on the schedule grid
(:func:`_next_run`) and the retry backoff (in :func:`expected_target`) are computed here
from the contract's formulas, independently of the engine's ``envq._timers`` and
``envq._attempt``, so that a wrong delay in the engine is caught rather than copied.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from envq._machine import (
    ARMED,
    ENVELOPE_MOVES,
    LIFECYCLE,
    LIVE_STATES,
    OPERATOR_EVENTS,
    OUTCOMES,
    STOP_PARKS,
    TERMINAL_STATES,
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
from envq.conform.hooks import Problem, Reports
from envq.conform.protocol import (
    ERRORS,
    EXPIRED_CAUSE,
    LONG_SECONDS,
    SLOW_SECONDS,
    EnvSpec,
    Plan,
    Policy,
    QueueConfig,
)
from envq.model.envelope import EnvelopeModel
from envq.model.tables import enabled_targets, lifecycle_moves

__all__ = [
    "ALLOWED_LIVE",
    "CALL_MOVES",
    "DRAINED_MOVE",
    "LIVE",
    "AttemptLog",
    "Coverage",
    "Expected",
    "Oracle",
    "Violation",
    "expected_outcome",
    "expected_target",
    "infer_event",
    "model_target",
    "room_in_time",
    "send_error",
    "start_result",
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
_LIFE_MODEL: Final = lifecycle_moves()
#: The actions of the rows that report an attempt's end with ``on_success``.
_REPORTS: Final = frozenset({Action.SUCCEED, Action.RESCHEDULE})
#: How long the attempts that sleep before they succeed take.
_DURATIONS: Final = {Plan.SLOW: SLOW_SECONDS, Plan.LONG: LONG_SECONDS}


class Violation(AssertionError):
    """A check failed: ``check`` names the invariant (``I1`` …), ``row`` the table row
    at stake (or None)."""

    def __init__(self, check: str, message: str, row: str | None = None) -> None:
        super().__init__(f"[{check}{' ' + row if row else ''}] {message}")
        self.check = check
        self.row = row
        self.message = message


def _check(ok: bool, check: str, message: str, row: str | None = None) -> None:
    if not ok:
        raise Violation(check, message, row)


def _hook_problem(name: str, problem: Problem | None) -> None:
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


def _first_delay(spec: EnvSpec, now: float, delay: float) -> float:
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
    _check(to is not None, "I7", f"the model has no transition for {outcome.name} in {situation}")
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
        _check(spec.deadline > 0, "I7", nobody)
        _check(cancelled_at >= started + spec.deadline - tolerance, "I7", nobody)
        return O.TIMEOUT
    _check(final is not None, "I3", "an attempt ended before its plan was carried out")
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


# ---------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------


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
            _check(
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


def _on_success(t: Track, attempt: int) -> None:
    """An ``on_success`` call of ``t``, for its attempt number ``attempt``."""
    _check(t.spec.on_success, "I7", f"{t.name}: on_success called; it has none")
    _hook_problem(t.name, t.reports.success(attempt, t.stays))


def _hooks_accounted(t: Track, late_batches: int) -> None:
    """At an invariant check: every hook call of ``t`` belongs with an attempt —
    ``on_failure``'s with the end of the attempt in flight, ``on_success``'s with an
    attempt's end within ``late_batches`` checks (:meth:`Reports.unmatched`)."""
    unaccounted = f"{t.name}: on_failure calls unaccounted for: {t.hooks}{t.last_end}"
    _check(not t.hooks, "I7", unaccounted)
    _hook_problem(t.name, t.reports.unmatched(t.state is ES.RUNNING, late_batches))


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


class Oracle:
    """The contract's model of one port's queue, checked against what the driver says.

    :param tolerance: model seconds any timing check allows (0 on a virtual clock).
    :param leases: whether the port declared ``leases``: an attempt of it may end
        EXPIRED (another of its processes reaped the attempt), whatever its plan.
    """

    def __init__(
        self, tolerance: float = 1e-6, *, leases: bool = False, cancel_latency: float = 0.0
    ) -> None:
        self.tolerance = tolerance
        self.leases = leases
        #: Invariant checks an on_success call may wait for the attempt it reports (a
        #: real-clock port reports in batches: the moves may come in a later one).
        self.late_batches = 0
        #: How long a stop's or terminate's cancel may take to reach an attempt in
        #: flight (a port that declared ``late_cancel``; 0: at once).
        self.cancel_latency = cancel_latency
        #: How late after its due time a delayed envelope may become ready (a port
        #: that declared ``late_due``; 0: on time, within ``tolerance``). Never early.
        self.due_latency = 0.0
        self.coverage = Coverage()
        self.tracks: dict[str, Track] = {}
        self.config = QueueConfig()
        self.admissions = 0
        self.now = 0.0
        self.calling: QueueCall | None = None
        self.admitting: set[str] = set()
        self.lent: list[str] = []
        self.fresh_queue(QueueConfig())

    # -- set-up -----------------------------------------------------------------------

    def fresh_queue(self, config: QueueConfig) -> None:
        """A new queue: INIT, no blacklist, no stop, zero counters."""
        self.config = config
        self.life = QS.INIT
        self.stop_request = StopMode(config.stop_mode)
        self.run: RunLog | None = None
        self.last_report: dict[str, Any] = _report((), (), (), False)
        self.blacklist: set[str] = set()
        #: Model time each type was banned.
        self.banned_at: dict[str, float] = {}
        self.returned: list[str] = []
        self.terminal_counts = dict.fromkeys(TERMINAL_STATES, 0)
        self.outcomes = dict.fromkeys(O, 0)
        self.dedups = 0
        self.rejections = dict.fromkeys(
            ("state", "invalid", "blacklisted", "foreign", "capacity"), 0
        )

    def define(self, name: str, spec: EnvSpec) -> None:
        """A scripted envelope the harness defined."""
        self.tracks[name] = Track(name, spec, deque(spec.script))

    def plan(self, name: str, plan: Plan) -> None:
        """A plan appended to an envelope's script."""
        self.tracks[name].script.append(plan)

    def in_state(self, *states: EnvState) -> list[Track]:
        """The envelopes in these states."""
        return [t for t in self.tracks.values() if t.state in states]

    def live(self) -> list[Track]:
        """The live envelopes."""
        return self.in_state(*LIVE)

    def parked(self) -> list[str]:
        """The parked envelopes, in admission order."""
        return [t.name for t in sorted(self.in_state(ES.PARKED), key=lambda t: t.seq)]

    def blocked(self) -> bool:
        """Whether an attempt in flight can only end by a release or a cancel."""
        return any(
            t.attempt is not None
            and t.attempt.hanging
            and t.spec.deadline == 0
            and t.attempt.cancel_cause is None
            for t in self.in_state(ES.RUNNING)
        )

    def hanging(self) -> list[str]:
        """The envelopes whose attempt hangs, by name."""
        return sorted(
            t.name for t in self.tracks.values() if t.attempt is not None and t.attempt.hanging
        )

    def request_cancel(self, cause: CancelCause) -> None:
        """A stop with cancel, or terminate, asks every attempt in flight to cancel
        (one dispatched whose invoke has not begun yet hears it when it begins)."""
        for t in self.in_state(ES.RUNNING):
            if t.attempt is not None:
                t.attempt.cancel_cause = cause
                if t.attempt.cancel_asked is None:
                    t.attempt.cancel_asked = self.now
            else:
                first = self.now if t.cancel_pending is None else t.cancel_pending[1]
                t.cancel_pending = (cause, first)

    # -- observations -----------------------------------------------------------------

    def observe(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Check a batch of the driver's observations, in order."""
        for ev in events:
            self.now = max(self.now, float(ev.get("t", self.now)))
            kind = ev.get("kind")
            if kind == "queue":
                self._queue_event(QS(ev["from"]), QS(ev["to"]))
            elif kind == "move":
                self._envelope_event(ev)
            elif kind == "invoke":
                self._invoked(str(ev["env"]), Plan(ev["plan"]), float(ev["t"]))
            elif kind == "cancelled":
                t = self.tracks[str(ev["env"])]
                _check(t.attempt is not None, "I3", f"{t.name}: cancelled with no attempt")
                assert t.attempt is not None
                t.attempt.cancelled_at = float(ev["t"])
            elif kind == "on_failure":
                t = self.tracks[str(ev["env"])]
                if not t.reports.failure((str(ev["error"]), int(ev["attempt"]))):
                    t.hooks.append((str(ev["error"]), int(ev["attempt"])))
            elif kind == "on_success":
                _on_success(self.tracks[str(ev["env"])], int(ev["attempt"]))
            else:
                raise Violation("protocol", f"unknown observation {ev!r}")

    def resync(self, event: Mapping[str, Any]) -> None:
        """After a violation the port is allowed (a declared divergence), follow the
        port: take the state it reports, so that one divergence is reported once
        rather than as a cascade."""
        if event.get("kind") == "queue":
            self.life = QS(event["to"])
        elif event.get("kind") == "move" and event.get("env") in self.tracks:
            t = self.tracks[str(event["env"])]
            to = ES(event["to"])
            if t.state in LIVE and to in TERMINAL_STATES:
                t.ends += 1
            elif t.state not in LIVE and to in LIVE:
                t.stays += 1
                self.admissions += 1
                t.seq = self.admissions
            t.state = to
            if to is ES.DELAYED:
                t.due = math.inf  # when the port will run it again is its own business
            self.admitting.discard(t.name)
            if to is not ES.RUNNING:
                t.attempt = None
                t.cancel_pending = None
                t.hooks = []
                t.reports.forget()

    def _invoked(self, name: str, plan: Plan, now: float) -> None:
        t = self.tracks[name]
        self.coverage.check("I3")
        _check(t.state is ES.RUNNING, "I3", f"{name}: invoked while {t.state.name}")
        _check(t.attempt is None, "I3", f"{name}: invoked again while its attempt runs")
        expected = t.script.popleft() if t.script else t.spec.then
        _check(plan is expected, "protocol", f"{name}: ran plan {plan.value}, not {expected.value}")
        t.attempt = AttemptLog(plan, now)
        if t.cancel_pending is not None:
            t.attempt.cancel_cause, t.attempt.cancel_asked = t.cancel_pending
        t.cancel_pending = None
        if plan in (Plan.SLOW, Plan.LONG):
            t.attempt.final = Plan.OK
        elif plan is not Plan.HANG:
            t.attempt.final = plan

    def release(self, name: str, plan: Plan) -> None:
        """The harness released a hanging attempt with ``plan``."""
        att = self.tracks[name].attempt
        assert att is not None
        assert att.hanging
        att.release = plan
        att.final = plan

    def _queue_event(self, frm: QueueState, to: QueueState) -> None:
        self.coverage.check("I7")
        _check(frm is self.life, "I7", f"queue event from {frm.name}, model has {self.life.name}")
        _check(frm is not to, "I7", f"queue event {frm.name} -> {to.name} changes nothing")
        _check(
            any(target is to for (s, _c), target in _LIFE_MODEL.items() if s is frm),
            "I7",
            f"no transition of LifecycleModel leads {frm.name} -> {to.name}",
        )
        move = (frm, to)
        _check(
            move in CALL_MOVES[self.calling] or move == DRAINED_MOVE,
            "I7",
            f"{frm.name} -> {to.name} during {self.calling}",
        )
        if to is QS.STOPPING:
            self.run = RunLog(self.stop_request)
        if move == DRAINED_MOVE:
            self.coverage.row("LIFECYCLE[STOPPING,DRAINED]")
            self.coverage.check("I6")
            _check(not self.in_state(ES.RUNNING), "I6", "stop ended with attempts in flight")
            stray = [t.name for t in self.live() if t.state is not ES.PARKED]
            _check(not stray, "I6", f"stop ended with {stray} not parked")
            run = self.run
            assert run is not None
            self.last_report = _report(self.parked(), run.completed, run.cancelled, True)
            self.run = None
        self.life = to

    def _envelope_event(self, ev: Mapping[str, Any]) -> None:
        name = str(ev["env"])
        t = self.tracks.get(name)
        _check(t is not None, "protocol", f"event for an envelope never defined: {name!r}")
        assert t is not None
        frm, to = ES(ev["from"]), ES(ev["to"])
        now = float(ev["t"])
        outcome = None if ev.get("outcome") is None else O(ev["outcome"])
        self.coverage.check("I7")
        if frm is ES.NEW:
            self.coverage.check("I8")
            _check(
                t.state is ES.NEW or t.state in TERMINAL_STATES,
                "I8",
                f"{name}: re-admitted while {t.state.name}",
            )
        else:
            _check(frm is t.state, "I2", f"{name}: moved from {frm.name}, model has {t.state.name}")
        event: EnvEvent | Outcome | None = outcome or infer_event(frm, to)
        _check(event is not None, "I7", f"{name}: no event moves {frm.name} -> {to.name}")
        assert event is not None
        _check(
            to in ENVELOPE_MOVES.get((frm, event), ()),
            "I7",
            f"{name}: illegal move {frm.name} --{event.name}--> {to.name}",
            f"ENVELOPE_MOVES[{frm.name},{event.name}]",
        )
        self.coverage.row(f"ENVELOPE_MOVES[{frm.name},{event.name}]")
        if isinstance(event, Outcome):
            self._outcome_event(t, event, to, ev.get("cause"), now)
        elif event is EnvEvent.SEND:
            _check(not t.lent, "I2", f"{name}: admitted while live in the other queue")
            _check(name in self.admitting, "I5", f"{name}: admitted without a send")
            self.admitting.discard(name)
            self.admissions += 1
            t.stays += 1
            t.seq = self.admissions
            t.attempts = t.failures = 0
            t.attempt = None
            t.reports.admitted()
            if self.life is QS.INIT:
                _check(to is ES.BUFFERED, "I6", f"{name}: sent to an INIT queue, went {to.name}")
                t.remaining = t.spec.delay
            else:
                _check(self.life is QS.RUNNING, "I6", f"{name}: admitted while {self.life.name}")
                t.arrive(to, _first_delay(t.spec, now, t.spec.delay), now, armed=True)
        elif event is EnvEvent.START:
            _check(self.life is QS.RUNNING, "I6", f"{name}: armed while {self.life.name}")
            if frm is ES.BUFFERED:
                delay = _first_delay(t.spec, now, t.spec.delay)
            else:  # a calendar skips the fires missed while stopped
                delay = _first_delay(t.spec, now, 0.0) if t.spec.cron else t.remaining
            t.arrive(to, delay, now, armed=True)
        elif event is EnvEvent.DUE:
            _check(self.life is QS.RUNNING, "I6", f"{name}: due while {self.life.name}")
            _check(
                math.isinf(t.due)
                or -self.tolerance <= now - t.due <= self.tolerance + self.due_latency,
                "I7",
                f"{name}: due at {t.due:g}, became ready at {now:g}",
            )
            t.sched = now if math.isinf(t.due) else t.due
        elif event is EnvEvent.DISPATCH:
            _check(
                self.life in (QS.RUNNING, QS.STOPPING),
                "I6",
                f"{name}: dispatched while {self.life.name}",
            )
            if self.life is QS.STOPPING:
                assert self.run is not None
                _check(self.run.mode is StopMode.DRAIN, "I6", f"{name}: dispatched by a STOP stop")
            busy = len(self.in_state(ES.RUNNING))
            _check(
                busy < self.config.workers,
                "I3",
                f"{busy + 1} attempts at once on {self.config.workers} worker(s)",
            )
            t.attempts += 1
            t.attempt = None
            t.cancel_pending = None
        elif event is EnvEvent.STOP:
            _check(self.life is QS.STOPPING, "I6", f"{name}: parked while {self.life.name}")
            assert self.run is not None
            if frm is ES.READY:
                _check(self.run.mode is StopMode.STOP, "I6", f"{name}: a DRAIN stop parked it")
                t.remaining = 0.0
            else:  # inf: a due time the oracle took from the port (see resync)
                t.remaining = max(0.0, t.due - now)
        elif event is EnvEvent.TERMINATE:
            _check(self.life is QS.TERMINATED, "I5", f"{name}: handed back while {self.life.name}")
        elif event is EnvEvent.BLACKLIST:
            spec_type = t.spec.type
            _check(bool(spec_type), "I4", f"{name}: a type-less envelope stopped by a blacklist")
            if spec_type not in self.blacklist:
                # The attempt raising StopType is ending: its queue bans the type (and
                # stops the others of it) before its own end is reported.
                culprits = [
                    o.name
                    for o in self.in_state(ES.RUNNING)
                    if o.spec.type == spec_type
                    and o.attempt is not None
                    and o.attempt.final is Plan.STOP_TYPE
                ]
                _check(bool(culprits), "I4", f"{name}: stopped, {spec_type!r} not banned")
                self._ban(spec_type)
        t.state = to
        if to in TERMINAL_STATES:
            t.ends += 1
            self.terminal_counts[to] += 1
            if to is ES.RETURNED:
                self.returned.append(name)

    def _planned_outcome(self, t: Track, att: AttemptLog, now: float) -> Outcome:
        """The outcome the attempt's plan, deadline or cancel makes (a StopType it
        carried out bans the type)."""
        want = expected_outcome(
            t.spec,
            att.final,
            started=att.start,
            cancelled_at=att.cancelled_at,
            cancel_cause=att.cancel_cause,
            tolerance=self.tolerance,
        )
        if att.cancelled_at is None and att.plan in _DURATIONS:
            # The attempt's body must have run to its end before its outcome came.
            ends = att.start + _DURATIONS[att.plan]
            _check(
                now >= ends - self.tolerance,
                "I3",
                f"{t.name}: attempt ({att.plan.value}) from {att.start:g} ended at {now:g}",
            )
        if want is O.STOP_TYPE and t.spec.type:
            self._ban(t.spec.type)
        return want

    def _ban(self, type_: str) -> None:
        self.blacklist.add(type_)
        self.banned_at.setdefault(type_, self.now)

    def _hook_before_ban(
        self, t: Track, outcome: Outcome, hooks: list[tuple[str, int]], now: float
    ) -> bool:
        """Whether ``hooks`` are those the attempt's own row calls, decided before the
        ban of its type reached it: the port declared that a ban, like a cancel, takes
        up to ``cancel_latency`` to reach an attempt, and the attempt ended no later
        than that after the ban."""
        banned = self.banned_at.get(t.spec.type)
        if not self.cancel_latency or banned is None or not hooks:
            return False
        if now > banned + self.cancel_latency + self.tolerance:
            return False
        assert t.attempt is not None
        unbanned, _ = expected_target(
            t.spec,
            outcome,
            blacklisted=False,
            queue=self.life,
            cancel_cause=t.attempt.cancel_cause,
            attempts=t.attempts,
            failures=t.failures,
            sched=t.sched,
            now=now,
        )
        return hooks == [unbanned.hook]

    def _outcome_event(
        self, t: Track, outcome: Outcome, to: EnvState, cause: object, now: float
    ) -> None:
        att = t.attempt
        _check(att is not None, "I3", f"{t.name}: an attempt ended that never started")
        assert att is not None
        blacklisted = bool(t.spec.type) and t.spec.type in self.blacklist
        kind = "BLACKLISTED" if blacklisted else "PERIODIC" if t.spec.periodic else "ONE_OFF"
        row = f"OUTCOMES[{kind},{outcome.name}]"
        action = OUTCOMES[(Kind[kind], outcome)].action
        if outcome is O.EXPIRED:
            # No plan makes a lease expire: a port whose store several processes share
            # reports it when another process reaps the attempt, at any point of its
            # plan. It is decided like a TIMEOUT (expected_target).
            _check(
                self.leases,
                "I7",
                f"{t.name}: attempt ({att.plan.value}) ended EXPIRED; the port has no leases",
                row,
            )
            want = O.EXPIRED
        else:
            want = self._planned_outcome(t, att, now)
        cancel_cause = att.cancel_cause
        first = att.deadline_first(t.spec.deadline, self.cancel_latency, self.tolerance)
        if want is O.CANCELLED and outcome is O.TIMEOUT and first:
            want, cancel_cause = O.TIMEOUT, None
        self.coverage.row(row)
        _check(
            outcome is want,
            "I7",
            f"{t.name}: attempt ({att.plan.value}) ended {outcome.name}, expected {want.name}",
            row,
        )
        self.outcomes[outcome] += 1
        if self.run is not None:
            (self.run.cancelled if outcome is O.CANCELLED else self.run.completed).append(t.name)
        expected, t.failures = expected_target(
            t.spec,
            outcome,
            blacklisted=blacklisted,
            queue=self.life,
            cancel_cause=cancel_cause,
            attempts=t.attempts,
            failures=t.failures,
            sched=t.sched,
            now=now,
        )
        check = "I4" if outcome in (O.STOP, O.STOP_TYPE) or blacklisted else "I7"
        if expected.to is ES.PARKED:
            check = "I6"
        _check(
            to is expected.to,
            check,
            f"{t.name}: {outcome.name} led to {to.name}, expected {expected.to.name}",
            row,
        )
        if expected.cause == "stop" and att.final is Plan.STOP_TYPE:
            expected = attrs.evolve(expected, cause="stop_type")  # a typeless StopType
        if expected.check_cause:
            _check(
                cause == expected.cause,
                "I7",
                f"{t.name}: {outcome.name} with cause {cause!r}, expected {expected.cause!r}",
                row,
            )
        hooks, t.hooks = t.hooks, []
        if expected.hook is None:
            late = blacklisted and self._hook_before_ban(t, outcome, hooks, now)
            _check(not hooks or late, "I7", f"{t.name}: on_failure called: {hooks}", row)
        else:
            # A port with leases may run a hook that only reports after the move.
            owed = self.leases and not hooks and action is Action.REPORT_FAILURE
            _check(
                hooks == [expected.hook] or owed,
                "I7",
                f"{t.name}: on_failure {hooks}, expected {[expected.hook]}",
                row,
            )
            if owed:
                t.reports.owe_failure(expected.hook)
        reports = t.spec.on_success and action in _REPORTS
        ended = t.reports.end(
            t.attempts, t.stays, outcome.name, row, reports=reports, leases=self.leases
        )
        _hook_problem(t.name, ended)
        t.last_end = f", after attempt {t.attempts} ended {outcome.name} ({row})"
        t.arrive(to, expected.delay, now, armed=False)
        t.attempt = None

    # -- calls ------------------------------------------------------------------------

    def predict_send(
        self, names: list[str], *, valid: bool = True
    ) -> tuple[str | None, str, list[str]]:
        """send()'s checks in the contract's order: state, validation (``valid``: every
        item of the batch is an envelope), blacklist, dedup / another queue, capacity.
        (error name or None, rejection reason, fresh names)."""
        error = send_error(self.life)
        if error is not None:
            return error, "state", []
        if not valid:
            return ERRORS["BadEnvelope"], "invalid", []
        tracks = [self.tracks[n] for n in names]
        if any(t.spec.type and t.spec.type in self.blacklist for t in tracks):
            return "type_blacklisted", "blacklisted", []
        if any(t.lent for t in tracks):
            return "bad_envelope", "foreign", []
        fresh = list(dict.fromkeys(t.name for t in tracks if t.state not in LIVE))
        capacity = self.config.capacity
        if fresh and capacity and len(self.live()) + len(fresh) > capacity:
            return "capacity_exceeded", "capacity", fresh
        return None, "", fresh

    def check_call(
        self, what: str, expected: str | None, ok: bool, error: object, row: str
    ) -> None:
        """A call answered as predicted: success, or exactly this error (by name)."""
        self.coverage.row(row)
        self.coverage.check("I7")
        if expected is None:
            _check(ok, "I7", f"{what}: expected success, got {error!r}", row)
        else:
            _check(
                not ok and error == expected,
                "I7",
                f"{what}: expected {expected}, got {'success' if ok else error!r}",
                row,
            )

    def check_report(self, report: Mapping[str, Any], before: QueueState, wait: bool) -> None:
        """A stop's report against the model's."""
        self.coverage.check("I6")
        if before in (QS.INIT, QS.STOPPED, QS.TERMINATED):
            _check(
                self.life is before, "I6", f"a no-op stop moved {before.name} to {self.life.name}"
            )
            _check(
                dict(report) == self.last_report,
                "I6",
                f"report {dict(report)} != {self.last_report}",
            )
            return
        if wait or self.life is QS.STOPPED:
            _check(self.life is QS.STOPPED, "I6", f"stop returned while {self.life.name}")
            _check(
                dict(report) == self.last_report,
                "I6",
                f"report {dict(report)} != {self.last_report}",
            )
            return
        _check(self.life is QS.STOPPING, "I6", f"stop(wait=False) left the queue {self.life.name}")
        assert self.run is not None
        expected = _report(self.parked(), self.run.completed, self.run.cancelled, False)
        _check(dict(report) == expected, "I6", f"report {dict(report)} != {expected}")

    def check_handed_back(self, handed: list[str], before: QueueState) -> None:
        """terminate()'s list against the RETURNED events."""
        self.coverage.check("I5")
        returned = sorted(self.returned, key=lambda n: self.tracks[n].seq)
        self.returned = []
        _check(len(set(handed)) == len(handed), "I5", f"handed back twice: {handed}")
        _check(handed == returned, "I5", f"handed back {handed}, RETURNED events for {returned}")
        _check(self.life is QS.TERMINATED, "I5", f"terminate() left the queue {self.life.name}")
        if before is QS.TERMINATED:
            _check(handed == [], "I5", f"a second terminate() handed back {handed}")

    # -- invariants -------------------------------------------------------------------

    def check_due(self, now: float | None = None) -> None:
        """No envelope still DELAYED past its due time at ``now`` (the port's time;
        default: the last observation's)."""
        self.now = self.now if now is None else max(self.now, now)
        _check_due(self.in_state(ES.DELAYED), self.now, self.tolerance + self.due_latency)

    def check_invariants(self, stats: Mapping[str, Any] | None) -> None:
        """The invariants after a step, against the port's statistics (None: the port
        reports none)."""
        live = self.live()
        self.coverage.check("I1")
        if stats is not None:
            used = int(stats["capacity_used"])
            _check(used == len(live), "I1", f"capacity_used {used}, live envelopes {len(live)}")
            by_state = stats.get("by_state", {})
            self.coverage.check("I2")
            for state in LIVE:
                got = int(by_state.get(state.value, 0))
                want = len(self.in_state(state))
                _check(got == want, "I2", f"statistics say {got} {state.name}, the model {want}")
            _check(
                QS(stats["state"]) is self.life,
                "I7",
                f"statistics say {stats['state']}, the model {self.life.value}",
            )
        if self.config.capacity:
            _check(len(live) <= self.config.capacity, "I1", f"{len(live)} live > capacity")
        # I6: which envelope states each lifecycle state allows.
        self.coverage.check("I6")
        allowed = ALLOWED_LIVE[self.life]
        stray = [(t.name, t.state.name) for t in live if t.state not in allowed]
        _check(not stray, "I6", f"{self.life.name} queue holds {stray}")
        ready, running = len(self.in_state(ES.READY)), len(self.in_state(ES.RUNNING))
        if self.life is QS.STOPPING:
            assert self.run is not None
            _check(running >= 1, "I6", "STOPPING with nothing in flight")
            if self.run.mode is StopMode.STOP:
                _check(ready == 0, "I6", "a STOP-mode stop left envelopes READY")
        if ready:
            _check(running == self.config.workers, "I3", f"{ready} READY, {running} running")
        # I4: no live envelope of a blacklisted type but RUNNING ones.
        self.coverage.check("I4")
        banned = [
            t.name for t in live if t.spec.type in self.blacklist and t.state is not ES.RUNNING
        ]
        _check(not banned, "I4", f"live envelopes of blacklisted types: {banned}")
        self.check_due()
        # I5: nothing lost.
        self.coverage.check("I5")
        _check(not self.returned, "I5", f"RETURNED but not handed back: {self.returned}")
        for t in self.tracks.values():
            in_queue = 1 if t.state in LIVE else 0
            _check(t.ends == t.stays - in_queue, "I5", f"{t.name}: {t.stays} stays, {t.ends} ends")
            _hooks_accounted(t, self.late_batches)


def _check_due(delayed: Iterable[Track], now: float, tolerance: float) -> None:
    """Delayed envelopes become ready on time."""
    late = [(t.name, t.due) for t in delayed if t.due < now - tolerance]
    _check(not late, "I7", f"at {now:g}, still DELAYED past their due time: {late}")


def _report(
    parked: Iterable[str], completed: Iterable[str], cancelled: Iterable[str], complete: bool
) -> dict[str, Any]:
    return {
        "parked": list(parked),
        "completed": list(completed),
        "cancelled": list(cancelled),
        "complete": complete,
    }
