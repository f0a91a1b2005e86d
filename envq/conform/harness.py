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

import contextvars
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from envq._machine import CancelCause, EnvState, Outcome, QueueCall, QueueState, StopMode
from envq.conform.oracle import LIVE, Coverage, Oracle, Violation, start_result
from envq.conform.protocol import PROTOCOL, EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.transport import Driver, DriverCrashed, ProtocolError

__all__ = [
    "GUARD_REAL",
    "GUARD_VIRTUAL",
    "REAL_JITTER",
    "Harness",
    "ScriptError",
    "bad_answer",
    "load_script",
    "matches",
    "replay",
    "shape_problem",
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_QUEUE_STATES: Final = frozenset(s.value for s in QueueState)
_ENV_STATES: Final = frozenset(s.value for s in EnvState)
_OUTCOMES: Final = frozenset(o.value for o in Outcome)
_PLANS: Final = frozenset(p.value for p in Plan)


def _field(value: object, field: str, want: str) -> str:
    """What is wrong with ``field``: missing, or ``value`` is not ``want``."""
    return f"field {field!r} is {_json(value)}, not {want}"


def _json(value: object) -> str:
    if value is _MISSING:
        return "missing"
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING: Final = object()

#: The fields each kind of observation has, and what each must be.
_EVENT_FIELDS: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "queue": (("from", "queue state"), ("to", "queue state")),
    "move": (
        ("env", "name"),
        ("from", "envelope state"),
        ("to", "envelope state"),
        ("outcome", "outcome or null"),
        ("cause", "name or null"),
    ),
    "invoke": (("env", "name"), ("plan", "plan")),
    "cancelled": (("env", "name"),),
    "on_failure": (("env", "name"), ("error", "name"), ("attempt", "count")),
    "on_success": (("env", "name"), ("attempt", "count")),
}

_KINDS: Final[Mapping[str, Callable[[object], bool]]] = {
    "queue state": lambda v: v in _QUEUE_STATES,
    "envelope state": lambda v: v in _ENV_STATES,
    "outcome or null": lambda v: v is None or v in _OUTCOMES,
    "name or null": lambda v: v is None or isinstance(v, str),
    "name": lambda v: isinstance(v, str),
    "plan": lambda v: v in _PLANS,
    "count": _is_count,
}


def _event_problem(event: object, where: str) -> str | None:
    if not isinstance(event, dict):
        return _field(event, where, "an object")
    kind = event.get("kind", _MISSING)
    if kind not in _EVENT_FIELDS:
        return _field(kind, f"{where}.kind", f"one of {sorted(_EVENT_FIELDS)}")
    t = event.get("t", _MISSING)
    if not _is_number(t):
        return _field(t, f"{where}.t", "a number")
    for name, want in _EVENT_FIELDS[str(kind)]:
        value = event.get(name, _MISSING)
        if value is _MISSING and want.endswith("or null"):
            continue
        if not _KINDS[want](value):
            return _field(value, f"{where}.{name}", f"a {want}")
    return None


def _counts_problem(value: object, field: str) -> str | None:
    if not isinstance(value, dict) or not all(_is_count(n) for n in value.values()):
        return _field(value, field, "an object of counts")
    return None


def _result_problem(cmd: object, result: object) -> str | None:
    """What is wrong with the ``result`` of a successful ``cmd``, if anything."""
    if cmd == "stats":
        if not isinstance(result, dict):
            return _field(result, "result", "an object")
        state = result.get("state", _MISSING)
        if state not in _QUEUE_STATES:
            return _field(state, "result.state", "a queue state")
        used = result.get("capacity_used", _MISSING)
        if not _is_count(used):
            return _field(used, "result.capacity_used", "a count")
        for name in ("by_state", "outcomes", "rejections"):
            if name in result and (problem := _counts_problem(result[name], f"result.{name}")):
                return problem
        for name in ("in_flight", "dedups"):
            if name in result and not _is_count(result[name]):
                return _field(result[name], f"result.{name}", "a count")
    elif cmd in ("stop", "wait_stopped", "terminate", "hello"):
        if not isinstance(result, dict):
            return _field(result, "result", "an object")
        if cmd == "terminate" and not result.get("timed_out"):
            handed = result.get("handed_back", _MISSING)
            if not isinstance(handed, list) or not all(isinstance(n, str) for n in handed):
                return _field(handed, "result.handed_back", "a list of names")
        if cmd == "hello":
            features = result.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                return _field(features, "result.features", "a list of names")
            if not isinstance(result.get("divergences", []), list):
                return _field(result.get("divergences"), "result.divergences", "a list")
            for name in ("cancel_latency", "due_latency"):
                latency = result.get(name, 0.0)
                if not _is_number(latency) or not 0 <= float(latency) < math.inf:
                    return _field(latency, f"result.{name}", "model seconds, 0 or more")
    elif cmd == "release" and not isinstance(result, bool):
        return _field(result, "result", "true or false")
    elif cmd == "reclaim" and (
        not isinstance(result, list) or not all(isinstance(n, str) for n in result)
    ):
        return _field(result, "result", "a list of names")
    return None


