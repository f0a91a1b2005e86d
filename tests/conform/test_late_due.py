"""A port whose due moves land after the due time (``late_due``).

On PostgreSQL a delayed envelope's due time is kept in the database and a node's keeper
moves it to ready at its next round, in a statement of its own. A port that declares
``late_due`` with its ``due_latency`` may be that late, and no later; no port may be
early.
"""

from __future__ import annotations

import pytest

from envq._machine import QueueCall
from envq.conform.oracle import Oracle, Violation
from envq.conform.protocol import SHARED_STORE_FEATURES, EnvSpec
from envq.conform.shapes import shape_problem

TOLERANCE = 0.25
DUE = 1.0


def _delayed(latency: float) -> Oracle:
    """An oracle that has seen envelope ``a`` (delay 1) sent to a started queue at 0."""
    oracle = Oracle(tolerance=TOLERANCE)
    oracle.due_latency = latency
    oracle.define("a", EnvSpec(delay=DUE))
    oracle.calling = QueueCall.START
    oracle.observe([{"t": 0.0, "kind": "queue", "from": "init", "to": "running"}])
    oracle.calling = None
    oracle.admitting = {"a"}
    oracle.observe(
        [
            {
                "t": 0.0,
                "kind": "move",
                "env": "a",
                "from": "new",
                "to": "delayed",
                "outcome": None,
                "cause": None,
            }
        ]
    )
    return oracle


def _due_at(oracle: Oracle, t: float) -> None:
    oracle.observe(
        [
            {
                "t": t,
                "kind": "move",
                "env": "a",
                "from": "delayed",
                "to": "ready",
                "outcome": None,
                "cause": None,
            }
        ]
    )


@pytest.mark.parametrize("at", [DUE, DUE + TOLERANCE + 0.15, DUE + TOLERANCE + 0.2])
def test_a_due_move_within_the_latency_conforms(at: float) -> None:
    oracle = _delayed(latency=0.2)
    _due_at(oracle, at)


def test_a_due_move_later_than_the_latency_is_a_violation() -> None:
    oracle = _delayed(latency=0.2)
    with pytest.raises(Violation, match=r"I7.*due at 1, became ready at 1\.5"):
        _due_at(oracle, DUE + TOLERANCE + 0.25)


def test_the_latency_never_allows_an_early_move() -> None:
    oracle = _delayed(latency=5.0)
    with pytest.raises(Violation, match=r"became ready at 0\.7"):
        _due_at(oracle, DUE - TOLERANCE - 0.05)


def test_without_the_feature_a_due_move_is_on_time() -> None:
    oracle = _delayed(latency=0.0)
    with pytest.raises(Violation, match=r"became ready at 1\.4"):
        _due_at(oracle, DUE + TOLERANCE + 0.15)


def test_an_envelope_still_delayed_past_the_latency_is_a_violation() -> None:
    oracle = _delayed(latency=0.2)
    oracle.check_due(DUE + TOLERANCE + 0.15)  # late, within the bound
    with pytest.raises(Violation, match="still DELAYED past their due time"):
        oracle.check_due(DUE + TOLERANCE + 0.25)


def test_only_a_shared_store_declares_it() -> None:
    assert "late_due" in SHARED_STORE_FEATURES


@pytest.mark.parametrize("latency", [-1, "0.1", float("inf"), None])
def test_a_latency_that_is_no_duration_is_a_protocol_error(latency: object) -> None:
    hello = {"ok": True, "result": {"features": ["late_due"], "due_latency": latency}}
    problem = shape_problem({"cmd": "hello"}, hello)
    assert problem is not None
    assert "'result.due_latency'" in problem
