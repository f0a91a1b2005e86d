"""The dashboard's machines and move labels come from the tables: every edge drawn is
a move of ``ENVELOPE_MOVES`` or a row of ``LIFECYCLE`` and every one of those is drawn;
every move is named by a row that holds it."""

from __future__ import annotations

import re

import pytest

from envq._machine import (
    ENVELOPE_MOVES,
    LIFECYCLE,
    OPERATOR_EVENTS,
    OUTCOMES,
    QUEUE_MOVES,
    RELABEL,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueCall,
    QueueState,
)

pytest.importorskip("starlette")

from envq.web._diagram import envelope_diagram, lifecycle_diagram
from envq.web._rows import (
    envelope_row,
    event_of,
    operator_events,
    queue_calls,
    queue_row,
    states_allowing,
)
from envq.web._source import ENVELOPE_ACTIONS


def test_envelope_edges_are_the_moves_of_the_tables() -> None:
    drawn = {(e.source, e.target): set(e.events) for e in envelope_diagram().edges}
    want: dict[tuple[str, str], set[str]] = {}
    for (state, event), targets in ENVELOPE_MOVES.items():
        for to in targets:
            if to is not state:
                want.setdefault((state.name, to.name), set()).add(event.name)
    assert drawn == want
    tables = {(e.source, e.target): e.table for e in envelope_diagram().edges}
    assert tables[("RUNNING", "SUCCEEDED")] == "OUTCOMES"
    assert tables[("DELAYED", "READY")] == "QUEUE_MOVES"
    assert tables[("NEW", "READY")] == "QUEUE_MOVES"


def test_lifecycle_edges_are_the_rows_that_change_the_state() -> None:
    drawn = {(e.source, e.target): set(e.events) for e in lifecycle_diagram().edges}
    want: dict[tuple[str, str], set[str]] = {}
    for (state, call), row in LIFECYCLE.items():
        if row.target is not None and row.target is not state:
            want.setdefault((state.name, row.target.name), set()).add(call.name)
    assert drawn == want


@pytest.mark.parametrize("diagram", [envelope_diagram, lifecycle_diagram])
def test_states_are_placed_apart_and_inside(diagram: object) -> None:
    d = diagram()  # type: ignore[operator]
    names = [n.name for n in d.nodes]
    assert len(names) == len(set(names))
    for a in d.nodes:
        assert a.x >= 0
        assert a.x + a.width <= d.width
        assert a.y >= 0
        assert a.y + a.height <= d.height
        for b in d.nodes:
            if a is not b:
                apart = (
                    a.x + a.width <= b.x
                    or b.x + b.width <= a.x
                    or a.y + a.height <= b.y
                    or b.y + b.height <= a.y
                )
                assert apart, (a.name, b.name)
    for e in d.edges:
        assert re.fullmatch(r"M[-\d.]+,[-\d.]+ Q[-\d.]+,[-\d.]+ [-\d.]+,[-\d.]+", e.path)


def test_each_queue_side_pair_has_one_event() -> None:
    """Each (from, to) of the engine's own events has one event; an operator's move
    that shares a pair with one (a cancel stops what a blacklist would) is named when
    the move's record names it."""
    for (state, event), row in QUEUE_MOVES.items():
        for to in row.targets.values():
            events = [
                ev
                for (s, ev), r in QUEUE_MOVES.items()
                if s is state and to in r.targets.values() and ev not in OPERATOR_EVENTS
            ]
            assert len(events) <= 1, (state, to, events)
            assert event_of(state, to) is (events[0] if events else event), (state, to)
            assert event_of(state, to, event) is event


def _row_of(name: str) -> object:
    """The table entry a label names."""
    found = re.match(r"(QUEUE_MOVES|OUTCOMES)\[\((\w+), (\w+)\)\]", name)
    assert found, name
    if found[1] == "OUTCOMES":
        return OUTCOMES[(Kind[found[2]], Outcome[found[3]])]
    return QUEUE_MOVES[(EnvState[found[2]], EnvEvent[found[3]])]


