"""What the pages show, and the one protocol both stores answer it through.

The pages never ask a store directly: they ask a :class:`Source` — the in-process
queue's (:mod:`envq.web._memory`) or PostgreSQL's (:mod:`envq.web._pg`) — for plain
values (:class:`QueueSummary`, :class:`EnvelopePage`, :class:`EnvelopeDetail`), so that
a page is written once for both. Times are wall-clock epoch seconds (UTC).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

import attrs

from envq._machine import OPERATOR_EVENTS, EnvEvent, EnvState, QueueState

__all__ = [
    "ACTIONS",
    "ENVELOPE_ACTIONS",
    "STORED",
    "Action",
    "AttemptShown",
    "BadParameter",
    "Bucket",
    "EnvelopeDetail",
    "EnvelopePage",
    "EnvelopeQuery",
    "EnvelopeRow",
    "ErrorShown",
    "Lease",
    "Move",
    "NotFound",
    "QueueSummary",
    "Refused",
    "Source",
    "SourceUnavailable",
    "not_allowed",
    "refused",
]

#: The envelope states a page can list (``NEW`` is the state of no envelope in a queue).
STORED: Final[tuple[EnvState, ...]] = tuple(s for s in EnvState if s is not EnvState.NEW)


class Action(enum.Enum):
    """An operator's action on a queue (its lifecycle call of the same name)."""

    STOP = "stop"
    START = "start"


#: The queue's actions by their name in a form.
ACTIONS: Final[Mapping[str, Action]] = {a.value: a for a in Action}
#: The actions on one envelope by their name in a form: the operator's events of the
#: tables (``retry``, ``cancel``, ``discard``), each performed by the queue's call of
#: that name.
ENVELOPE_ACTIONS: Final[Mapping[str, EnvEvent]] = {
    e.value: e for e in EnvEvent if e in OPERATOR_EVENTS
}


class NotFound(LookupError):
    """No such queue or envelope (HTTP 404)."""


class BadParameter(ValueError):
    """A malformed query parameter or form field (HTTP 400); the message names it."""


class Refused(RuntimeError):
    """An action the queue's tables refuse in its state (HTTP 409)."""


class SourceUnavailable(RuntimeError):
    """The store cannot be read now (HTTP 503); the message never holds a secret."""


def not_allowed(key: int, state: EnvState, event: EnvEvent) -> Refused:
    """The refusal of an operator's move the tables do not allow in ``state``."""
    return Refused(
        f"envelope {key} is {state.name}: the tables have no {event.name} move from "
        f"{state.name} (no row ({state.name}, {event.name}) in QUEUE_MOVES)"
    )


def refused(
    key: int, event: EnvEvent, error: Exception, clean: Callable[[str], str] = str
) -> Refused:
    """The queue's call refused an operator's move (``clean``: what the message may
    show)."""
    return Refused(
        f"the {event.value} of envelope {key} was refused ({type(error).__name__}): "
        + clean(str(error))
    )


@attrs.frozen
class Bucket:
    """Envelopes that ended in one slice of time."""

    #: The slice's start, epoch seconds.
    start: float
    succeeded: int
    failed: int


@attrs.frozen
class Lease:
    """The attempts one lease owner (a node's object) holds on a queue."""

    owner: str
    running: int
    #: When the first of its leases expires without renewal, epoch seconds.
    earliest_expiry: float


@attrs.frozen
class QueueSummary:
    """One queue as the overview shows it."""

    name: str
    state: QueueState
    #: Envelopes by state (every state of :data:`STORED`, zeros included).
    counts: Mapping[EnvState, int]
    #: 0: no limit.
    capacity: int
    #: Ends per slice over the last minutes, oldest first.
    series: Sequence[Bucket] = ()
    #: PostgreSQL: who holds the attempts in flight.
    leases: Sequence[Lease] = ()
    #: PostgreSQL: whether the queue's moves are written to the journal.
    journal: bool | None = None
    #: Types blacklisted by a ``StopType``.
    blacklist: Sequence[str] = ()


@attrs.frozen
class EnvelopeRow:
    """One envelope in a list."""

    #: The stay's number in the queue (``seq``): the key of its page.
    key: int
    #: Its ``id``, shown (JSON or ``repr``), or ``""`` for none.
    id: str
    type: str
    state: EnvState
    kind: str
    attempts: int
    #: ``every 5s``, ``cron 0 3 * * * (UTC)``, or ``""`` for a one-off envelope.
    schedule: str = ""
    #: When it runs next: epoch seconds, or None when it does not wait for a time.
    due: float | None = None
    #: What ``due`` cannot say: ``ready now``, ``running``, ``when started``...
    due_note: str = ""
    #: PostgreSQL: the lease owner of a RUNNING envelope.
    owner: str = ""


