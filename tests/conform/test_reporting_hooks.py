"""The hooks that report an attempt's end: ``on_success`` (the feature ``on_success``)
and the ``on_failure`` of a DoNotRetry (row ``REPORT_FAILURE``).

An attempt that ends OK in a row that reports it calls ``on_success``, and no other
attempt does. In one process a reporting hook is called once, before the move that
ends the attempt; a port whose store several processes share (``leases``) runs it
after the end committed, at most once, and never for an end the store refused (an
attempt that ended ``expired``)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from envq.conform import strategies
from envq.conform.harness import Harness
from envq.conform.oracle import Oracle, Violation
from envq.conform.protocol import FEATURES, SHARED_STORE_FEATURES, EnvSpec, Plan, Policy
from envq.conform.runner import Options, run
from envq.conform.scripts import ScriptError, load_script, replay
from envq.conform.shapes import shape_problem
from envq.conform.transport import InProcessDriver
from envq.driver import Session
from tests.conform.faulty_drivers import LeasedTimeouts
from tests.conform.oracles import running_oracle

HOOKED = EnvSpec(on_success=True)


def _ok(t: float = 0.0, to: str = "succeeded", outcome: str = "ok") -> dict[str, Any]:
    return {
        "t": t,
        "kind": "move",
        "env": "a",
        "from": "running",
        "to": to,
        "outcome": outcome,
        "cause": None if outcome == "ok" else outcome,
    }


def _success(attempt: int = 1, t: float = 0.0) -> dict[str, Any]:
    return {"t": t, "kind": "on_success", "env": "a", "attempt": attempt}


def _running(spec: EnvSpec = HOOKED, invoke: str = "ok", **options: Any) -> Oracle:
    return running_oracle(spec, invoke=invoke, **options)


class TestInOneProcess:
    """A port without ``leases``: exactly once, before the move."""

    def test_called_before_the_move(self) -> None:
        oracle = _running()
        oracle.observe([_success(), _ok()])
        oracle.check_invariants(None)

    @pytest.mark.parametrize("spec", [HOOKED, EnvSpec(interval=10.0, on_success=True)])
    def test_not_called_before_the_move(self, spec: EnvSpec) -> None:
        """Missing, or only after the move: the row that reports it is at stake."""
        oracle = _running(spec)
        to = "delayed" if spec.periodic else "succeeded"
        with pytest.raises(Violation, match="ended OK; on_success was not called") as caught:
            oracle.observe([_ok(to=to), _success()])
        kind = "PERIODIC" if spec.periodic else "ONE_OFF"
        assert (caught.value.check, caught.value.row) == ("I7", f"OUTCOMES[{kind},OK]")

    def test_called_twice(self) -> None:
        oracle = _running()
        with pytest.raises(Violation, match="on_success called 2 times for attempt 1"):
            oracle.observe([_success(), _success(), _ok()])

    def test_not_for_a_failed_attempt(self) -> None:
        oracle = _running(EnvSpec(script=(Plan.ERROR,), on_success=True), invoke="error")
        failed = {**_ok(to="failed", outcome="error"), "cause": "error"}
        with pytest.raises(Violation, match="attempt 1, which ended ERROR") as caught:
            oracle.observe([_success(), failed])
        assert caught.value.row == "OUTCOMES[ONE_OFF,ERROR]"

    def test_not_for_a_blacklisted_type(self) -> None:
        """An attempt whose type was banned while it ran ends in the BLACKLISTED row
        group, whose rows call no hook, even when it returned."""
        oracle = _running(EnvSpec(type="t", on_success=True))
        oracle.blacklist.add("t")
        with pytest.raises(Violation, match="which ended OK") as caught:
            oracle.observe([_success(), _ok(to="stopped")])
        assert caught.value.row == "OUTCOMES[BLACKLISTED,OK]"

    def test_not_for_an_envelope_without_the_hook(self) -> None:
        oracle = _running(EnvSpec())
        with pytest.raises(Violation, match="on_success called; it has none"):
            oracle.observe([_success()])

    def test_not_for_an_attempt_that_never_ran(self) -> None:
        """A call no attempt's end matches, with nothing of the envelope running: the
        invariants catch it (on the virtual clock, at the first check)."""
        oracle = _running()
        oracle.observe([_success(), _ok(), _success(attempt=2)])
        with pytest.raises(Violation, match=r"attempt\(s\) \[2\], and no such attempt ended"):
            oracle.check_invariants(None)


class TestOnASharedStore:
    """A port with ``leases``: at most once, before or after the move, never for an
    end that was not OK in a row that reports it."""

    def test_after_the_move(self) -> None:
        oracle = _running(leases=True)
        oracle.observe([_ok(), _success()])
        oracle.check_invariants(None)

    def test_before_the_move(self) -> None:
        oracle = _running(leases=True)
        oracle.observe([_success(), _ok()])
        oracle.check_invariants(None)

    def test_not_at_all(self) -> None:
        """A node that died between the commit and its hook reports nothing."""
        oracle = _running(leases=True)
        oracle.observe([_ok()])
        oracle.check_invariants(None)

    @pytest.mark.parametrize("before", [True, False])
    def test_twice(self, before: bool) -> None:
        oracle = _running(leases=True)
        events = [_success(), _ok(), _success()] if before else [_ok(), _success(), _success()]
        with pytest.raises(Violation, match="on_success called twice for attempt 1") as caught:
            oracle.observe(events)
        assert caught.value.row == "OUTCOMES[ONE_OFF,OK]"

    def test_not_for_an_expired_attempt(self) -> None:
        """The end a late node reports after another process reaped its attempt."""
        spec = EnvSpec(then=Plan.HANG, on_success=True)
        oracle = _running(spec, invoke="hang", leases=True)
        expired = {**_ok(to="failed", outcome="expired"), "cause": "expired"}
        with pytest.raises(Violation, match="attempt 1, which ended EXPIRED") as caught:
            oracle.observe([expired, _success()])
        assert (caught.value.check, caught.value.row) == ("I7", "OUTCOMES[ONE_OFF,EXPIRED]")

    def test_late_for_an_attempt_after_the_next_began(self) -> None:
        """A periodic envelope's next run may start on another node before this node's
        hook reports the last one: the call names its attempt."""
        oracle = _running(EnvSpec(interval=10.0, on_success=True), leases=True)
        move = {"kind": "move", "env": "a", "outcome": None, "cause": None}
        oracle.observe(
            [
                _ok(to="delayed"),
                {**move, "t": 10.0, "from": "delayed", "to": "ready"},
                {**move, "t": 10.0, "from": "ready", "to": "running"},
                {"t": 10.0, "kind": "invoke", "env": "a", "plan": "ok"},
                _success(attempt=1, t=10.0),
                _success(attempt=2, t=10.0),
                _ok(t=10.0, to="delayed"),
            ]
        )
        with pytest.raises(Violation, match="called twice for attempt 1"):
            oracle.observe([_success(attempt=1, t=10.0)])

    def test_late_from_an_earlier_stay(self) -> None:
        """A call still owed to the attempt of an earlier stay is settled first, even
        once the envelope was sent again and its new first attempt runs."""
        oracle = _running(leases=True)
        move = {"t": 1.0, "kind": "move", "env": "a", "outcome": None, "cause": None}
        oracle.observe([_ok()])
        oracle.admitting = {"a"}
        oracle.observe(
            [
                {**move, "from": "new", "to": "ready"},
                {**move, "from": "ready", "to": "running"},
                {"t": 1.0, "kind": "invoke", "env": "a", "plan": "ok"},
                _success(),
                _ok(t=1.0),
                _success(),
            ]
        )
        oracle.check_invariants(None)
        with pytest.raises(Violation, match="twice"):
            oracle.observe([_success()])

    def test_a_later_batch_on_the_real_clock(self) -> None:
        """An unmatched call is allowed one more check when the port's batches may
        split it from the moves it belongs with (a real clock), and no more."""
        oracle = _running(leases=True)
        oracle.late_batches = 1
        oracle.observe([_ok(), _success(attempt=2)])
        oracle.check_invariants(None)
        with pytest.raises(Violation, match=r"attempt\(s\) \[2\]"):
            oracle.check_invariants(None)

    def test_a_call_for_the_attempt_in_flight_waits_for_its_end(self) -> None:
        oracle = _running(leases=True)
        oracle.observe([_success()])
        oracle.check_invariants(None)
        oracle.check_invariants(None)
        oracle.observe([_ok()])


class TestAReportingOnFailure:
    """DoNotRetry's row reports the failure with ``on_failure`` (its answer ignored)."""

    def _no_retry(self, **options: Any) -> Oracle:
        spec = EnvSpec(script=(Plan.NO_RETRY,), policy=Policy.DROP)
        return running_oracle(spec, invoke="no_retry", **options)

    def _events(self, *, after: bool) -> list[dict[str, Any]]:
        end = {**_ok(to="failed", outcome="no_retry"), "cause": "no_retry"}
        hook = {"t": 0.0, "kind": "on_failure", "env": "a", "error": "no_retry", "attempt": 1}
        return [end, hook] if after else [hook, end]

    @pytest.mark.parametrize("after", [False, True])
    def test_before_or_after_the_move_with_leases(self, after: bool) -> None:
        oracle = self._no_retry(leases=True)
        oracle.observe(self._events(after=after))
        oracle.check_invariants(None)

    def test_not_after_the_move_in_one_process(self) -> None:
        oracle = self._no_retry()
        with pytest.raises(Violation, match=r"on_failure \[\], expected") as caught:
            oracle.observe(self._events(after=True))
        assert caught.value.row == "OUTCOMES[ONE_OFF,NO_RETRY]"

    def test_at_most_once(self) -> None:
        oracle = self._no_retry(leases=True)
        events = self._events(after=True)
        oracle.observe([*events, events[1]])
        with pytest.raises(Violation, match="on_failure calls unaccounted for"):
            oracle.check_invariants(None)

    def test_a_deciding_hook_still_comes_before_the_move(self) -> None:
        """Only a row that reports lets a leased port's hook come late: a decision is
        the end's guard."""
        spec = EnvSpec(script=(Plan.ERROR,), policy=Policy.DROP)
        oracle = running_oracle(spec, invoke="error", leases=True)
        end = {**_ok(to="failed", outcome="error"), "cause": "error"}
        with pytest.raises(Violation, match=r"on_failure \[\], expected"):
            oracle.observe([end])