def shape_problem(command: Mapping[str, Any], response: Mapping[str, Any]) -> str | None:
    """What makes ``response`` (to ``command``) break the protocol's shapes: the field
    and what is wrong with it; ``None`` if nothing. The values are not judged here,
    only their form (the oracle judges the values)."""
    ok = response.get("ok", _MISSING)
    if not isinstance(ok, bool):
        return _field(ok, "ok", "true or false")
    if not ok and not isinstance(response.get("error"), str):
        return _field(response.get("error", _MISSING), "error", "a name")
    events = response.get("events", [])
    if not isinstance(events, list):
        return _field(events, "events", "a list")
    for i, event in enumerate(events):
        if problem := _event_problem(event, f"events[{i}]"):
            return problem
    if "at" in response:
        at = response["at"]
        if not _is_count(at) or at > len(events):
            return _field(at, "at", f"a count from 0 to {len(events)} (the events)")
    if "effect" in response:
        effect, at = response["effect"], response.get("at", len(events))
        if not _is_count(effect) or effect > at:
            return _field(effect, "effect", f"a count from 0 to {at} (the events before 'at')")
    if "t" in response and not _is_number(response["t"]):
        return _field(response["t"], "t", "a number")
    if ok and response.get("error") != "DriverError":
        return _result_problem(command.get("cmd"), response.get("result", _MISSING))
    return None


def bad_answer(driver: Driver, command: Mapping[str, Any], problem: str) -> str:
    """A protocol error's message: the command, what is wrong with which field, and
    the driver's line (numbered, when the driver counts its lines)."""
    lines = getattr(driver, "lines", None)
    line = str(getattr(driver, "last_line", ""))
    where = f"line {lines} of the driver's output" if lines else "the driver's answer"
    if len(line) > 300:
        line = line[:297] + "..."
    return f"protocol error: the answer to {command.get('cmd')!r}: {problem}\n  {where}: {line}"


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
        oracle = self.oracle
        self._observe(events[:effect])
        if prepare is not None:
            prepare()
        oracle.calling = calling
        try:
            self._observe(events[effect:at])
        finally:
            oracle.calling = None
        if check is not None:
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
        """Append a plan to an envelope's script."""
        self._call({"cmd": "plan", "env": name, "plan": plan.value})
        self.oracle.plan(name, plan)

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


class ScriptError(ValueError):
    """A saved script that cannot be replayed: not JSON lines, an unknown command, a
    field missing or of the wrong type, an envelope used before it is defined."""


#: Each script command's fields: the field, what it must be, and whether it may be
#: missing.
_SCRIPT_FIELDS: Final[Mapping[str, tuple[tuple[str, str, bool], ...]]] = {
    "hello": (("protocol", "count", True), ("time_scale", "scale", True)),
    "queue": (
        ("workers", "count", True),
        ("capacity", "count", True),
        ("stop_mode", "mode", True),
        ("wait", "bool", True),
    ),
    "define": (("env", "name", False), ("spec", "spec", False)),
    "plan": (("env", "defined", False), ("plan", "plan", False)),
    "start": (),
    "send": (("envs", "defined list", False),),
    "send_wait": (("envs", "defined list", False), ("timeout", "seconds", False)),
    "stop": (
        ("mode", "mode or null", True),
        ("cancel", "bool", True),
        ("wait", "bool or null", True),
    ),
    "wait_stopped": (),
    "terminate": (),
    "lend": (("env", "defined", False),),
    "reclaim": (),
    "release": (("env", "defined", False), ("plan", "plan", False)),
    "advance": (("seconds", "seconds", False),),
    "stats": (),
}


