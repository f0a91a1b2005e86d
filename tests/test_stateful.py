"""Stateful property test: the real ``envq.Queue`` driven step by step beside a model.

A Hypothesis ``RuleBasedStateMachine`` owns a :class:`envq.testing.VirtualTimeLoop`
(rules cannot be async, Hypothesis issue #4107): every rule runs one coroutine on it
to quiescence, and time only moves when a rule advances it.

The envelopes are scripted: each attempt takes the next :class:`Plan` of its envelope's
script (then the envelope's default, OK, SLOW, LONG or HANG) and returns, raises,
sleeps, or hangs until released, cancelled or cut off by its deadline; rules append
plans. The model is plain Python:

* every envelope ever admitted (by identity), its current state, its stays in the
  queue (a re-send after a terminal state starts a new one from NEW), its due time or
  remaining delay, its attempt counters and the attempt in flight;
* the lifecycle state, the stop under way (mode, completed and cancelled attempts)
  and the last final stop report;
* the type blacklist, the send_wait producers, and the counters ``statistics()``
  reports.

A listener checks every event as it happens: each envelope's events are a path through
``ENVELOPE_MOVES`` from NEW, and each move is the one the model predicts (the outcome
of the scripted attempt, the state it leads to with its delay, ``on_failure`` call and
cause, the due time of a delay, a parked envelope's remaining delay). Where an attempt
leads is the package's one oracle (:func:`envq.conform.oracle.expected_outcome` and
:func:`~envq.conform.oracle.expected_target`, which takes the state from the
python-statemachine model, written from the contract rather than from
``envq._machine``), the same one ``envq conform`` checks other ports with. Invariants
after every step compare the model with ``capacity_used`` and ``statistics()``.
Expected exceptions are the ones the model predicts, by exact type. Problems found
inside the loop (in the listener, ``invoke`` or a hook, where raising would only be
logged or turned into an outcome) are collected and raised when the step ends.
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import traceback
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from strategies import (
    LONG_SECONDS,
    SLOW_SECONDS,
    EnvSpec,
    Plan,
    Policy,
    QueueConfig,
    StopCall,
    bad_items,
    env_specs,
    large_steps,
    plans,
    queue_configs,
    releases,
    send_wait_timeouts,
    small_steps,
    stop_calls,
)

import envq
from envq._machine import ENVELOPE_MOVES, LIFECYCLE, CancelCause, EnvEvent, QueueCall
from envq.conform.oracle import (
    ALLOWED_LIVE,
    CALL_MOVES,
    DRAINED_MOVE,
    LIVE,
    AttemptLog,
    expected_outcome,
    expected_target,
    infer_event,
    room_in_time,
)
from envq.conform.protocol import CAUSES
from envq.testing import VirtualTimeLoop

T = TypeVar("T")
P = ParamSpec("P")

ES = envq.EnvState
QS = envq.QueueState
O = envq.Outcome  # noqa: E741 - short alias like ES/QS
DRAIN = envq.StopMode.DRAIN
STOP = envq.StopMode.STOP

TERMINAL = (ES.SUCCEEDED, ES.FAILED, ES.STOPPED, ES.RETURNED)
#: Virtual seconds a rule waits for a stop, wait_stopped or terminate before it
#: concludes the call will never return (which the model must then explain: an attempt
#: hanging without a deadline). Far longer than any backlog of LONG attempts a DRAIN
#: stop runs; virtual time costs nothing.
GUARD = 100_000.0
#: At most this many ``sleep(0)`` passes let ready callbacks run (see ``settle``).
SETTLE_PASSES = 200
#: Timing tolerance of the oracle's checks (the virtual clock is exact).
EPS = 1e-9
#: More attempts of one envelope at one instant than this is a livelock.
LIVELOCK = 200

#: What ``send()`` raises in each lifecycle state (contract §3), None = accepted.
SEND_ERROR: dict[envq.QueueState, type[envq.EnvqError] | None] = {
    QS.INIT: None,
    QS.RUNNING: None,
    QS.STOPPING: envq.QueueStopping,
    QS.STOPPED: envq.QueueNotRunning,
    QS.TERMINATED: envq.QueueTerminated,
}
#: What ``start()`` does in each state: the next state, or the error it raises.
START_RESULT: dict[envq.QueueState, envq.QueueState | type[envq.EnvqError]] = {
    QS.INIT: QS.RUNNING,
    QS.RUNNING: QS.RUNNING,
    QS.STOPPING: envq.QueueStopping,
    QS.STOPPED: QS.RUNNING,
    QS.TERMINATED: envq.QueueTerminated,
}
#: The exception class of each of the protocol's cause names (the oracle names causes
#: as the driver protocol does; envq raises and reports these classes).
CAUSE_CLASSES: dict[str, type[BaseException]] = {
    CAUSES[cls.__name__]: cls
    for cls in (
        RuntimeError,
        TimeoutError,
        asyncio.CancelledError,
        envq.StopEnvelope,
        envq.StopType,
        envq.DoNotRetry,
        envq.MaxRetriesExceeded,
    )
}


def _retry(spec: EnvSpec) -> envq.Retry | None:
    """The ``envq.Retry`` of a :attr:`Policy.RETRY` spec (no jitter: the model predicts
    each backoff exactly)."""
    if spec.policy is not Policy.RETRY:
        return None
    return envq.Retry(attempts=spec.attempts, base=spec.base, cap=spec.cap, jitter=False)


async def settle() -> None:
    """Let every ready callback run without moving the clock: pass control until the
    loop's ready queue (a private attribute of asyncio's base loop) is empty, and once
    more; at most SETTLE_PASSES times."""
    ready = cast("Any", asyncio.get_running_loop())._ready
    idle = 0
    for _ in range(SETTLE_PASSES):
        await asyncio.sleep(0)
        idle = idle + 1 if not ready else 0
        if idle == 2:
            return


class Violation(AssertionError):
    """A check of the model failed (inside the event loop, or in a rule or invariant)."""


def one_origin(fn: Callable[P, T]) -> Callable[P, T]:
    """Report every failed check of a rule or invariant as one Violation raised here.

    Hypothesis tells failures apart by where they were raised (and what they were
    raised from); a broken engine typically trips several of the model's checks (or
    makes a call raise something unexpected), and
    Hypothesis would then shrink and report each separately, for minutes. Raising
    outside the ``except`` block drops the context, so all share one origin; the
    original traceback is kept in the message.
    """

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except HypothesisException:
            raise
        except Exception as exc:
            failure = exc
        message = "".join(traceback.format_exception(failure, chain=False))
        raise Violation(f"{fn.__name__}: {failure}\n\n{message}")

    return checked


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Attempt(AttemptLog):
    """One attempt of a scripted envelope, as its ``invoke`` saw it: the oracle's
    record of an attempt, plus the event a HANG attempt waits on until released."""

    gate: asyncio.Event | None = None


@attrs.define(eq=False)
class Track:
    """The model of one envelope, across all its stays in the queue."""

    env: envq.Envelope
    #: The envelope's id: the order in which the test made it.
    number: int
    spec: EnvSpec
    script: deque[Plan] = attrs.Factory(deque)
    state: envq.EnvState = ES.NEW
    #: Admissions so far (a re-send after a terminal state is a new stay).
    stays: int = 0
    #: Terminal events so far (one per stay that has ended).
    ends: int = 0
    #: Admission number of the current stay (the queue's admission order).
    seq: int = 0
    #: Attempts in this stay; consecutive failures of a periodic envelope.
    attempts: int = 0
    failures: int = 0
    #: DELAYED: the loop time it becomes READY.
    due: float = 0.0
    #: BUFFERED/PARKED: the delay still to wait when armed.
    remaining: float = 0.0
    #: READY/RUNNING: the scheduled start of the run (for FIXED_RATE).
    sched: float = 0.0
    attempt: Attempt | None = None
    #: Attempts of this envelope in progress right now (must stay <= 1).
    active: int = 0
    #: Live in the other queue.
    lent: bool = False
    #: Attempts started at the loop time ``burst_at`` (livelock detection).
    burst: int = 0
    burst_at: float = -1.0


@attrs.define(eq=False)
class RunLog:
    """A stop under way, as the model sees it."""

    mode: envq.StopMode
    completed: list[envq.Envelope] = attrs.Factory(list)
    cancelled: list[envq.Envelope] = attrs.Factory(list)


@attrs.define(eq=False)
class Waiter:
    """One ``send_wait`` producer and its batch."""

    envs: tuple[envq.Envelope, ...]
    started: float
    timeout: float
    #: "now" (admitted at once), "wait", or the error expected at once.
    expect: str | type[envq.EnvqError]
    task: asyncio.Task[None] | None = None
    #: The envelopes of the batch admitted so far (all at once, or none).
    got: set[envq.Envelope] = attrs.Factory(set)
    #: The model saw room for it while it was first in line.
    room_as_head: bool = False
    #: Errors of the lifecycle states the queue passed through while it waited.
    state_errors: set[type[envq.EnvqError]] = attrs.Factory(set)
    checked: bool = False

    @property
    def admitted(self) -> bool:
        return len(self.got) == len(self.envs)

    @property
    def label(self) -> str:
        return f"send_wait({', '.join(map(repr, self.envs))})"


class QueueMachine(RuleBasedStateMachine):
    """Drives one real queue (and a second one envelopes can be lent to)."""

    envelopes: Bundle[envq.Envelope] = Bundle("envelopes")

    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualTimeLoop()
        self.config = QueueConfig()
        self._q: envq.Queue | None = None
        self.other = envq.Queue("other")
        self.tracks: dict[envq.Envelope, Track] = {}
        self.made = 0
        self.admissions = 0
        #: Envelopes live in the other queue, in the order they were sent there.
        self.lent: list[envq.Envelope] = []
        #: Envelopes a call under way may admit (send, send_wait producers).
        self.admitting: set[envq.Envelope] = set()
        self.failure_calls: list[tuple[envq.Envelope, BaseException, int]] = []
        self.calling: QueueCall | None = None
        self.livelocked = False
        self._fresh_queue_model()
        self.violations: list[str] = []
        self.recent: deque[str] = deque(maxlen=40)

    def _fresh_queue_model(self) -> None:
        """The model of a new queue: INIT, no blacklist, no stop, zero counters."""
        self.life = QS.INIT
        self.stop_request: envq.StopMode = DRAIN
        self.run: RunLog | None = None
        self.last_report = envq.StopReport()
        self.blacklist: set[str] = set()
        #: RETURNED events not yet matched with what terminate() handed back.
        self.returned: list[envq.Envelope] = []
        self.waiters: list[Waiter] = []
        self.terminal_counts = dict.fromkeys(TERMINAL, 0)
        self.outcomes = dict.fromkeys(O, 0)
        self.dedups = 0
        self.rejections = dict.fromkeys(
            ("state", "invalid", "blacklisted", "foreign", "capacity"), 0
        )

    # -----------------------------------------------------------------------------------
    # Plumbing
    # -----------------------------------------------------------------------------------

    @property
    def q(self) -> envq.Queue:
        assert self._q is not None
        return self._q

    def now(self) -> float:
        return self.loop.time()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one step's coroutine, then let the loop settle; report violations."""

        async def step() -> T:
            try:
                return await coro
            finally:
                await settle()

        try:
            return self.loop.run_until_complete(step())
        finally:
            self._raise_violations()

    def _raise_violations(self) -> None:
        if self.violations:
            found, self.violations = self.violations, []
            more = f"\n(and {len(found) - 5} more)" if len(found) > 5 else ""
            recent = "\n  ".join(self.recent)
            raise Violation("\n".join(found[:5]) + more + f"\nrecent events:\n  {recent}")

    def _check(self, ok: bool, message: Callable[[], str]) -> None:
        """An assertion usable inside the loop, where raising would be swallowed."""
        if not ok:
            self.violations.append(f"t={self.now():g}: {message()}")

    def _make(self, spec: EnvSpec) -> envq.Envelope:
        self.made += 1
        env = envq.Envelope(
            invoke=self._invoke,
            id=self.made,
            type=spec.type,
            interval=spec.interval,
            deadline=spec.deadline,
            delay=spec.delay,
            schedule=envq.FIXED_RATE if spec.fixed_rate else envq.FIXED_DELAY,
            on_failure=self._on_failure if spec.policy.has_on_failure else None,
            retry=_retry(spec),
        )
        self.tracks[env] = Track(env, self.made, spec, deque(spec.script))
        return env

    def _in(self, *states: envq.EnvState) -> list[Track]:
        return [t for t in self.tracks.values() if t.state in states]

    def _live(self) -> list[Track]:
        return self._in(*LIVE)

    def _parked(self) -> tuple[envq.Envelope, ...]:
        return tuple(t.env for t in sorted(self._in(ES.PARKED), key=lambda t: t.seq))

    def _pending_waiters(self) -> list[Waiter]:
        return [
            w
            for w in self.waiters
            if w.expect == "wait" and not w.admitted and w.task is not None and not w.task.done()
        ]

    def _blocked(self) -> bool:
        """Whether an attempt in flight can only end by a release or a cancel."""
        return any(
            t.attempt is not None
            and t.attempt.hanging
            and t.spec.deadline == 0
            and t.attempt.cancel_cause is None
            for t in self._in(ES.RUNNING)
        )

    def _request_cancel(self, cause: CancelCause) -> None:
        for t in self._in(ES.RUNNING):
            if t.attempt is not None:
                t.attempt.cancel_cause = cause

    @staticmethod
    def _expect_error(
        what: str, expected: type[BaseException] | None, got: BaseException | None
    ) -> None:
        if expected is None:
            assert got is None, f"{what}: expected success, got {got!r}"
        else:
            assert type(got) is expected, f"{what}: expected {expected.__name__}, got {got!r}"

    # -----------------------------------------------------------------------------------
    # The scripted envelope's callables
    # -----------------------------------------------------------------------------------

    async def _invoke(self, env: envq.Envelope) -> None:
        t = self.tracks[env]
        self._check(t.state is ES.RUNNING, lambda: f"{env!r}: invoked while {t.state.name}")
        self._check(t.active == 0, lambda: f"{env!r}: two attempts at once")
        plan = t.script.popleft() if t.script else t.spec.then
        att = t.attempt = Attempt(plan, self.now())
        t.active += 1
        try:
            if plan in (Plan.SLOW, Plan.LONG):
                await asyncio.sleep(SLOW_SECONDS if plan is Plan.SLOW else LONG_SECONDS)
                plan = Plan.OK
            elif plan is Plan.HANG:
                att.gate = asyncio.Event()
                await att.gate.wait()
                assert att.release is not None
                plan = att.release
            att.final = plan
        except asyncio.CancelledError:
            att.cancelled_at = self.now()
            raise
        finally:
            t.active -= 1
        if plan is Plan.ERROR:
            raise RuntimeError(f"{env!r}: planned error")
        if plan is Plan.STOP:
            raise envq.StopEnvelope
        if plan is Plan.STOP_TYPE:
            if env.type:
                self.blacklist.add(env.type)
            raise envq.StopType
        if plan is Plan.NO_RETRY:
            raise envq.DoNotRetry

    async def _on_failure(
        self, env: envq.Envelope, exc: BaseException, attempt: int
    ) -> envq.Decision | None:
        self.failure_calls.append((env, exc, attempt))
        policy = self.tracks[env].spec.policy
        if policy is Policy.DROP:
            return envq.drop()
        if policy is Policy.RETRY_NOW:
            return envq.retry_now()
        if policy is Policy.RETRY_AFTER:
            return envq.retry_after(self.tracks[env].spec.retry_after)
        if policy is Policy.CRASH:
            raise RuntimeError("on_failure crashed (planned)")
        return None

    # -----------------------------------------------------------------------------------
    # The listener: every event is checked against the tables and the model
    # -----------------------------------------------------------------------------------

    def _on_event(self, ev: envq.Event) -> None:
        who = "queue" if ev.envelope is None else repr(ev.envelope)
        outcome = f" [{ev.outcome.name}]" if ev.outcome is not None else ""
        self.recent.append(
            f"t={ev.time:g} {who}: {ev.from_state.name} -> {ev.to_state.name}{outcome}"
        )
        try:
            if ev.envelope is None:
                self._queue_event(ev)
            else:
                self._envelope_event(ev, ev.envelope)
        except AssertionError as exc:
            self.violations.append(f"t={ev.time:g} {who}: {exc}")
            self._resync(ev)
        except Exception:
            self.violations.append(f"model crashed on {ev}:\n{traceback.format_exc()}")
            self._resync(ev)

    def _resync(self, ev: envq.Event) -> None:
        """After a violation, follow the engine so that one wrong move is reported once
        rather than as a cascade."""
        if ev.envelope is None:
            if isinstance(ev.to_state, envq.QueueState):
                self.life = ev.to_state
        elif ev.envelope in self.tracks and isinstance(ev.to_state, envq.EnvState):
            self.tracks[ev.envelope].state = ev.to_state

    def _queue_event(self, ev: envq.Event) -> None:
        frm, to = ev.from_state, ev.to_state
        assert isinstance(frm, envq.QueueState), frm
        assert isinstance(to, envq.QueueState), to
        assert frm is self.life, f"queue event from {frm.name}, model has {self.life.name}"
        assert frm is not to, f"queue event {frm.name} -> {to.name} changes nothing"
        assert any(row.target is to for (s, _c), row in LIFECYCLE.items() if s is frm), (
            f"no LIFECYCLE row leads {frm.name} -> {to.name}"
        )
        move = (frm, to)
        assert move in CALL_MOVES[self.calling] or move == DRAINED_MOVE, (
            f"{frm.name} -> {to.name} during {self.calling}"
        )
        if to is QS.STOPPING:
            self.run = RunLog(self.stop_request)
        if move == DRAINED_MOVE:
            assert not self._in(ES.RUNNING), "stop ended with attempts in flight"
            stray = [t for t in self._live() if t.state is not ES.PARKED]
            assert not stray, f"stop ended with {[(t.env, t.state.name) for t in stray]}"
            run = self.run
            assert run is not None
            self.last_report = envq.StopReport(
                parked=self._parked(),
                completed=tuple(run.completed),
                cancelled=tuple(run.cancelled),
                complete=True,
            )
            self.run = None
        error = SEND_ERROR[to]
        if error is not None:
            for w in self._pending_waiters():
                w.state_errors.add(error)
        self.life = to

    def _envelope_event(self, ev: envq.Event, env: envq.Envelope) -> None:
        t = self.tracks.get(env)
        assert t is not None, f"event for an envelope the test never made: {env!r}"
        frm, to = ev.from_state, ev.to_state
        assert isinstance(frm, envq.EnvState), frm
        assert isinstance(to, envq.EnvState), to
        if to is ES.RUNNING:
            self._watch_for_livelock(t, ev.time)
        if frm is ES.NEW:
            assert t.state is ES.NEW or t.state in TERMINAL, f"re-admitted while {t.state.name}"
        else:
            assert frm is t.state, f"move from {frm.name}, but the model has it {t.state.name}"
        event: EnvEvent | envq.Outcome | None = ev.outcome or infer_event(frm, to)
        assert event is not None, f"no event moves {frm.name} -> {to.name}"
        assert to in ENVELOPE_MOVES.get((frm, event), ()), (
            f"illegal move {frm.name} --{event.name}--> {to.name}"
        )
        now = ev.time
        if isinstance(event, envq.Outcome):
            self._outcome_event(ev, t, event)
        elif event is EnvEvent.SEND:
            assert not t.lent, "admitted while live in the other queue"
            if env in self.admitting:
                self.admitting.discard(env)
            else:
                producers = [
                    w
                    for w in self.waiters
                    if env in w.envs and w.expect in ("now", "wait") and env not in w.got
                ]
                assert producers, "admitted without a send"
                w = producers[0]
                w.got.add(env)
                if w.admitted:
                    self._check_no_overtake(w, now)
            self.admissions += 1
            t.stays += 1
            t.seq = self.admissions
            t.attempts = t.failures = 0
            t.attempt = None
            if self.life is QS.INIT:
                assert to is ES.BUFFERED, f"sent to an INIT queue, went {to.name}"
                t.remaining = t.spec.delay
            else:
                assert self.life is QS.RUNNING, f"admitted while {self.life.name}"
                self._arrive(t, to, t.spec.delay, now, armed=True)
        elif event is EnvEvent.START:
            assert self.life is QS.RUNNING, f"armed while {self.life.name}"
            delay = t.spec.delay if frm is ES.BUFFERED else t.remaining
            self._arrive(t, to, delay, now, armed=True)
        elif event is EnvEvent.DUE:
            assert self.life is QS.RUNNING, f"became due while {self.life.name}"
            assert math.isclose(now, t.due, abs_tol=1e-6), f"due at {t.due:g}, ran at {now:g}"
            t.sched = t.due
        elif event is EnvEvent.DISPATCH:
            assert self.life in (QS.RUNNING, QS.STOPPING), f"dispatched while {self.life.name}"
            if self.life is QS.STOPPING:
                assert self.run is not None
                assert self.run.mode is DRAIN, "dispatched during a STOP-mode stop"
            busy = len(self._in(ES.RUNNING))
            assert busy < self.config.workers, f"{busy + 1} attempts on {self.config.workers}"
            t.attempts += 1
            t.attempt = None
        elif event is EnvEvent.STOP:
            assert self.life is QS.STOPPING, f"parked while {self.life.name}"
            assert self.run is not None
            if frm is ES.READY:
                assert self.run.mode is STOP, "a DRAIN stop parked a READY envelope"
                t.remaining = 0.0
            else:
                t.remaining = max(0.0, t.due - now)
        elif event is EnvEvent.TERMINATE:
            assert self.life is QS.TERMINATED, f"handed back while {self.life.name}"
        elif event is EnvEvent.BLACKLIST:
            assert env.type, "a type-less envelope stopped by a blacklist"
            assert env.type in self.blacklist, f"stopped, type {env.type!r} not blacklisted"
        t.state = to
        if to in TERMINAL:
            t.ends += 1
            self.terminal_counts[to] += 1
            if to is ES.RETURNED:
                self.returned.append(env)
            self._note_room()

    def _watch_for_livelock(self, t: Track, now: float) -> None:
        """Stop the loop if one envelope keeps running at one instant: the clock would
        never move again and the step would hang (a scripted run has at most a few
        dozen failures in a row, each retried at once at worst)."""
        if now != t.burst_at:
            t.burst_at, t.burst = now, 0
        t.burst += 1
        if t.burst > LIVELOCK:
            self.livelocked = True
            self.loop.stop()
            raise AssertionError(f"livelock: {t.burst} attempts at t={now:g}")

    def _arrive(
        self, t: Track, to: envq.EnvState, delay: float, now: float, *, armed: bool = False
    ) -> None:
        """Check the state an envelope enters with ``delay`` to wait, and record its times.

        ``armed``: entering the queue's schedule (send to a running queue, start), where
        a non-positive delay means READY and a positive one DELAYED.
        """
        if armed:
            want = ES.READY if delay <= 0 else ES.DELAYED
            assert to is want, f"armed with {delay:g} s to wait, went {to.name} not {want.name}"
        if to is ES.READY:
            t.sched = now
        elif to is ES.DELAYED:
            t.due = now + delay
        elif to is ES.PARKED:
            t.remaining = max(0.0, delay)

    def _outcome_event(self, ev: envq.Event, t: Track, outcome: envq.Outcome) -> None:
        assert ev.from_state is ES.RUNNING
        att = t.attempt
        assert att is not None, "an attempt ended that never reached invoke"
        spec = t.spec
        want = expected_outcome(
            spec,
            att.final,
            started=att.start,
            cancelled_at=att.cancelled_at,
            cancel_cause=att.cancel_cause,
            tolerance=EPS,
        )
        assert outcome is want, f"attempt ({att}) ended {outcome.name}, expected {want.name}"
        self.outcomes[outcome] += 1
        if self.run is not None:
            (self.run.cancelled if outcome is O.CANCELLED else self.run.completed).append(t.env)
        want_next, t.failures = expected_target(
            spec,
            outcome,
            blacklisted=bool(spec.type) and spec.type in self.blacklist,
            queue=self.life,
            cancel_cause=att.cancel_cause,
            attempts=t.attempts,
            failures=t.failures,
            sched=t.sched,
            now=ev.time,
        )
        to = want_next.to
        assert ev.to_state is to, f"{outcome.name} led to {ev.to_state.name}, expected {to.name}"
        if want_next.check_cause:
            if want_next.cause is None:
                assert ev.cause is None, f"{outcome.name} event with cause {ev.cause!r}"
            else:
                cause = CAUSE_CLASSES[want_next.cause]
                assert isinstance(ev.cause, cause), f"cause {ev.cause!r}, not {cause.__name__}"
        calls = self.failure_calls
        self.failure_calls = []
        if want_next.hook is None:
            assert not calls, f"on_failure called: {calls}"
        else:
            error, number = want_next.hook
            exc_type = CAUSE_CLASSES[error]
            assert len(calls) == 1, f"on_failure calls: {calls}, expected one"
            env, exc, attempt = calls[0]
            assert env is t.env, f"on_failure called for {env!r}"
            assert isinstance(exc, exc_type), f"on_failure saw {exc!r}, not {exc_type.__name__}"
            assert attempt == number, f"on_failure saw attempt {attempt}, expected {number}"
        self._arrive(t, to, want_next.delay, ev.time)
        t.attempt = None

    def _check_no_overtake(self, w: Waiter, now: float) -> None:
        """``w``'s batch was just admitted: every producer that waits ahead of it must
        be gone by now, or be going (its tasks may finish later in the same instant):
        admitted, or failing for a reason the model knows (timed out, a lent envelope,
        a banned type, a state error)."""
        for o in self.waiters[: self.waiters.index(w)]:
            if o.admitted or o.checked or o.expect != "wait":
                continue
            timed_out = now >= o.started + o.timeout or math.isclose(now, o.started + o.timeout)
            lent = any(self.tracks[env].lent for env in o.envs)
            banned = any(env.type in self.blacklist for env in o.envs)
            assert timed_out or lent or banned or o.state_errors, (
                f"{w.label} overtook {o.label}, still waiting"
            )

    def _note_room(self) -> None:
        """After a slot is freed: the first waiting producer must get it."""
        pending = self._pending_waiters()
        if not pending or self.life not in (QS.INIT, QS.RUNNING):
            return
        head = pending[0]
        if len(self._live()) + len(head.envs) <= self.config.capacity and room_in_time(
            self.now(), started=head.started, timeout=head.timeout, tolerance=0.0
        ):
            head.room_as_head = True

    # -----------------------------------------------------------------------------------
    # send prediction
    # -----------------------------------------------------------------------------------

    def _predict_send(
        self, items: Sequence[object], *, check_capacity: bool = True
    ) -> tuple[type[envq.EnvqError] | None, str, list[envq.Envelope]]:
        """send()'s checks in the contract's order: state, validation, blacklist,
        dedup / another queue, capacity. Returns (error, rejection reason, fresh)."""
        error = SEND_ERROR[self.life]
        if error is not None:
            return error, "state", []
        envs = [item for item in items if isinstance(item, envq.Envelope)]
        if len(envs) < len(items):
            return envq.BadEnvelopeType, "invalid", []
        if any(env.type in self.blacklist for env in envs):
            return envq.TypeBlacklisted, "blacklisted", []
        if any(self.tracks[env].lent for env in envs):
            return envq.BadEnvelope, "foreign", []
        fresh = list(dict.fromkeys(env for env in envs if self.tracks[env].state not in LIVE))
        capacity = self.config.capacity
        if (
            check_capacity
            and fresh
            and capacity
            and (len(self._live()) + len(fresh) > capacity or self._pending_waiters())
        ):
            return envq.CapacityExceeded, "capacity", fresh
        return None, "", fresh

    def _send(self, items: Sequence[object]) -> None:
        """Call send() and check the result against the model's prediction."""
        error, reason, fresh = self._predict_send(items)
        live_before = len(self._live())

        async def go() -> None:
            self.admitting = set(fresh) if error is None else set()
            self.calling = QueueCall.SEND
            got: BaseException | None = None
            try:
                self.q.send(*items)  # type: ignore[arg-type]
            except envq.EnvqError as exc:
                got = exc
            finally:
                self.calling = None
            self._expect_error(f"send({len(items)} items) while {self.life.name}", error, got)
            if error is not None:
                self.rejections[reason] += 1
                assert len(self._live()) == live_before, "a rejected batch admitted something"
                return
            assert not self.admitting, f"not admitted: {self.admitting}"
            self.dedups += len(items) - len(fresh)

        self._run(go())

    # -----------------------------------------------------------------------------------
    # Rules
    # -----------------------------------------------------------------------------------

    def _new_queue(self) -> None:
        config = self.config
        self._q = envq.Queue(
            "machine",
            workers=config.workers,
            capacity=config.capacity,
            stop_mode=envq.StopMode(config.stop_mode),
            wait=config.wait,
        )
        self._unsubscribe = self._q.subscribe(self._on_event)

    @initialize(
        target=envelopes,
        config=queue_configs(),
        initial=st.lists(env_specs(), min_size=1, max_size=4),
        started=st.sampled_from([True, True, True, False]),
    )
    @one_origin
    def make_queue(
        self, config: QueueConfig, initial: list[EnvSpec], started: bool
    ) -> MultipleResults[envq.Envelope]:
        """The queue under test, with a first batch (buffered; armed if started)."""
        self.config = config
        self._new_queue()
        envs = [self._make(spec) for spec in initial]
        if envs:
            self._send(envs)
        if started:
            self.start()
        return multiple(*envs)

    @precondition(lambda self: self.life is QS.TERMINATED)
    @rule()
    @one_origin
    def renew(self) -> None:
        """Replace a terminated queue with a new one (same configuration); its
        envelopes, all terminal now, may be sent to the new one."""
        assert all(t.state not in LIVE for t in self.tracks.values())
        self._unsubscribe()
        self._new_queue()
        self._fresh_queue_model()

    @rule()
    @one_origin
    def start(self) -> None:
        result = START_RESULT[self.life]

        async def go() -> None:
            self.calling = QueueCall.START
            got: BaseException | None = None
            try:
                self.q.start()
            except envq.EnvqError as exc:
                got = exc
            finally:
                self.calling = None
            if isinstance(result, envq.QueueState):
                self._expect_error("start()", None, got)
                assert self.q.state is result is self.life
            else:
                self._expect_error(f"start() while {self.life.name}", result, got)
                self.rejections["state"] += 1

        self._run(go())

    @rule(call=stop_calls())
    @one_origin
    def stop(self, call: StopCall) -> None:
        self._stop(call)

    @precondition(lambda self: self.life is QS.RUNNING and bool(self._in(ES.RUNNING)))
    @rule(call=stop_calls())
    @one_origin
    def stop_while_busy(self, call: StopCall) -> None:
        """stop() with attempts in flight (and maybe envelopes READY behind them): the
        cells of the stop-mode table that random timing rarely reaches."""
        self._stop(call)

    def _stop(self, call: StopCall) -> None:
        # The protocol's StopCall and QueueConfig name the modes by value.
        call_mode = None if call.mode is None else envq.StopMode(call.mode)
        mode = envq.StopMode(self.config.stop_mode) if call_mode is None else call_mode
        wait = self.config.wait if call.wait is None else call.wait
        before = self.life
        if call.cancel and mode is DRAIN:

            async def invalid() -> None:
                try:
                    await self.q.stop(mode=call_mode, cancel=True, wait=call.wait)
                except ValueError:
                    return
                raise AssertionError("stop(cancel=True) with DRAIN did not raise ValueError")

            self._run(invalid())
            assert self.q.state is before
            return
        if before is QS.RUNNING:
            self.stop_request = mode
            if call.cancel:
                self._request_cancel(CancelCause.STOP)

        async def go() -> None:
            self.calling = QueueCall.STOP
            try:
                stopping = self.q.stop(mode=call_mode, cancel=call.cancel, wait=call.wait)
                if wait and before in (QS.RUNNING, QS.STOPPING):
                    try:
                        report = await asyncio.wait_for(stopping, GUARD)
                    except TimeoutError:
                        assert self._blocked(), "stop() never ended, yet nothing hangs"
                        assert self.q.state is QS.STOPPING
                        return
                else:
                    report = await stopping
            finally:
                self.calling = None
            self._check_report(report, before, wait)

        self._run(go())

    def _check_report(self, report: envq.StopReport, before: envq.QueueState, wait: bool) -> None:
        if before in (QS.INIT, QS.STOPPED, QS.TERMINATED):
            assert self.q.state is before, f"a no-op stop moved {before.name} to {self.q.state}"
            assert report == self.last_report, f"{report} != {self.last_report}"
            return
        if wait or self.q.state is QS.STOPPED:
            assert self.q.state is QS.STOPPED, self.q.state
            assert report == self.last_report, f"{report} != {self.last_report}"
            return
        assert self.q.state is QS.STOPPING
        assert self.run is not None
        expected = envq.StopReport(
            parked=self._parked(),
            completed=tuple(self.run.completed),
            cancelled=tuple(self.run.cancelled),
            complete=False,
        )
        assert report == expected, f"{report} != {expected}"

    @precondition(lambda self: self.life in (QS.STOPPING, QS.STOPPED, QS.TERMINATED))
    @rule()
    @one_origin
    def wait_stopped(self) -> None:
        async def go() -> None:
            try:
                report = await asyncio.wait_for(self.q.wait_stopped(), GUARD)
            except TimeoutError:
                assert self._blocked(), "wait_stopped() never returned, yet nothing hangs"
                return
            assert self.q.state in (QS.STOPPED, QS.TERMINATED)
            assert report == self.last_report, f"{report} != {self.last_report}"

        self._run(go())

    @rule()
    @one_origin
    def terminate(self) -> None:
        before = self.life
        if before is QS.STOPPING:
            assert self.run is not None
            self.run.mode = STOP
        if before is QS.RUNNING:
            self.stop_request = STOP
        if before in (QS.RUNNING, QS.STOPPING):
            self._request_cancel(CancelCause.TERMINATE)

        async def go() -> None:
            self.calling = QueueCall.TERMINATE
            try:
                left = await asyncio.wait_for(self.q.terminate(), GUARD)
            except TimeoutError:
                raise AssertionError(f"terminate() from {before.name} never ended") from None
            finally:
                self.calling = None
            returned = sorted(self.returned, key=lambda env: self.tracks[env].seq)
            self.returned = []
            assert len(set(left)) == len(left), f"handed back twice: {left}"
            assert left == returned, f"handed back {left}, RETURNED events for {returned}"
            assert self.q.state is QS.TERMINATED
            assert self.q.capacity_used == 0
            if before is QS.TERMINATED:
                assert left == []

        self._run(go())

    @rule(
        target=envelopes,
        specs=st.lists(env_specs(), min_size=1, max_size=4),
        repeat=st.booleans(),
    )
    @one_origin
    def send(self, specs: list[EnvSpec], repeat: bool) -> MultipleResults[envq.Envelope]:
        """New envelopes in one batch, maybe naming one twice (admitted once); over
        capacity the batch admits none."""
        envs = [self._make(spec) for spec in specs]
        self._send([*envs, envs[0]] if repeat else envs)
        return multiple(*envs)

    @precondition(lambda self: bool(self._pending_waiters()))
    @rule(target=envelopes, spec=env_specs())
    @one_origin
    def send_behind_producer(self, spec: EnvSpec) -> envq.Envelope:
        """send() while a producer waits in send_wait: CapacityExceeded even when
        there is room (send does not overtake the waiting producers)."""
        env = self._make(spec)
        self._send([env])
        return env

    @rule(env=envelopes)
    @one_origin
    def resend(self, env: envq.Envelope) -> None:
        """Send an envelope again: live here (dedup), terminal (a new stay), or live in
        the other queue (BadEnvelope)."""
        self._send([env])

    @rule(target=envelopes, spec=env_specs(), item=bad_items())
    @one_origin
    def send_bad(self, spec: EnvSpec, item: object) -> envq.Envelope:
        """A batch with something that is not an envelope admits nothing."""
        env = self._make(spec)
        self._send([env, item])
        return env

    @rule(
        target=envelopes,
        specs=st.lists(env_specs(), min_size=1, max_size=2),
        timeout=send_wait_timeouts(),
        background=st.booleans(),
    )
    @one_origin
    def send_wait(
        self, specs: list[EnvSpec], timeout: float, background: bool
    ) -> MultipleResults[envq.Envelope]:
        """A producer waiting for room for its batch: to the end (at most ``timeout``),
        or in the background while later rules run (send() must not overtake it)."""
        envs = tuple(self._make(spec) for spec in specs)
        if background and not (
            self.config.capacity > 0
            and self.life in (QS.INIT, QS.RUNNING)
            and len(self._pending_waiters()) < 2
        ):
            background = False
        w = self._start_waiter(envs, timeout)
        if not background:

            async def finish() -> None:
                assert w.task is not None
                await asyncio.wait({w.task}, timeout=GUARD)
                assert w.task.done(), "send_wait outlived its timeout"

            self._run(finish())
        return multiple(*envs)

    def _start_waiter(self, envs: tuple[envq.Envelope, ...], timeout: float) -> Waiter:
        """Start ``send_wait(*envs)`` with what the model expects of it: at once, the
        error send() would raise, wait (behind other producers, or for room), or
        CapacityExceeded at once for a batch that can never fit."""
        error, _reason, fresh = self._predict_send(envs, check_capacity=False)
        capacity = self.config.capacity
        expect: str | type[envq.EnvqError] | None = None
        if not self._pending_waiters():
            if error is not None:
                expect = error
            elif not capacity or len(self._live()) + len(fresh) <= capacity:
                expect = "now"
        if expect is None:
            too_big = capacity and len(envs) > capacity
            expect = envq.CapacityExceeded if too_big else "wait"
        w = Waiter(envs, self.now(), timeout, expect)
        self.waiters.append(w)

        async def start() -> None:
            w.task = asyncio.ensure_future(self.q.send_wait(*envs, timeout=timeout))
            w.task.add_done_callback(lambda _task: self._waiter_done(w))

        self._run(start())
        return w

    def _waiter_done(self, w: Waiter) -> None:
        task = w.task
        assert task is not None
        if task.cancelled() or w.checked:
            return
        w.checked = True
        exc = task.exception()
        elapsed = self.now() - w.started
        expect = w.expect
        if expect == "now":
            self._check(exc is None and w.admitted, lambda: f"{w.label}: {exc!r}")
            self._check(elapsed == 0, lambda: f"{w.label} took {elapsed:g} s")
            return
        if isinstance(expect, type):
            self._check(type(exc) is expect, lambda: f"{w.label}: {exc!r}, not {expect}")
            self._check(elapsed == 0, lambda: f"{w.label} took {elapsed:g} s to fail")
            reason = {
                envq.TypeBlacklisted: "blacklisted",
                envq.BadEnvelopeType: "invalid",
                envq.BadEnvelope: "foreign",
                envq.CapacityExceeded: "capacity",
            }.get(expect, "state")
            self.rejections[reason] += 1
            return
        if exc is None:
            # (Overtaking is checked when the batch is admitted: _check_no_overtake.)
            self._check(w.admitted, lambda: f"{w.label} returned, not admitted")
        elif type(exc) is envq.CapacityExceeded:
            self.rejections["capacity"] += 1
            self._check(
                math.isclose(elapsed, w.timeout),
                lambda: f"{w.label} gave up after {elapsed:g} s, not {w.timeout:g}",
            )
            self._check(not w.room_as_head, lambda: f"{w.label} timed out though room was free")
            self._note_room()  # the room it leaves is the next producer's
        elif type(exc) is envq.TypeBlacklisted:
            self.rejections["blacklisted"] += 1
            banned = any(env.type in self.blacklist for env in w.envs)
            self._check(banned, lambda: f"{w.label}: {exc!r}")
        elif type(exc) is envq.BadEnvelope:
            # One of its envelopes was sent to the other queue while it waited here.
            self.rejections["foreign"] += 1
            lent = any(self.tracks[env].lent for env in w.envs)
            self._check(lent, lambda: f"{w.label}: {exc!r}")
        elif type(exc) in w.state_errors:
            self.rejections["state"] += 1
        else:
            self._check(False, lambda: f"{w.label} raised {exc!r}")

    @rule(env=envelopes)
    @one_origin
    def lend(self, env: envq.Envelope) -> None:
        """Send an envelope to the other queue: it is then live there, and sending it
        to the machine's queue raises BadEnvelope (and vice versa)."""
        t = self.tracks[env]
        got: BaseException | None = None
        try:
            self.other.send(env)
        except envq.EnvqError as exc:
            got = exc
        if t.state in LIVE:
            self._expect_error("other.send(live here)", envq.BadEnvelope, got)
        else:
            self._expect_error("other.send", None, got)
            if not t.lent:
                t.lent = True
                self.lent.append(env)

    @precondition(lambda self: bool(self.lent))
    @rule()
    @one_origin
    def reclaim(self) -> None:
        """Terminate the other queue: it hands back the lent envelopes."""
        left = self._run(self.other.terminate())
        assert left == self.lent, f"{left} != {self.lent}"
        for env in left:
            self.tracks[env].lent = False
        self.lent = []
        self.other = envq.Queue("other")

    @rule(env=envelopes, plan=plans())
    @one_origin
    def plan(self, env: envq.Envelope, plan: Plan) -> None:
        """Choose what a later attempt of this envelope does."""
        self.tracks[env].script.append(plan)

    @precondition(
        lambda self: any(t.attempt is not None and t.attempt.hanging for t in self.tracks.values())
    )
    @rule(index=st.integers(0, 3), then=releases())
    @one_origin
    def release(self, index: int, then: Plan) -> None:
        """Let a hanging attempt finish with the given plan."""
        hanging = [
            t.attempt
            for t in sorted(self.tracks.values(), key=lambda t: t.number)
            if t.attempt is not None and t.attempt.hanging
        ]
        att = hanging[index % len(hanging)]
        assert att.gate is not None
        att.release = then
        att.gate.set()
        self._run(settle())

    @rule(dt=small_steps())
    @one_origin
    def tick(self, dt: float) -> None:
        """Let a little time pass: inside deadlines and SLOW attempts."""
        self._run(asyncio.sleep(dt))

    @rule(dt=large_steps())
    @one_origin
    def advance(self, dt: float) -> None:
        """Let much time pass: past intervals, retries and delays. (This rule and
        ``tick`` are always possible, so terminal states never stall the run.)"""
        self._run(asyncio.sleep(dt))

    # -----------------------------------------------------------------------------------
    # Invariants
    # -----------------------------------------------------------------------------------

    @invariant()
    @one_origin
    def no_violations(self) -> None:
        self._raise_violations()

    @invariant()
    @one_origin
    def capacity_used_is_live_count(self) -> None:
        stats = self.q.statistics()
        live = len(self._live())
        by_state = sum(stats.by_state.get(s, 0) for s in LIVE)
        assert self.q.capacity_used == live == stats.capacity_used == by_state, (
            self.q.capacity_used,
            live,
            stats.capacity_used,
            by_state,
        )
        if self.config.capacity:
            assert live <= self.config.capacity

    @invariant()
    @one_origin
    def statistics_match_model(self) -> None:
        stats = self.q.statistics()
        for state in LIVE:
            assert stats.by_state.get(state, 0) == len(self._in(state)), state
        for state in TERMINAL:
            assert stats.by_state.get(state, 0) == self.terminal_counts[state], state
        running = len(self._in(ES.RUNNING))
        assert stats.in_flight == running <= self.config.workers
        assert stats.state is self.q.state is self.life
        assert dict(stats.outcomes) == self.outcomes
        assert stats.dedups == self.dedups
        assert dict(stats.rejections) == self.rejections, (stats.rejections, self.rejections)

    @invariant()
    @one_origin
    def states_fit_the_lifecycle(self) -> None:
        """Which envelope states each lifecycle state allows; workers never idle while
        envelopes are READY; a stop with nothing in flight has ended."""
        allowed = ALLOWED_LIVE[self.life]
        stray = [(t.env, t.state.name) for t in self._live() if t.state not in allowed]
        assert not stray, f"{self.life.name} queue holds {stray}"
        ready, running = len(self._in(ES.READY)), len(self._in(ES.RUNNING))
        if self.life is QS.STOPPING:
            assert self.run is not None
            assert running >= 1, "STOPPING with nothing in flight"
            if self.run.mode is STOP:
                assert ready == 0, "a STOP-mode stop left envelopes READY"
        if ready:
            assert running == self.config.workers, f"{ready} READY, {running} running"

    @invariant()
    @one_origin
    def blacklisted_types_are_gone(self) -> None:
        stray = [
            t.env
            for t in self._live()
            if t.env.type in self.blacklist and t.state is not ES.RUNNING
        ]
        assert not stray, f"live envelopes of blacklisted types: {stray}"

    @invariant()
    @one_origin
    def delayed_envelopes_are_not_overdue(self) -> None:
        now = self.now()
        late = [(t.env, t.due) for t in self._in(ES.DELAYED) if t.due <= now]
        assert not late, f"at {now:g}, still DELAYED past their due time: {late}"

    @invariant()
    @one_origin
    def nothing_lost(self) -> None:
        """Every admitted envelope is live, or ended with one event per stay; RETURNED
        exactly when handed back; no on_failure call unaccounted for."""
        assert not self.returned, f"RETURNED but not handed back: {self.returned}"
        assert not self.failure_calls, self.failure_calls
        for t in self.tracks.values():
            live = 1 if t.state in LIVE else 0
            assert t.ends == t.stays - live, (t.env, t.stays, t.ends, t.state)
            assert t.active == 0 or t.state is ES.RUNNING, (t.env, t.state)
            if t.stays:
                assert t.state is not ES.NEW

    @invariant()
    @one_origin
    def first_waiting_producer_has_no_room(self) -> None:
        pending = self._pending_waiters()
        if pending and self.life in (QS.INIT, QS.RUNNING):
            head = pending[0]
            room = self.config.capacity - len(self._live())
            assert len(head.envs) > room, f"{head.label} waits with room for {room}"
            banned = [env for env in head.envs if env.type in self.blacklist]
            assert not banned, f"{head.label} waits with banned types {banned}"

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: if a step failed, that failure
        # is the one to report, not what a final terminate() makes of the wreck.
        failing = sys.exc_info()[1] is not None

        async def close() -> str | None:
            for w in self.waiters:
                if w.task is not None and not w.task.done():
                    w.task.cancel()
            if self._q is not None and self._q.state is not QS.TERMINATED:
                try:
                    await asyncio.wait_for(self._q.terminate(), GUARD)
                except TimeoutError:
                    return "terminate() at the end of the run never returned"
            await self.other.terminate()
            await settle()
            return None

        problem = None
        try:
            if not self.livelocked:
                problem = self.loop.run_until_complete(close())
        except Exception:  # reported as the machine's one kind of failure (one_origin)
            problem = f"the run's final terminate() failed:\n{traceback.format_exc()}"
        finally:
            self.loop.close()
        if problem is not None and not failing:
            raise Violation(problem)