class _AfterCommit(Session):
    """Each reporting hook (``on_success``, DoNotRetry's ``on_failure``) reported
    after the move that ended its attempt, as the PostgreSQL port reports it (the
    hook runs once the end committed)."""

    def __init__(self, clock: str = "virtual") -> None:
        super().__init__(clock)
        self.held: dict[str, list[tuple[str, dict[str, Any]]]] = {}

    def observe(self, kind: str, **fields: Any) -> None:
        reports = kind == "on_success" or fields.get("error") == "no_retry"
        if kind in ("on_success", "on_failure") and reports:
            self.held.setdefault(fields["env"], []).append((kind, fields))
            return
        super().observe(kind, **fields)
        if kind == "move" and fields.get("outcome"):
            for held, found in self.held.pop(fields["env"], []):
                super().observe(held, **found)


class ReportsAfterCommit(_AfterCommit, LeasedTimeouts):
    """A correct leased port: it reports on_success after the move, and its
    deadlines end attempts ``expired`` (which report no on_success)."""


class ReportsAfterCommitInProcess(_AfterCommit):
    """The same order from a port without ``leases``: wrong."""


#: Derandomized runs are seeded from the machine's source: enough examples that the rows
#: asserted below are reached whatever that seed is.
RUN = Options(examples=100, steps=30, derandomize=True)