def _script_field_problem(value: object, want: str, defined: set[str]) -> str | None:
    """What is wrong with one field of a script command (``None``: nothing)."""
    names = value if isinstance(value, list) else [value]
    checks: dict[str, Callable[[], bool]] = {
        "count": lambda: _is_count(value),
        "scale": lambda: _is_number(value) and float(value) > 0,  # type: ignore[arg-type]
        "mode": lambda: value in ("drain", "stop"),
        "mode or null": lambda: value is None or value in ("drain", "stop"),
        "bool": lambda: isinstance(value, bool),
        "bool or null": lambda: value is None or isinstance(value, bool),
        "name": lambda: isinstance(value, str),
        "plan": lambda: value in _PLANS,
        "seconds": lambda: _is_number(value) and float(value) >= 0,  # type: ignore[arg-type]
        "spec": lambda: isinstance(value, dict),
        "defined": lambda: isinstance(value, str),
        "defined list": lambda: isinstance(value, list) and all(isinstance(n, str) for n in names),
    }
    descriptions = {
        "count": "a whole number >= 0",
        "scale": "a number > 0",
        "mode": '"drain" or "stop"',
        "mode or null": '"drain", "stop" or null',
        "bool": "true or false",
        "bool or null": "true, false or null",
        "name": "a name",
        "plan": f"one of {sorted(_PLANS)}",
        "seconds": "a finite number >= 0",
        "spec": "an object",
        "defined": "a name",
        "defined list": "a list of names",
    }
    if not checks[want]():
        return f"is {_json(value)}, not {descriptions[want]}"
    if want.startswith("defined"):
        unknown = [n for n in names if n not in defined]
        if unknown:
            return f"names {unknown[0]!r}, which no earlier 'define' defines"
    return None


def load_script(text: str, source: str = "script") -> list[dict[str, Any]]:
    """The commands of a saved script (JSON lines, as ``envq conform`` saves them),
    each checked before anything is sent: a :class:`ScriptError` names the line and
    what is wrong with it. Blank lines are skipped."""
    commands: list[dict[str, Any]] = []
    defined: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"{where}: not JSON ({exc.msg}): {line[:120]!r}") from None
        if not isinstance(command, dict):
            raise ScriptError(f"{where}: a command is a JSON object, got {_json(command)}")
        cmd = command.get("cmd", _MISSING)
        if cmd not in _SCRIPT_FIELDS:
            raise ScriptError(f"{where}: unknown command {_json(cmd)}")
        for field, want, optional in _SCRIPT_FIELDS[str(cmd)]:
            if field not in command:
                if optional:
                    continue
                raise ScriptError(f"{where}: {cmd!r} has no field {field!r}")
            problem = _script_field_problem(command[field], want, defined)
            if problem is not None:
                raise ScriptError(f"{where}: {cmd!r}: field {field!r} {problem}")
        if cmd == "define":
            try:
                EnvSpec.from_json(command["spec"])
            except (TypeError, ValueError) as exc:
                raise ScriptError(f"{where}: 'define': field 'spec': {exc}") from None
            defined.add(command["env"])
        commands.append(command)
    if not any(c["cmd"] != "hello" for c in commands):
        raise ScriptError(f"{source}: no command to replay")
    return commands


def replay(harness: Harness, commands: Iterable[Mapping[str, Any]]) -> None:
    """Play a saved script (a counterexample) through ``harness``: each command is
    checked as when it was first generated. Raises the first violation; a command
    that cannot be played in the state the model is in (a ``release`` of an
    envelope that does not hang) raises :class:`ScriptError`."""
    for number, command in enumerate(commands, 1):
        try:
            _replay_one(harness, command)
        except (Violation, ScriptError):
            raise
        except (KeyError, TypeError, AssertionError, ValueError) as exc:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise ScriptError(f"command {number} ({command.get('cmd')!r}): {what}") from exc


def _replay_one(harness: Harness, command: Mapping[str, Any]) -> None:
    cmd = command.get("cmd")
    if cmd == "hello":
        return
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
        name = str(command["env"])
        if name not in harness.oracle.hanging():
            raise ScriptError(f"release: {name!r} has no hanging attempt in the model")
        harness.release(name, Plan(command["plan"]))
    elif cmd == "advance":
        harness.advance(float(command["seconds"]))
    elif cmd == "stats":
        harness.stats()
    else:
        raise ScriptError(f"a script command envq conform does not know: {cmd!r}")
