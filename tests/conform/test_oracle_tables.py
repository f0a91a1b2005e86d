"""The oracle's sets of states and moves are derived from ``envq._machine``'s tables,
and equal the sets it used to spell out by hand (so its checks are unchanged)."""

from __future__ import annotations

import itertools
from types import MappingProxyType

import pytest

from envq import _machine as m
from envq.conform import expected
from envq.conform.oracle import ALLOWED_LIVE, CALL_MOVES, DRAINED_MOVE, LIVE, infer_event

ES = m.EnvState
QS = m.QueueState
EV = m.EnvEvent


def hand_infer_event(frm: m.EnvState, to: m.EnvState) -> m.EnvEvent | None:
    """The oracle's inverse of the envelope moves as it was written by hand."""
    if frm is ES.NEW:
        return EV.SEND
    if to is ES.STOPPED:
        return EV.BLACKLIST
    if frm in (ES.BUFFERED, ES.PARKED) and to in (ES.READY, ES.DELAYED):
        return EV.START
    if (frm, to) == (ES.DELAYED, ES.READY):
        return EV.DUE
    if (frm, to) == (ES.READY, ES.RUNNING):
        return EV.DISPATCH
    if frm in (ES.READY, ES.DELAYED) and to is ES.PARKED:
        return EV.STOP
    if frm in (ES.BUFFERED, ES.PARKED) and to is ES.RETURNED:
        return EV.TERMINATE
    return None


class TestEqualToTheHandWrittenSets:
    def test_live(self) -> None:
        assert LIVE == (ES.BUFFERED, ES.READY, ES.DELAYED, ES.RUNNING, ES.PARKED)

    def test_call_moves(self) -> None:
        assert {
            None: frozenset(),
            m.QueueCall.SEND: frozenset(),
            m.QueueCall.START: frozenset({(QS.INIT, QS.RUNNING), (QS.STOPPED, QS.RUNNING)}),
            m.QueueCall.STOP: frozenset({(QS.RUNNING, QS.STOPPING)}),
            m.QueueCall.TERMINATE: frozenset(
                {(QS.INIT, QS.TERMINATED), (QS.RUNNING, QS.STOPPING), (QS.STOPPED, QS.TERMINATED)}
            ),
        } == CALL_MOVES
        assert DRAINED_MOVE == (QS.STOPPING, QS.STOPPED)

    def test_allowed_live(self) -> None:
        assert {
            QS.INIT: frozenset({ES.BUFFERED}),
            QS.RUNNING: frozenset({ES.READY, ES.DELAYED, ES.RUNNING}),
            QS.STOPPING: frozenset({ES.READY, ES.RUNNING, ES.PARKED}),
            QS.STOPPED: frozenset({ES.PARKED}),
            QS.TERMINATED: frozenset(),
        } == ALLOWED_LIVE

    def test_infer_event_on_every_queue_side_move(self) -> None:
        """Every move of the table is inferred as the hand-written inverse did."""
        moves = [
            (frm, event, to)
            for (frm, event), targets in m.ENVELOPE_MOVES.items()
            if isinstance(event, m.EnvEvent) and event not in m.OPERATOR_EVENTS
            for to in targets
        ]
        assert len(moves) == 17
        for frm, event, to in moves:
            assert infer_event(frm, to) is event is hand_infer_event(frm, to), (frm, to)

    def test_infer_event_elsewhere(self) -> None:
        """A move no row makes has no event now; where the hand-written inverse named one,
        that event's row does not allow the move, so the oracle rejected it then too."""
        for frm, to in itertools.product(ES, ES):
            derived, hand = infer_event(frm, to), hand_infer_event(frm, to)
            if derived is None and hand is not None:
                assert to not in m.ENVELOPE_MOVES.get((frm, hand), frozenset()), (frm, to)
            else:
                assert derived is hand, (frm, to)


class TestFollowsTheTables:
    """A changed table changes the derived sets (they are not copies)."""

    def test_stop_parks_drives_allowed_live(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """If a STOP stop did not park READY envelopes, READY would still be allowed
        while STOPPING, and if DRAIN parked READY too, it would not."""
        parks = dict(m.STOP_PARKS)
        parks[m.StopMode.DRAIN] = frozenset({ES.READY, ES.DELAYED})
        monkeypatch.setattr(expected, "STOP_PARKS", MappingProxyType(parks))
        assert ES.READY not in expected._allowed_live()[QS.STOPPING]

    def test_armed_drives_allowed_live(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(expected, "ARMED", MappingProxyType({False: ES.READY, True: ES.READY}))
        assert expected._allowed_live()[QS.RUNNING] == {ES.READY, ES.RUNNING}

    def test_lifecycle_drives_call_moves(self, monkeypatch: pytest.MonkeyPatch) -> None:
        table = dict(m.LIFECYCLE)
        table[(QS.RUNNING, m.QueueCall.STOP)] = m.LifeRow(m.LifeAction.BEGIN_STOP, QS.STOPPED)
        monkeypatch.setattr(expected, "LIFECYCLE", table)
        assert expected._call_moves(m.QueueCall.STOP) == {(QS.RUNNING, QS.STOPPED)}
        # terminate from RUNNING stops first: it follows the STOP row too
        assert (QS.RUNNING, QS.STOPPED) in expected._call_moves(m.QueueCall.TERMINATE)

    def test_envelope_moves_drive_infer_event(self, monkeypatch: pytest.MonkeyPatch) -> None:
        moves = dict(m.ENVELOPE_MOVES)
        moves[(ES.READY, EV.STOP)] = frozenset({ES.DELAYED})
        monkeypatch.setattr(expected, "ENVELOPE_MOVES", moves)
        assert infer_event(ES.READY, ES.PARKED) is None
        assert infer_event(ES.READY, ES.DELAYED) is EV.STOP
        moves[(ES.READY, EV.DUE)] = frozenset({ES.DELAYED})
        with pytest.raises(AssertionError, match="more than one event"):
            infer_event(ES.READY, ES.DELAYED)
