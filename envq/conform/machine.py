"""The stateful conformance machine: Hypothesis drives a port through a driver, and the
oracle checks every step.

:func:`make_machine` builds a ``RuleBasedStateMachine`` for one port: its rules are
the protocol's commands (only those the port declared it supports), each carried out
through the driver; the driver's observations go to the :class:`~envq.conform.oracle.
Oracle` as they come, and after every step the invariants are checked against the
port's statistics. A failed check raises :class:`~envq.conform.oracle.Violation`;
Hypothesis then shrinks the run to a short counterexample, whose commands are kept
(:attr:`Recorder.commands`) so that it can be saved as a JSON-lines script and
replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final

import attrs
from hypothesis import strategies as st
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

from envq._machine import CancelCause, EnvState, QueueCall, QueueState, StopMode
from envq.conform.oracle import LIVE, Oracle, Violation, start_result
from envq.conform.protocol import EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.strategies import Profile
from envq.conform.transport import Driver

__all__ = ["Recorder", "make_machine"]

QS = QueueState
#: Model seconds a blocking call may take before the harness concludes it will never
#: return (which the oracle must then explain: an attempt hanging without a deadline).
GUARD_VIRTUAL: Final = 100_000.0
GUARD_REAL: Final = 60.0


@attrs.define
class Recorder:
    """The commands of the current run, and the last failing run's."""

    commands: list[dict[str, Any]] = attrs.Factory(list)
    failing: list[dict[str, Any]] | None = None
    violation: Violation | None = None


