"""Every state, event and transition of envq, as plain data.

Theory of operation
-------------------
envq has two state machines:

* the **queue lifecycle** (:class:`QueueState`): INIT → RUNNING → STOPPING → STOPPED →
  RUNNING … → TERMINATED, driven by the calls ``start``/``send``/``stop``/``terminate``
  and by two internal events: ``DRAINED`` (a stop has nothing left to wait for) and
  ``ABANDON`` (a worker task was cancelled by someone other than envq);
* the **envelope machine** (:class:`EnvState`), one instance per envelope per stay in a
  queue, driven by queue-side events (send, start, due, dispatch, stop, terminate,
  blacklist), by an operator's moves (retry, cancel, discard) and, from RUNNING, by
  the :class:`Outcome` of the attempt.

This module is the only place that says which move follows which event, guards
included; nothing else writes a state it did not look up here (a test walks the source
for it). The queue's lifecycle methods look up ``LIFECYCLE[(state, call)]`` and perform
the named :class:`LifeAction`; the queue-side moves of an envelope are the rows of
``QUEUE_MOVES[(state, event)]``, each choosing its target by a :class:`Guard` whose
value keys the row's ``targets``; each row of ``OUTCOMES[(kind, outcome)]`` is resolved
once per queue into its :class:`Action`, which the worker performs at the end of every
attempt. Where a move depends on more than the pair, the choice is a table too:

* ``DECISION_TARGET`` — where a failure decision sends the envelope;
* ``SHELVE_TARGET`` — where a cancelled attempt goes, by who cancelled it;
* ``LIMITED``, ``TAKES_BACK``, ``PARK_INSTEAD`` — a move back into the queue
  (:func:`put_back`): a retry the failure limiter makes wait becomes DELAYED (for the
  outcome rows flagged ``limited``), and in a queue that does not take envelopes back
  (not RUNNING) it parks;
* ``ARMED`` — the targets of the START rows: READY, or DELAYED when the envelope must
  wait (``delay``, ``not_before``, time left when parked);
* ``KIND_OF`` and ``RELABEL`` — the row group of an envelope's attempts: by whether it
  is periodic, and once its type is blacklisted, or an operator cancels it, while it
  runs;
* ``TYPELESS`` — the outcome an envelope without a ``type`` gets instead (its
  ``StopType`` acts as ``StopEnvelope``);
* ``INITIAL``, ``INITIAL_QUEUE``, ``FAULT_TARGET`` — where an envelope and a queue
  begin, and where an envelope goes when the queue itself fails settling it.

``STOP_PARKS`` and ``ENVELOPE_MOVES`` are derived from the rows. :func:`target` states
what these tables mean together: the one state an event leads to in a
:class:`Situation` (the guard valuation). The python-statemachine models in
:mod:`envq.model` are written independently and proven equal to it, guards included,
over every (state, event, situation).

What stays code, and nothing else (h11's rule):

* *performing* a row — running hooks and stamps, computing delays (interval, the
  FIXED_RATE grid, backoff, the limiter's wait), the bookkeeping of capacity, the
  ready deque, the delay heap, parking times and the stop report;
* *deciding the situation* — the failure decision (``on_failure``'s answer, the
  ``Retry`` policy), who cancelled an attempt, whether an envelope must wait, whether
  the limiter asks it to, how the queue takes a send (:func:`guard_value`), and which
  outcome an attempt ended with (the classification of its exception,
  ``envq._attempt``);
* the meaning of each :class:`Action` and :class:`LifeAction` (one exhaustive
  ``match`` each in the queue, mirrored by :func:`target`).

A pair missing from a table is illegal; ``ILLEGAL_LIFECYCLE`` lists the ones missing on
purpose, and a test proves every pair is one or the other.

``ENVELOPE_MOVES`` is the envelope machine as a relation (state, event) → the states
the event may lead to; the runtime checks every envelope move against it when
``STRICT`` is on. The tables are plain dicts typed ``Mapping`` (read-only to mypy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs

from envq._errors import EnvqError, QueueNotRunning, QueueStopping, QueueTerminated

#: When True, every envelope move is checked against ``ENVELOPE_MOVES`` (an illegal
#: move raises ``AssertionError``). Off by default (it costs a lookup per move); envq's
#: own test suite turns it on.
STRICT = False

__all__ = [
    "ARMED",
    "BROADCASTS",
    "DECISION_TARGET",
    "DISPATCHING",
    "ENVELOPE_MOVES",
    "FAULT_TARGET",
    "ILLEGAL_LIFECYCLE",
    "INITIAL",
    "INITIAL_QUEUE",
    "KIND_OF",
    "LIFECYCLE",
    "LIMITED",
    "LIVE_STATES",
    "OPERATOR_EVENTS",
    "OUTCOMES",
    "PARK_INSTEAD",
    "QUEUE_MOVES",
    "RELABEL",
    "SETTLED",
    "SHELVE_TARGET",
    "STAYING",
    "STOP_PARKS",
    "TAKES_BACK",
    "TERMINAL_STATES",
    "TYPELESS",
    "Action",
    "Arrival",
    "CancelCause",
    "DecisionKind",
    "EnvEvent",
    "EnvState",
    "Guard",
    "Kind",
    "LifeAction",
    "LifeRow",
    "MoveRow",
    "Outcome",
    "OutcomeRow",
    "QueueCall",
    "QueueState",
    "Situation",
    "StopMode",
    "guard_value",
    "moved_by",
    "put_back",
    "queue_move",
    "stop_parks",
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
    #: The attempt's lease expired before it ended (a store shared by several
    #: processes): the node running it died, stalled or lost the store. Never the end
    #: of an attempt in one process, where nothing holds a lease.
    EXPIRED = "expired"


class Kind(_Enum):
    """The row group of the outcome table an envelope's attempt is looked up in.

    ``BLACKLISTED`` is the group of an envelope whose ``type`` was blacklisted while
    its attempt was in flight, ``CANCELLED`` of one an operator cancelled while its
    attempt was in flight: whatever the outcome, it ends STOPPED, no hooks.
    """

    ONE_OFF = "one_off"
    PERIODIC = "periodic"
    BLACKLISTED = "blacklisted"
    CANCELLED = "cancelled"


class EnvEvent(_Enum):
    """Queue-side events of the envelope machine (the outcomes are the others).

    The last three are an operator's moves: ``RETRY`` sends an envelope that ended
    FAILED or STOPPED back into the queue (keeping its story: its attempts, its last
    error); ``CANCEL`` ends a live envelope STOPPED (one whose attempt is in flight is
    asked to stop, and ends STOPPED whatever the attempt's outcome); ``DISCARD``
    removes an ended envelope from the queue's keeping (back to ``NEW``: not in the
    queue)."""

    SEND = "send"
    START = "start"
    DUE = "due"
    DISPATCH = "dispatch"
    STOP = "stop"
    TERMINATE = "terminate"
    BLACKLIST = "blacklist"
    RETRY = "retry"
    CANCEL = "cancel"
    DISCARD = "discard"


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
    """What a lifecycle call does; performed by ``Lifecycle.perform`` in one exhaustive
    ``match``."""

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


#: The envelope events a lifecycle action applies to every live envelope of the queue,
#: in order (each envelope moves where ``QUEUE_MOVES`` leads; one in flight is left to
#: its attempt). Both stores read it: the in-process ``Lifecycle`` and the PostgreSQL
#: store's lifecycle call (which applies each event with ``envq.broadcast``). The
#: two-step actions (``STOP_THEN_TERMINATE``, ``ESCALATE_THEN_TERMINATE``) are not
#: listed: both stores perform them as a stop (``BEGIN_STOP``, ``ESCALATE``), then, once
#: it has ended, the ``HAND_BACK`` of a terminate. Any other action moves no envelope.
BROADCASTS: Final[Mapping[LifeAction, tuple[EnvEvent, ...]]] = MappingProxyType(
    {
        LifeAction.ARM: (EnvEvent.START,),
        LifeAction.BEGIN_STOP: (EnvEvent.STOP,),
        LifeAction.ESCALATE: (EnvEvent.STOP,),
        LifeAction.HAND_BACK: (EnvEvent.TERMINATE,),
    }
)


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

#: Lifecycle actions whose rows leave the queue's state as it is (checked under
#: ``STRICT``: such a row's target must be its own state).
STAYING: Final[frozenset[LifeAction]] = frozenset(
    {_L.NOTHING, _L.BUFFER, _L.ADMIT, _L.AWAIT_STOP, _L.ESCALATE}
)

#: Lifecycle states in which the last stop's report is final (no stop is under way).
SETTLED: Final[frozenset[QueueState]] = frozenset({_S.STOPPED, _S.TERMINATED})

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
    cancel's cause, or the queue not running); ``limited``: a move back into the
    queue by this row is a failure retry, which the queue's failure limiter may make
    wait (``LIMITED``).
    """

    action: Action
    target: EnvState
    redirects: frozenset[EnvState] = frozenset()
    limited: bool = False


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
#: RUNNING: parked.
PARK_INSTEAD: Final[Mapping[EnvState, EnvState]] = MappingProxyType(
    {_E.READY: _E.PARKED, _E.DELAYED: _E.PARKED}
)

