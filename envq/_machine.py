"""Every state, event and transition of envq, as plain data: lifecycle and outcomes.

Theory of operation
-------------------
envq has two state machines:

* the **queue lifecycle** (:class:`QueueState`): INIT → RUNNING → STOPPING → STOPPED →
  RUNNING … → TERMINATED, driven by the calls ``start``/``send``/``stop``/``terminate``
  and by two internal events: ``DRAINED`` (a stop has nothing left to wait for) and
  ``ABANDON`` (a worker task was cancelled by someone other than envq);
* the **envelope machine** (:class:`EnvState`), one instance per envelope per stay in a
  queue, driven by queue-side events (send, start, due, dispatch, stop, terminate,
  blacklist) and, from RUNNING, by the :class:`Outcome` of the attempt.

This module is the only place that says which move follows which event, guards
included. The queue's lifecycle methods look up ``LIFECYCLE[(state, call)]`` and
perform the named :class:`LifeAction`; each row of ``OUTCOMES[(kind, outcome)]`` is
resolved once per queue into its :class:`Action`, which the worker performs at the end
of every attempt. Where a move depends on more than the pair, the choice is a table
too:

* ``DECISION_TARGET`` — where a failure decision sends the envelope;
* ``SHELVE_TARGET`` — where a cancelled attempt goes, by who cancelled it;
* ``PARK_INSTEAD`` — a move back into the queue while it is not RUNNING parks;
* ``LIMITED`` — a retry the failure limiter makes wait becomes DELAYED;
* ``ARMED`` — an envelope armed (sent to a running queue, or at ``start()``) is READY,
  or DELAYED when it must wait (``delay``, ``not_before``, time left when parked);
* ``STOP_PARKS`` — which states a stop parks, per :class:`StopMode`;
* ``TYPELESS`` — the outcome an envelope without a ``type`` gets instead (its
  ``StopType`` acts as ``StopEnvelope``).

:func:`target` states what these tables mean together: the one state an event leads to
in a :class:`Situation` (the guard valuation). The python-statemachine models in
:mod:`envq.model` are written from the contract and proven equal to it, guards
included, over every (state, event, situation).

What stays code, and nothing else (h11's rule): *performing* a row — running hooks,
computing delays (interval, FIXED_RATE grid, backoff, the limiter's wait), the
bookkeeping of capacity, the ready deque, the delay heap and the stop report — and
*deciding the situation*: the failure decision (``on_failure``'s answer, the ``Retry``
policy), who cancelled an attempt, whether an envelope must wait, whether the limiter
asks it to, and which outcome an attempt ended with (the classification of its
exception, ``envq._attempt``). A pair missing from a table is illegal;
``ILLEGAL_LIFECYCLE`` lists the ones missing on purpose, and a test proves every pair
is one or the other.

``ENVELOPE_MOVES`` is the envelope machine as a relation (state, event) → the states
the event may lead to; the runtime checks every envelope move against it when
``STRICT`` is on. The tables are plain dicts typed ``Mapping`` (read-only to mypy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from envq._errors import EnvqError, QueueNotRunning, QueueStopping, QueueTerminated

#: When True, every envelope move is checked against ``ENVELOPE_MOVES`` (an illegal
#: move raises ``AssertionError``). Off by default (it costs a lookup per move); envq's
#: own test suite turns it on.
STRICT = False

__all__ = [
    "ARMED",
    "DECISION_TARGET",
    "DISPATCHING",
    "ENVELOPE_MOVES",
    "ILLEGAL_LIFECYCLE",
    "LIFECYCLE",
    "LIMITED",
    "LIVE_STATES",
    "OUTCOMES",
    "PARK_INSTEAD",
    "SHELVE_TARGET",
    "STOP_PARKS",
    "TERMINAL_STATES",
    "TYPELESS",
    "Action",
    "CancelCause",
    "DecisionKind",
    "EnvEvent",
    "EnvState",
    "Kind",
    "LifeAction",
    "LifeRow",
    "Outcome",
    "OutcomeRow",
    "QueueCall",
    "QueueState",
    "Situation",
    "StopMode",
    "target",
]


class _Enum(enum.Enum):
    """Enum members hash by identity: the tables and counters are looked up on every
    attempt, and ``Enum.__hash__`` (a Python function hashing the name) is several
    times slower. Members are singletons and compare by identity, so this is sound."""

    __hash__ = object.__hash__


class QueueState(_Enum):
    """The queue's lifecycle state (the docs' Lifecycle page draws the diagram)."""

    INIT = "init"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    TERMINATED = "terminated"


class StopMode(_Enum):
    """How ``stop()`` treats READY envelopes: run them first (DRAIN) or park them (STOP)."""

    #: Ready envelopes run before the stop ends; what they reschedule is parked.
    DRAIN = "drain"
    #: Ready envelopes are parked, not started.
    STOP = "stop"


class QueueCall(_Enum):
    """Events of the lifecycle machine: the public calls, plus the internal DRAINED."""

    START = "start"
    SEND = "send"
    STOP = "stop"
    TERMINATE = "terminate"
    #: Internal: a stop under way has nothing left to wait for.
    DRAINED = "drained"
    #: Internal: a worker task was cancelled by someone other than envq (typically
    #: ``asyncio.run()`` cancelling every task as its loop closes). The queue stops at
    #: once, cancelling and parking everything, so nothing is left RUNNING or lost.
    ABANDON = "abandon"


class EnvState(_Enum):
    """The state of one envelope inside one queue.

    ``NEW`` is the pseudo-state of an envelope not (yet) in the queue; the last four
    are terminal.
    """

    NEW = "new"
    BUFFERED = "buffered"
    READY = "ready"
    DELAYED = "delayed"
    RUNNING = "running"
    PARKED = "parked"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    RETURNED = "returned"


class Outcome(_Enum):
    """How one attempt ended; with the envelope's kind, it picks the row of the outcome table."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    STOP = "stop"
    STOP_TYPE = "stop_type"
    NO_RETRY = "no_retry"
    CANCELLED = "cancelled"