def make_machine(
    connect: Callable[[], Driver],
    profile: Profile,
    recorder: Recorder,
    *,
    hello: dict[str, Any] | None = None,
    ignore: frozenset[str] = frozenset(),
) -> type[RuleBasedStateMachine]:
    """The conformance machine for one port.

    :param connect: starts a driver session (one per Hypothesis run).
    :param profile: what to generate (the port's features and clock).
    :param recorder: where each run's commands are kept.
    :param hello: extra fields of the ``hello`` command (e.g. ``time_scale``).
    :param ignore: checks (``I1`` … or ``protocol``) not to report: the port's declared
        divergences, or the ones an audit has already found.
    """
    tolerance = 0.25 if profile.real_clock else 1e-6
    guard = GUARD_REAL if profile.real_clock else GUARD_VIRTUAL
    has = profile.has

    class ConformMachine(RuleBasedStateMachine):
        """Drives one port's queue beside the oracle."""

        envelopes: ClassVar[Bundle[str]] = Bundle("envelopes")

        def __init__(self) -> None:
            super().__init__()
            recorder.commands = []
            self.driver = connect()
            self.oracle = Oracle(tolerance)
            self.made = 0
            self.closed = False
            self.call({"cmd": "hello", "protocol": 1, **(hello or {})})

        # -- plumbing -----------------------------------------------------------------

        def call(
            self,
            command: dict[str, Any],
            check: Callable[[dict[str, Any]], None] | None = None,
            calling: QueueCall | None = None,
        ) -> dict[str, Any]:
            """Send one command: feed the oracle the observations made until the call
            returned (with ``calling`` as the call under way), run ``check`` on the
            response (the queue as it was then), then feed it the rest."""
            recorder.commands.append(command)
            response = self.driver.call(command)
            if response.get("error") == "DriverError":
                raise Violation("protocol", f"{command['cmd']}: {response.get('message')}")
            events = response.get("events", [])
            at = int(response.get("at", len(events)))
            oracle = self.oracle
            oracle.calling = calling
            try:
                self._checked(lambda: oracle.observe(events[:at]))
            finally:
                oracle.calling = None
            if check is not None:
                self._checked(lambda: check(response))
            self._checked(lambda: oracle.observe(events[at:]))
            return response

        def _checked(self, check: Callable[[], None]) -> None:
            try:
                check()
            except Violation as exc:
                if exc.check in ignore:
                    return
                recorder.violation = exc
                raise

        def _make(self, spec: EnvSpec) -> str:
            self.made += 1
            name = f"e{self.made}"
            self.call({"cmd": "define", "env": name, "spec": spec.to_json()})
            self.oracle.define(name, spec)
            return name

        def _send(self, names: list[str]) -> None:
            oracle = self.oracle
            error, reason, fresh = oracle.predict_send(names)
            live_before = len(oracle.live())
            before = oracle.life
            oracle.admitting = set(fresh) if error is None else set()

            def check(response: dict[str, Any]) -> None:
                row = f"LIFECYCLE[{before.name},SEND]"
                oracle.check_call(
                    f"send({', '.join(names)}) while {before.name}",
                    error,
                    bool(response.get("ok")),
                    response.get("error"),
                    row,
                )
                if error is not None:
                    oracle.rejections[reason] += 1
                    if len(oracle.live()) != live_before:
                        raise Violation("I1", "a rejected batch admitted something")
                    return
                if oracle.admitting:
                    raise Violation("I5", f"not admitted: {sorted(oracle.admitting)}")
                oracle.dedups += len(names) - len(fresh)

            self.call({"cmd": "send", "envs": names}, check, QueueCall.SEND)

        def teardown(self) -> None:
            if not self.closed:
                self.closed = True
                self.driver.close()

        # -- rules --------------------------------------------------------------------

        @initialize(
            target=envelopes,
            config=profile.queue_configs(),
            initial=st.lists(profile.env_specs(), min_size=1, max_size=4),
            started=st.sampled_from([True, True, True, False]) if has("buffer") else st.just(True),
        )
        def make_queue(
            self, config: QueueConfig, initial: list[EnvSpec], started: bool
        ) -> MultipleResults[str]:
            """The queue under test, with a first batch (buffered if not started)."""
            self._new_queue(config)
            if started:
                self.start()
            names = [self._make(spec) for spec in initial]
            self._send(names)
            return multiple(*names)

        def _new_queue(self, config: QueueConfig) -> None:
            self.call({"cmd": "queue", **config.to_json()})
            self.oracle.fresh_queue(config)

        @precondition(lambda self: self.oracle.life is QS.TERMINATED)
        @rule()
        def renew(self) -> None:
            """A new queue (same configuration) replaces a terminated one."""
            self._new_queue(self.oracle.config)

        @rule()
        def start(self) -> None:
            """``start()``: armed, a no-op, or the state's error."""
            oracle = self.oracle
            before = oracle.life
            result = start_result(before)
            if not has("restart") and before is QS.STOPPED:
                return

            def check(response: dict[str, Any]) -> None:
                row = f"LIFECYCLE[{before.name},START]"
                expected = result if isinstance(result, str) else None
                ok, got = bool(response.get("ok")), response.get("error")
                oracle.check_call(f"start() while {before.name}", expected, ok, got, row)
                if isinstance(result, str):
                    oracle.rejections["state"] += 1
                elif oracle.life is not result:
                    message = f"start() left the queue {oracle.life.name}, not {result.name}"
                    raise Violation("I7", message, row)

            self.call({"cmd": "start"}, check, QueueCall.START)

        @rule(call=profile.stop_calls())
        def stop(self, call: StopCall) -> None:
            """``stop(mode, cancel, wait)``."""
            self._stop(call)

        @precondition(
            lambda self: (
                self.oracle.life is QS.RUNNING and bool(self.oracle.in_state(EnvState.RUNNING))
            )
        )
        @rule(call=profile.stop_calls())
        def stop_while_busy(self, call: StopCall) -> None:
            """``stop()`` with attempts in flight (the cells random timing rarely reaches)."""
            self._stop(call)

        def _stop(self, call: StopCall) -> None:
            oracle = self.oracle
            mode = StopMode(call.mode or oracle.config.stop_mode)
            wait = oracle.config.wait if call.wait is None else call.wait
            before = oracle.life
            row = f"LIFECYCLE[{before.name},STOP]"
            command: dict[str, Any] = {
                "cmd": "stop",
                "mode": call.mode,
                "cancel": call.cancel,
                "wait": call.wait,
            }
            if call.cancel and mode is StopMode.DRAIN:

                def invalid(response: dict[str, Any]) -> None:
                    if response.get("ok") or response.get("error") != "invalid_argument":
                        raise Violation("I7", f"stop(cancel=True) with DRAIN answered {response}")
                    if oracle.life is not before:
                        raise Violation("I7", "a refused stop changed the queue")

                self.call(command, invalid)
                return
            if before is QS.RUNNING:
                oracle.stop_request = mode
                if call.cancel:
                    oracle.request_cancel(CancelCause.STOP)
            if wait and before in (QS.RUNNING, QS.STOPPING):
                command["limit"] = guard

            def check(response: dict[str, Any]) -> None:
                oracle.coverage.row(row)
                if not response.get("ok"):
                    raise Violation("I7", f"stop() failed: {response.get('error')}", row)
                result = response.get("result")
                if isinstance(result, dict) and result.get("timed_out"):
                    if not oracle.blocked():
                        raise Violation("I6", "stop() never ended, yet nothing hangs", row)
                    return
                if not isinstance(result, dict):
                    raise Violation("protocol", f"stop() answered {result!r}")
                oracle.check_report(result, before, wait)

            self.call(command, check, QueueCall.STOP)

        @precondition(lambda self: self.oracle.life in (QS.STOPPING, QS.STOPPED, QS.TERMINATED))
        @rule()
        def wait_stopped(self) -> None:
            """``wait_stopped()``: the final report."""
            oracle = self.oracle

            def check(response: dict[str, Any]) -> None:
                result = response.get("result")
                if isinstance(result, dict) and result.get("timed_out"):
                    if not oracle.blocked():
                        raise Violation("I6", "wait_stopped() never returned, yet nothing hangs")
                    return
                if not response.get("ok") or not isinstance(result, dict):
                    raise Violation("I7", f"wait_stopped() answered {response}")
                if oracle.life not in (QS.STOPPED, QS.TERMINATED):
                    raise Violation("I6", f"wait_stopped() returned while {oracle.life.name}")
                if result != oracle.last_report:
                    raise Violation("I6", f"report {result} != {oracle.last_report}")

            self.call({"cmd": "wait_stopped", "limit": guard}, check)

        @rule()
        def terminate(self) -> None:
            """``terminate()``: everything handed back or ended."""
            oracle = self.oracle
            before = oracle.life
            row = f"LIFECYCLE[{before.name},TERMINATE]"
            if before is QS.STOPPING:
                assert oracle.run is not None
                oracle.run.mode = StopMode.STOP
            if before is QS.RUNNING:
                oracle.stop_request = StopMode.STOP
            if before in (QS.RUNNING, QS.STOPPING):
                oracle.request_cancel(CancelCause.TERMINATE)

            def check(response: dict[str, Any]) -> None:
                oracle.coverage.row(row)
                result = response.get("result")
                if not response.get("ok") or not isinstance(result, dict):
                    raise Violation("I5", f"terminate() answered {response}", row)
                if result.get("timed_out"):
                    raise Violation("I5", f"terminate() from {before.name} never ended", row)
                handed = list(result.get("handed_back", []))
                if not has("terminate_handback"):
                    handed = sorted(oracle.returned, key=lambda n: oracle.tracks[n].seq)
                oracle.check_handed_back(handed, before)

            self.call({"cmd": "terminate", "limit": guard}, check, QueueCall.TERMINATE)

        @rule(
            target=envelopes,
            specs=st.lists(profile.env_specs(), min_size=1, max_size=4),
            repeat=st.booleans() if has("dedup") else st.just(False),
        )
        def send(self, specs: list[EnvSpec], repeat: bool) -> MultipleResults[str]:
            """New envelopes in one batch, maybe naming one twice (admitted once)."""
            names = [self._make(spec) for spec in specs]
            self._send([*names, names[0]] if repeat else names)
            return multiple(*names)

        @precondition(lambda self: has("dedup"))
        @rule(env=envelopes)
        def resend(self, env: str) -> None:
            """Send an envelope again: live here (dedup), terminal (a new stay), or live in
            the other queue (refused)."""
            self._send([env])

        @precondition(lambda self: has("send_wait"))
        @rule(
            target=envelopes,
            specs=st.lists(profile.env_specs(), min_size=1, max_size=2),
            timeout=profile.send_wait_timeouts(),
        )
        def send_wait(self, specs: list[EnvSpec], timeout: float) -> MultipleResults[str]:
            """A producer waiting (at most ``timeout``) for room for its batch."""
            oracle = self.oracle
            names = [self._make(spec) for spec in specs]
            before = oracle.life
            error, reason, fresh = oracle.predict_send(names)
            capacity = oracle.config.capacity
            expect: str | None = None
            if error == "capacity_exceeded":
                error = None
                expect = "capacity_exceeded" if len(fresh) > capacity else "wait"
            oracle.admitting = (
                set(fresh) if error is None and expect != "capacity_exceeded" else set()
            )

            def check(response: dict[str, Any]) -> None:
                row = f"LIFECYCLE[{before.name},SEND]"
                ok, got = bool(response.get("ok")), response.get("error")
                if error is not None:
                    oracle.check_call("send_wait()", error, ok, got, row)
                    oracle.rejections[reason] += 1
                elif expect == "capacity_exceeded":
                    oracle.check_call("send_wait(batch > capacity)", expect, ok, got, row)
                    oracle.rejections["capacity"] += 1
                elif ok:
                    if oracle.admitting:
                        raise Violation(
                            "I5", f"send_wait returned, {oracle.admitting} not admitted"
                        )
                    oracle.dedups += len(names) - len(fresh)
                elif got == "type_blacklisted" and expect == "wait":
                    # Its type was banned while it waited: refused as send() would be.
                    oracle.rejections["blacklisted"] += 1
                    banned = [n for n in names if oracle.tracks[n].spec.type in oracle.blacklist]
                    if not banned:
                        raise Violation("I4", "send_wait refused a type that is not banned", row)
                elif got == "capacity_exceeded" and expect == "wait":
                    oracle.rejections["capacity"] += 1
                    if oracle.admitting != set(fresh):
                        raise Violation(
                            "I1", "a send_wait that timed out admitted part of its batch"
                        )
                else:
                    raise Violation("I7", f"send_wait() answered {got!r}", row)
                oracle.admitting = set()

            self.call(
                {"cmd": "send_wait", "envs": names, "timeout": timeout, "limit": guard},
                check,
                QueueCall.SEND,
            )
            return multiple(*names)

        @precondition(lambda self: has("foreign"))
        @rule(env=envelopes)
        def lend(self, env: str) -> None:
            """Send an envelope to the second queue: live there, refused here."""
            oracle = self.oracle
            t = oracle.tracks[env]
            live_here = t.state in LIVE

            def check(response: dict[str, Any]) -> None:
                if live_here:
                    if response.get("ok") or response.get("error") != "bad_envelope":
                        raise Violation(
                            "I2", f"{env}: live here, lent to another queue: {response}"
                        )
                elif not response.get("ok"):
                    raise Violation("I2", f"{env}: could not be lent: {response}")
                elif not t.lent:
                    t.lent = True
                    oracle.lent.append(env)

            self.call({"cmd": "lend", "env": env}, check)

        @precondition(lambda self: has("foreign") and bool(self.oracle.lent))
        @rule()
        def reclaim(self) -> None:
            """Terminate the second queue: it hands back the lent envelopes."""
            oracle = self.oracle

            def check(response: dict[str, Any]) -> None:
                if response.get("result") != oracle.lent:
                    got = response.get("result")
                    raise Violation("I5", f"the other queue handed back {got}, not {oracle.lent}")
                for name in oracle.lent:
                    oracle.tracks[name].lent = False
                oracle.lent = []

            self.call({"cmd": "reclaim"}, check)

        @rule(env=envelopes, plan=profile.plans())
        def plan(self, env: str, plan: Plan) -> None:
            """Choose what a later attempt of this envelope does."""
            self.call({"cmd": "plan", "env": env, "plan": plan.value})
            self.oracle.plan(env, plan)

        @precondition(lambda self: bool(self.oracle.hanging()))
        @rule(index=st.integers(0, 3), then=profile.releases())
        def release(self, index: int, then: Plan) -> None:
            """Let a hanging attempt finish with the given plan."""
            hanging = self.oracle.hanging()
            name = hanging[index % len(hanging)]
            self.oracle.release(name, then)

            def check(response: dict[str, Any]) -> None:
                if response.get("result") is not True:
                    raise Violation("protocol", f"{name} was not hanging")

            self.call({"cmd": "release", "env": name, "plan": then.value}, check)

        @rule(dt=profile.small_steps())
        def tick(self, dt: float) -> None:
            """Let a little time pass: inside deadlines and SLOW attempts."""
            self.call({"cmd": "advance", "seconds": dt})

        @rule(dt=profile.large_steps())
        def advance(self, dt: float) -> None:
            """Let much time pass: past intervals, retries and delays."""
            self.call({"cmd": "advance", "seconds": dt})

        # -- invariants ---------------------------------------------------------------

        @invariant()
        def invariants_hold(self) -> None:
            """The invariants, against the port's statistics."""
            if self.closed:
                return
            oracle = self.oracle

            def check(response: dict[str, Any]) -> None:
                stats = response.get("result") if response.get("ok") else None
                oracle.check_invariants(stats)
                if stats is None or "outcomes" not in stats:
                    return
                outcomes = {o.value: n for o, n in oracle.outcomes.items()}
                if dict(stats["outcomes"]) != outcomes:
                    raise Violation("I7", f"outcome counts {stats['outcomes']} != {outcomes}")
                if "dedups" in stats and stats["dedups"] != oracle.dedups:
                    raise Violation("I8", f"dedups {stats['dedups']} != {oracle.dedups}")
                if "rejections" in stats and dict(stats["rejections"]) != oracle.rejections:
                    got = stats["rejections"]
                    raise Violation("I7", f"rejections {got} != {oracle.rejections}")

            self.call({"cmd": "stats"}, check)

    return ConformMachine
