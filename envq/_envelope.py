"""The envelope: one unit of work with its schedule, deadline, hooks and stamps."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Protocol, TypeAlias, cast

import attrs

from envq import _checks
from envq._checks import is_async_callable
from envq._errors import BadEnvelope, BadEnvelopeType, BadIntervals
from envq._machine import INITIAL, KIND_OF, EnvEvent, EnvState, Kind, Outcome
from envq._schedule import MIN_INTERVAL, Timing
from envq._values import Decision, Retry, Schedule

__all__ = [
    "AfterHook",
    "BeforeHook",
    "Enter",
    "Envelope",
    "FailureHook",
    "Invoke",
    "Invoker",
    "Stamp",
    "SuccessHook",
    "is_async_callable",
]

_INF = math.inf

#: ``invoke``: called with the envelope; ``async def`` or plain (runs in a thread).
Invoke: TypeAlias = Callable[["Envelope"], Awaitable[None] | None]
#: ``before`` / ``after``: as ``invoke``.
BeforeHook: TypeAlias = Invoke
AfterHook: TypeAlias = Invoke
#: ``on_success``: as ``invoke``.
SuccessHook: TypeAlias = Invoke
#: ``on_failure(env, exc, attempt)`` → a :class:`Decision` or ``None`` (drop).
FailureHook: TypeAlias = Callable[
    ["Envelope", BaseException, int], Awaitable[Decision | None] | Decision | None
]
#: The async callable a stamp wraps.
Invoker: TypeAlias = Callable[["Envelope"], Awaitable[None]]
#: Middleware: takes the next invoker, returns one that wraps it.
Stamp: TypeAlias = Callable[[Invoker], Invoker]


class _Rec:
    """A queue's bookkeeping of one envelope during one stay in it.

    Every envelope carries one, made with it: an envelope is live in at most one
    queue at a time, and admission resets it, so sending allocates nothing (which
    keeps the garbage collector out of the send/run path).

    ``due`` means: READY/RUNNING — the scheduled start of a periodic run; DELAYED —
    the loop time it becomes ready; BUFFERED/PARKED — the delay still to wait when
    armed. ``origin`` is the scheduled start of the last run its schedule did not
    place (a FIXED_RATE grid's origin: each slot is computed from it, so rounding
    never accumulates).
    """

    __slots__ = (
        "attempts",
        "due",
        "error",
        "failures",
        "kind",
        "logged",
        "origin",
        "owner",
        "seq",
        "state",
        "story",
        "tick",
    )

    def __init__(self) -> None:
        #: The queue the envelope is live in (None when in none); set by the queue only.
        self.owner: Any = None
        self.state: EnvState = INITIAL
        self.kind: Kind = KIND_OF[False]
        self.seq = 0
        self.due = 0.0
        self.origin = 0.0
        #: The number of its entry in the queue's timer heap while DELAYED, else 0.
        self.tick = 0
        self.attempts = 0
        self.failures = 0
        #: The loop time of the last WARNING about its row of unhandled periodic
        #: failures (read only when a run fails).
        self.logged = 0.0
        #: The last error an attempt ended with in this stay or before an operator's
        #: retry (``ErrorInfo``), and the story of its failed attempts (a list of
        #: ``AttemptRecord``, the latest last, bounded); None until the first failure.
        self.error: Any = None
        self.story: Any = None


# Every field check raises BadEnvelopeType (a BadEnvelope and a TypeError) for a value
# of the wrong type and BadEnvelope (a ValueError) for a wrong value.


def _seconds_field(what: str, value: object) -> float:
    # A finite non-negative float (the default 0.0 among them) as it is: construction
    # is on every producer's path, and the general check costs a microsecond.
    if value.__class__ is float and 0.0 <= value < _INF:
        return value
    return _checks.seconds(
        what, value, timedelta=True, type_error=BadEnvelopeType, value_error=BadEnvelope
    )


def _interval(value: float | dt.timedelta) -> float:
    interval = _seconds_field("Envelope: interval", value)
    if 0 < interval < MIN_INTERVAL:
        raise BadEnvelope(
            f"Envelope: interval must be 0 (one-off) or at least {MIN_INTERVAL:g} s "
            f"(a shorter one is a busy loop the clock cannot resolve), got {_checks.show(value)}"
        )
    return interval


def _deadline(value: float | dt.timedelta) -> float:
    return _seconds_field("Envelope: deadline", value)


def _delay(value: float | dt.timedelta) -> float:
    return _seconds_field("Envelope: delay", value)


def _callable_or_none(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _checks.callable_(f"Envelope: {attr.alias}", value, type_error=BadEnvelopeType)


def _check_invoke(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        raise BadEnvelopeType("Envelope: invoke is required: a callable (env) -> None, got None")
    _checks.callable_("Envelope: invoke", value, type_error=BadEnvelopeType)


def _stamps(value: Iterable[Stamp] | None) -> tuple[Stamp, ...]:
    if value == ():  # the default: no stamps
        return ()
    return _checks.stamps("Envelope: stamps", value, type_error=BadEnvelopeType)


def _check_type(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    _checks.instance("Envelope: type", value, str, want="a str", type_error=BadEnvelopeType)


def _check_id(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    _checks.hashable("Envelope: id", value, type_error=BadEnvelopeType)


def _check_retry(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _checks.instance(
            "Envelope: retry",
            value,
            Retry,
            want="an envq.Retry or None",
            type_error=BadEnvelopeType,
        )


def _check_schedule(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    # A Schedule member first: a runtime Protocol's isinstance is slow, and construction
    # is on every producer's path.
    if value.__class__ is not Schedule and not isinstance(value, Timing):
        raise BadEnvelopeType(
            "Envelope: schedule must be envq.FIXED_DELAY, envq.FIXED_RATE, an envq.Cron "
            f"or another envq.Timing, got {_checks.show(value)}"
        )


def _check_not_before(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _checks.aware_datetime(
            "Envelope: not_before", value, type_error=BadEnvelopeType, value_error=BadEnvelope
        )


class Enter(Protocol):
    """The queue's entry routine (``envq._moves.Mover.enter``): move ``env`` into ``to``
    and have the store hold it there."""

    def __call__(
        self,
        env: Envelope,
        rec: _Rec,
        event: EnvEvent | Outcome,
        to: EnvState,
        delay: float = 0.0,
        cause: BaseException | None = None,
        at: float | None = None,
    ) -> None: ...


@attrs.define(eq=False, kw_only=True, repr=False, on_setattr=attrs.setters.frozen)
class Envelope:
    """One unit of work for a :class:`envq.Queue`.

    Every field is fixed after construction except :attr:`payload`; use
    :meth:`evolve` for a validated copy with changes. A queue holds an envelope at most
    once at a time, by its ``id`` when it has one (else by identity), and an envelope
    object is live in at most one queue at a time. Equality is identity.

    :param invoke: the work, called with the envelope; ``async def`` or plain (a
        plain one runs in the queue's thread pool).
    :param id: any hashable value, for logs and metrics, and the envelope's dedup key:
        while an envelope with this ``id`` is live in a queue, sending another one with
        the same ``id`` there is a dedup (without an ``id``, the envelope object itself
        is the key).
    :param type: a name for logs, metric labels and the type blacklist.
    :param interval: seconds (or ``timedelta``); 0 = one-off, > 0 = periodic (at least
        a microsecond).
    :param deadline: seconds bounding ``before`` + the invoker chain + ``after`` of one
        attempt; 0 = none. A periodic envelope's deadline may not exceed its interval.
    :param before: hook run before the invoker chain; may raise
        :class:`envq.StopEnvelope` / :class:`envq.StopType`.
    :param after: hook run after a successful (or stopped) invoker chain.
    :param on_failure: ``(env, exc, attempt) -> Decision | None`` for failed attempts.
    :param on_success: hook run after a successful attempt.
    :param stamps: envelope-level middleware, wrapped by the queue's stamps.
    :param payload: user data; the only field that may change after construction.
    :param retry: retry policy for one-off envelopes without ``on_failure``; refused
        (:class:`envq.BadEnvelope`) beside ``on_failure`` or on a periodic envelope,
        where it could never apply.
    :param delay: seconds after arming before the first run.
    :param not_before: an aware datetime: the earliest first run (wall clock).
    :param schedule: periodic timing: :data:`envq.FIXED_DELAY` or :data:`envq.FIXED_RATE`
        (with an ``interval``), or a calendar such as :class:`envq.Cron` (any
        :class:`envq.Timing` that is not a ``Schedule``; ``interval`` must then be 0,
        and the envelope is periodic).
    """

    # Defaults to None only so that a missing invoke raises BadEnvelope, not TypeError.
    invoke: Invoke = attrs.field(default=cast("Invoke", None), validator=_check_invoke)
    id: Hashable = attrs.field(default=None, validator=_check_id)
    type: str = attrs.field(default="", validator=_check_type)
    interval: float = attrs.field(default=0.0, converter=_interval)
    deadline: float = attrs.field(default=0.0, converter=_deadline)
    before: BeforeHook | None = attrs.field(default=None, validator=_callable_or_none)
    after: AfterHook | None = attrs.field(default=None, validator=_callable_or_none)
    on_failure: FailureHook | None = attrs.field(default=None, validator=_callable_or_none)
    on_success: SuccessHook | None = attrs.field(default=None, validator=_callable_or_none)
    stamps: tuple[Stamp, ...] = attrs.field(default=(), converter=_stamps)
    #: User data carried by the envelope; the only field that may be replaced at any time.
    payload: Any = attrs.field(default=None, on_setattr=attrs.setters.NO_OP)
    retry: Retry | None = attrs.field(default=None, validator=_check_retry)
    delay: float = attrs.field(default=0.0, converter=_delay)
    not_before: dt.datetime | None = attrs.field(default=None, validator=_check_not_before)
    schedule: Timing = attrs.field(default=Schedule.FIXED_DELAY, validator=_check_schedule)
    # Derived at construction, read by the worker on every attempt.
    _async: bool = attrs.field(init=False, default=False)
    _async_before: bool = attrs.field(init=False, default=False)
    _async_after: bool = attrs.field(init=False, default=False)
    _async_success: bool = attrs.field(init=False, default=False)
    _async_failure: bool = attrs.field(init=False, default=False)
    _lean: bool = attrs.field(init=False, default=False)
    #: The schedule is a calendar (not a Schedule member): periodic without interval.
    _calendar: bool = attrs.field(init=False, default=False)
    #: The first delay needs working out (a not_before or a calendar).
    _timed: bool = attrs.field(init=False, default=False)
    #: Admission must look closer: the envelope has an ``id`` (its dedup key) or a
    #: first delay to work out, either of which may refuse or shrink the batch.
    _careful: bool = attrs.field(init=False, default=False)
    #: :attr:`periodic`, read once (admission reads it for every envelope).
    _periodic: bool = attrs.field(init=False, default=False)
    _direct: bool = attrs.field(init=False, default=False)
    _rec: _Rec = attrs.field(init=False, factory=_Rec, repr=False)

    def __attrs_post_init__(self) -> None:
        calendar = not isinstance(self.schedule, Schedule)
        if calendar and self.interval > 0:
            raise BadEnvelope(
                f"Envelope: interval must be 0 with the calendar schedule "
                f"{_checks.show(self.schedule)} (it sets the times), got {self.interval!r}"
            )
        if self.retry is not None:
            # A policy that could never apply is refused rather than silently ignored.
            if self.on_failure is not None:
                raise BadEnvelope(
                    "Envelope: retry and on_failure cannot be combined: on_failure decides "
                    "every failure, so the retry policy would never apply (return "
                    "envq.retry_after(...) from on_failure, or drop one of them)"
                )
            if calendar or self.interval > 0:
                raise BadEnvelope(
                    "Envelope: retry applies to one-off envelopes only; a periodic envelope "
                    "goes on with its schedule after a failure (use on_failure to retry "
                    "sooner), got retry with "
                    + (
                        f"schedule {_checks.show(self.schedule)}"
                        if calendar
                        else f"interval {self.interval!r}"
                    )
                )
        if self.interval > 0 and self.deadline > self.interval:
            raise BadIntervals(
                f"deadline ({self.deadline!r} s) must not exceed interval "
                f"({self.interval!r} s) for a periodic envelope"
            )
        set_ = object.__setattr__
        set_(self, "_async", is_async_callable(self.invoke))
        set_(self, "_direct", self._async and not self.stamps)
        set_(self, "_async_before", is_async_callable(self.before))
        set_(self, "_async_after", is_async_callable(self.after))
        set_(self, "_async_success", is_async_callable(self.on_success))
        set_(self, "_async_failure", is_async_callable(self.on_failure))
        set_(self, "_lean", self.before is None and self.after is None and not self.stamps)
        set_(self, "_calendar", calendar)
        timed = calendar or self.not_before is not None
        set_(self, "_timed", timed)
        set_(self, "_careful", timed or self.id is not None)
        set_(self, "_periodic", self.interval > 0 or calendar)

    @property
    def periodic(self) -> bool:
        """True for a periodic envelope (``interval > 0``, or a calendar schedule)."""
        return self._periodic

    def evolve(self, **changes: Any) -> Envelope:
        """A validated copy of this envelope with ``changes`` applied (a new identity).

        :raises BadEnvelopeType: an unknown field, or a field of the wrong type.
        :raises BadEnvelope: a field with a wrong value.
        """
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise BadEnvelopeType(
                f"Envelope.evolve: no field named {', '.join(map(repr, sorted(unknown)))}; "
                f"the fields are {', '.join(sorted(_FIELDS))}"
            )
        return attrs.evolve(self, **changes)

    def _sibling(self, id: Hashable, payload: Any) -> Envelope:
        """A copy with another ``id`` and ``payload`` and a record of its own, not
        validated again: for a store that rebuilds many envelopes of one validated
        shape from rows (``id`` must be hashable, as the rows' are)."""
        twin: Envelope = object.__new__(Envelope)
        set_ = object.__setattr__
        for name in _SLOTS:
            set_(twin, name, getattr(self, name))
        set_(twin, "id", id)
        set_(twin, "_careful", self._timed or id is not None)
        set_(twin, "payload", payload)
        set_(twin, "_rec", _Rec())
        return twin

    def label(self) -> str:
        """``type/id`` for messages and logs."""
        return f"{self.type or '-'}/{_checks.show(self.id)}"

    def __repr__(self) -> str:
        if self._calendar:
            kind = f"on {self.schedule!r}"
        else:
            kind = f"every {self.interval:g}s" if self.interval > 0 else "one-off"
        return f"<Envelope {self.label()} {kind}>"


#: Every attribute of an envelope, for :meth:`Envelope._sibling`.
_SLOTS: tuple[str, ...] = tuple(a.name for a in attrs.fields(Envelope))
#: The fields ``Envelope(...)`` and ``evolve(...)`` take.
_FIELDS: frozenset[str] = frozenset(a.alias for a in attrs.fields(Envelope) if a.init and a.alias)