# The loaded profile (dev/ci/deep) decides max_examples; only the run length is fixed.
QueueMachine.TestCase.settings = settings(QueueMachine.TestCase.settings, stateful_step_count=100)
TestQueueMachine = QueueMachine.TestCase


async def test_send_wait_timeout_race() -> None:
    """Regression (found by the machine): two producers wait for room until t=1; the
    second one's envelope is meanwhile sent to another queue. At t=1 the first
    producer's timeout hands the turn to the second just as the second producer's own
    timeout fires. A woken producer admits (or is refused) only when it runs, so the
    timeout wins: both calls raise CapacityExceeded, and each counts as one
    rejection."""

    async def noop(env: envq.Envelope) -> None:
        pass

    q = envq.Queue("race", capacity=1)
    other = envq.Queue("other")
    q.send(envq.Envelope(invoke=noop))
    a, b = envq.Envelope(invoke=noop, id="a"), envq.Envelope(invoke=noop, id="b")
    first = asyncio.ensure_future(q.send_wait(a, timeout=1))
    second = asyncio.ensure_future(q.send_wait(b, timeout=1))
    await asyncio.sleep(0)
    other.send(b)
    await asyncio.sleep(2)
    assert type(first.exception()) is envq.CapacityExceeded
    assert type(second.exception()) is envq.CapacityExceeded
    assert q.statistics().rejections["capacity"] == 2
    assert sum(q.statistics().rejections.values()) == 2
    await q.terminate()
    await other.terminate()