#: A retry the failure limiter makes wait (``limiter.when(env) > 0``) becomes DELAYED
#: even when the decision was to retry now.
LIMITED: Final[Mapping[EnvState, EnvState]] = MappingProxyType({_E.READY: _E.DELAYED})


def _rows(kind: Kind, rows: Mapping[Outcome, OutcomeRow]) -> dict[tuple[Kind, Outcome], OutcomeRow]:
    return {(kind, outcome): row for outcome, row in rows.items()}


_A = Action
#: The states a move back into the queue may land in: READY or DELAYED, or parked.
_PUT_BACK: Final = frozenset({*PARK_INSTEAD, *PARK_INSTEAD.values()})
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
            _O.ERROR: OutcomeRow(_A.DECIDE, _E.FAILED, _PUT_BACK, limited=True),
            _O.TIMEOUT: OutcomeRow(_A.DECIDE, _E.FAILED, _PUT_BACK, limited=True),
            _O.EXPIRED: OutcomeRow(_A.DECIDE, _E.FAILED, _PUT_BACK, limited=True),
            **_COMMON,
        },
    ),
    **_rows(
        Kind.PERIODIC,
        {
            _O.OK: OutcomeRow(_A.RESCHEDULE, _E.DELAYED, frozenset({_E.PARKED})),
            _O.ERROR: OutcomeRow(
                _A.DECIDE_PERIODIC,
                _E.DELAYED,
                frozenset({_E.READY, _E.PARKED, _E.FAILED}),
                limited=True,
            ),
            _O.TIMEOUT: OutcomeRow(
                _A.DECIDE_PERIODIC,
                _E.DELAYED,
                frozenset({_E.READY, _E.PARKED, _E.FAILED}),
                limited=True,
            ),
            _O.EXPIRED: OutcomeRow(
                _A.DECIDE_PERIODIC,
                _E.DELAYED,
                frozenset({_E.READY, _E.PARKED, _E.FAILED}),
                limited=True,
            ),
            **_COMMON,
        },
    ),
    **_rows(Kind.BLACKLISTED, {outcome: OutcomeRow(_A.END, _E.STOPPED) for outcome in _O}),
    **_rows(Kind.CANCELLED, {outcome: OutcomeRow(_A.END, _E.STOPPED) for outcome in _O}),
}

