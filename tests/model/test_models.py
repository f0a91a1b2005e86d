"""The python-statemachine models equal the runtime tables of ``envq._machine``.

The models in ``models/`` are written from the contract; the runtime tables are what
the engine looks up. Every test here rebuilds plain dicts from both and compares them
over *every* pair of the product (state × event, kind × outcome), legal and illegal, so
a row added, dropped or changed on either side fails a test. The ``TestCanFail`` class
shows that the comparisons catch a changed runtime row.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from envq._machine import (
    DECISION_TARGET,
    ENVELOPE_MOVES,
    ILLEGAL_LIFECYCLE,
    LIFECYCLE,
    LIVE_STATES,
    OPERATOR_EVENTS,
    OUTCOMES,
    PARK_INSTEAD,
    SHELVE_TARGET,
    TERMINAL_STATES,
    Arrival,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Guard,
    Kind,
    LifeAction,
    LifeRow,
    MoveRow,
    Outcome,
    OutcomeRow,
    QueueCall,
    QueueState,
    StopMode,
)
from envq._machine import (
    target as table_target,
)
from models import CALL_EVENTS, EVENTS, REJECTED, Context, EnvelopeModel, LifecycleModel
from models.tables import (
    ENVELOPE_EVENTS,
    contexts,
    enabled_targets,
    envelope_moves,
    envelope_transitions,
    lifecycle_moves,
    outcome_targets,
)

# The tables and the models are data: the same on every CPython (CI runs this on its
# first only).
pytestmark = pytest.mark.one_python

# A lifecycle pair is one of: ("move", target), ("reject", error class), ("illegal",).
Verdict = tuple[Any, ...]
LIFE_PAIRS = list(itertools.product(QueueState, QueueCall))
ENVELOPE_PAIRS = list(itertools.product(EnvState, ENVELOPE_EVENTS))
OUTCOME_PAIRS = list(itertools.product(Kind, Outcome))


def model_lifecycle_view() -> dict[tuple[QueueState, QueueCall], Verdict]:
    """Every (state, call) as the model and its REJECTED list say."""
    moves = lifecycle_moves()
    view: dict[tuple[QueueState, QueueCall], Verdict] = {}
    for pair in LIFE_PAIRS:
        if pair in moves:
            view[pair] = ("move", moves[pair])
        elif pair in REJECTED:
            view[pair] = ("reject", REJECTED[pair])
        else:
            view[pair] = ("illegal",)
    return view


def runtime_lifecycle_view(
    table: Mapping[tuple[QueueState, QueueCall], LifeRow],
    illegal: frozenset[tuple[QueueState, QueueCall]],
) -> dict[tuple[QueueState, QueueCall], Verdict]:
    """Every (state, call) as the runtime table says; a pair in neither is ``missing``."""
    view: dict[tuple[QueueState, QueueCall], Verdict] = {}
    for pair in LIFE_PAIRS:
        row = table.get(pair)
        if row is not None and pair in illegal:
            view[pair] = ("row and illegal",)
        elif row is None:
            view[pair] = ("illegal",) if pair in illegal else ("missing",)
        elif row.action is LifeAction.REJECT:
            view[pair] = ("reject", row.error) if row.target is None else ("bad reject", row)
        else:
            view[pair] = ("move", row.target) if row.error is None else ("bad move", row)
    return view


def runtime_moves_view(
    moves: Mapping[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]],
) -> dict[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]]:
    """Every (state, event) of the runtime relation; an absent pair has no targets."""
    return {pair: frozenset(moves.get(pair, frozenset())) for pair in ENVELOPE_PAIRS}


def model_moves_view() -> dict[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]]:
    """Every (state, event) of the model's transition relation."""
    moves = envelope_moves()
    return {pair: moves.get(pair, frozenset()) for pair in ENVELOPE_PAIRS}


def runtime_outcomes_view(
    outcomes: Mapping[tuple[Kind, Outcome], OutcomeRow],
) -> dict[tuple[Kind, Outcome], frozenset[EnvState]]:
    """Per (kind, outcome): ``{row.target} | row.redirects``; no row → no targets."""
    view: dict[tuple[Kind, Outcome], frozenset[EnvState]] = {}
    for pair in OUTCOME_PAIRS:
        row = outcomes.get(pair)
        view[pair] = frozenset() if row is None else frozenset({row.target, *row.redirects})
    return view


def diff(left: Mapping[Any, Any], right: Mapping[Any, Any]) -> dict[Any, tuple[Any, Any]]:
    """The keys on which two total tables disagree, with both values."""
    return {
        k: (left.get(k), right.get(k))
        for k in left.keys() | right.keys()
        if left.get(k) != right.get(k)
    }


