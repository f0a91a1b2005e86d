"""The table row behind each move, named as the source spells it.

A move is (from, to) and, for the end of an attempt, its outcome: the row that decided
it is read back from the tables of :mod:`envq._machine` — ``OUTCOMES[(kind, outcome)]``
for an attempt's end (with the choice table a redirect went through), the one
``QUEUE_MOVES[(state, event)]`` row whose targets hold ``to`` (with its guard's value)
otherwise, ``LIFECYCLE[(state, call)]`` for a queue's move. Nothing here restates a
rule: a name is found by looking the move up. So are the actions a page offers: the
operator's moves an envelope's state has a row for, the lifecycle calls that move a
queue from its state.
"""

from __future__ import annotations

from typing import Final

from envq._machine import (
    DECISION_TARGET,
    FAULT_TARGET,
    LIFECYCLE,
    OPERATOR_EVENTS,
    OUTCOMES,
    PARK_INSTEAD,
    QUEUE_MOVES,
    RELABEL,
    SHELVE_TARGET,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Guard,
    Kind,
    Outcome,
    QueueCall,
    QueueState,
)

__all__ = [
    "envelope_row",
    "event_of",
    "operator_events",
    "queue_calls",
    "queue_row",
    "states_allowing",
]

_UNKNOWN: Final = "(not a row of the tables)"


def event_of(
    from_state: EnvState, to_state: EnvState, known: EnvEvent | None = None
) -> EnvEvent | None:
    """The queue-side event whose row moves ``from_state`` to ``to_state``, if one does:
    ``known`` when the move's record names it and its row allows the move, else the one
    event of the engine's own that does (each pair has at most one: a test checks it),
    else an operator's (a cancel stops what a blacklist would)."""
    if known is not None:
        row = QUEUE_MOVES.get((from_state, known))
        if row is not None and to_state in row.targets.values():
            return known
    found = [
        event
        for (state, event), row in QUEUE_MOVES.items()
        if state is from_state and to_state in row.targets.values()
    ]
    found.sort(key=lambda event: event in OPERATOR_EVENTS)
    return found[0] if found else None


def _guarded(from_state: EnvState, event: EnvEvent, to_state: EnvState) -> str:
    row = QUEUE_MOVES[(from_state, event)]
    name = f"QUEUE_MOVES[({from_state.name}, {event.name})]"
    if row.guard is Guard.NONE:
        return name
    values = [v for v, t in row.targets.items() if t is to_state]
    shown = " or ".join(getattr(v, "name", str(v)) for v in values)
    return f"{name} ({row.guard.name}: {shown})"


def envelope_row(
    from_state: EnvState,
    to_state: EnvState,
    *,
    outcome: Outcome | None = None,
    kind: Kind = Kind.ONE_OFF,
    decision: DecisionKind | None = None,
    cause: CancelCause | None = None,
    event: EnvEvent | None = None,
) -> str:
    """The row that moved an envelope from ``from_state`` to ``to_state``.

    ``outcome``: the attempt's end (from RUNNING), looked up in the row group ``kind``;
    ``decision`` and ``cause``, when known, name the choice table a redirect took;
    ``event``, when known, the queue-side event (an operator's cancel and a blacklist
    both stop an envelope).
    """
    if outcome is not None:
        row = OUTCOMES.get((kind, outcome))
        if row is None:
            return _UNKNOWN
        name = f"OUTCOMES[({kind.name}, {outcome.name})]"
        if to_state is row.target:
            return name
        if decision is not None and DECISION_TARGET[decision] is to_state:
            return f"{name} → DECISION_TARGET[{decision.name}]"
        if cause is not None and SHELVE_TARGET[cause] is to_state:
            return f"{name} → SHELVE_TARGET[{cause.name}]"
        if to_state in PARK_INSTEAD.values():
            return f"{name} → PARK_INSTEAD"
        return f"{name} → {to_state.name}" if to_state in row.redirects else _UNKNOWN
    if from_state is EnvState.RUNNING and to_state is FAULT_TARGET:
        return "FAULT_TARGET"
    found = event_of(from_state, to_state, event)
    return _UNKNOWN if found is None else _guarded(from_state, found, to_state)


def queue_row(from_state: QueueState, to_state: QueueState, call: QueueCall | None) -> str:
    """The lifecycle row that moved a queue (``call`` when known, else the one call
    whose row leads there)."""
    calls = [call] if call is not None else list(QueueCall)
    for each in calls:
        row = LIFECYCLE.get((from_state, each))
        if row is not None and row.target is to_state:
            return f"LIFECYCLE[({from_state.name}, {each.name})]"
    return _UNKNOWN


def operator_events(state: EnvState) -> tuple[EnvEvent, ...]:
    """The operator's moves (``OPERATOR_EVENTS``) the tables allow an envelope in
    ``state``, in :class:`EnvEvent`'s order: each with a ``QUEUE_MOVES`` row from
    ``state``, and for a RUNNING envelope (which keeps running: no row moves it) each
    that relabels its attempt's end (``RELABEL``: a cancel)."""
    return tuple(
        event
        for event in EnvEvent
        if event in OPERATOR_EVENTS
        and ((state, event) in QUEUE_MOVES or (state is EnvState.RUNNING and event in RELABEL))
    )


#: The lifecycle calls a page offers as actions.
_PAGE_CALLS: Final = (QueueCall.STOP, QueueCall.START)


def queue_calls(state: QueueState) -> tuple[QueueCall, ...]:
    """The calls among stop and start whose ``LIFECYCLE`` row moves a queue out of
    ``state`` (a call refused there, or one that leaves it where it is, is not
    offered)."""
    found = []
    for call in _PAGE_CALLS:
        row = LIFECYCLE.get((state, call))
        if row is not None and row.target is not None and row.target is not state:
            found.append(call)
    return tuple(found)


def states_allowing(call: QueueCall) -> tuple[QueueState, ...]:
    """The queue states in which :func:`queue_calls` offers ``call``."""
    return tuple(state for state in QueueState if call in queue_calls(state))