#: Where an armed envelope goes: READY, or DELAYED when it must wait first (the
#: targets of both START rows of :data:`QUEUE_MOVES`).
ARMED: Final[Mapping[bool, EnvState]] = MappingProxyType({False: _E.READY, True: _E.DELAYED})

#: The outcome an envelope with an empty ``type`` gets instead: a ``StopType`` acts as
#: ``StopEnvelope`` (there is no type to blacklist).
TYPELESS: Final[Mapping[Outcome, Outcome]] = MappingProxyType({_O.STOP_TYPE: _O.STOP})

#: The queue states in which a move back into the queue (a retry, a periodic
#: reschedule) stays READY or DELAYED; in every other state it parks (``PARK_INSTEAD``).
TAKES_BACK: Final[frozenset[QueueState]] = frozenset({QueueState.RUNNING})

#: The row group an admitted envelope's attempts are looked up in, by whether it is
#: periodic (``interval > 0``).
KIND_OF: Final[Mapping[bool, Kind]] = MappingProxyType({False: Kind.ONE_OFF, True: Kind.PERIODIC})

#: A RUNNING envelope hit by a queue-side event keeps running; its attempt's end is then
#: looked up in this row group instead (a blacklisted type, an operator's cancel: it
#: ends STOPPED, no hooks). A cancel also asks the attempt to stop.
RELABEL: Final[Mapping[EnvEvent, Kind]] = MappingProxyType(
    {EnvEvent.BLACKLIST: Kind.BLACKLISTED, EnvEvent.CANCEL: Kind.CANCELLED}
)

#: The state an envelope enters the queue from (reset at each admission).
INITIAL: Final[EnvState] = _E.NEW
#: The state a queue is made in.
INITIAL_QUEUE: Final[QueueState] = QueueState.INIT
#: Where an envelope goes when the queue itself fails while settling its attempt (an
#: internal error, logged): it ends as a dropped failure would.
FAULT_TARGET: Final[EnvState] = _E.FAILED


