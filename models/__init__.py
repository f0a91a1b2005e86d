"""Formal models of envq: the auditor's entry point.

The python-statemachine models of the contract's two state machines ship inside the
package as :mod:`envq.model` (``pip install envq[conform]`` adds what they need), so
that ``envq conform`` can use them as its oracle; this top-level ``models`` package,
which is not installed, re-exports them for reading and for the repository's scripts
and tests:

* :class:`~envq.model.lifecycle.LifecycleModel` — the queue lifecycle (docs/lifecycle.md);
* :class:`~envq.model.envelope.EnvelopeModel` — one envelope's states and the outcome
  table (docs/outcomes.md).

``tests/model/test_models.py`` proves them equal to the runtime tables in ``envq._machine``,
guards included; ``python -m envq spec --write`` renders them into ``specs/``. See
``docs/model.md``.
"""

from __future__ import annotations

from envq.model import CALL_EVENTS, EVENTS, REJECTED, Context, EnvelopeModel, LifecycleModel

__all__ = ["CALL_EVENTS", "EVENTS", "REJECTED", "Context", "EnvelopeModel", "LifecycleModel"]
