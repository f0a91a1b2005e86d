"""Stateful property test: the real ``envq.Queue`` driven step by step beside the oracle.

A Hypothesis ``RuleBasedStateMachine`` drives one queue on a
:class:`envq.testing.VirtualTimeLoop` (rules cannot be async, Hypothesis issue #4107):
every rule runs one coroutine on it to quiescence, and time only moves when a rule
advances it.

The envelopes are the reference driver's (:class:`envq.driver.Session`): each attempt
takes the next plan of its envelope's script (then the envelope's default, OK, SLOW,
LONG or HANG) and returns, raises, sleeps, or hangs until released, cancelled or cut off
by its deadline; rules append plans. The session reports what happens as the driver
protocol's observations (every move of the queue and of each envelope, every attempt's
start and cancel, every ``on_failure`` call), and each observation goes to
:class:`envq.conform.oracle.Oracle` as it is made: the one model of the package, the
same one ``envq conform`` checks other ports with. The oracle follows every envelope
(its state, stays, attempts, due time, the attempt in flight), the lifecycle, the stop
under way and the counters, and checks every move against the tables and the
python-statemachine models. This test keeps no envelope tracking of its own.

What the protocol cannot express is the test's: calls made straight on the queue
(``send`` with items that are not envelopes, ``send_wait`` producers that wait in the
background while later rules run, ``statistics()`` and ``capacity_used`` as Python
objects), each checked against what the oracle predicts. Expected errors are the ones
the oracle predicts, by exact type. Problems found inside the loop (an observation
the oracle rejects, a producer's result), where raising would only be logged or turned
into an outcome, are collected and raised when the step ends.
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
    EnvSpec,
    Plan,
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
import envq._outcomes
from envq._machine import (
    TERMINAL_STATES,
    CancelCause,
    QueueCall,
)
from envq.conform.oracle import (
    LIVE,
    Oracle,
    room_in_time,
    send_error,
    start_result,
)
from envq.conform.protocol import ERRORS
from envq.driver import Session

T = TypeVar("T")
P = ParamSpec("P")

ES = envq.EnvState
QS = envq.QueueState
DRAIN = envq.StopMode.DRAIN
STOP = envq.StopMode.STOP

#: Virtual seconds a rule waits for a stop, wait_stopped or terminate before it
#: concludes the call will never return (which the oracle must then explain: an attempt
#: hanging without a deadline). Far longer than any backlog of LONG attempts a DRAIN
#: stop runs; virtual time costs nothing.
GUARD = 100_000.0
#: At most this many ``sleep(0)`` passes let ready callbacks run (see ``settle``).
SETTLE_PASSES = 200
#: Timing tolerance of the oracle's checks (the virtual clock is exact).
EPS = 1e-9
#: More attempts of one envelope at one instant than this is a livelock.
LIVELOCK = 200
#: The rejection reason counted for each error a waiting producer may get at once.
REJECTION_REASONS = {
    ERRORS["TypeBlacklisted"]: "blacklisted",
    ERRORS["BadEnvelope"]: "foreign",
    ERRORS["CapacityExceeded"]: "capacity",
}


def error_name(exc: BaseException | None) -> str | None:
    """The driver protocol's name of ``exc`` (None: no error)."""
    if exc is None:
        return None
    for cls in type(exc).__mro__:  # the nearest known class, as the driver names it
        if cls.__name__ in ERRORS:
            return ERRORS[cls.__name__]
    return f"other:{type(exc).__name__}"


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
    """A check failed (inside the event loop, or in a rule or invariant)."""