class TestLifecycle:
    """The lifecycle model equals ``LIFECYCLE`` / ``ILLEGAL_LIFECYCLE``."""

    def test_every_pair_agrees(self) -> None:
        """Each (state, call) is the same move, the same rejection or illegal on both sides."""
        model = model_lifecycle_view()
        runtime = runtime_lifecycle_view(LIFECYCLE, ILLEGAL_LIFECYCLE)
        assert diff(model, runtime) == {}
        assert len(model) == len(QueueState) * len(QueueCall)

    def test_runtime_table_covers_every_pair(self) -> None:
        """Every (state, call) is a row or listed illegal, never both, never neither."""
        for pair in LIFE_PAIRS:
            assert (pair in LIFECYCLE) != (pair in ILLEGAL_LIFECYCLE), pair
        assert set(LIFECYCLE) | ILLEGAL_LIFECYCLE == set(LIFE_PAIRS)

    def test_reject_rows_carry_an_error_and_no_target(self) -> None:
        """A REJECT row names its error and leaves the state alone; other rows name no error."""
        for pair, row in LIFECYCLE.items():
            if row.action is LifeAction.REJECT:
                assert row.target is None, pair
                assert row.error is not None, pair
            else:
                assert row.target is not None, pair
                assert row.error is None, pair

    def test_drained_only_from_stopping(self) -> None:
        """The internal DRAINED event has exactly one transition: STOPPING → STOPPED."""
        drained = {k: v for k, v in lifecycle_moves().items() if k[1] is QueueCall.DRAINED}
        assert drained == {(QueueState.STOPPING, QueueCall.DRAINED): QueueState.STOPPED}

    def test_rejections_are_not_transitions(self) -> None:
        """A rejected pair has no transition in the model (the call changes nothing)."""
        assert not set(REJECTED) & set(lifecycle_moves())

    def test_event_names(self) -> None:
        """Every call has one model event, and the model has no other event."""
        assert set(CALL_EVENTS) == set(QueueCall)
        assert sorted(CALL_EVENTS.values()) == sorted(e.id for e in LifecycleModel.events)

    def test_engine_follows_introspection(self) -> None:
        """python-statemachine's engine takes the transition the introspected table names."""
        for (state, call), target in lifecycle_moves().items():
            machine = LifecycleModel(start_value=state)
            machine.send(CALL_EVENTS[call])
            assert machine.current_state_value is target, (state, call)


class TestEnvelopeMoves:
    """The envelope model's transition relation equals ``ENVELOPE_MOVES``."""

    def test_every_pair_agrees(self) -> None:
        """Each (state, event), legal or not, leads to the same set of states on both sides."""
        assert diff(model_moves_view(), runtime_moves_view(ENVELOPE_MOVES)) == {}

    def test_runtime_relation_is_well_formed(self) -> None:
        """Keys are real pairs, no entry is empty, nothing but an operator's move
        leaves a terminal state, and only a discard leads back to NEW."""
        for (state, event), targets in ENVELOPE_MOVES.items():
            assert (state, event) in ENVELOPE_PAIRS
            assert targets, (state, event)
            assert state not in TERMINAL_STATES or event in OPERATOR_EVENTS, (state, event)
            assert (EnvState.NEW in targets) == (event is EnvEvent.DISCARD), (state, event)
        for event in ENVELOPE_EVENTS:
            assert any(e is event for _, e in ENVELOPE_MOVES), event

    def test_state_partition(self) -> None:
        """NEW, the live states and the terminal states partition EnvState; RETURNED is
        the model's one final state (an operator's move leaves every other terminal
        one)."""
        assert LIVE_STATES | TERMINAL_STATES | {EnvState.NEW} == set(EnvState)
        assert not LIVE_STATES & TERMINAL_STATES
        assert EnvState.NEW not in LIVE_STATES | TERMINAL_STATES
        assert {s.value for s in EnvelopeModel.final_states} == {EnvState.RETURNED}
        assert EnvelopeModel.initial_state.value is EnvState.NEW

    def test_event_names(self) -> None:
        """Every envelope event and outcome has one model event, and there are no others."""
        assert set(EVENTS) == set(ENVELOPE_EVENTS)
        assert sorted(EVENTS.values()) == sorted(e.id for e in EnvelopeModel.events)


