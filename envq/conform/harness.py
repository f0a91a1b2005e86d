"""One conformance session: a driver, the oracle beside it, and a check per command.

:class:`Harness` has one method per protocol command; each sends the command, feeds the
oracle the driver's observations (those made before the call returned, then the
rest) and checks the response against what the contract predicts. The Hypothesis
machine (:mod:`envq.conform.machine`) calls these methods with generated arguments; a
replay (:func:`replay`) calls them with the commands of a saved counterexample. Every
command sent is kept in :attr:`Harness.log`, which is the counterexample's script.

A check that fails raises :class:`~envq.conform.oracle.Violation`, unless the port
declared it (or an audit found it already): then it is recorded in
:attr:`Harness.known` and the session goes on, the oracle following the port.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from envq._machine import CancelCause, QueueCall, QueueState, StopMode
from envq.conform.oracle import LIVE, Coverage, Oracle, Violation, start_result
from envq.conform.protocol import PROTOCOL, EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.transport import Driver

__all__ = ["GUARD_REAL", "GUARD_VIRTUAL", "REAL_JITTER", "Harness", "matches", "replay"]

QS = QueueState
#: Model seconds a blocking call may take before the harness concludes it will never
#: return (which the oracle must then explain: an attempt hanging without a deadline).
GUARD_VIRTUAL: Final = 100_000.0
GUARD_REAL: Final = 60.0
#: What the timing checks of a real-clock port allow: this many real seconds of
#: scheduling jitter, or a quarter of a model second, whichever is more.
REAL_JITTER: Final = 0.02


def matches(violation: Violation, keys: Iterable[str]) -> bool:
    """Whether ``violation`` is one of ``keys``: a check (``I6``: any violation of it),
    a check and a table row (``I6 OUTCOMES[PERIODIC,OK]``), or either with a leading
    ``=`` for exactly that key (``=I6``: a violation of I6 that names no row)."""
    row = f"{violation.check} {violation.row}" if violation.row else ""
    own = {violation.check, row, f"={row or violation.check}"}
    return any(key in own for key in keys)


class Harness:
    """A driver session checked command by command.

    :param driver: the session with the port.
    :param hello: extra fields of ``hello`` (``time_scale`` for a real-clock port).
    :param real_clock: whether the port's clock is real (timing checks get a tolerance,
        blocking calls a shorter guard).
    :param ignore: violations to record instead of raising (see :func:`matches`).
    :param coverage: where the checks and table rows exercised are counted.
    :param features: the features to generate for (default: those ``hello`` declares).
    :param known: where the violations set aside are kept, the first of each check
        and row (shared across sessions by the runner).
    :param on_violation: called with each violation raised and the script that led to
        it, as it is raised (a real-clock port may not fail the same way again when the
        script is replayed).
    """

    def __init__(
        self,
        driver: Driver,
        *,
        hello: Mapping[str, Any] | None = None,
        real_clock: bool = False,
        ignore: Iterable[str] = (),
        coverage: Coverage | None = None,
        features: Iterable[str] | None = None,
        known: list[Violation] | None = None,
        on_violation: Callable[[Violation, tuple[dict[str, Any], ...]], None] | None = None,
    ) -> None:
        self.driver = driver
        self.on_violation = on_violation
        self.ignore = frozenset(ignore)
        scale = float((hello or {}).get("time_scale", 0.05))
        self.oracle = Oracle(max(0.25, REAL_JITTER / scale) if real_clock else 1e-6)
        if coverage is not None:
            self.oracle.coverage = coverage
        self.guard = GUARD_REAL if real_clock else GUARD_VIRTUAL
        self.log: list[dict[str, Any]] = []
        self.known: list[Violation] = [] if known is None else known
        self.closed = False
        response = self._call({"cmd": "hello", "protocol": PROTOCOL, **(hello or {})})
        answer = response.get("result") or {}
        declared = features if features is not None else answer.get("features", [])
        self.features = frozenset(declared)

    # -- plumbing ---------------------------------------------------------------------

    def _call(
        self,
        command: dict[str, Any],
        check: Callable[[dict[str, Any]], None] | None = None,
        calling: QueueCall | None = None,
    ) -> dict[str, Any]:
        """Send one command: feed the oracle the observations made until the call
        returned (``calling`` being the call under way), run ``check`` on the response
        (the queue as it was then), then feed it the rest."""
        self.log.append(command)
        response = self.driver.call(command)
        if response.get("error") == "DriverError":
            raise Violation("protocol", f"{command['cmd']}: {response.get('message')}")
        events = response.get("events", [])
        at = int(response.get("at", len(events)))
        oracle = self.oracle
        oracle.calling = calling
        try:
            self._observe(events[:at])
        finally:
            oracle.calling = None
        if check is not None:
            self._checked(lambda: check(response))
        self._observe(events[at:])
        return response

    def _observe(self, events: Iterable[Mapping[str, Any]]) -> None:
        for event in events:
            self._checked(functools.partial(self.oracle.observe, [event]), resync=event)

    def _checked(self, check: Callable[[], None], resync: Mapping[str, Any] | None = None) -> None:
        try:
            check()
        except Violation as exc:
            if not matches(exc, self.ignore):
                if self.on_violation is not None:
                    self.on_violation(exc, tuple(self.log))
                raise
            if all((k.check, k.row) != (exc.check, exc.row) for k in self.known):
                self.known.append(exc)
            if resync is not None:
                self.oracle.resync(resync)

    def has(self, feature: str) -> bool:
        """Whether the port declared ``feature``."""
        return feature in self.features

    def close(self) -> None:
        """End the session."""
        if not self.closed:
            self.closed = True
            self.driver.close()

    # -- commands ---------------------------------------------------------------------

    def queue(self, config: QueueConfig) -> None:
        """A new queue under test."""
        self._call({"cmd": "queue", **config.to_json()})
        self.oracle.fresh_queue(config)

    def define(self, name: str, spec: EnvSpec) -> None:
        """A scripted envelope."""
        self._call({"cmd": "define", "env": name, "spec": spec.to_json()})
        self.oracle.define(name, spec)

    def plan(self, name: str, plan: Plan) -> None:
        """Append a plan to an envelope's script."""
        self._call({"cmd": "plan", "env": name, "plan": plan.value})
        self.oracle.plan(name, plan)

    def start(self) -> None:
        """``start()``: armed, a no-op, or the state's error."""
        oracle = self.oracle
        before = oracle.life
        result = start_result(before)

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

        self._call({"cmd": "start"}, check, QueueCall.START)

    def send(self, names: list[str]) -> None:
        """``send(*names)``: admitted (dedup counted), or refused whole."""
        oracle = self.oracle
        error, reason, fresh = oracle.predict_send(names)
        live_before = len(oracle.live())
        before = oracle.life
        oracle.admitting = set(fresh) if error is None else set()

        def check(response: dict[str, Any]) -> None:
            row = f"LIFECYCLE[{before.name},SEND]"
            ok, got = bool(response.get("ok")), response.get("error")
            oracle.check_call(f"send({', '.join(names)}) while {before.name}", error, ok, got, row)
            if error is not None:
                oracle.rejections[reason] += 1
                if len(oracle.live()) != live_before:
                    raise Violation("I1", "a rejected batch admitted something")
                return
            if oracle.admitting:
                raise Violation("I5", f"not admitted: {sorted(oracle.admitting)}")
            oracle.dedups += len(names) - len(fresh)

        self._call({"cmd": "send", "envs": names}, check, QueueCall.SEND)

    def send_wait(self, names: list[str], timeout: float) -> None:
        """``send_wait(*names, timeout)``: admitted, timed out, or refused."""
        oracle = self.oracle
        before = oracle.life
        error, reason, fresh = oracle.predict_send(names)
        expect: str | None = None
        if error == "capacity_exceeded":
            error = None
            expect = "capacity_exceeded" if len(fresh) > oracle.config.capacity else "wait"
        oracle.admitting = set(fresh) if error is None and expect != "capacity_exceeded" else set()

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
                    raise Violation("I5", f"send_wait returned, {oracle.admitting} not admitted")
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
                    raise Violation("I1", "a send_wait that timed out admitted part of its batch")
            else:
                raise Violation("I7", f"send_wait() answered {got!r}", row)
            oracle.admitting = set()

        command = {"cmd": "send_wait", "envs": names, "timeout": timeout, "limit": self.guard}
        self._call(command, check, QueueCall.SEND)

    def stop(self, call: StopCall) -> None:
        """``stop(mode, cancel, wait)``: the report, or ``invalid_argument``."""
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

            self._call(command, invalid)
            return
        if before is QS.RUNNING:
            oracle.stop_request = mode
            if call.cancel:
                oracle.request_cancel(CancelCause.STOP)
        if wait and before in (QS.RUNNING, QS.STOPPING):
            command["limit"] = self.guard

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

        self._call(command, check, QueueCall.STOP)

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

        self._call({"cmd": "wait_stopped", "limit": self.guard}, check)

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
            oracle.check_handed_back(list(result.get("handed_back", [])), before)

        self._call({"cmd": "terminate", "limit": self.guard}, check, QueueCall.TERMINATE)

    def lend(self, name: str) -> None:
        """Send an envelope to the second queue: live there, refused here."""
        oracle = self.oracle
        t = oracle.tracks[name]
        live_here = t.state in LIVE

        def check(response: dict[str, Any]) -> None:
            if live_here:
                if response.get("ok") or response.get("error") != "bad_envelope":
                    raise Violation("I2", f"{name}: live here, lent to another queue: {response}")
            elif not response.get("ok"):
                raise Violation("I2", f"{name}: could not be lent: {response}")
            elif not t.lent:
                t.lent = True
                oracle.lent.append(name)

        self._call({"cmd": "lend", "env": name}, check)

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

        self._call({"cmd": "reclaim"}, check)

    def release(self, name: str, plan: Plan) -> None:
        """Let a hanging attempt go on with ``plan``."""
        self.oracle.release(name, plan)

        def check(response: dict[str, Any]) -> None:
            if response.get("result") is not True:
                raise Violation("protocol", f"{name} was not hanging")

        self._call({"cmd": "release", "env": name, "plan": plan.value}, check)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        self._call({"cmd": "advance", "seconds": seconds})

    def stats(self) -> None:
        """The invariants, against the port's statistics."""
        oracle = self.oracle
        oracle.coverage.steps += 1

        def check(response: dict[str, Any]) -> None:
            stats = response.get("result") if response.get("ok") else None
            oracle.check_invariants(stats)
            if stats is None or "outcomes" not in stats:
                return
            outcomes = {o.value: n for o, n in oracle.outcomes.items()}
            if dict(stats["outcomes"]) != outcomes:
                raise Violation("I7", f"outcome counts {stats['outcomes']} != {outcomes}")
            oracle.coverage.check("I8")
            if "dedups" in stats and stats["dedups"] != oracle.dedups:
                raise Violation("I8", f"dedups {stats['dedups']} != {oracle.dedups}")
            if "rejections" in stats and dict(stats["rejections"]) != oracle.rejections:
                got = stats["rejections"]
                raise Violation("I7", f"rejections {got} != {oracle.rejections}")

        self._call({"cmd": "stats"}, check)