class TestThroughTheHarness:
    def test_the_reference_driver_reports_before_the_move(self) -> None:
        """One attempt fails and is retried at once, the second succeeds; then the
        envelope is sent again: envq's hook runs just before each move that ends an
        attempt OK, numbered in the envelope's stay (2, then 1), and the oracle agrees."""
        spec = {"script": ["error"], "policy": "retry_now", "on_success": True}
        script: list[dict[str, Any]] = [
            {"cmd": "queue", "workers": 1},
            {"cmd": "define", "env": "e1", "spec": spec},
            {"cmd": "start"},
            {"cmd": "send", "envs": ["e1"]},
            {"cmd": "stats"},
            {"cmd": "plan", "env": "e1", "plan": "ok"},
            {"cmd": "send", "envs": ["e1"]},
            {"cmd": "stats"},
        ]
        session = Session()
        try:
            events = [ev for command in script for ev in session.handle(command)["events"]]
        finally:
            session.close()
        calls = [i for i, ev in enumerate(events) if ev["kind"] == "on_success"]
        assert [events[i]["attempt"] for i in calls] == [2, 1]
        assert all(events[i + 1]["outcome"] == "ok" for i in calls)
        harness = Harness(InProcessDriver(Session))
        try:
            replay(harness, script)
        finally:
            harness.close()

    def test_a_port_reporting_after_the_commit_conforms_with_leases(self) -> None:
        result = run(lambda: InProcessDriver(ReportsAfterCommit), RUN)
        assert result.error is None, result.error
        assert result.findings == []
        assert result.coverage.rows["OUTCOMES[ONE_OFF,OK]"] > 0
        assert result.coverage.rows["OUTCOMES[ONE_OFF,NO_RETRY]"] > 0

    def test_and_not_without(self) -> None:
        result = run(lambda: InProcessDriver(ReportsAfterCommitInProcess), RUN)
        [finding] = result.findings
        assert finding.check == "I7"
        assert "was not called before" in finding.message or "on_failure []" in finding.message

    def test_the_observation_has_its_fields(self) -> None:
        command = {"cmd": "advance", "seconds": 1}
        event = {"t": 0.0, "kind": "on_success", "env": "e1", "attempt": 1}
        assert shape_problem(command, {"ok": True, "events": [event]}) is None
        del event["attempt"]
        problem = shape_problem(command, {"ok": True, "events": [event]})
        assert problem is not None
        assert "events[0].attempt" in problem