def one_origin(fn: Callable[P, T]) -> Callable[P, T]:
    """Report every failed check of a rule or invariant as one Violation raised here.

    Hypothesis tells failures apart by where they were raised (and what they were
    raised from); a broken engine typically trips several checks (or makes a call
    raise something unexpected), and Hypothesis would then shrink and report each
    separately, for minutes. Raising outside the ``except`` block drops the context,
    so all share one origin; the original traceback is kept in the message.
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


def observed(base: type[Session], feed: Callable[[dict[str, Any]], None]) -> Session:
    """A virtual-clock session of ``base`` (the reference driver, or a faulty variant)
    whose observations go to ``feed`` as they are made, rather than into a response."""

    class Observed(base):  # type: ignore[valid-type, misc]
        def observe(self, kind: str, **fields: Any) -> None:
            super().observe(kind, **fields)
            feed(self.events.pop())

    return cast("Session", Observed("virtual"))


@attrs.define(eq=False)
class Waiter:
    """One ``send_wait`` producer and its batch (by envelope name)."""

    names: tuple[str, ...]
    started: float
    timeout: float
    #: "now" (admitted at once), "wait", or the protocol's name of the error expected
    #: at once.
    expect: str
    task: asyncio.Task[None] | None = None
    #: The envelopes of the batch admitted so far (all at once, or none).
    got: set[str] = attrs.Factory(set)
    #: Room was free for it while it was first in line.
    room_as_head: bool = False
    #: Errors (by name) of the lifecycle states the queue passed through while it waited.
    state_errors: set[str] = attrs.Factory(set)
    checked: bool = False

    @property
    def admitted(self) -> bool:
        return len(self.got) == len(self.names)

    @property
    def label(self) -> str:
        return f"send_wait({', '.join(self.names)})"


class QueueMachine(RuleBasedStateMachine):
    """Drives one real queue (and a second one envelopes can be lent to) beside the
    oracle."""

    envelopes: Bundle[str] = Bundle("envelopes")
    #: The session whose envelopes and listener the queue gets: the reference driver's,
    #: or a deliberately faulty variant (the tests that show the machine can fail).
    session_class: type[Session] = Session

    def __init__(self) -> None:
        super().__init__()
        self.oracle = Oracle(tolerance=EPS)
        self.session = observed(self.session_class, self._feed)
        self.loop = self.session.loop
        self.config = QueueConfig()
        self.made = 0
        self.waiters: list[Waiter] = []
        self.violations: list[str] = []
        self.recent: deque[str] = deque(maxlen=40)
        #: Livelock guard: attempts started per envelope at the loop time ``burst_at``.
        self.burst_at = -1.0
        self.bursts: dict[str, int] = {}
        self.livelocked = False

    # -----------------------------------------------------------------------------------
    # Plumbing
    # -----------------------------------------------------------------------------------

    @property
    def q(self) -> envq.Queue:
        assert self.session.q is not None
        return self.session.q

    def now(self) -> float:
        return self.session.now()

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

    def _answered(
        self, what: str, expected: str | None, got: BaseException | None, row: str
    ) -> None:
        """A call answered as the oracle predicted: success, or exactly this error."""
        self.oracle.check_call(what, expected, got is None, error_name(got), row)

    def _make(self, spec: EnvSpec) -> str:
        self.made += 1
        name = f"e{self.made}"
        self.session.cmd_define({"env": name, "spec": spec.to_json()})
        self.oracle.define(name, spec)
        return name

    def _env(self, name: str) -> envq.Envelope:
        return self.session.envs[name]

    def _pending_waiters(self) -> list[Waiter]:
        return [
            w
            for w in self.waiters
            if w.expect == "wait" and not w.admitted and w.task is not None and not w.task.done()
        ]

    # -----------------------------------------------------------------------------------
    # Observations: each goes to the oracle as it is made
    # -----------------------------------------------------------------------------------

    def _feed(self, ev: dict[str, Any]) -> None:
        kind, now = ev["kind"], float(ev["t"])
        if kind == "queue":
            self.recent.append(f"t={now:g} queue: {ev['from']} -> {ev['to']}")
        else:
            detail = {k: v for k, v in ev.items() if k not in ("t", "kind", "env") and v}
            self.recent.append(f"t={now:g} {ev['env']}: {kind} {detail}")
        if kind == "invoke":
            self._watch_for_livelock(str(ev["env"]), now)
        if kind == "move" and ev["from"] == ES.NEW.value:
            self._producer_admits(str(ev["env"]), now)
        try:
            self.oracle.observe([ev])
        except AssertionError as exc:
            self.violations.append(f"t={now:g}: {exc}")
            self.oracle.resync(ev)
        except Exception:
            self.violations.append(f"the oracle crashed on {ev}:\n{traceback.format_exc()}")
            self.oracle.resync(ev)
        if kind == "queue":
            error = send_error(QS(ev["to"]))
            if error is not None:
                for w in self._pending_waiters():
                    w.state_errors.add(error)
        elif kind == "move" and ES(ev["to"]) in TERMINAL_STATES:
            self._note_room()

    def _watch_for_livelock(self, name: str, now: float) -> None:
        """Stop the loop if one envelope keeps running at one instant: the clock would
        never move again and the step would hang (a scripted run has at most a few
        dozen failures in a row, each retried at once at worst)."""
        if now != self.burst_at:
            self.burst_at, self.bursts = now, {}
        self.bursts[name] = self.bursts.get(name, 0) + 1
        if self.bursts[name] > LIVELOCK:
            self.livelocked = True
            self.loop.stop()
            self.violations.append(f"livelock: {self.bursts[name]} attempts at t={now:g}")

    def _producer_admits(self, name: str, now: float) -> None:
        """An admission no call under way explains is a waiting producer's: tell the
        oracle it was sent, and check the producer overtook nobody."""
        if name in self.oracle.admitting:
            return
        for w in self.waiters:
            if name in w.names and w.expect in ("now", "wait") and name not in w.got:
                w.got.add(name)
                self.oracle.admitting.add(name)
                if w.admitted:
                    self._check_no_overtake(w, now)
                return

    def _check_no_overtake(self, w: Waiter, now: float) -> None:
        """``w``'s batch was just admitted: every producer that waits ahead of it must
        be gone by now, or be going (its tasks may finish later in the same instant):
        admitted, or failing for a reason the oracle knows (timed out, a lent envelope,
        a banned type, a state error)."""
        tracks, blacklist = self.oracle.tracks, self.oracle.blacklist
        for o in self.waiters[: self.waiters.index(w)]:
            if o.admitted or o.checked or o.expect != "wait":
                continue
            timed_out = now >= o.started + o.timeout or math.isclose(now, o.started + o.timeout)
            lent = any(tracks[n].lent for n in o.names)
            banned = any(tracks[n].spec.type in blacklist for n in o.names)
            self._check(
                timed_out or lent or banned or bool(o.state_errors),
                lambda o=o: f"{w.label} overtook {o.label}, still waiting",  # type: ignore[misc]
            )

    def _note_room(self) -> None:
        """After a slot is freed: the first waiting producer must get it."""
        pending = self._pending_waiters()
        if not pending or self.oracle.life not in (QS.INIT, QS.RUNNING):
            return
        head = pending[0]
        if len(self.oracle.live()) + len(head.names) <= self.config.capacity and room_in_time(
            self.now(), started=head.started, timeout=head.timeout, tolerance=0.0
        ):
            head.room_as_head = True

    # -----------------------------------------------------------------------------------
    # send prediction
    # -----------------------------------------------------------------------------------

    def _predict_send(
        self, items: Sequence[object], *, check_capacity: bool = True
    ) -> tuple[str | None, str, list[str]]:
        """The oracle's prediction for ``send(*items)``: (error name, rejection reason,
        fresh names). Without ``check_capacity``, the capacity check is left out (a
        producer waits for room); with it, a send also fails while a producer waits
        (send does not overtake the waiting producers)."""
        envs = [item for item in items if isinstance(item, envq.Envelope)]
        names = [self.session.names[env] for env in envs]
        error, reason, fresh = self.oracle.predict_send(names, valid=len(envs) == len(items))
        capacity_error = ERRORS["CapacityExceeded"]
        if not check_capacity:
            return (None, "", fresh) if error == capacity_error else (error, reason, fresh)
        if error is None and fresh and self.config.capacity and self._pending_waiters():
            return capacity_error, "capacity", fresh
        return error, reason, fresh

    def _send(self, items: Sequence[object]) -> None:
        """Call send() and check the result against the oracle's prediction."""
        oracle = self.oracle
        error, reason, fresh = self._predict_send(items)
        live_before = len(oracle.live())
        before = oracle.life

        async def go() -> None:
            oracle.admitting = set(fresh) if error is None else set()
            oracle.calling = QueueCall.SEND
            got: BaseException | None = None
            try:
                self.q.send(*items)  # type: ignore[arg-type]
            except envq.EnvqError as exc:
                got = exc
            finally:
                oracle.calling = None
            what = f"send({len(items)} items) while {before.name}"
            name = error_name(got)
            if reason == "invalid":
                # Not an envelope: the protocol's bad_envelope, as its own class, a
                # BadEnvelope that is a TypeError as well.
                assert type(got) is envq.BadEnvelopeType, f"{what}: {got!r}"
                name = ERRORS["BadEnvelope"]
            oracle.check_call(what, error, got is None, name, f"LIFECYCLE[{before.name},SEND]")
            if error is not None:
                oracle.rejections[reason] += 1
                assert len(oracle.live()) == live_before, "a rejected batch admitted something"
                return
            assert not oracle.admitting, f"not admitted: {oracle.admitting}"
            oracle.dedups += len(items) - len(fresh)

        self._run(go())

    # -----------------------------------------------------------------------------------
    # Rules
    # -----------------------------------------------------------------------------------

    def _new_queue(self) -> None:
        self.session.cmd_queue({"cmd": "queue", **self.config.to_json()})
        self.oracle.fresh_queue(self.config)
        self.waiters = []

    @initialize(
        target=envelopes,
        config=queue_configs(),
        initial=st.lists(env_specs(), min_size=1, max_size=4),
        started=st.sampled_from([True, True, True, False]),
    )
    @one_origin
    def make_queue(
        self, config: QueueConfig, initial: list[EnvSpec], started: bool
    ) -> MultipleResults[str]:
        """The queue under test, with a first batch (buffered; armed if started)."""
        self.config = config
        self._new_queue()
        names = [self._make(spec) for spec in initial]
        self._send([self._env(n) for n in names])
        if started:
            self.start()
        return multiple(*names)

    @precondition(lambda self: self.oracle.life is QS.TERMINATED)
    @rule()
    @one_origin
    def renew(self) -> None:
        """Replace a terminated queue with a new one (same configuration); its
        envelopes, all terminal now, may be sent to the new one."""
        assert not self.oracle.live()
        self._new_queue()

    @rule()
    @one_origin
    def start(self) -> None:
        oracle = self.oracle
        before = oracle.life
        result = start_result(before)

        async def go() -> None:
            oracle.calling = QueueCall.START
            got: BaseException | None = None
            try:
                self.q.start()
            except envq.EnvqError as exc:
                got = exc
            finally:
                oracle.calling = None
            row = f"LIFECYCLE[{before.name},START]"
            if isinstance(result, envq.QueueState):
                self._answered("start()", None, got, row)
                assert self.q.state is result is oracle.life, (self.q.state, oracle.life)
            else:
                self._answered(f"start() while {before.name}", result, got, row)
                oracle.rejections["state"] += 1

        self._run(go())

    @rule(call=stop_calls())
    @one_origin
    def stop(self, call: StopCall) -> None:
        self._stop(call)

    @precondition(
        lambda self: self.oracle.life is QS.RUNNING and bool(self.oracle.in_state(ES.RUNNING))
    )
    @rule(call=stop_calls())
    @one_origin
    def stop_while_busy(self, call: StopCall) -> None:
        """stop() with attempts in flight (and maybe envelopes READY behind them): the
        cells of the stop-mode table that random timing rarely reaches."""
        self._stop(call)

    def _report(self, report: envq.StopReport) -> dict[str, Any]:
        """A stop report as the protocol writes it (envelopes by name)."""
        names = self.session.names
        return {
            "parked": [names[e] for e in report.parked],
            "completed": [names[e] for e in report.completed],
            "cancelled": [names[e] for e in report.cancelled],
            "complete": report.complete,
        }

    def _stop(self, call: StopCall) -> None:
        oracle = self.oracle
        # The protocol's StopCall and QueueConfig name the modes by value.
        call_mode = None if call.mode is None else envq.StopMode(call.mode)
        mode = envq.StopMode(self.config.stop_mode) if call_mode is None else call_mode
        wait = self.config.wait if call.wait is None else call.wait
        before = oracle.life
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
            oracle.stop_request = mode
            if call.cancel:
                oracle.request_cancel(CancelCause.STOP)

        async def go() -> None:
            oracle.calling = QueueCall.STOP
            try:
                stopping = self.q.stop(mode=call_mode, cancel=call.cancel, wait=call.wait)
                if wait and before in (QS.RUNNING, QS.STOPPING):
                    try:
                        report = await asyncio.wait_for(stopping, GUARD)
                    except TimeoutError:
                        assert oracle.blocked(), "stop() never ended, yet nothing hangs"
                        assert self.q.state is QS.STOPPING
                        return
                else:
                    report = await stopping
            finally:
                oracle.calling = None
            oracle.check_report(self._report(report), before, wait)

        self._run(go())

    @precondition(lambda self: self.oracle.life in (QS.STOPPING, QS.STOPPED, QS.TERMINATED))
    @rule()
    @one_origin
    def wait_stopped(self) -> None:
        async def go() -> None:
            try:
                report = await asyncio.wait_for(self.q.wait_stopped(), GUARD)
            except TimeoutError:
                assert self.oracle.blocked(), "wait_stopped() never returned, yet nothing hangs"
                return
            assert self.q.state in (QS.STOPPED, QS.TERMINATED)
            assert self.oracle.life is self.q.state
            got = self._report(report)
            assert got == self.oracle.last_report, f"{got} != {self.oracle.last_report}"

        self._run(go())

    @rule()
    @one_origin
    def terminate(self) -> None:
        oracle = self.oracle
        before = oracle.life
        if before is QS.STOPPING:
            assert oracle.run is not None
            oracle.run.mode = STOP
        if before is QS.RUNNING:
            oracle.stop_request = STOP
        if before in (QS.RUNNING, QS.STOPPING):
            oracle.request_cancel(CancelCause.TERMINATE)

        async def go() -> None:
            oracle.calling = QueueCall.TERMINATE
            try:
                left = await asyncio.wait_for(self.q.terminate(), GUARD)
            except TimeoutError:
                raise AssertionError(f"terminate() from {before.name} never ended") from None
            finally:
                oracle.calling = None
            oracle.check_handed_back([self.session.names[e] for e in left], before)
            assert self.q.state is QS.TERMINATED
            assert self.q.capacity_used == 0

        self._run(go())

    @rule(
        target=envelopes,
        specs=st.lists(env_specs(), min_size=1, max_size=4),
        repeat=st.booleans(),
    )
    @one_origin
    def send(self, specs: list[EnvSpec], repeat: bool) -> MultipleResults[str]:
        """New envelopes in one batch, maybe naming one twice (admitted once); over
        capacity the batch admits none."""
        names = [self._make(spec) for spec in specs]
        envs = [self._env(n) for n in names]
        self._send([*envs, envs[0]] if repeat else envs)
        return multiple(*names)

    @precondition(lambda self: bool(self._pending_waiters()))
    @rule(target=envelopes, spec=env_specs())
    @one_origin
    def send_behind_producer(self, spec: EnvSpec) -> str:
        """send() while a producer waits in send_wait: CapacityExceeded even when
        there is room (send does not overtake the waiting producers)."""
        name = self._make(spec)
        self._send([self._env(name)])
        return name

    @rule(env=envelopes)
    @one_origin
    def resend(self, env: str) -> None:
        """Send an envelope again: live here (dedup), terminal (a new stay), or live in
        the other queue (BadEnvelope)."""
        self._send([self._env(env)])

    @rule(target=envelopes, spec=env_specs(), item=bad_items())
    @one_origin
    def send_bad(self, spec: EnvSpec, item: object) -> str:
        """A batch with something that is not an envelope admits nothing."""
        name = self._make(spec)
        self._send([self._env(name), item])
        return name

    @rule(
        target=envelopes,
        specs=st.lists(env_specs(), min_size=1, max_size=2),
        timeout=send_wait_timeouts(),
        background=st.booleans(),
    )
    @one_origin
    def send_wait(
        self, specs: list[EnvSpec], timeout: float, background: bool
    ) -> MultipleResults[str]:
        """A producer waiting for room for its batch: to the end (at most ``timeout``),
        or in the background while later rules run (send() must not overtake it)."""
        names = tuple(self._make(spec) for spec in specs)
        if background and not (
            self.config.capacity > 0
            and self.oracle.life in (QS.INIT, QS.RUNNING)
            and len(self._pending_waiters()) < 2
        ):
            background = False
        w = self._start_waiter(names, timeout)
        if not background:

            async def finish() -> None:
                assert w.task is not None
                await asyncio.wait({w.task}, timeout=GUARD)
                assert w.task.done(), "send_wait outlived its timeout"

            self._run(finish())
        return multiple(*names)

    def _start_waiter(self, names: tuple[str, ...], timeout: float) -> Waiter:
        """Start ``send_wait`` with what the oracle expects of it: at once, the error
        send() would raise, wait (behind other producers, or for room), or
        CapacityExceeded at once for a batch that can never fit."""
        error, _reason, fresh = self._predict_send(
            [self._env(n) for n in names], check_capacity=False
        )
        capacity = self.config.capacity
        expect: str | None = None
        if not self._pending_waiters():
            if error is not None:
                expect = error
            elif not capacity or len(self.oracle.live()) + len(fresh) <= capacity:
                expect = "now"
        if expect is None:
            too_big = capacity and len(names) > capacity
            expect = ERRORS["CapacityExceeded"] if too_big else "wait"
        w = Waiter(names, self.now(), timeout, expect)
        self.waiters.append(w)
        envs = [self._env(n) for n in names]

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
        got = error_name(exc)
        elapsed = self.now() - w.started
        expect = w.expect
        rejections = self.oracle.rejections
        if expect == "now":
            self._check(exc is None and w.admitted, lambda: f"{w.label}: {exc!r}")
            self._check(elapsed == 0, lambda: f"{w.label} took {elapsed:g} s")
            return
        if expect != "wait":
            self._check(got == expect, lambda: f"{w.label}: {exc!r}, not {expect}")
            self._check(elapsed == 0, lambda: f"{w.label} took {elapsed:g} s to fail")
            rejections[REJECTION_REASONS.get(expect, "state")] += 1
            return
        tracks = self.oracle.tracks
        if exc is None:
            # (Overtaking is checked when the batch is admitted: _check_no_overtake.)
            self._check(w.admitted, lambda: f"{w.label} returned, not admitted")
        elif got == ERRORS["CapacityExceeded"]:
            rejections["capacity"] += 1
            self._check(
                math.isclose(elapsed, w.timeout),
                lambda: f"{w.label} gave up after {elapsed:g} s, not {w.timeout:g}",
            )
            self._check(not w.room_as_head, lambda: f"{w.label} timed out though room was free")
            self._note_room()  # the room it leaves is the next producer's
        elif got == ERRORS["TypeBlacklisted"]:
            rejections["blacklisted"] += 1
            banned = any(tracks[n].spec.type in self.oracle.blacklist for n in w.names)
            self._check(banned, lambda: f"{w.label}: {exc!r}")
        elif got == ERRORS["BadEnvelope"]:
            # One of its envelopes was sent to the other queue while it waited here.
            rejections["foreign"] += 1
            lent = any(tracks[n].lent for n in w.names)
            self._check(lent, lambda: f"{w.label}: {exc!r}")
        elif got in w.state_errors:
            rejections["state"] += 1
        else:
            self._check(False, lambda: f"{w.label} raised {exc!r}")

    @rule(env=envelopes)
    @one_origin
    def lend(self, env: str) -> None:
        """Send an envelope to the other queue: it is then live there, and sending it
        to the machine's queue raises BadEnvelope (and vice versa)."""
        oracle = self.oracle
        t = oracle.tracks[env]
        got: BaseException | None = None
        try:
            self.session.cmd_lend({"env": env})
        except envq.EnvqError as exc:
            got = exc
        expected = ERRORS["BadEnvelope"] if t.state in LIVE else None
        what = f"other.send({env}) while {t.state.name} here"
        assert error_name(got) == expected, f"{what}: expected {expected}, got {got!r}"
        if got is None and not t.lent:
            t.lent = True
            oracle.lent.append(env)

    @precondition(lambda self: bool(self.oracle.lent))
    @rule()
    @one_origin
    def reclaim(self) -> None:
        """Terminate the other queue: it hands back the lent envelopes."""
        oracle = self.oracle
        left = self.session.cmd_reclaim({})
        self._raise_violations()
        assert left == oracle.lent, f"{left} != {oracle.lent}"
        for name in left:
            oracle.tracks[name].lent = False
        oracle.lent = []

    @rule(env=envelopes, plan=plans())
    @one_origin
    def plan(self, env: str, plan: Plan) -> None:
        """Choose what a later attempt of this envelope does."""
        self.session.cmd_plan({"env": env, "plan": plan.value})
        self.oracle.plan(env, plan)

    @precondition(lambda self: bool(self.oracle.hanging()))
    @rule(index=st.integers(0, 3), then=releases())
    @one_origin
    def release(self, index: int, then: Plan) -> None:
        """Let a hanging attempt finish with the given plan."""
        hanging = self.oracle.hanging()
        name = hanging[index % len(hanging)]
        self.oracle.release(name, then)
        released = self.session.cmd_release({"env": name, "plan": then.value})
        self._run(settle())
        assert released, f"{name} hangs for the oracle, not for the queue"

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
    def oracle_invariants_hold(self) -> None:
        """The oracle's invariants after a step, against the queue's statistics: I1
        (capacity_used is the live count, within the capacity), I2 (the count in each
        live state), I3, I4 (no banned type left), I5 (nothing lost, every hand-back
        and on_failure call accounted for), I6 (the states each lifecycle state allows),
        the lifecycle state, no DELAYED envelope past its due time."""
        self.oracle.now = self.now()
        self.oracle.check_invariants(self.session.cmd_stats({}))

    @invariant()
    @one_origin
    def statistics_match_the_oracle(self) -> None:
        """What ``statistics()`` and ``capacity_used`` say beyond the protocol's
        invariants: terminal counts, attempts in flight, outcomes, dedups, rejections."""
        oracle = self.oracle
        stats = self.q.statistics()
        assert self.q.capacity_used == stats.capacity_used == len(oracle.live())
        assert self.q.state is stats.state is oracle.life, (self.q.state, oracle.life)
        for state in TERMINAL_STATES:
            got = stats.by_state.get(state, 0)
            assert got == oracle.terminal_counts[state], (state, got, oracle.terminal_counts)
        running = len(oracle.in_state(ES.RUNNING))
        assert stats.in_flight == running <= self.config.workers, (stats.in_flight, running)
        assert dict(stats.outcomes) == oracle.outcomes, (stats.outcomes, oracle.outcomes)
        assert stats.dedups == oracle.dedups, (stats.dedups, oracle.dedups)
        assert dict(stats.rejections) == oracle.rejections, (stats.rejections, oracle.rejections)

    @invariant()
    @one_origin
    def delayed_envelopes_are_not_overdue(self) -> None:
        """Stricter than the oracle's timing check (which allows a real clock's
        lateness): on the virtual clock, once the loop has settled, no envelope is
        still DELAYED at its due time."""
        now = self.now()
        late = [(t.name, t.due) for t in self.oracle.in_state(ES.DELAYED) if t.due <= now]
        assert not late, f"at {now:g}, still DELAYED past their due time: {late}"

    @invariant()
    @one_origin
    def first_waiting_producer_has_no_room(self) -> None:
        pending = self._pending_waiters()
        if pending and self.oracle.life in (QS.INIT, QS.RUNNING):
            head = pending[0]
            room = self.config.capacity - len(self.oracle.live())
            assert len(head.names) > room, f"{head.label} waits with room for {room}"
            tracks, blacklist = self.oracle.tracks, self.oracle.blacklist
            banned = [n for n in head.names if tracks[n].spec.type in blacklist]
            assert not banned, f"{head.label} waits with banned types {banned}"

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: if a step failed, that failure
        # is the one to report, not what a final terminate() makes of the wreck.
        failing = sys.exc_info()[1] is not None
        q, other = self.session.q, self.session.other

        async def close() -> str | None:
            for w in self.waiters:
                if w.task is not None and not w.task.done():
                    w.task.cancel()
            if q is not None and q.state is not QS.TERMINATED:
                try:
                    await asyncio.wait_for(q.terminate(), GUARD)
                except TimeoutError:
                    return "terminate() at the end of the run never returned"
            if other is not None:
                await other.terminate()
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
