"""A port whose cancels take time to reach an attempt (``late_cancel``).

A stop with cancel on PostgreSQL commits at once but reaches an attempt on another
node at that node's next round; an attempt whose deadline falls in between ends
TIMEOUT. A port that declares ``late_cancel`` with its ``cancel_latency`` has that
window, and no wider one.
"""

from __future__ import annotations

from typing import Any

import pytest

from envq._machine import CancelCause, EnvState, QueueCall
from envq.conform.oracle import Oracle, Violation
from envq.conform.protocol import SHARED_STORE_FEATURES, EnvSpec, Plan, Policy, QueueConfig
from envq.conform.shapes import shape_problem
from tests.conform.oracles import running_oracle

DEADLINE = 1.0


def _hanging_attempt(latency: float) -> Oracle:
    """An oracle that has seen envelope ``a`` (deadline 1, hangs) start at 0."""
    spec = EnvSpec(deadline=DEADLINE, then=Plan.HANG)
    return running_oracle(spec, tolerance=1e-6, cancel_latency=latency)


def _cancel_asked_at(oracle: Oracle, at: float) -> None:
    oracle.now = at
    oracle.request_cancel(CancelCause.STOP)


def _ends(oracle: Oracle, outcome: str, to: str, cause: str) -> None:
    end: dict[str, Any] = {"t": DEADLINE, "kind": "move", "env": "a", "from": "running"}
    oracle.observe(
        [
            {"t": DEADLINE, "kind": "cancelled", "env": "a"},
            {**end, "to": to, "outcome": outcome, "cause": cause},
        ]
    )


def test_a_deadline_inside_the_latency_may_end_the_attempt_timeout() -> None:
    oracle = _hanging_attempt(latency=0.2)
    _cancel_asked_at(oracle, 0.9)
    _ends(oracle, "timeout", "failed", "timeout")
    assert oracle.tracks["a"].state is EnvState.FAILED


def test_inside_the_latency_the_cancel_may_still_win() -> None:
    oracle = _hanging_attempt(latency=0.2)
    _cancel_asked_at(oracle, 0.9)
    _ends(oracle, "cancelled", "parked", "cancelled")
    assert oracle.tracks["a"].state is EnvState.PARKED


def test_a_deadline_after_the_latency_must_not_win() -> None:
    oracle = _hanging_attempt(latency=0.2)
    _cancel_asked_at(oracle, 0.5)
    with pytest.raises(Violation, match="ended TIMEOUT, expected CANCELLED"):
        _ends(oracle, "timeout", "failed", "timeout")


def test_without_the_feature_the_cancel_wins_at_once() -> None:
    oracle = _hanging_attempt(latency=0.0)
    _cancel_asked_at(oracle, 0.99)
    with pytest.raises(Violation, match="ended TIMEOUT, expected CANCELLED"):
        _ends(oracle, "timeout", "failed", "timeout")


def test_only_a_shared_store_declares_it() -> None:
    """The in-process reference declares every feature but those of a shared store."""
    assert "late_cancel" in SHARED_STORE_FEATURES


@pytest.mark.parametrize("latency", [-1, "0.1", float("inf"), None])
def test_a_latency_that_is_no_duration_is_a_protocol_error(latency: object) -> None:
    hello = {"ok": True, "result": {"features": ["late_cancel"], "cancel_latency": latency}}
    problem = shape_problem({"cmd": "hello"}, hello)
    assert problem is not None
    assert "'result.cancel_latency'" in problem


# -- a ban reaching an attempt in another process ---------------------------------------


def _two_of_a_type(latency: float) -> Oracle:
    """``b`` (type t) raises StopType at 1; ``a`` (type t, on_failure drops) fails."""
    oracle = Oracle(tolerance=1e-6, cancel_latency=latency)
    oracle.fresh_queue(QueueConfig(workers=2))
    oracle.define("a", EnvSpec(type="t", policy=Policy.DROP, then=Plan.ERROR))
    oracle.define("b", EnvSpec(type="t", then=Plan.STOP_TYPE))
    oracle.calling = QueueCall.START
    oracle.observe([{"t": 0.0, "kind": "queue", "from": "init", "to": "running"}])
    oracle.calling = None
    oracle.admitting = {"a", "b"}
    for name in ("a", "b"):
        move = {"t": 0.0, "kind": "move", "env": name, "outcome": None, "cause": None}
        oracle.observe(
            [
                {**move, "from": "new", "to": "ready"},
                {**move, "from": "ready", "to": "running"},
            ]
        )
    oracle.observe(
        [
            {"t": 0.0, "kind": "invoke", "env": "b", "plan": "stop_type"},
            {"t": 0.0, "kind": "invoke", "env": "a", "plan": "error"},
            {"t": 0.0, "kind": "on_failure", "env": "a", "error": "error", "attempt": 1},
            {
                "t": 1.0,
                "kind": "move",
                "env": "b",
                "from": "running",
                "to": "stopped",
                "outcome": "stop_type",
                "cause": "stop_type",
            },
        ]
    )
    return oracle


def _a_ends(oracle: Oracle, at: float) -> None:
    end = {"t": at, "kind": "move", "env": "a", "from": "running", "to": "stopped"}
    oracle.observe([{**end, "outcome": "error", "cause": "error"}])


def test_a_hook_decided_before_the_ban_reached_it_is_accepted_inside_the_latency() -> None:
    oracle = _two_of_a_type(latency=0.2)
    _a_ends(oracle, 1.1)
    assert oracle.tracks["a"].state is EnvState.STOPPED


def test_a_hook_called_after_the_latency_is_a_violation() -> None:
    oracle = _two_of_a_type(latency=0.2)
    with pytest.raises(Violation, match="a: on_failure called"):
        _a_ends(oracle, 1.5)


def test_without_the_feature_a_hook_after_the_ban_is_a_violation() -> None:
    oracle = _two_of_a_type(latency=0.0)
    with pytest.raises(Violation, match="a: on_failure called"):
        _a_ends(oracle, 1.0)