class Kind(_Enum):
    """The row group of the outcome table an envelope's attempt is looked up in.

    ``BLACKLISTED`` is the group of an envelope whose ``type`` was blacklisted while
    its attempt was in flight: whatever the outcome, it ends STOPPED, no hooks.
    """

    ONE_OFF = "one_off"
    PERIODIC = "periodic"
    BLACKLISTED = "blacklisted"


class EnvEvent(_Enum):
    """Queue-side events of the envelope machine (the outcomes are the others)."""

    SEND = "send"
    START = "start"
    DUE = "due"
    DISPATCH = "dispatch"
    STOP = "stop"
    TERMINATE = "terminate"
    BLACKLIST = "blacklist"


class CancelCause(_Enum):
    """Who cancelled an in-flight attempt."""

    STOP = "stop"
    TERMINATE = "terminate"


class DecisionKind(_Enum):
    """What a failure decision asks for."""

    DROP = "drop"
    RETRY_NOW = "retry_now"
    RETRY_AFTER = "retry_after"


# ---------------------------------------------------------------------------------------
# The lifecycle table
# ---------------------------------------------------------------------------------------


class LifeAction(_Enum):
    """What a lifecycle call does; performed by ``Queue`` in one exhaustive ``match``."""

    #: Nothing changes (the call is a no-op in this state).
    NOTHING = "nothing"
    #: Raise the row's error; nothing changes.
    REJECT = "reject"
    #: Keep the envelopes in the pre-start buffer (capacity reserved).
    BUFFER = "buffer"
    #: Admit the envelopes: ready now, or delayed until their first run.
    ADMIT = "admit"
    #: Spawn the workers and arm buffered or parked envelopes.
    ARM = "arm"
    #: Enter STOPPING: park what the mode parks, cancel if asked.
    BEGIN_STOP = "begin_stop"
    #: A stop is under way: wait for it.
    AWAIT_STOP = "await_stop"
    #: The stop has nothing left: make the final report.
    FINISH_STOP = "finish_stop"
    #: Stop in STOP mode, cancelling, then terminate.
    STOP_THEN_TERMINATE = "stop_then_terminate"
    #: A stop is under way: turn it into a cancelling STOP, wait, then terminate.
    ESCALATE_THEN_TERMINATE = "escalate_then_terminate"
    #: A stop is under way: turn it into a cancelling STOP (ready envelopes parked).
    ESCALATE = "escalate"
    #: Hand back every envelope still held and end.
    HAND_BACK = "hand_back"