def replay(harness: Harness, commands: Iterable[Mapping[str, Any]]) -> None:
    """Play a saved script (a counterexample) through ``harness``: each command is
    checked as when it was first generated. Raises the first violation."""
    for command in commands:
        cmd = command.get("cmd")
        if cmd == "hello":
            continue
        if cmd == "queue":
            fields = {k: v for k, v in command.items() if k != "cmd"}
            harness.queue(QueueConfig(**fields))
        elif cmd == "define":
            harness.define(str(command["env"]), EnvSpec.from_json(command["spec"]))
        elif cmd == "plan":
            harness.plan(str(command["env"]), Plan(command["plan"]))
        elif cmd == "start":
            harness.start()
        elif cmd == "send":
            harness.send(list(command["envs"]))
        elif cmd == "send_wait":
            harness.send_wait(list(command["envs"]), float(command["timeout"]))
        elif cmd == "stop":
            mode, cancel, wait = (
                command.get("mode"),
                command.get("cancel", False),
                command.get("wait"),
            )
            harness.stop(StopCall(mode=mode, cancel=bool(cancel), wait=wait))
        elif cmd == "wait_stopped":
            harness.wait_stopped()
        elif cmd == "terminate":
            harness.terminate()
        elif cmd == "lend":
            harness.lend(str(command["env"]))
        elif cmd == "reclaim":
            harness.reclaim()
        elif cmd == "release":
            harness.release(str(command["env"]), Plan(command["plan"]))
        elif cmd == "advance":
            harness.advance(float(command["seconds"]))
        elif cmd == "stats":
            harness.stats()
        else:
            raise ValueError(f"a script command envq conform does not know: {cmd!r}")