@attrs.frozen
class Move:
    """One move of an envelope, with the table row that decided it."""

    at: float
    from_state: str
    to_state: str
    #: The event or outcome (``dispatch``, ``ok``...).
    event: str
    #: The deciding row, e.g. ``OUTCOMES[(ONE_OFF, OK)]``.
    row: str
    #: The node whose attempt began or ended with this move ("" for other moves, and
    #: in process).
    node: str = ""


@attrs.frozen
class ErrorShown:
    """The error an attempt ended with, as a page shows it."""

    #: The error's class, qualified (``builtins.RuntimeError``).
    type: str
    message: str
    #: The formatted traceback ("" when not kept).
    traceback: str = ""


@attrs.frozen
class AttemptShown:
    """One attempt of an envelope's story (an attempt that ended with an error)."""

    attempt: int
    #: How it ended, an :class:`envq.Outcome`'s name (``ERROR``, ``TIMEOUT``...).
    outcome: str
    #: Epoch seconds (None: not known).
    started: float | None
    ended: float | None
    #: The node that ran it ("" in process).
    node: str
    #: ``type: message`` of its error ("" for none).
    error: str


@attrs.frozen
class EnvelopeDetail:
    """One envelope's page."""

    row: EnvelopeRow
    #: (field, value shown) in display order.
    fields: Sequence[tuple[str, str]]
    #: The payload as text (JSON or ``repr``), cut to a bound.
    payload: str
    payload_cut: bool
    moves: Sequence[Move]
    #: Where the moves come from, and what they may miss.
    moves_note: str
    #: The last error an attempt of it ended with.
    error: ErrorShown | None = None
    #: Its attempts that ended with an error (the latest the store keeps), oldest first.
    history: Sequence[AttemptShown] = ()
    #: The operator's moves offered on its page: those the tables allow in its state,
    #: when the queue holds it (see :func:`envq.web._rows.operator_events`).
    actions: Sequence[EnvEvent] = ()
    #: Why no move is offered although the tables allow one ("" otherwise).
    actions_note: str = ""


@attrs.frozen
class EnvelopeQuery:
    """A page of envelopes: filters, and a keyset cursor (newest first)."""

    state: EnvState | None = None
    type: str | None = None
    id: str | None = None
    #: Envelopes older than this key (the next page).
    before: int | None = None
    #: Envelopes newer than this key (the page before).
    after: int | None = None
    limit: int = 50
    #: Only periodic and calendar envelopes that are live.
    scheduled: bool = False


@attrs.frozen
class EnvelopePage:
    """One page of envelopes, newest first, with the cursors of its neighbours."""

    rows: Sequence[EnvelopeRow]
    #: ``before=`` of the next (older) page; None: none.
    older: int | None
    #: ``after=`` of the previous (newer) page; None: none.
    newer: int | None


class Source(Protocol):
    """Where the pages read queues and envelopes, and send the operators' actions."""

    #: ``in-process`` or ``PostgreSQL``.
    kind: str

    async def queues(self) -> list[QueueSummary]:
        """Every queue, by name."""
        ...

    async def queue(self, name: str) -> QueueSummary:
        """One queue; :class:`NotFound` when there is none of that name."""
        ...

    async def envelopes(self, name: str, query: EnvelopeQuery) -> EnvelopePage:
        """A page of the queue's envelopes."""
        ...

    async def envelope(self, name: str, key: int) -> EnvelopeDetail:
        """One envelope of the queue; :class:`NotFound` when there is none."""
        ...

    async def act(self, name: str, action: Action) -> None:
        """Perform an action through the queue's own API; :class:`Refused` when its
        tables refuse it in the queue's state."""
        ...

    async def state_of(self, name: str, key: int) -> EnvState:
        """The state of one envelope now; :class:`NotFound` when there is none."""
        ...

    async def operate(self, name: str, key: int, event: EnvEvent) -> int | None:
        """An operator's move (``retry``, ``cancel``, ``discard``) on one envelope,
        through the queue's call of that name; the key of its page afterwards (None:
        it left the queue's keeping). :class:`NotFound` when there is none;
        :class:`Refused` when the tables allow no such move in its state, the call
        refuses it (a stopped queue, no capacity...) or moved nothing."""
        ...

    async def aclose(self) -> None:
        """Let go of connections and listeners."""
        ...