@attrs.frozen
class LifeRow:
    """One row of the lifecycle table: the action and the state it leads to."""

    action: LifeAction
    #: The state after the call; ``None`` for a rejected call (no change).
    target: QueueState | None
    #: The error a REJECT row raises.
    error: type[EnvqError] | None = None


_S = QueueState
_C = QueueCall
_L = LifeAction

LIFECYCLE: Final[Mapping[tuple[QueueState, QueueCall], LifeRow]] = {
    (_S.INIT, _C.START): LifeRow(_L.ARM, _S.RUNNING),
    (_S.INIT, _C.SEND): LifeRow(_L.BUFFER, _S.INIT),
    (_S.INIT, _C.STOP): LifeRow(_L.NOTHING, _S.INIT),
    (_S.INIT, _C.TERMINATE): LifeRow(_L.HAND_BACK, _S.TERMINATED),
    (_S.RUNNING, _C.START): LifeRow(_L.NOTHING, _S.RUNNING),
    (_S.RUNNING, _C.SEND): LifeRow(_L.ADMIT, _S.RUNNING),
    (_S.RUNNING, _C.STOP): LifeRow(_L.BEGIN_STOP, _S.STOPPING),
    (_S.RUNNING, _C.TERMINATE): LifeRow(_L.STOP_THEN_TERMINATE, _S.TERMINATED),
    (_S.STOPPING, _C.START): LifeRow(_L.REJECT, None, QueueStopping),
    (_S.STOPPING, _C.SEND): LifeRow(_L.REJECT, None, QueueStopping),
    (_S.STOPPING, _C.STOP): LifeRow(_L.AWAIT_STOP, _S.STOPPING),
    (_S.STOPPING, _C.TERMINATE): LifeRow(_L.ESCALATE_THEN_TERMINATE, _S.TERMINATED),
    (_S.STOPPING, _C.DRAINED): LifeRow(_L.FINISH_STOP, _S.STOPPED),
    (_S.RUNNING, _C.ABANDON): LifeRow(_L.BEGIN_STOP, _S.STOPPING),
    (_S.STOPPING, _C.ABANDON): LifeRow(_L.ESCALATE, _S.STOPPING),
    (_S.STOPPED, _C.ABANDON): LifeRow(_L.NOTHING, _S.STOPPED),
    (_S.TERMINATED, _C.ABANDON): LifeRow(_L.NOTHING, _S.TERMINATED),
    (_S.STOPPED, _C.START): LifeRow(_L.ARM, _S.RUNNING),
    (_S.STOPPED, _C.SEND): LifeRow(_L.REJECT, None, QueueNotRunning),
    (_S.STOPPED, _C.STOP): LifeRow(_L.NOTHING, _S.STOPPED),
    (_S.STOPPED, _C.TERMINATE): LifeRow(_L.HAND_BACK, _S.TERMINATED),
    (_S.TERMINATED, _C.START): LifeRow(_L.REJECT, None, QueueTerminated),
    (_S.TERMINATED, _C.SEND): LifeRow(_L.REJECT, None, QueueTerminated),
    (_S.TERMINATED, _C.STOP): LifeRow(_L.NOTHING, _S.TERMINATED),
    (_S.TERMINATED, _C.TERMINATE): LifeRow(_L.NOTHING, _S.TERMINATED),
}

