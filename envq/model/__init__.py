"""Formal models of envq: the contract's state machines as python-statemachine classes.

The models need ``python-statemachine`` (``pip install envq[conform]``); the engine
never imports them. The repository's top-level ``models`` package re-exports them for
auditors.

* :class:`~envq.model.lifecycle.LifecycleModel` — the queue lifecycle;
* :class:`~envq.model.envelope.EnvelopeModel` — one envelope's states and the outcome
  table.

Both are python-statemachine ``StateMachine`` classes written from the contract.
``tests/model/test_models.py`` proves them equal to the runtime tables in
``envq._machine``. The verification tools live here too, each run by a subcommand of
``python -m envq``:

* :mod:`envq.model.specdata` — the runtime tables as data (``envq spec``; needs only
  the engine);
* :mod:`envq.model.specgen` — ``specs/`` and the generated blocks of ``docs/model.md``
  (``envq spec --write`` / ``--check``);
* :mod:`envq.model.doctables` — the generated tables of ``docs/tables.md``,
  ``docs/lifecycle.md`` and ``docs/outcomes.md`` (written and checked with them);
* :mod:`envq.model.explore` — the exhaustive small-scope explorer (``envq explore``).

See ``docs/model.md``. The names below are imported on first use, so that
:mod:`envq.model.specdata` and :mod:`envq.model.doctables` work without
python-statemachine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envq.model.envelope import EVENTS, Context, EnvelopeModel
    from envq.model.lifecycle import CALL_EVENTS, REJECTED, LifecycleModel

__all__ = ["CALL_EVENTS", "EVENTS", "REJECTED", "Context", "EnvelopeModel", "LifecycleModel"]

_HOME = {
    "CALL_EVENTS": "envq.model.lifecycle",
    "REJECTED": "envq.model.lifecycle",
    "LifecycleModel": "envq.model.lifecycle",
    "EVENTS": "envq.model.envelope",
    "Context": "envq.model.envelope",
    "EnvelopeModel": "envq.model.envelope",
}


def __getattr__(name: str) -> Any:
    """Import a model's name from its module when it is first asked for."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
