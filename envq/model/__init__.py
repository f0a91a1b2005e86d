"""Formal models of envq: the contract's state machines as python-statemachine classes.

This subpackage needs ``python-statemachine`` (``pip install envq[conform]``); the
engine never imports it. The repository's top-level ``models`` package re-exports it
for auditors.

* :class:`~envq.model.lifecycle.LifecycleModel` — the queue lifecycle;
* :class:`~envq.model.envelope.EnvelopeModel` — one envelope's states and the outcome
  table.

Both are python-statemachine ``StateMachine`` classes written from the contract.
``tests/test_models.py`` proves them equal to the runtime tables in
``envq._machine``; ``scripts/gen_specs.py`` renders them into ``specs/``;
``scripts/explore.py`` checks the runtime tables against the invariants. See
``docs/model.md``.
"""

from __future__ import annotations

from envq.model.envelope import EVENTS, Context, EnvelopeModel
from envq.model.lifecycle import CALL_EVENTS, REJECTED, LifecycleModel

__all__ = ["CALL_EVENTS", "EVENTS", "REJECTED", "Context", "EnvelopeModel", "LifecycleModel"]
