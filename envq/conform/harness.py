"""One conformance session: a driver, the oracle beside it, and a check per command.

:class:`Harness` has one method per protocol command; each sends the command, feeds the
oracle the driver's observations (those made before the call returned, then the
rest) and checks the response against what the contract predicts. The Hypothesis
machine (:mod:`envq.conform.machine`) calls these methods with generated arguments; a
replay (:func:`envq.conform.scripts.replay`) calls them with the commands of a saved
counterexample. Every
command sent is kept in :attr:`Harness.log`, which is the counterexample's script.

A check that fails raises :class:`~envq.conform.oracle.Violation`, unless the port
declared it (or an audit found it already): then it is recorded in
:attr:`Harness.known` and the session goes on, the oracle following the port.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from envq._machine import CancelCause, QueueCall, QueueState, StopMode
from envq.conform.oracle import LIVE, Coverage, Oracle, Violation, start_result
from envq.conform.protocol import PROTOCOL, EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.shapes import bad_answer, shape_problem
from envq.conform.transport import Driver, DriverCrashed, ProtocolError

__all__ = [
    "GUARD_REAL",
    "GUARD_VIRTUAL",
    "REAL_JITTER",
    "Harness",
    "matches",
]

QS = QueueState
#: Model seconds a blocking call may take before the harness concludes it will never
#: return (which the oracle must then explain: an attempt hanging without a deadline).
GUARD_VIRTUAL: Final = 100_000.0
GUARD_REAL: Final = 60.0
#: What the timing checks of a real-clock port allow: this many real seconds of
#: scheduling jitter, or a quarter of a model second, whichever is more.
REAL_JITTER: Final = 0.02
#: The jitter a harness allows when it is not told (a run of the runner sets it from
#: ``Options.jitter`` for the harnesses its machine makes).
JITTER: Final[contextvars.ContextVar[float]] = contextvars.ContextVar(
    "envq_conform_jitter", default=REAL_JITTER
)


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
    :param on_crash: called with the error when the driver fails (exits, hangs, answers
        out of the protocol) and the script that led to it; the error is raised after.
    :param jitter: real seconds of scheduling jitter the timing checks of a real-clock
        port allow (at least a quarter of a model second is allowed whatever it is;
        default: :data:`JITTER`'s value).
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
        on_crash: Callable[[DriverCrashed, tuple[dict[str, Any], ...]], None] | None = None,
        jitter: float | None = None,
    ) -> None:
        self.driver = driver
        self.on_violation = on_violation
        self.on_crash = on_crash
        self.ignore = frozenset(ignore)
        scale = float((hello or {}).get("time_scale", 0.05))
        jitter = JITTER.get() if jitter is None else jitter
        self.oracle = Oracle(max(0.25, jitter / scale) if real_clock else 1e-6)
        # A real-clock port may report the moves an on_success call belongs with in
        # the batch after the call's.
        self.oracle.late_batches = 1 if real_clock else 0
        if coverage is not None:
            self.oracle.coverage = coverage
        self.guard = GUARD_REAL if real_clock else GUARD_VIRTUAL
        self.real_clock = real_clock
        self.log: list[dict[str, Any]] = []
        self.known: list[Violation] = [] if known is None else known
        self.closed = False
        response = self._call({"cmd": "hello", "protocol": PROTOCOL, **(hello or {})})
        answer = response.get("result") or {}
        declared = features if features is not None else answer.get("features", [])
        self.features = frozenset(declared)
        self.oracle.leases = self.has("leases")
        if self.has("late_cancel"):
            self.oracle.cancel_latency = float(answer.get("cancel_latency", 0.0))
        if self.has("late_due"):
            self.oracle.due_latency = float(answer.get("due_latency", 0.0))

    # -- plumbing ---------------------------------------------------------------------

    def _call(
        self,
        command: dict[str, Any],
        check: Callable[[dict[str, Any]], None] | None = None,
        calling: QueueCall | None = None,
        prepare: Callable[[], None] | None = None,
        answered: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Send one command: feed the oracle the observations made before the call took
        effect, run ``prepare`` (what the call should do, predicted from the queue as
        they left it), feed it those made until the call returned (``calling`` being
        the call under way), run ``check`` on the response (the queue as it was then),
        then feed it the rest.

        A send the port refused at once may say it took effect somewhere from
        ``effect`` to ``effect_until`` (a port whose calls and moves commit on several
        sessions cannot always tell which of the moves made around the call it saw):
        it is judged at the first point of that range where the model explains the
        refusal, and fails only if none does — the harness asks only what the port's
        answers make certain.

        A port on the real clock goes on between commands: an envelope may fall due,
        start or end after the previous answer and before the call reaches the queue.
        Such a port says so with ``effect`` (the observations before the call took
        effect); without it the call is predicted from the previous answer.

        ``answered`` sees the response before any of its observations: what the call
        did where the port alone knows it (whether a ``release`` found its attempt)."""
        self.log.append(command)
        try:
            response = self.driver.call(command)
            problem = shape_problem(command, response)
            if problem is not None:
                raise ProtocolError(bad_answer(self.driver, command, problem))
        except DriverCrashed as exc:
            if self.on_crash is not None:
                self.on_crash(exc, tuple(self.log))
            raise
        if response.get("error") == "DriverError":
            raise Violation("protocol", f"{command['cmd']}: {response.get('message')}")
        if answered is not None:
            self._checked(lambda: answered(response))
        events = response.get("events", [])
        at = int(response.get("at", len(events)))
        effect = int(response.get("effect", 0))
        until = int(response.get("effect_until", effect))
        oracle = self.oracle
        self._observe(events[:effect])
        judged = False
        ranged = until > effect and not response["ok"] and calling is QueueCall.SEND
        if prepare is not None and check is not None and ranged:
            # Judged where the model explains the refusal: each point of the range in
            # turn, the call checked at once (nothing moves between the two). Only a
            # send's prediction leaves nothing behind but what it expects admitted,
            # cleared before the next point's moves are observed.
            while effect < until and not judged:
                prepare()
                try:
                    check(response)
                    judged = True
                except Violation:
                    oracle.admitting = set()
                    self._observe(events[effect : effect + 1])
                    effect += 1
        if prepare is not None and not judged:
            prepare()
        oracle.calling = calling
        try:
            self._observe(events[effect:at])
        finally:
            oracle.calling = None
        if check is not None and not judged:
            self._checked(lambda: check(response))
        self._observe(events[at:])
        return response

    def _observe(self, events: Iterable[Mapping[str, Any]]) -> None:
        for event in events:
            self._checked(functools.partial(self._observe_one, event), resync=event)

    def _observe_one(self, event: Mapping[str, Any]) -> None:
        name = event.get("env")
        if event.get("kind") != "move" and name is not None and name not in self.oracle.tracks:
            raise Violation("protocol", f"{event['kind']} for an envelope never defined: {name!r}")
        self.oracle.observe([event])

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
        """Append a plan to an envelope's script, in the model where the call returned:
        an attempt that began while the port settled after it runs the new plan."""

        def appended(response: dict[str, Any]) -> None:
            self.oracle.plan(name, plan)

        self._call({"cmd": "plan", "env": name, "plan": plan.value}, appended)

    def start(self) -> None:
        """``start()``: armed, a no-op, or the state's error."""
        oracle = self.oracle
        before = oracle.life
        result = start_result(before)

        def prepare() -> None:
            nonlocal before, result
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

        self._call({"cmd": "start"}, check, QueueCall.START, prepare)

    def send(self, names: list[str]) -> None:
        """``send(*names)``: admitted (dedup counted), or refused whole."""
        oracle = self.oracle
        error, reason, fresh = oracle.predict_send(names)
        live_before = len(oracle.live())
        before = oracle.life

        def prepare() -> None:
            nonlocal error, reason, fresh, live_before, before
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

        self._call({"cmd": "send", "envs": names}, check, QueueCall.SEND, prepare)

    def send_wait(self, names: list[str], timeout: float) -> None:
        """``send_wait(*names, timeout)``: admitted, timed out, or refused."""
        oracle = self.oracle
        before = oracle.life
        error: str | None = None
        reason, fresh = "", list[str]()
        expect: str | None = None

        def prepare() -> None:
            nonlocal before, error, reason, fresh, expect
            before = oracle.life
            error, reason, fresh = oracle.predict_send(names)
            expect = None
            if error == "capacity_exceeded":
                error = None
                expect = "capacity_exceeded" if len(fresh) > oracle.config.capacity else "wait"
            waits = error is None and expect != "capacity_exceeded"
            oracle.admitting = set(fresh) if waits else set()

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
            elif got == "type_blacklisted" and (expect == "wait" or self.real_clock):
                # Its type was banned while it waited: refused as send() would be. On
                # the real clock the ban may also have come between the previous answer
                # and the call (an attempt raising StopType meanwhile): the port then
                # refuses at once what the model, a step behind, admitted; the ban is
                # among the observations made until the call returned.
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
        self._call(command, check, QueueCall.SEND, prepare)

    def stop(self, call: StopCall) -> None:
        """``stop(mode, cancel, wait)``: the report, or ``invalid_argument``."""
        oracle = self.oracle
        mode = StopMode(call.mode or oracle.config.stop_mode)
        wait = oracle.config.wait if call.wait is None else call.wait
        before = oracle.life
        command: dict[str, Any] = {
            "cmd": "stop",
            "mode": call.mode,
            "cancel": call.cancel,
            "wait": call.wait,
        }

        def took_effect() -> None:
            nonlocal before
            before = oracle.life

        if call.cancel and mode is StopMode.DRAIN:

            def invalid(response: dict[str, Any]) -> None:
                if response.get("ok") or response.get("error") != "invalid_argument":
                    raise Violation("I7", f"stop(cancel=True) with DRAIN answered {response}")
                if oracle.life is not before:
                    raise Violation("I7", "a refused stop changed the queue")

            self._call(command, invalid, prepare=took_effect)
            return
        if wait and before in (QS.RUNNING, QS.STOPPING):
            command["limit"] = self.guard

        def prepare() -> None:
            took_effect()
            if before is QS.RUNNING:
                oracle.stop_request = mode
                if call.cancel:
                    oracle.request_cancel(CancelCause.STOP)

        def check(response: dict[str, Any]) -> None:
            row = f"LIFECYCLE[{before.name},STOP]"
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

        self._call(command, check, QueueCall.STOP, prepare)

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

        def prepare() -> None:
            nonlocal before
            before = oracle.life
            if before is QS.STOPPING:
                assert oracle.run is not None
                oracle.run.mode = StopMode.STOP
            if before is QS.RUNNING:
                oracle.stop_request = StopMode.STOP
            if before in (QS.RUNNING, QS.STOPPING):
                oracle.request_cancel(CancelCause.TERMINATE)

        def check(response: dict[str, Any]) -> None:
            row = f"LIFECYCLE[{before.name},TERMINATE]"
            oracle.coverage.row(row)
            result = response.get("result")
            if not response.get("ok") or not isinstance(result, dict):
                raise Violation("I5", f"terminate() answered {response}", row)
            if result.get("timed_out"):
                raise Violation("I5", f"terminate() from {before.name} never ended", row)
            oracle.check_handed_back(list(result.get("handed_back", [])), before)

        self._call({"cmd": "terminate", "limit": self.guard}, check, QueueCall.TERMINATE, prepare)

    def lend(self, name: str) -> None:
        """Send an envelope to the second queue: live there, refused here."""
        oracle = self.oracle
        t = oracle.tracks[name]
        live_here = t.state in LIVE

        def prepare() -> None:
            nonlocal live_here
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

        self._call({"cmd": "lend", "env": name}, check, prepare=prepare)

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
        """Let a hanging attempt go on with ``plan``.

        On the real clock the port goes on between commands: an attempt the model still
        sees hanging may already be ending by its deadline, a cancel or (a port with
        leases) a lapsed lease, its end not yet reported. The port's "not hanging" is
        then believed, and the attempt's end must follow; it is a violation only where
        nothing but a release could end the attempt."""
        oracle = self.oracle
        attempt = oracle.tracks[name].attempt
        deadline = oracle.tracks[name].spec.deadline

        def answered(response: dict[str, Any]) -> None:
            if response.get("result") is True:
                oracle.release(name, plan)
                return
            may_end = attempt is not None and (
                deadline > 0 or attempt.cancel_cause is not None or oracle.leases
            )
            if not (self.real_clock and may_end):
                raise Violation("protocol", f"{name} was not hanging")

        self._call({"cmd": "release", "env": name, "plan": plan.value}, answered=answered)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass; then nothing may still wait past its due time (a port
        that runs a schedule late is caught even if it never runs it)."""
        oracle = self.oracle

        def check(response: dict[str, Any]) -> None:
            t = response.get("t")
            oracle.check_due(float(t) if isinstance(t, (int, float)) else None)

        self._call({"cmd": "advance", "seconds": seconds}, check)

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