class Guard(_Enum):
    """What chooses the target of a queue-side row (:class:`MoveRow`)."""

    #: Nothing: the row has one target, under the key ``None``.
    NONE = "none"
    #: How the queue takes a sent envelope (:class:`Arrival`).
    ARRIVAL = "arrival"
    #: Whether the envelope must wait before it runs (``bool``).
    WAIT = "wait"
    #: The mode of the stop under way (:class:`StopMode`).
    MODE = "mode"


class Arrival(_Enum):
    """How the queue takes an envelope sent to it."""

    #: Held in the pre-start buffer (the queue was never started).
    BUFFER = "buffer"
    #: Admitted, and may run at once.
    NOW = "now"
    #: Admitted, and must wait first (``delay``, ``not_before``).
    LATER = "later"


@attrs.frozen
class MoveRow:
    """One queue-side row of the envelope machine: the state the event leads to, by the
    value of the row's guard. A value missing from ``targets`` means the event leaves
    the envelope where it is (a DRAIN stop does not park READY envelopes)."""

    guard: Guard
    targets: Mapping[Any, EnvState]


def _one(to: EnvState) -> MoveRow:
    return MoveRow(Guard.NONE, MappingProxyType({None: to}))


_EV = EnvEvent

#: The queue-side moves of the envelope machine, guards as data (the outcome side is
#: ``OUTCOMES``). The runtime resolves each row once per queue.
QUEUE_MOVES: Final[Mapping[tuple[EnvState, EnvEvent], MoveRow]] = {
    (_E.NEW, _EV.SEND): MoveRow(
        Guard.ARRIVAL,
        MappingProxyType(
            {Arrival.BUFFER: _E.BUFFERED, Arrival.NOW: _E.READY, Arrival.LATER: _E.DELAYED}
        ),
    ),
    (_E.BUFFERED, _EV.START): MoveRow(Guard.WAIT, ARMED),
    (_E.PARKED, _EV.START): MoveRow(Guard.WAIT, ARMED),
    (_E.DELAYED, _EV.DUE): _one(_E.READY),
    (_E.READY, _EV.DISPATCH): _one(_E.RUNNING),
    # Under DRAIN ready envelopes still run; every stop parks what waits for its time.
    (_E.READY, _EV.STOP): MoveRow(Guard.MODE, MappingProxyType({StopMode.STOP: _E.PARKED})),
    (_E.DELAYED, _EV.STOP): MoveRow(
        Guard.MODE, MappingProxyType({StopMode.DRAIN: _E.PARKED, StopMode.STOP: _E.PARKED})
    ),
    (_E.BUFFERED, _EV.TERMINATE): _one(_E.RETURNED),
    (_E.PARKED, _EV.TERMINATE): _one(_E.RETURNED),
    **{
        (state, _EV.BLACKLIST): _one(_E.STOPPED)
        for state in (_E.BUFFERED, _E.READY, _E.DELAYED, _E.PARKED)
    },
    # An operator's moves. A retried envelope is taken as a sent one is (buffered
    # before the first start), and never waits: it ran before.
    **{
        (state, _EV.RETRY): MoveRow(
            Guard.ARRIVAL,
            MappingProxyType(
                {Arrival.BUFFER: _E.BUFFERED, Arrival.NOW: _E.READY, Arrival.LATER: _E.READY}
            ),
        )
        for state in (_E.FAILED, _E.STOPPED)
    },
    **{
        (state, _EV.CANCEL): _one(_E.STOPPED)
        for state in (_E.BUFFERED, _E.READY, _E.DELAYED, _E.PARKED)
    },
    # A RETURNED envelope is the user's again (handed back by ``terminate()``): no
    # queue keeps it to discard.
    **{(state, _EV.DISCARD): _one(_E.NEW) for state in (_E.SUCCEEDED, _E.FAILED, _E.STOPPED)},
}


#: The events only an operator causes (``retry``, ``cancel``, ``discard``): the only
#: ones that leave a terminal state, and ``DISCARD`` the only one that leads back to
#: ``NEW`` (out of the queue's keeping).
OPERATOR_EVENTS: Final[frozenset[EnvEvent]] = frozenset(
    {EnvEvent.RETRY, EnvEvent.CANCEL, EnvEvent.DISCARD}
)


