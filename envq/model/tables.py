"""Plain dict tables rebuilt from the models by class-level introspection.

The models are python-statemachine classes; these functions read their states,
transitions, events and guard names (never their runtime engine) and return the same
shapes as the runtime tables in ``envq._machine``, so a test can compare them with one
``==``. Guards are evaluated by name on a model instance built for each
:class:`~models.envelope.Context` of :func:`contexts`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, Final

import attrs

from envq._machine import (
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueCall,
    QueueState,
    StopMode,
)
from envq.model.envelope import EVENTS, Context, EnvelopeModel
from envq.model.lifecycle import CALL_EVENTS, LifecycleModel

__all__ = [
    "ENVELOPE_EVENTS",
    "Guard",
    "ModelTransition",
    "contexts",
    "enabled_targets",
    "envelope_moves",
    "envelope_transitions",
    "lifecycle_moves",
    "lifecycle_transitions",
    "outcome_targets",
]

#: Every event of the envelope machine: the queue-side ones, then the outcomes.
ENVELOPE_EVENTS: Final[tuple[EnvEvent | Outcome, ...]] = (*EnvEvent, *Outcome)


@attrs.frozen
class Guard:
    """One guard of a transition: the predicate's name and the value it must return."""

    name: str
    expected: bool

    def __str__(self) -> str:
        return self.name if self.expected else f"!{self.name}"


@attrs.frozen
class ModelTransition:
    """One transition of a model, in the terms of the runtime enums."""

    source: Any
    event: Any
    target: Any
    guards: tuple[Guard, ...] = ()


def _guards(transition: Any) -> tuple[Guard, ...]:
    guards = []
    for spec in transition.cond:
        name = spec.func
        if not (isinstance(name, str) and name.isidentifier()):
            raise TypeError(f"guards must be plain method names, got {name!r}")
        guards.append(Guard(name, spec.expected_value is not False))
    return tuple(guards)


def _transitions(machine: type[Any], events: Mapping[str, Any]) -> Iterator[ModelTransition]:
    for state in machine.states:
        for transition in state.transitions:
            for event in transition.events:
                yield ModelTransition(
                    source=state.value,
                    event=events[str(event)],
                    target=transition.target.value,
                    guards=_guards(transition),
                )


@functools.cache
def lifecycle_transitions() -> tuple[ModelTransition, ...]:
    """Every transition of :class:`LifecycleModel`, events as :class:`QueueCall`."""
    by_name = {name: call for call, name in CALL_EVENTS.items()}
    return tuple(_transitions(LifecycleModel, by_name))


@functools.cache
def envelope_transitions() -> tuple[ModelTransition, ...]:
    """Every transition of :class:`EnvelopeModel`, events as :class:`EnvEvent`/:class:`Outcome`."""
    by_name = {name: event for event, name in EVENTS.items()}
    return tuple(_transitions(EnvelopeModel, by_name))


def lifecycle_moves() -> dict[tuple[QueueState, QueueCall], QueueState]:
    """The lifecycle model as (state, call) → target; a pair without a transition is absent.

    Raises ``ValueError`` if the model has two transitions for one pair or a guard:
    the lifecycle is deterministic and unguarded.
    """
    moves: dict[tuple[QueueState, QueueCall], QueueState] = {}
    for t in lifecycle_transitions():
        key = (t.source, t.event)
        if key in moves or t.guards:
            raise ValueError(f"lifecycle model is not a function at {key}")
        moves[key] = t.target
    return moves


def envelope_moves() -> dict[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]]:
    """The envelope model as a relation (state, event) → every target, guards ignored."""
    moves: dict[tuple[EnvState, EnvEvent | Outcome], set[EnvState]] = {}
    for t in envelope_transitions():
        moves.setdefault((t.source, t.event), set()).add(t.target)
    return {key: frozenset(targets) for key, targets in moves.items()}


def contexts(kinds: tuple[Kind, ...] = tuple(Kind)) -> Iterator[Context]:
    """Every guard context: kind × queue state × wait × decision × cancel cause × stop
    mode × limiter."""
    for kind, queue, wait, decision, cause, mode, limited in itertools.product(
        kinds,
        QueueState,
        (False, True),
        (None, *DecisionKind),
        (None, *CancelCause),
        StopMode,
        (False, True),
    ):
        yield Context(
            kind=kind,
            queue=queue,
            wait=wait,
            decision=decision,
            cause=cause,
            mode=mode,
            limited=limited,
        )


def enabled_targets(
    model: EnvelopeModel, source: EnvState, event: EnvEvent | Outcome
) -> list[EnvState]:
    """The targets of the transitions from ``source`` on ``event`` whose guards all hold.

    Guards are evaluated by name on ``model`` (whose context they read); the model's
    current state does not matter.
    """
    return [
        t.target
        for t in _by_pair().get((source, event), ())
        if all(bool(getattr(model, g.name)()) is g.expected for g in t.guards)
    ]


@functools.cache
def _by_pair() -> dict[tuple[Any, Any], tuple[ModelTransition, ...]]:
    index: dict[tuple[Any, Any], list[ModelTransition]] = {}
    for t in envelope_transitions():
        index.setdefault((t.source, t.event), []).append(t)
    return {pair: tuple(ts) for pair, ts in index.items()}


def outcome_targets() -> dict[tuple[Kind, Outcome], frozenset[EnvState]]:
    """Per (kind, outcome): every state the model lets an attempt's end lead to.

    The union, over every context of that kind, of the enabled transitions from
    RUNNING on the outcome's event — the model's version of ``{row.target} |
    row.redirects`` of the runtime's outcome table.
    """
    table: dict[tuple[Kind, Outcome], set[EnvState]] = {
        (kind, outcome): set() for kind in Kind for outcome in Outcome
    }
    for context in contexts():
        model = EnvelopeModel(context)
        for outcome in Outcome:
            table[(context.kind, outcome)].update(enabled_targets(model, EnvState.RUNNING, outcome))
    return {key: frozenset(targets) for key, targets in table.items()}