#: (state, call) pairs that can never happen: DRAINED only occurs while STOPPING, and
#: there are no workers to abandon a queue that was never started.
ILLEGAL_LIFECYCLE: Final[frozenset[tuple[QueueState, QueueCall]]] = frozenset(
    {
        (_S.INIT, _C.ABANDON),
        (_S.INIT, _C.DRAINED),
        (_S.RUNNING, _C.DRAINED),
        (_S.STOPPED, _C.DRAINED),
        (_S.TERMINATED, _C.DRAINED),
    }
)

#: Lifecycle states in which workers take READY envelopes.
DISPATCHING: Final[frozenset[QueueState]] = frozenset({_S.RUNNING, _S.STOPPING})

# ---------------------------------------------------------------------------------------
# The envelope machine and the outcome table
# ---------------------------------------------------------------------------------------

_E = EnvState
_O = Outcome

TERMINAL_STATES: Final[frozenset[EnvState]] = frozenset(
    {_E.SUCCEEDED, _E.FAILED, _E.STOPPED, _E.RETURNED}
)
#: States that count against capacity: every non-terminal state inside the queue.
LIVE_STATES: Final[frozenset[EnvState]] = frozenset(
    {_E.BUFFERED, _E.READY, _E.DELAYED, _E.RUNNING, _E.PARKED}
)


class Action(_Enum):
    """What the worker does for an (kind, outcome) row; one exhaustive ``match``."""

    #: Run ``on_success``; end in the row's target.
    SUCCEED = "succeed"
    #: Run ``on_success``; next run after the interval.
    RESCHEDULE = "reschedule"
    #: One-off failure: ``on_failure``'s decision, else the ``Retry`` policy, else drop.
    DECIDE = "decide"
    #: Periodic failure: ``on_failure``'s decision if set, else next run after the interval.
    DECIDE_PERIODIC = "decide_periodic"
    #: ``on_failure`` is called to report; its decision is ignored.
    REPORT_FAILURE = "report_failure"
    #: End without reschedule.
    END = "end"
    #: Blacklist the envelope's type in the queue, stop every live one of it, and end.
    BLACKLIST = "blacklist"
    #: A cancelled attempt: parked by a stop, handed back by terminate.
    SHELVE = "shelve"


@attrs.frozen
class OutcomeRow:
    """One row of the outcome table.

    ``target`` is where the row leads unless the action redirects;
    ``redirects`` are the other states the action may choose (by a decision, the
    cancel's cause, or the queue not running).
    """

    action: Action
    target: EnvState
    redirects: frozenset[EnvState] = frozenset()


def _rows(kind: Kind, rows: Mapping[Outcome, OutcomeRow]) -> dict[tuple[Kind, Outcome], OutcomeRow]:
    return {(kind, outcome): row for outcome, row in rows.items()}


_A = Action
_REQUEUE = frozenset({_E.READY, _E.DELAYED, _E.PARKED})
_COMMON: Final = {
    _O.NO_RETRY: OutcomeRow(_A.REPORT_FAILURE, _E.FAILED),
    _O.STOP: OutcomeRow(_A.END, _E.STOPPED),
    _O.STOP_TYPE: OutcomeRow(_A.BLACKLIST, _E.STOPPED),
    _O.CANCELLED: OutcomeRow(_A.SHELVE, _E.PARKED, frozenset({_E.RETURNED})),
}

OUTCOMES: Final[Mapping[tuple[Kind, Outcome], OutcomeRow]] = {
    **_rows(
        Kind.ONE_OFF,
        {
            _O.OK: OutcomeRow(_A.SUCCEED, _E.SUCCEEDED),
            _O.ERROR: OutcomeRow(_A.DECIDE, _E.FAILED, _REQUEUE),
            _O.TIMEOUT: OutcomeRow(_A.DECIDE, _E.FAILED, _REQUEUE),
            **_COMMON,
        },
    ),
    **_rows(
        Kind.PERIODIC,
        {
            _O.OK: OutcomeRow(_A.RESCHEDULE, _E.DELAYED, frozenset({_E.PARKED})),
            _O.ERROR: OutcomeRow(
                _A.DECIDE_PERIODIC, _E.DELAYED, frozenset({_E.READY, _E.PARKED, _E.FAILED})
            ),
            _O.TIMEOUT: OutcomeRow(
                _A.DECIDE_PERIODIC, _E.DELAYED, frozenset({_E.READY, _E.PARKED, _E.FAILED})
            ),
            **_COMMON,
        },
    ),
    **_rows(Kind.BLACKLISTED, {outcome: OutcomeRow(_A.END, _E.STOPPED) for outcome in _O}),
}