async def test_start_admits_a_waiting_producer_once() -> None:
    """Two producers wait in an INIT queue: the first for room for two envelopes, the
    second, queued behind it, for one (there is room for one). The first one's second
    envelope is meanwhile sent to another queue. start() must reject the first producer
    (BadEnvelope), admit the second's envelope, and arm it once: it runs once."""
    runs: list[str] = []

    async def job(env: envq.Envelope) -> None:
        runs.append(str(env.id))
        await asyncio.sleep(1)

    q = envq.Queue("q", capacity=2)
    other = envq.Queue("other")
    a, b, c, d = (envq.Envelope(invoke=job, id=name) for name in "abcd")
    q.send(a)
    first = asyncio.ensure_future(q.send_wait(b, c, timeout=10))
    second = asyncio.ensure_future(q.send_wait(d, timeout=10))
    await asyncio.sleep(0)
    other.send(c)
    q.start()
    await asyncio.sleep(5)
    assert type(first.exception()) is envq.BadEnvelope
    assert second.result() is None
    assert sorted(runs) == ["a", "d"]  # d runs once
    await q.terminate()
    await other.terminate()


def test_infer_event_covers_every_queue_side_move() -> None:
    """Every (from, to) pair of a queue-side move in ENVELOPE_MOVES is inferred back to
    the event that allows it (so the listener's reconstruction is sound)."""
    for (frm, event), targets in ENVELOPE_MOVES.items():
        if isinstance(event, EnvEvent):
            for to in targets:
                assert infer_event(frm, to) is event, (frm, event, to)


def test_every_cause_has_a_class() -> None:
    """The listener knows the exception class of every cause the oracle can name."""
    assert set(CAUSE_CLASSES) == set(CAUSES.values())


def test_send_wait_timeout_at_the_instant_room_is_freed() -> None:
    """Regression (the deep profile, seed 238466981112243565922858615954300807931): a
    ``send_wait(…, timeout=0.5)`` issued at t=8.0 into a full queue whose envelope
    runs at t=8.5 and frees the slot. The timeout, due at that very instant, wins (the
    decision records why); the machine used to count the room as free in time and
    report "timed out though room was free"."""
    machine = QueueMachine()
    try:
        machine.make_queue(QueueConfig(capacity=1), [EnvSpec(delay=8.5)], started=True)
        machine.advance(8.0)
        machine.send_wait([EnvSpec()], timeout=0.5, background=False)
        machine.advance(10.0)
        machine.no_violations()
    finally:
        machine.teardown()