class TestOutcomes:
    """The model's guarded transitions from RUNNING equal the outcome table."""

    def test_every_row_agrees(self) -> None:
        """Per (kind, outcome), the targets the model allows are ``{target} | redirects``."""
        assert diff(outcome_targets(), runtime_outcomes_view(OUTCOMES)) == {}

    def test_runtime_table_covers_every_pair(self) -> None:
        """Every (kind, outcome) has a row, and every target and redirect is a real state."""
        assert set(OUTCOMES) == set(OUTCOME_PAIRS)
        for row in OUTCOMES.values():
            assert row.target not in row.redirects
            assert EnvState.NEW not in {row.target, *row.redirects}

    def test_blacklisted_always_stops(self) -> None:
        """An attempt of a blacklisted type ends STOPPED whatever its outcome."""
        targets = outcome_targets()
        for outcome in Outcome:
            assert targets[(Kind.BLACKLISTED, outcome)] == {EnvState.STOPPED}

    def test_model_is_deterministic(self) -> None:
        """In every context at most one transition of an event is enabled from any state.

        From RUNNING exactly one is, except CANCELLED without a cause (cannot happen).
        """
        for context in contexts():
            model = EnvelopeModel(context)
            for state, event in ENVELOPE_PAIRS:
                targets = enabled_targets(model, state, event)
                assert len(targets) <= 1, (context, state, event, targets)
                cause_missing = event is Outcome.CANCELLED and context.cause is None
                if state is EnvState.RUNNING and isinstance(event, Outcome) and not cause_missing:
                    assert len(targets) == 1, (context, event)

    def test_decision_shelve_and_parking_maps(self) -> None:
        """The model's guards agree with DECISION_TARGET, SHELVE_TARGET and the parking map.

        Running queue: a one-off failure goes where the decision says; a cancel goes
        where its cause says; a queue that is not RUNNING parks what would go back.
        """
        for decision, target in DECISION_TARGET.items():
            for outcome in (Outcome.ERROR, Outcome.TIMEOUT):
                model = EnvelopeModel(Context(kind=Kind.ONE_OFF, decision=decision))
                assert enabled_targets(model, EnvState.RUNNING, outcome) == [target]
                for queue in set(QueueState) - {QueueState.RUNNING}:
                    model = EnvelopeModel(
                        Context(kind=Kind.ONE_OFF, decision=decision, queue=queue)
                    )
                    expected = PARK_INSTEAD.get(target, target)
                    assert enabled_targets(model, EnvState.RUNNING, outcome) == [expected]
        for cause, target in SHELVE_TARGET.items():
            for kind in (Kind.ONE_OFF, Kind.PERIODIC):
                model = EnvelopeModel(Context(kind=kind, cause=cause))
                assert enabled_targets(model, EnvState.RUNNING, Outcome.CANCELLED) == [target]
        assert set(DECISION_TARGET) == set(DecisionKind)
        assert set(SHELVE_TARGET) == set(CancelCause)

    def test_engine_follows_the_guards(self) -> None:
        """python-statemachine's engine, sent the outcome, lands where the guards say."""
        for context in contexts(tuple(Kind)):
            if context.wait or context.queue not in (QueueState.RUNNING, QueueState.STOPPING):
                continue
            for outcome in Outcome:
                expected = enabled_targets(EnvelopeModel(context), EnvState.RUNNING, outcome)
                if not expected:
                    continue
                machine = EnvelopeModel(context, start_value=EnvState.RUNNING)
                machine.send(EVENTS[outcome])
                assert [machine.current_state_value] == expected, (context, outcome)

    def test_guarded_events_from_running_only_read_context(self) -> None:
        """Only the moves out of NEW, BUFFERED, PARKED, RUNNING, (the stop mode) READY
        and (an operator's retry, buffered before the first start) FAILED and STOPPED
        are guarded."""
        guarded = {t.source for t in envelope_transitions() if t.guards}
        assert guarded == {
            EnvState.NEW,
            EnvState.BUFFERED,
            EnvState.PARKED,
            EnvState.RUNNING,
            EnvState.FAILED,
            EnvState.STOPPED,
            EnvState.READY,
        }