#: Where a failure decision sends the envelope.
DECISION_TARGET: Final[Mapping[DecisionKind, EnvState]] = MappingProxyType(
    {
        DecisionKind.DROP: _E.FAILED,
        DecisionKind.RETRY_NOW: _E.READY,
        DecisionKind.RETRY_AFTER: _E.DELAYED,
    }
)

#: Where a cancelled attempt goes, by who cancelled it.
SHELVE_TARGET: Final[Mapping[CancelCause, EnvState]] = MappingProxyType(
    {CancelCause.STOP: _E.PARKED, CancelCause.TERMINATE: _E.RETURNED}
)

#: What a move back into the queue (reschedule, retry) becomes while the queue is not
#: RUNNING: parked (contract §4, "Decide").
PARK_INSTEAD: Final[Mapping[EnvState, EnvState]] = MappingProxyType(
    {_E.READY: _E.PARKED, _E.DELAYED: _E.PARKED}
)

#: A retry the failure limiter makes wait (``limiter.when(env) > 0``) becomes DELAYED
#: even when the decision was to retry now.
LIMITED: Final[Mapping[EnvState, EnvState]] = MappingProxyType({_E.READY: _E.DELAYED})

#: Where an armed envelope goes: READY, or DELAYED when it must wait first.
ARMED: Final[Mapping[bool, EnvState]] = MappingProxyType({False: _E.READY, True: _E.DELAYED})

#: The states a stop parks (``EnvEvent.STOP``): DELAYED always, READY under STOP mode
#: (under DRAIN, ready envelopes still run).
STOP_PARKS: Final[Mapping[StopMode, frozenset[EnvState]]] = MappingProxyType(
    {
        StopMode.DRAIN: frozenset({_E.DELAYED}),
        StopMode.STOP: frozenset({_E.READY, _E.DELAYED}),
    }
)

#: The outcome an envelope with an empty ``type`` gets instead: a ``StopType`` acts as
#: ``StopEnvelope`` (there is no type to blacklist).
TYPELESS: Final[Mapping[Outcome, Outcome]] = MappingProxyType({_O.STOP_TYPE: _O.STOP})

_ARMED = frozenset({_E.READY, _E.DELAYED})


def _after(outcome: Outcome) -> frozenset[EnvState]:
    targets: set[EnvState] = set()
    for (_kind, out), row in OUTCOMES.items():
        if out is outcome:
            targets |= {row.target, *row.redirects}
    return frozenset(targets)


#: The envelope machine as a relation: (state, event) → the states it may lead to.
#: Events are :class:`EnvEvent` members (queue side) and :class:`Outcome` members
#: (the end of an attempt, from RUNNING).
ENVELOPE_MOVES: Final[Mapping[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]]] = (
    MappingProxyType(
        {
            (_E.NEW, EnvEvent.SEND): frozenset({_E.BUFFERED, *_ARMED}),
            (_E.BUFFERED, EnvEvent.START): _ARMED,
            (_E.PARKED, EnvEvent.START): _ARMED,
            (_E.DELAYED, EnvEvent.DUE): frozenset({_E.READY}),
            (_E.READY, EnvEvent.DISPATCH): frozenset({_E.RUNNING}),
            (_E.READY, EnvEvent.STOP): frozenset({_E.PARKED}),
            (_E.DELAYED, EnvEvent.STOP): frozenset({_E.PARKED}),
            (_E.BUFFERED, EnvEvent.TERMINATE): frozenset({_E.RETURNED}),
            (_E.PARKED, EnvEvent.TERMINATE): frozenset({_E.RETURNED}),
            **{
                (state, EnvEvent.BLACKLIST): frozenset({_E.STOPPED})
                for state in (_E.BUFFERED, _E.READY, _E.DELAYED, _E.PARKED)
            },
            **{(_E.RUNNING, outcome): _after(outcome) for outcome in Outcome},
        }
    )
)


