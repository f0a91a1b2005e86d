"""The runtime tables of :mod:`envq._machine` as JSON-able data: the one serialiser.

``envq spec`` prints this data, and ``specs/lifecycle.json`` and
``specs/envelope.json`` (written by ``python -m envq spec --write``) are built from
it, so the printed tables and the committed specs cannot disagree. This module needs
nothing but the engine (no python-statemachine): ``envq spec`` works on a plain
install.

Lists follow the declaration order of the enums (states, calls, kinds, outcomes).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from envq import _machine as m

__all__ = ["choice_maps", "lifecycle_rows", "names", "outcome_rows", "spec_data"]


def names(members: Iterable[Enum]) -> list[str]:
    """The names of ``members``, in the declaration order of their enum."""
    items = list(members)
    if not items:
        return []
    declared = list(type(items[0]))
    return [member.name for member in sorted(items, key=declared.index)]


def lifecycle_rows() -> list[dict[str, Any]]:
    """One entry per (queue state, call), in declaration order: the row's ``action``,
    ``target`` and ``error``, or ``illegal`` (whether the pair is listed as one that
    cannot happen) for a pair missing from ``LIFECYCLE``."""
    rows: list[dict[str, Any]] = []
    for state in m.QueueState:
        for call in m.QueueCall:
            entry: dict[str, Any] = {"state": state.name, "call": call.name}
            row = m.LIFECYCLE.get((state, call))
            if row is None:
                entry["illegal"] = (state, call) in m.ILLEGAL_LIFECYCLE
            else:
                entry["action"] = row.action.name
                entry["target"] = row.target.name if row.target is not None else None
                entry["error"] = row.error.__name__ if row.error is not None else None
            rows.append(entry)
    return rows


def outcome_rows() -> list[dict[str, Any]]:
    """One entry per (kind, outcome) row of ``OUTCOMES``: its ``action``, ``target``
    and the ``redirects`` the action may choose instead."""
    return [
        {
            "kind": kind.name,
            "outcome": outcome.name,
            "action": row.action.name,
            "target": row.target.name,
            "redirects": names(row.redirects),
        }
        for kind in m.Kind
        for outcome in m.Outcome
        if (row := m.OUTCOMES.get((kind, outcome))) is not None
    ]


def choice_maps() -> dict[str, dict[str, str]]:
    """The maps that choose among a row's targets: ``decision_target`` (a failure
    decision), ``shelve_target`` (who cancelled an attempt) and ``park_instead`` (a
    move back into a queue that is not running)."""
    return {
        "decision_target": {d.name: t.name for d, t in m.DECISION_TARGET.items()},
        "shelve_target": {c.name: t.name for c, t in m.SHELVE_TARGET.items()},
        "park_instead": {s.name: t.name for s, t in m.PARK_INSTEAD.items()},
    }


def spec_data() -> dict[str, Any]:
    """What ``envq spec`` prints: ``lifecycle`` (:func:`lifecycle_rows`), ``outcomes``
    (:func:`outcome_rows`) and the :func:`choice_maps`."""
    return {"lifecycle": lifecycle_rows(), "outcomes": outcome_rows(), **choice_maps()}
