"""Oracles set up for a check: a started queue with one envelope's attempt under way."""

from __future__ import annotations

from typing import Any

from envq._machine import QueueCall
from envq.conform.oracle import Oracle
from envq.conform.protocol import EnvSpec


def running_oracle(spec: EnvSpec, *, invoke: str | None = "hang", **options: Any) -> Oracle:
    """An oracle (made with ``options``) that has seen a started queue admit envelope
    ``a`` with ``spec`` at model time 0 and dispatch it; its invoke is observed with
    the plan ``invoke`` too, unless that is None."""
    oracle = Oracle(**options)
    oracle.define("a", spec)
    oracle.calling = QueueCall.START
    oracle.observe([{"t": 0.0, "kind": "queue", "from": "init", "to": "running"}])
    oracle.calling = None
    oracle.admitting = {"a"}
    move = {"t": 0.0, "kind": "move", "env": "a", "outcome": None, "cause": None}
    events: list[dict[str, Any]] = [
        {**move, "from": "new", "to": "ready"},
        {**move, "from": "ready", "to": "running"},
    ]
    if invoke is not None:
        events.append({"t": 0.0, "kind": "invoke", "env": "a", "plan": invoke})
    oracle.observe(events)
    return oracle
