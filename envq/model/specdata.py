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

__all__ = [
    "choice_maps",
    "lifecycle_rows",
    "names",
    "outcome_rows",
    "queue_move_rows",
    "spec_data",
]


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
    """One entry per (kind, outcome) row of ``OUTCOMES``: its ``action``, ``target``,
    the ``redirects`` the action may choose instead, and ``limited`` (whether a move
    back into the queue by the row is a failure retry the failure limiter may delay)."""
    return [
        {
            "kind": kind.name,
            "outcome": outcome.name,
            "action": row.action.name,
            "target": row.target.name,
            "redirects": names(row.redirects),
            "limited": row.limited,
        }
        for kind in m.Kind
        for outcome in m.Outcome
        if (row := m.OUTCOMES.get((kind, outcome))) is not None
    ]


def _key(value: object) -> str:
    if isinstance(value, Enum):
        return value.name
    return "-" if value is None else str(value).lower()


def queue_move_rows() -> list[dict[str, Any]]:
    """One entry per queue-side row of ``QUEUE_MOVES``, in declaration order: its
    ``state``, ``event``, the ``guard`` that chooses its target, and ``targets`` by
    guard value (``-`` for a row without a guard; a value missing means no move)."""
    return [
        {
            "state": state.name,
            "event": event.name,
            "guard": row.guard.name,
            "targets": {_key(value): to.name for value, to in row.targets.items()},
        }
        for (state, event), row in m.QUEUE_MOVES.items()
    ]


def choice_maps() -> dict[str, dict[str, str]]:
    """The maps that choose among a row's targets: ``decision_target`` (a failure
    decision), ``shelve_target`` (who cancelled an attempt) and ``park_instead`` (a
    move back into a queue that is not running)."""
    return {
        "decision_target": {d.name: t.name for d, t in m.DECISION_TARGET.items()},
        "shelve_target": {c.name: t.name for c, t in m.SHELVE_TARGET.items()},
        "park_instead": {s.name: t.name for s, t in m.PARK_INSTEAD.items()},
        "limited_to": {s.name: t.name for s, t in m.LIMITED.items()},
        "kind_of": {_key(periodic): k.name for periodic, k in m.KIND_OF.items()},
    }


def spec_data() -> dict[str, Any]:
    """What ``envq spec`` prints: ``lifecycle`` (:func:`lifecycle_rows`), ``outcomes``
    (:func:`outcome_rows`), ``queue_moves`` (:func:`queue_move_rows`), the
    :func:`choice_maps`, and ``takes_back`` (the queue states a put-back stays in)."""
    return {
        "lifecycle": lifecycle_rows(),
        "outcomes": outcome_rows(),
        "queue_moves": queue_move_rows(),
        **choice_maps(),
        "takes_back": names(m.TAKES_BACK),
    }
