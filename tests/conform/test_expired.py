"""An attempt whose lease expired (``expired``): only a port whose store several
processes share reports it, after declaring ``leases``; the oracle decides it as it
decides a TIMEOUT, through the tables. The in-process reference driver never declares
the feature, and nothing the harness generates asks for the outcome."""

from __future__ import annotations

import io
from typing import Any

import pytest

from envq._machine import CancelCause, EnvState, Outcome, QueueState
from envq.conform import strategies
from envq.conform.harness import Harness
from envq.conform.oracle import Oracle, Violation, expected_target
from envq.conform.protocol import (
    EXPIRED_CAUSE,
    FEATURES,
    SHARED_STORE_FEATURES,
    EnvSpec,
    Plan,
    Policy,
)
from envq.conform.reports import report
from envq.conform.runner import Options, run
from envq.conform.scripts import replay
from envq.conform.transport import InProcessDriver
from envq.driver import Session
from tests.conform.faulty_drivers import LeasedTimeouts, Undeclared
from tests.conform.oracles import running_oracle

ES = EnvState


def _hanging(spec: EnvSpec, *, leases: bool = True) -> Oracle:
    """An oracle that has seen a started queue run envelope ``a``, its attempt hanging."""
    return running_oracle(spec, leases=leases)


def _expired(t: float, to: str, cause: str | None = EXPIRED_CAUSE) -> dict[str, Any]:
    return {
        "t": t,
        "kind": "move",
        "env": "a",
        "from": "running",
        "to": to,
        "outcome": "expired",
        "cause": cause,
    }


class TestTheOracle:
    def test_a_one_off_without_a_policy_fails(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG))
        oracle.observe([_expired(1.0, "failed")])
        assert oracle.tracks["a"].state is ES.FAILED
        assert oracle.outcomes[Outcome.EXPIRED] == 1
        assert oracle.coverage.rows["OUTCOMES[ONE_OFF,EXPIRED]"] == 1

    def test_on_failure_decides_with_the_expired_error(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG, policy=Policy.RETRY_AFTER, retry_after=2.0))
        hook = {"t": 1.0, "kind": "on_failure", "env": "a", "error": "expired", "attempt": 1}
        oracle.observe([hook, _expired(1.0, "delayed")])
        assert oracle.tracks["a"].state is ES.DELAYED
        assert oracle.tracks["a"].due == 3.0

    def test_on_failure_must_be_called(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG, policy=Policy.RETRY_AFTER))
        with pytest.raises(Violation, match=r"on_failure \[\], expected \[\('expired', 1\)\]"):
            oracle.observe([_expired(1.0, "delayed")])

    def test_a_periodic_envelope_goes_on_with_its_schedule(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG, interval=10.0))
        oracle.observe([_expired(4.0, "delayed")])
        assert oracle.tracks["a"].due == 14.0

    def test_the_cause_is_expired(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG))
        with pytest.raises(Violation, match="EXPIRED with cause 'timeout', expected 'expired'"):
            oracle.observe([_expired(1.0, "failed", cause="timeout")])

    def test_the_tables_decide_where_it_goes(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG))
        with pytest.raises(Violation, match="EXPIRED led to DELAYED, expected FAILED"):
            oracle.observe([_expired(1.0, "delayed")])

    def test_a_port_without_leases_may_not_report_it(self) -> None:
        oracle = _hanging(EnvSpec(then=Plan.HANG), leases=False)
        with pytest.raises(Violation, match="ended EXPIRED; the port has no leases") as caught:
            oracle.observe([_expired(1.0, "failed")])
        assert caught.value.row == "OUTCOMES[ONE_OFF,EXPIRED]"

    @pytest.mark.parametrize("policy", list(Policy))
    @pytest.mark.parametrize("interval", [0.0, 10.0])
    @pytest.mark.parametrize("queue", [QueueState.RUNNING, QueueState.STOPPING])
    @pytest.mark.parametrize("blacklisted", [False, True])
    def test_decided_as_a_timeout(
        self, policy: Policy, interval: float, queue: QueueState, blacklisted: bool
    ) -> None:
        """Target, delay and failure count as a TIMEOUT's; the hook and cause carry the
        protocol's name for an expired lease instead of ``timeout``."""
        spec = EnvSpec(type="a", interval=interval, policy=policy)
        common: dict[str, Any] = {
            "blacklisted": blacklisted,
            "queue": queue,
            "cancel_cause": None,
            "attempts": 2,
            "failures": 1,
            "sched": 0.0,
            "now": 1.0,
        }
        expired, failures = expected_target(spec, Outcome.EXPIRED, **common)
        timeout, timeout_failures = expected_target(spec, Outcome.TIMEOUT, **common)
        assert (expired.to, expired.delay, failures) == (
            timeout.to,
            timeout.delay,
            timeout_failures,
        )
        renamed = {"timeout": EXPIRED_CAUSE}
        assert expired.cause == renamed.get(str(timeout.cause), timeout.cause)
        if timeout.hook is None:
            assert expired.hook is None
        else:
            assert expired.hook == (renamed.get(timeout.hook[0]), timeout.hook[1])