# ---------------------------------------------------------------------------------------
# What the tables mean together
# ---------------------------------------------------------------------------------------


@attrs.frozen
class Situation:
    """The guard valuation of an envelope move: everything besides (state, event) that
    chooses its target.

    ``decision`` is the effective failure decision (``on_failure``'s, else the
    ``Retry`` policy's); ``None`` means there is none and the row's default applies
    (one-off: drop; periodic: the next run after ``interval``).
    """

    #: The row group of the outcome table.
    kind: Kind = Kind.ONE_OFF
    #: The queue's lifecycle state at the move.
    queue: QueueState = QueueState.RUNNING
    #: The envelope must wait before it runs (armed: DELAYED rather than READY).
    wait: bool = False
    decision: DecisionKind | None = None
    #: Who cancelled the attempt in flight.
    cause: CancelCause | None = None
    #: The mode of the stop under way.
    mode: StopMode = StopMode.DRAIN
    #: The failure limiter asks the retry to wait.
    limited: bool = False


_REQUEUE_TARGETS = frozenset({_E.READY, _E.DELAYED, _E.PARKED})


def _put_back(to: EnvState, situation: Situation) -> EnvState:
    """A move back into the queue: limited, then parked while the queue is not RUNNING."""
    if situation.limited:
        to = LIMITED.get(to, to)
    if situation.queue is not QueueState.RUNNING:
        to = PARK_INSTEAD.get(to, to)
    return to


def target(state: EnvState, event: EnvEvent | Outcome, situation: Situation) -> EnvState | None:
    """The state ``event`` leads an envelope in ``state`` to, in ``situation``; None when
    the event does not move it.

    This is what the tables above mean together (the runtime performs the same rows,
    with hooks and delays); ``tests/test_models.py`` proves the models in
    :mod:`envq.model` agree with it for every (state, event, situation).
    """
    if isinstance(event, Outcome):
        if state is not _E.RUNNING:
            return None
        row = OUTCOMES[(situation.kind, event)]
        match row.action:
            case Action.SUCCEED | Action.END | Action.BLACKLIST | Action.REPORT_FAILURE:
                return row.target
            case Action.RESCHEDULE:
                return _put_back(row.target, situation)
            case Action.DECIDE | Action.DECIDE_PERIODIC:
                decision = situation.decision
                to = row.target if decision is None else DECISION_TARGET[decision]
                return _put_back(to, situation) if to in _REQUEUE_TARGETS else to
            case Action.SHELVE:
                cause = situation.cause
                return None if cause is None else SHELVE_TARGET[cause]
            case _:
                raise AssertionError(row.action)
    match event:
        case EnvEvent.SEND if state is _E.NEW:
            buffered = LIFECYCLE[(situation.queue, QueueCall.SEND)].action is LifeAction.BUFFER
            return _E.BUFFERED if buffered else ARMED[situation.wait]
        case EnvEvent.START if state in (_E.BUFFERED, _E.PARKED):
            return ARMED[situation.wait]
        case EnvEvent.DUE if state is _E.DELAYED:
            return _E.READY
        case EnvEvent.DISPATCH if state is _E.READY:
            return _E.RUNNING
        case EnvEvent.STOP if state in STOP_PARKS[situation.mode]:
            return _E.PARKED
        case EnvEvent.TERMINATE if state in (_E.BUFFERED, _E.PARKED):
            return _E.RETURNED
        case EnvEvent.BLACKLIST if state in (_E.BUFFERED, _E.READY, _E.DELAYED, _E.PARKED):
            return _E.STOPPED
        case _:
            return None