class TestTheSpec:
    def test_sent_only_when_asked_for(self) -> None:
        """A port that does not declare the feature never sees the field."""
        assert "on_success" not in EnvSpec().to_json()
        assert EnvSpec(on_success=True).to_json()["on_success"] is True
        assert EnvSpec.from_json(EnvSpec(on_success=True).to_json()).on_success

    def test_a_script_with_a_wrong_value_is_refused(self) -> None:
        text = '{"cmd": "define", "env": "e1", "spec": {"on_success": "yes"}}\n'
        with pytest.raises(ScriptError, match="field 'spec'"):
            load_script(text)


class TestGeneration:
    def _pool(self, monkeypatch: pytest.MonkeyPatch, features: frozenset[str]) -> list[EnvSpec]:
        fields: list[dict[str, Any]] = []
        monkeypatch.setattr(strategies, "_env_specs", lambda **kwargs: fields.append(kwargs))
        strategies.Profile(features).env_specs()
        return strategies.spec_pool(**fields[0])

    def test_only_for_a_port_that_declares_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """About half the specs have the hook; without the feature none has, and the
        specs are otherwise the same, in the same order (a derandomized run of a port
        that does not declare it draws what it drew before the feature existed)."""
        features = frozenset(FEATURES) - SHARED_STORE_FEATURES
        hooked = self._pool(monkeypatch, features)
        plain = self._pool(monkeypatch, features - {"on_success"})
        assert not any(s.on_success for s in plain)
        assert [attrs.evolve(s, on_success=False) for s in hooked] == plain
        assert 0.4 < sum(s.on_success for s in hooked) / len(hooked) < 0.6
        assert not hooked[0].on_success
