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

Which states and moves the oracle allows, where a move goes and what an attempt
leads to are :mod:`envq.conform.expected`'s (derived from the tables of
:mod:`envq._machine` and the models; its time arithmetic is the harness's own, on
purpose); the names tests and ports use are re-exported here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from envq._machine import (
    ENVELOPE_MOVES,
    OUTCOMES,
    TERMINAL_STATES,
    Action,
    CancelCause,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueCall,
    QueueState,
    StopMode,
)
from envq.conform.expected import (
    ALLOWED_LIVE,
    CALL_MOVES,
    DRAINED_MOVE,
    DURATIONS,
    LIFE_MODEL,
    LIVE,
    REPORTS,
    Expected,
    Violation,
    expected_outcome,
    expected_target,
    first_delay,
    hook_problem,
    infer_event,
    model_target,
    require,
)
from envq.conform.protocol import (
    ERRORS,
    EnvSpec,
    Plan,
    QueueConfig,
)
from envq.conform.records import (
    AttemptLog,
    Coverage,
    RunLog,
    Track,
    hooks_accounted,
    room_in_time,
    send_error,
    start_result,
    success_called,
)

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

# ---------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------


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
                require(t.attempt is not None, "I3", f"{t.name}: cancelled with no attempt")
                assert t.attempt is not None
                t.attempt.cancelled_at = float(ev["t"])
            elif kind == "on_failure":
                t = self.tracks[str(ev["env"])]
                if not t.reports.failure((str(ev["error"]), int(ev["attempt"]))):
                    t.hooks.append((str(ev["error"]), int(ev["attempt"])))
            elif kind == "on_success":
                success_called(self.tracks[str(ev["env"])], int(ev["attempt"]))
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
        require(t.state is ES.RUNNING, "I3", f"{name}: invoked while {t.state.name}")
        require(t.attempt is None, "I3", f"{name}: invoked again while its attempt runs")
        expected = t.script.popleft() if t.script else t.spec.then
        require(
            plan is expected, "protocol", f"{name}: ran plan {plan.value}, not {expected.value}"
        )
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
        require(frm is self.life, "I7", f"queue event from {frm.name}, model has {self.life.name}")
        require(frm is not to, "I7", f"queue event {frm.name} -> {to.name} changes nothing")
        require(
            any(target is to for (s, _c), target in LIFE_MODEL.items() if s is frm),
            "I7",
            f"no transition of LifecycleModel leads {frm.name} -> {to.name}",
        )
        move = (frm, to)
        require(
            move in CALL_MOVES[self.calling] or move == DRAINED_MOVE,
            "I7",
            f"{frm.name} -> {to.name} during {self.calling}",
        )
        if to is QS.STOPPING:
            self.run = RunLog(self.stop_request)
        if move == DRAINED_MOVE:
            self.coverage.row("LIFECYCLE[STOPPING,DRAINED]")
            self.coverage.check("I6")
            require(not self.in_state(ES.RUNNING), "I6", "stop ended with attempts in flight")
            stray = [t.name for t in self.live() if t.state is not ES.PARKED]
            require(not stray, "I6", f"stop ended with {stray} not parked")
            run = self.run
            assert run is not None
            self.last_report = _report(self.parked(), run.completed, run.cancelled, True)
            self.run = None
        self.life = to

    def _envelope_event(self, ev: Mapping[str, Any]) -> None:
        name = str(ev["env"])
        t = self.tracks.get(name)
        require(t is not None, "protocol", f"event for an envelope never defined: {name!r}")
        assert t is not None
        frm, to = ES(ev["from"]), ES(ev["to"])
        now = float(ev["t"])
        outcome = None if ev.get("outcome") is None else O(ev["outcome"])
        self.coverage.check("I7")
        if frm is ES.NEW:
            self.coverage.check("I8")
            require(
                t.state is ES.NEW or t.state in TERMINAL_STATES,
                "I8",
                f"{name}: re-admitted while {t.state.name}",
            )
        else:
            require(
                frm is t.state, "I2", f"{name}: moved from {frm.name}, model has {t.state.name}"
            )
        event: EnvEvent | Outcome | None = outcome or infer_event(frm, to)
        require(event is not None, "I7", f"{name}: no event moves {frm.name} -> {to.name}")
        assert event is not None
        require(
            to in ENVELOPE_MOVES.get((frm, event), ()),
            "I7",
            f"{name}: illegal move {frm.name} --{event.name}--> {to.name}",
            f"ENVELOPE_MOVES[{frm.name},{event.name}]",
        )
        self.coverage.row(f"ENVELOPE_MOVES[{frm.name},{event.name}]")
        if isinstance(event, Outcome):
            self._outcome_event(t, event, to, ev.get("cause"), now)
        elif event is EnvEvent.SEND:
            require(not t.lent, "I2", f"{name}: admitted while live in the other queue")
            require(name in self.admitting, "I5", f"{name}: admitted without a send")
            self.admitting.discard(name)
            self.admissions += 1
            t.stays += 1
            t.seq = self.admissions
            t.attempts = t.failures = 0
            t.attempt = None
            t.reports.admitted()
            if self.life is QS.INIT:
                require(to is ES.BUFFERED, "I6", f"{name}: sent to an INIT queue, went {to.name}")
                t.remaining = t.spec.delay
            else:
                require(self.life is QS.RUNNING, "I6", f"{name}: admitted while {self.life.name}")
                t.arrive(to, first_delay(t.spec, now, t.spec.delay), now, armed=True)
        elif event is EnvEvent.START:
            require(self.life is QS.RUNNING, "I6", f"{name}: armed while {self.life.name}")
            if frm is ES.BUFFERED:
                delay = first_delay(t.spec, now, t.spec.delay)
            else:  # a calendar skips the fires missed while stopped
                delay = first_delay(t.spec, now, 0.0) if t.spec.cron else t.remaining
            t.arrive(to, delay, now, armed=True)
        elif event is EnvEvent.DUE:
            require(self.life is QS.RUNNING, "I6", f"{name}: due while {self.life.name}")
            require(
                math.isinf(t.due)
                or -self.tolerance <= now - t.due <= self.tolerance + self.due_latency,
                "I7",
                f"{name}: due at {t.due:g}, became ready at {now:g}",
            )
            t.sched = now if math.isinf(t.due) else t.due
        elif event is EnvEvent.DISPATCH:
            require(
                self.life in (QS.RUNNING, QS.STOPPING),
                "I6",
                f"{name}: dispatched while {self.life.name}",
            )
            if self.life is QS.STOPPING:
                assert self.run is not None
                require(self.run.mode is StopMode.DRAIN, "I6", f"{name}: dispatched by a STOP stop")
            busy = len(self.in_state(ES.RUNNING))
            require(
                busy < self.config.workers,
                "I3",
                f"{busy + 1} attempts at once on {self.config.workers} worker(s)",
            )
            t.attempts += 1
            t.attempt = None
            t.cancel_pending = None
        elif event is EnvEvent.STOP:
            require(self.life is QS.STOPPING, "I6", f"{name}: parked while {self.life.name}")
            assert self.run is not None
            if frm is ES.READY:
                require(self.run.mode is StopMode.STOP, "I6", f"{name}: a DRAIN stop parked it")
                t.remaining = 0.0
            else:  # inf: a due time the oracle took from the port (see resync)
                t.remaining = max(0.0, t.due - now)
        elif event is EnvEvent.TERMINATE:
            require(self.life is QS.TERMINATED, "I5", f"{name}: handed back while {self.life.name}")
        elif event is EnvEvent.BLACKLIST:
            spec_type = t.spec.type
            require(bool(spec_type), "I4", f"{name}: a type-less envelope stopped by a blacklist")
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
                require(bool(culprits), "I4", f"{name}: stopped, {spec_type!r} not banned")
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
        if att.cancelled_at is None and att.plan in DURATIONS:
            # The attempt's body must have run to its end before its outcome came.
            ends = att.start + DURATIONS[att.plan]
            require(
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
        require(att is not None, "I3", f"{t.name}: an attempt ended that never started")
        assert att is not None
        blacklisted = bool(t.spec.type) and t.spec.type in self.blacklist
        kind = "BLACKLISTED" if blacklisted else "PERIODIC" if t.spec.periodic else "ONE_OFF"
        row = f"OUTCOMES[{kind},{outcome.name}]"
        action = OUTCOMES[(Kind[kind], outcome)].action
        if outcome is O.EXPIRED:
            # No plan makes a lease expire: a port whose store several processes share
            # reports it when another process reaps the attempt, at any point of its
            # plan. It is decided like a TIMEOUT (expected_target).
            require(
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
        require(
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
        require(
            to is expected.to,
            check,
            f"{t.name}: {outcome.name} led to {to.name}, expected {expected.to.name}",
            row,
        )
        if expected.cause == "stop" and att.final is Plan.STOP_TYPE:
            expected = attrs.evolve(expected, cause="stop_type")  # a typeless StopType
        if expected.check_cause:
            require(
                cause == expected.cause,
                "I7",
                f"{t.name}: {outcome.name} with cause {cause!r}, expected {expected.cause!r}",
                row,
            )
        hooks, t.hooks = t.hooks, []
        if expected.hook is None:
            late = blacklisted and self._hook_before_ban(t, outcome, hooks, now)
            require(not hooks or late, "I7", f"{t.name}: on_failure called: {hooks}", row)
        else:
            # A port with leases may run a hook that only reports after the move.
            owed = self.leases and not hooks and action is Action.REPORT_FAILURE
            require(
                hooks == [expected.hook] or owed,
                "I7",
                f"{t.name}: on_failure {hooks}, expected {[expected.hook]}",
                row,
            )
            if owed:
                t.reports.owe_failure(expected.hook)
        reports = t.spec.on_success and action in REPORTS
        ended = t.reports.end(
            t.attempts, t.stays, outcome.name, row, reports=reports, leases=self.leases
        )
        hook_problem(t.name, ended)
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
            require(ok, "I7", f"{what}: expected success, got {error!r}", row)
        else:
            require(
                not ok and error == expected,
                "I7",
                f"{what}: expected {expected}, got {'success' if ok else error!r}",
                row,
            )

    def check_report(self, report: Mapping[str, Any], before: QueueState, wait: bool) -> None:
        """A stop's report against the model's."""
        self.coverage.check("I6")
        if before in (QS.INIT, QS.STOPPED, QS.TERMINATED):
            require(
                self.life is before, "I6", f"a no-op stop moved {before.name} to {self.life.name}"
            )
            require(
                dict(report) == self.last_report,
                "I6",
                f"report {dict(report)} != {self.last_report}",
            )
            return
        if wait or self.life is QS.STOPPED:
            require(self.life is QS.STOPPED, "I6", f"stop returned while {self.life.name}")
            require(
                dict(report) == self.last_report,
                "I6",
                f"report {dict(report)} != {self.last_report}",
            )
            return
        require(self.life is QS.STOPPING, "I6", f"stop(wait=False) left the queue {self.life.name}")
        assert self.run is not None
        expected = _report(self.parked(), self.run.completed, self.run.cancelled, False)
        require(dict(report) == expected, "I6", f"report {dict(report)} != {expected}")

    def check_handed_back(self, handed: list[str], before: QueueState) -> None:
        """terminate()'s list against the RETURNED events."""
        self.coverage.check("I5")
        returned = sorted(self.returned, key=lambda n: self.tracks[n].seq)
        self.returned = []
        require(len(set(handed)) == len(handed), "I5", f"handed back twice: {handed}")
        require(handed == returned, "I5", f"handed back {handed}, RETURNED events for {returned}")
        require(self.life is QS.TERMINATED, "I5", f"terminate() left the queue {self.life.name}")
        if before is QS.TERMINATED:
            require(handed == [], "I5", f"a second terminate() handed back {handed}")

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
            require(used == len(live), "I1", f"capacity_used {used}, live envelopes {len(live)}")
            by_state = stats.get("by_state", {})
            self.coverage.check("I2")
            for state in LIVE:
                got = int(by_state.get(state.value, 0))
                want = len(self.in_state(state))
                require(got == want, "I2", f"statistics say {got} {state.name}, the model {want}")
            require(
                QS(stats["state"]) is self.life,
                "I7",
                f"statistics say {stats['state']}, the model {self.life.value}",
            )
        if self.config.capacity:
            require(len(live) <= self.config.capacity, "I1", f"{len(live)} live > capacity")
        # I6: which envelope states each lifecycle state allows.
        self.coverage.check("I6")
        allowed = ALLOWED_LIVE[self.life]
        stray = [(t.name, t.state.name) for t in live if t.state not in allowed]
        require(not stray, "I6", f"{self.life.name} queue holds {stray}")
        ready, running = len(self.in_state(ES.READY)), len(self.in_state(ES.RUNNING))
        if self.life is QS.STOPPING:
            assert self.run is not None
            require(running >= 1, "I6", "STOPPING with nothing in flight")
            if self.run.mode is StopMode.STOP:
                require(ready == 0, "I6", "a STOP-mode stop left envelopes READY")
        if ready:
            require(running == self.config.workers, "I3", f"{ready} READY, {running} running")
        # I4: no live envelope of a blacklisted type but RUNNING ones.
        self.coverage.check("I4")
        banned = [
            t.name for t in live if t.spec.type in self.blacklist and t.state is not ES.RUNNING
        ]
        require(not banned, "I4", f"live envelopes of blacklisted types: {banned}")
        self.check_due()
        # I5: nothing lost.
        self.coverage.check("I5")
        require(not self.returned, "I5", f"RETURNED but not handed back: {self.returned}")
        for t in self.tracks.values():
            in_queue = 1 if t.state in LIVE else 0
            require(t.ends == t.stays - in_queue, "I5", f"{t.name}: {t.stays} stays, {t.ends} ends")
            hooks_accounted(t, self.late_batches)


def _check_due(delayed: Iterable[Track], now: float, tolerance: float) -> None:
    """Delayed envelopes become ready on time."""
    late = [(t.name, t.due) for t in delayed if t.due < now - tolerance]
    require(not late, "I7", f"at {now:g}, still DELAYED past their due time: {late}")


def _report(
    parked: Iterable[str], completed: Iterable[str], cancelled: Iterable[str], complete: bool
) -> dict[str, Any]:
    return {
        "parked": list(parked),
        "completed": list(completed),
        "cancelled": list(cancelled),
        "complete": complete,
    }