def test_every_move_is_named_by_a_row_that_holds_it() -> None:
    for (state, event), targets in ENVELOPE_MOVES.items():
        for to in targets:
            if isinstance(event, Outcome):
                names = [
                    envelope_row(state, to, outcome=event, kind=kind, decision=d, cause=c)
                    for kind in Kind
                    for d in (None, *DecisionKind)
                    for c in (None, *CancelCause)
                    if to is OUTCOMES[(kind, event)].target
                    or to in OUTCOMES[(kind, event)].redirects
                ]
                assert names, (state, event, to)
                for name in names:
                    row = _row_of(name)
                    assert row is OUTCOMES[(Kind[name.split("(")[1].split(",")[0]], event)]
                    assert to is row.target or to in row.redirects  # type: ignore[attr-defined]
            else:
                name = envelope_row(state, to, event=event)
                row = _row_of(name)
                assert row is QUEUE_MOVES[(state, event)]
                assert to in row.targets.values()  # type: ignore[attr-defined]


def test_named_rows_say_which_choice_a_redirect_took() -> None:
    r, f, d, p, ret = (
        EnvState.RUNNING,
        EnvState.FAILED,
        EnvState.DELAYED,
        EnvState.PARKED,
        EnvState.RETURNED,
    )
    assert envelope_row(r, f, outcome=Outcome.ERROR) == "OUTCOMES[(ONE_OFF, ERROR)]"
    assert (
        envelope_row(r, d, outcome=Outcome.ERROR, decision=DecisionKind.RETRY_AFTER)
        == "OUTCOMES[(ONE_OFF, ERROR)] → DECISION_TARGET[RETRY_AFTER]"
    )
    assert (
        envelope_row(r, ret, outcome=Outcome.CANCELLED, cause=CancelCause.TERMINATE)
        == "OUTCOMES[(ONE_OFF, CANCELLED)] → SHELVE_TARGET[TERMINATE]"
    )
    assert envelope_row(r, p, outcome=Outcome.CANCELLED) == "OUTCOMES[(ONE_OFF, CANCELLED)]"
    assert envelope_row(EnvState.READY, EnvState.SUCCEEDED) == "(not a row of the tables)"
    assert queue_row(QueueState.RUNNING, QueueState.STOPPING, None) == "LIFECYCLE[(RUNNING, STOP)]"
    assert queue_row(QueueState.INIT, QueueState.STOPPED, None) == "(not a row of the tables)"


def test_the_moves_offered_are_the_operators_rows() -> None:
    """An envelope's page offers each operator's event with a row from its state, and a
    running one's cancel (a relabelling: it keeps running); nothing else."""
    for state in EnvState:
        want = {event for (s, event) in QUEUE_MOVES if s is state and event in OPERATOR_EVENTS}
        if state is EnvState.RUNNING:
            want |= set(RELABEL) & OPERATOR_EVENTS
        assert set(operator_events(state)) == want, state
    # As the tables read today (a change to them shows here first).
    offered = {s.name: [e.name for e in operator_events(s)] for s in EnvState}
    assert offered == {
        "NEW": [],
        "BUFFERED": ["CANCEL"],
        "READY": ["CANCEL"],
        "DELAYED": ["CANCEL"],
        "RUNNING": ["CANCEL"],
        "PARKED": ["CANCEL"],
        "SUCCEEDED": ["DISCARD"],
        "FAILED": ["RETRY", "DISCARD"],
        "STOPPED": ["RETRY", "DISCARD"],
        "RETURNED": [],
    }
    assert set(ENVELOPE_ACTIONS.values()) == OPERATOR_EVENTS


def test_stop_and_start_are_offered_where_their_row_moves_the_queue() -> None:
    for state in QueueState:
        want = [
            call
            for call in (QueueCall.STOP, QueueCall.START)
            if LIFECYCLE[(state, call)].target not in (None, state)
        ]
        assert list(queue_calls(state)) == want, state
    assert states_allowing(QueueCall.STOP) == (QueueState.RUNNING,)
    assert states_allowing(QueueCall.START) == (QueueState.INIT, QueueState.STOPPED)