def test_the_reference_driver_does_not_declare_leases() -> None:
    """An in-process queue holds no leases: the reference driver declares every
    feature but the shared-store ones."""
    session = Session()
    try:
        hello = session.handle({"cmd": "hello", "protocol": 1})["result"]
    finally:
        session.close()
    assert "leases" in SHARED_STORE_FEATURES <= FEATURES.keys()
    assert set(hello["features"]) == FEATURES.keys() - SHARED_STORE_FEATURES


#: A short generated run (deadlines are common: attempts end expired in most examples).
#: Derandomized runs are seeded from the machine's source: enough examples that the
#: EXPIRED rows are reached whatever that seed is, not by the luck of one.
LEASED_RUN = Options(examples=100, steps=30, derandomize=True)


#: A one-off envelope with a Retry policy and a periodic one with on_failure, both
#: hanging until their deadline: with ``LeasedTimeouts`` each attempt ends expired.
SCRIPT: list[dict[str, Any]] = [
    {"cmd": "queue", "workers": 2, "capacity": 0, "stop_mode": "drain", "wait": True},
    {"cmd": "define", "env": "e1", "spec": {"deadline": 5, "policy": "retry", "then": "hang"}},
    {
        "cmd": "define",
        "env": "e2",
        "spec": {"interval": 10, "deadline": 5, "policy": "retry_after", "then": "hang"},
    },
    {"cmd": "start"},
    {"cmd": "send", "envs": ["e1", "e2"]},
    {"cmd": "advance", "seconds": 20},
    {"cmd": "stats"},
    {"cmd": "stop", "mode": None, "cancel": False, "wait": True, "limit": 100},
    {"cmd": "terminate", "limit": 100},
]


def _replayed(cls: type[Session]) -> Harness:
    harness = Harness(InProcessDriver(cls))
    try:
        replay(harness, SCRIPT)
    finally:
        harness.close()
    return harness


class TestThroughTheHarness:
    def test_a_leased_port_conforms_to_a_script(self) -> None:
        """Every check (delays, hooks, causes, counts) holds, in both row groups, for a
        port whose expired leases end the attempts envq ends by a deadline."""
        harness = _replayed(LeasedTimeouts)
        rows = harness.oracle.coverage.rows
        assert rows["OUTCOMES[ONE_OFF,EXPIRED]"] == 3  # the Retry policy's three attempts
        assert rows["OUTCOMES[PERIODIC,EXPIRED]"] >= 2
        assert "OUTCOMES[ONE_OFF,TIMEOUT]" not in rows
        assert harness.oracle.tracks["e1"].state is ES.FAILED

    def test_an_undeclared_expiry_is_a_violation(self) -> None:
        with pytest.raises(Violation, match="the port has no leases"):
            _replayed(Undeclared)

    def test_a_leased_port_conforms_to_generated_runs(self) -> None:
        """The same port through generated runs: no finding, and attempts ended
        expired rather than by a timeout."""
        result = run(lambda: InProcessDriver(LeasedTimeouts), LEASED_RUN)
        assert result.error is None, result.error
        assert result.findings == []
        reached = result.coverage.rows
        assert sum(n for row, n in reached.items() if "EXPIRED]" in row) > 0
        assert not any("TIMEOUT]" in row and row.startswith("OUTCOMES") for row in reached)

    def test_expired_rows_need_leases_in_the_report(self) -> None:
        """For a port without leases the EXPIRED rows are not applicable, whatever
        their row group; with leases they are reached."""
        plain = run(lambda: InProcessDriver(Session), Options(examples=2, steps=5))
        out = io.StringIO()
        report(plain, out)
        lines = [line for line in out.getvalue().splitlines() if "EXPIRED]" in line]
        assert len(lines) == 5, lines  # OUTCOMES x 4 groups, ENVELOPE_MOVES x 1
        assert all("not applicable" in line for line in lines), lines


def test_a_cancel_cause_does_not_matter() -> None:
    """A stop's cancel asked of the attempt before its lease expired: still decided as
    an expired lease (the cancel never reached the attempt), not shelved."""
    oracle = _hanging(EnvSpec(then=Plan.HANG))
    oracle.request_cancel(CancelCause.STOP)
    oracle.observe([_expired(1.0, "failed")])
    assert oracle.tracks["a"].state is ES.FAILED


def test_nothing_is_generated_for_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port that declares the shared-store features is given the same plans, releases
    and envelopes as one that does not: no plan asks for an expired lease."""
    pools: list[dict[str, Any]] = []
    monkeypatch.setattr(strategies, "_env_specs", lambda **kwargs: pools.append(kwargs))
    plain = strategies.Profile(frozenset(FEATURES) - SHARED_STORE_FEATURES)
    shared = strategies.Profile(frozenset(FEATURES))
    assert shared._plans() == plain._plans()
    shared.env_specs()
    plain.env_specs()
    assert pools[0] == pools[1]
    assert "expired" not in {p.value for p in Plan}