def queue_move(state: EnvState, event: EnvEvent, value: object = None) -> EnvState | None:
    """The target of ``QUEUE_MOVES[(state, event)]`` for guard value ``value``; None when
    the event does not move an envelope in ``state``."""
    row = QUEUE_MOVES.get((state, event))
    return None if row is None else row.targets.get(value)


def moved_by(event: EnvEvent) -> frozenset[EnvState]:
    """The states a queue-side ``event`` has a row for in ``QUEUE_MOVES`` (a start: the
    buffered and parked envelopes it arms, each with the wait it had left)."""
    return frozenset(state for (state, ev) in QUEUE_MOVES if ev is event)


def stop_parks(mode: StopMode) -> frozenset[EnvState]:
    """The states a stop in ``mode`` parks, read off the STOP rows of ``QUEUE_MOVES``."""
    return frozenset(
        state
        for (state, event), row in QUEUE_MOVES.items()
        if event is EnvEvent.STOP and mode in row.targets
    )


#: The states a stop parks, per :class:`StopMode` (derived from ``QUEUE_MOVES``):
#: DELAYED always, READY under STOP mode (under DRAIN, ready envelopes still run).
STOP_PARKS: Final[Mapping[StopMode, frozenset[EnvState]]] = MappingProxyType(
    {mode: stop_parks(mode) for mode in StopMode}
)


def put_back(to: EnvState, *, limited: bool, queue: QueueState) -> EnvState:
    """Where a move back into the queue (``to``: READY or DELAYED) lands: DELAYED when
    the failure limiter makes a READY retry wait (``LIMITED``), parked while the queue
    does not take envelopes back (``TAKES_BACK``, ``PARK_INSTEAD``)."""
    if limited:
        to = LIMITED.get(to, to)
    if queue not in TAKES_BACK:
        to = PARK_INSTEAD.get(to, to)
    return to


def _after(outcome: Outcome) -> frozenset[EnvState]:
    targets: set[EnvState] = set()
    for (_kind, out), row in OUTCOMES.items():
        if out is outcome:
            targets |= {row.target, *row.redirects}
    return frozenset(targets)


#: The envelope machine as a relation: (state, event) → the states it may lead to.
#: Events are :class:`EnvEvent` members (queue side, the targets of ``QUEUE_MOVES``)
#: and :class:`Outcome` members (the end of an attempt, from RUNNING).
ENVELOPE_MOVES: Final[Mapping[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]]] = (
    MappingProxyType(
        {
            **{key: frozenset(row.targets.values()) for key, row in QUEUE_MOVES.items()},
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


def guard_value(guard: Guard, situation: Situation) -> object:
    """The value of a queue-side row's ``guard`` in ``situation`` (the key of its
    ``targets``)."""
    match guard:
        case Guard.NONE:
            return None
        case Guard.ARRIVAL:
            if LIFECYCLE[(situation.queue, QueueCall.SEND)].action is LifeAction.BUFFER:
                return Arrival.BUFFER
            return Arrival.LATER if situation.wait else Arrival.NOW
        case Guard.WAIT:
            return situation.wait
        case Guard.MODE:
            return situation.mode
        case _:
            raise AssertionError(guard)


def target(state: EnvState, event: EnvEvent | Outcome, situation: Situation) -> EnvState | None:
    """The state ``event`` leads an envelope in ``state`` to, in ``situation``; None when
    the event does not move it.

    This is what the tables above mean together (the runtime performs the same rows,
    with hooks and delays); ``tests/model/test_models.py`` proves the models in
    :mod:`envq.model` agree with it for every (state, event, situation).
    """
    if isinstance(event, Outcome):
        if state is not _E.RUNNING:
            return None
        row = OUTCOMES[(situation.kind, event)]
        match row.action:
            case Action.SUCCEED | Action.END | Action.BLACKLIST | Action.REPORT_FAILURE:
                return row.target
            case Action.RESCHEDULE | Action.DECIDE | Action.DECIDE_PERIODIC:
                decision = situation.decision
                to = row.target
                if row.action is not Action.RESCHEDULE and decision is not None:
                    to = DECISION_TARGET[decision]
                if to not in PARK_INSTEAD:
                    return to
                return put_back(
                    to, limited=row.limited and situation.limited, queue=situation.queue
                )
            case Action.SHELVE:
                cause = situation.cause
                return None if cause is None else SHELVE_TARGET[cause]
            case _:
                raise AssertionError(row.action)
    move = QUEUE_MOVES.get((state, event))
    if move is None:
        return None
    return move.targets.get(guard_value(move.guard, situation))