class TestGuards:
    """Guard by guard: for every (state, event, situation) the model allows exactly the
    one target the runtime tables give (``envq._machine.target``), or none when they
    give none."""

    def test_every_state_event_and_situation_agrees(self) -> None:
        """The model and the tables choose the same single target everywhere."""
        disagreements = []
        for context in contexts():
            model = EnvelopeModel(context)
            for state, event in ENVELOPE_PAIRS:
                expected = table_target(state, event, context)
                got = enabled_targets(model, state, event)
                if got != ([] if expected is None else [expected]):
                    disagreements.append((state.name, event.name, context, got, expected))
        assert disagreements == [], disagreements[:5]

    def test_targets_are_the_relation(self) -> None:
        """Over all situations, the targets of each pair are ``ENVELOPE_MOVES``'s."""
        union: dict[tuple[EnvState, EnvEvent | Outcome], set[EnvState]] = {}
        for context in contexts():
            for state, event in ENVELOPE_PAIRS:
                found = table_target(state, event, context)
                if found is not None:
                    union.setdefault((state, event), set()).add(found)
        assert {pair: frozenset(t) for pair, t in union.items()} == dict(ENVELOPE_MOVES)

    @pytest.mark.parametrize(
        ("table", "key", "value"),
        [
            (
                "QUEUE_MOVES",
                (EnvState.READY, EnvEvent.STOP),
                MoveRow(
                    Guard.MODE, {StopMode.DRAIN: EnvState.PARKED, StopMode.STOP: EnvState.PARKED}
                ),
            ),
            (
                "QUEUE_MOVES",
                (EnvState.BUFFERED, EnvEvent.START),
                MoveRow(Guard.WAIT, {False: EnvState.READY, True: EnvState.READY}),
            ),
            (
                "QUEUE_MOVES",
                (EnvState.NEW, EnvEvent.SEND),
                MoveRow(
                    Guard.ARRIVAL,
                    {
                        Arrival.BUFFER: EnvState.READY,
                        Arrival.NOW: EnvState.READY,
                        Arrival.LATER: EnvState.DELAYED,
                    },
                ),
            ),
            ("LIMITED", EnvState.READY, EnvState.READY),
            ("PARK_INSTEAD", EnvState.DELAYED, EnvState.DELAYED),
            ("DECISION_TARGET", DecisionKind.RETRY_NOW, EnvState.DELAYED),
        ],
    )
    def test_a_changed_guard_table_is_a_disagreement(
        self, monkeypatch: pytest.MonkeyPatch, table: str, key: object, value: object
    ) -> None:
        """The comparison can fail: one changed entry of a guard table makes the tables
        disagree with the model somewhere."""
        import envq._machine as machine  # noqa: PLC0415 - patched below

        monkeypatch.setattr(machine, table, {**getattr(machine, table), key: value})
        found = False
        for context in contexts():
            model = EnvelopeModel(context)
            for state, event in ENVELOPE_PAIRS:
                expected = machine.target(state, event, context)
                if enabled_targets(model, state, event) != ([] if expected is None else [expected]):
                    found = True
                    break
            if found:
                break
        assert found


class TestCanFail:
    """The comparisons above catch a changed runtime row (so a green run means something)."""

    @pytest.mark.parametrize(
        ("pair", "row"),
        [
            (
                (QueueState.STOPPED, QueueCall.START),
                LifeRow(LifeAction.NOTHING, QueueState.STOPPED),
            ),
            ((QueueState.STOPPING, QueueCall.SEND), LifeRow(LifeAction.ADMIT, QueueState.STOPPING)),
            (
                (QueueState.TERMINATED, QueueCall.SEND),
                LifeRow(LifeAction.REJECT, None, REJECTED[(QueueState.STOPPED, QueueCall.SEND)]),
            ),
        ],
    )
    def test_changed_lifecycle_row(self, pair: tuple[QueueState, QueueCall], row: LifeRow) -> None:
        """A lifecycle row with another target, action or error is a difference."""
        table = {**LIFECYCLE, pair: row}
        assert pair in diff(
            model_lifecycle_view(), runtime_lifecycle_view(table, ILLEGAL_LIFECYCLE)
        )

    def test_dropped_lifecycle_row(self) -> None:
        """A row neither present nor listed illegal is a difference."""
        pair = (QueueState.INIT, QueueCall.STOP)
        table = {k: v for k, v in LIFECYCLE.items() if k != pair}
        assert diff(model_lifecycle_view(), runtime_lifecycle_view(table, ILLEGAL_LIFECYCLE)) == {
            pair: (("move", QueueState.INIT), ("missing",))
        }

    def test_changed_move(self) -> None:
        """A move with one target more is a difference."""
        pair = (EnvState.DELAYED, EnvEvent.DUE)
        moves = {**ENVELOPE_MOVES, pair: frozenset({EnvState.READY, EnvState.RUNNING})}
        assert pair in diff(model_moves_view(), runtime_moves_view(moves))

    def test_changed_outcome_row(self) -> None:
        """A periodic OK that forgets to park when the queue is not RUNNING is a difference."""
        pair = (Kind.PERIODIC, Outcome.OK)
        outcomes = {**OUTCOMES, pair: attrs.evolve(OUTCOMES[pair], redirects=frozenset())}
        assert diff(outcome_targets(), runtime_outcomes_view(outcomes)) == {
            pair: (
                frozenset({EnvState.DELAYED, EnvState.PARKED}),
                frozenset({EnvState.DELAYED}),
            )
        }
