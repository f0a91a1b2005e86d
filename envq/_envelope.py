"""The envelope: one unit of work with its schedule, deadline, hooks and stamps (§2)."""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, TypeAlias, cast

import attrs

from envq._errors import BadEnvelope, BadIntervals
from envq._machine import EnvState, Kind
from envq._values import Decision, Retry, Schedule, _finite_seconds

__all__ = [
    "AfterHook",
    "BeforeHook",
    "Envelope",
    "FailureHook",
    "Invoke",
    "Invoker",
    "Stamp",
    "SuccessHook",
    "is_async_callable",
]

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
    armed.
    """

    __slots__ = (
        "attempts",
        "due",
        "failures",
        "kind",
        "owner",
        "seq",
        "state",
        "tick",
    )

    def __init__(self) -> None:
        #: The queue the envelope is live in (None when in none); set by the queue only.
        self.owner: Any = None
        self.state = EnvState.NEW
        self.kind = Kind.ONE_OFF
        self.seq = 0
        self.due = 0.0
        #: The number of its entry in the queue's timer heap while DELAYED, else 0.
        self.tick = 0
        self.attempts = 0
        self.failures = 0


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, a partial of one, or an
    object whose ``__call__`` is ``async def``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - we want the bound __call__, not callable()
    )


def _seconds(field: str, value: object) -> float:
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    return _finite_seconds(field, value)


def _interval(value: object) -> float:
    return _seconds("interval", value)


def _deadline(value: object) -> float:
    return _seconds("deadline", value)


def _delay(value: object) -> float:
    return _seconds("delay", value)


def _callable_or_none(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise BadEnvelope(f"{attr.alias} must be callable or None, got {value!r}")


def _check_invoke(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None or not callable(value):
        raise BadEnvelope(f"invoke is required and must be callable, got {value!r}")


def _check_stamps(value: object) -> tuple[Stamp, ...]:
    if value is None:
        return ()
    if not isinstance(value, Iterable) or isinstance(value, str | bytes):
        raise BadEnvelope(f"stamps must be a sequence of callables, got {value!r}")
    stamps = tuple(value)
    for stamp in stamps:
        if not callable(stamp):
            raise BadEnvelope(f"stamps must contain callables only, got {stamp!r}")
    return stamps


def _check_type(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise BadEnvelope(f"type must be a str, got {value!r}")


def _check_id(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Hashable):
        raise BadEnvelope(f"id must be hashable, got {value!r}")


def _check_retry(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, Retry):
        raise BadEnvelope(f"retry must be an envq.Retry or None, got {value!r}")


def _check_schedule(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Schedule):
        raise BadEnvelope(f"schedule must be envq.FIXED_DELAY or envq.FIXED_RATE, got {value!r}")


def _check_not_before(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, dt.datetime) or value.utcoffset() is None:
        raise BadEnvelope(f"not_before must be an aware datetime or None, got {value!r}")


@attrs.define(eq=False, kw_only=True, repr=False, on_setattr=attrs.setters.frozen)
class Envelope:
    """One unit of work for a :class:`envq.Queue` (contract §2).

    Every field is fixed after construction except :attr:`payload`; use
    :meth:`evolve` for a validated copy with changes. Identity matters: a queue holds
    an envelope *object* at most once at a time, and an envelope is live in at most
    one queue at a time. Equality is identity.

    :param invoke: the work, called with the envelope; ``async def`` or plain (a
        plain one runs in the queue's thread pool).
    :param id: any hashable value, for logs and metrics.
    :param type: a name for logs, metric labels and the type blacklist.
    :param interval: seconds (or ``timedelta``); 0 = one-off, > 0 = periodic.
    :param deadline: seconds bounding ``before`` + the invoker chain + ``after`` of one
        attempt; 0 = none. A periodic envelope's deadline may not exceed its interval.
    :param before: hook run before the invoker chain; may raise
        :class:`envq.StopEnvelope` / :class:`envq.StopType`.
    :param after: hook run after a successful (or stopped) invoker chain.
    :param on_failure: ``(env, exc, attempt) -> Decision | None`` for failed attempts.
    :param on_success: hook run after a successful attempt.
    :param stamps: envelope-level middleware, wrapped by the queue's stamps.
    :param payload: user data; the only field that may change after construction.
    :param retry: retry policy for one-off envelopes without ``on_failure``.
    :param delay: seconds after arming before the first run.
    :param not_before: an aware datetime: the earliest first run (wall clock).
    :param schedule: periodic timing, :data:`envq.FIXED_DELAY` or :data:`envq.FIXED_RATE`.
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
    stamps: tuple[Stamp, ...] = attrs.field(default=(), converter=_check_stamps)
    #: User data carried by the envelope; the only field that may be replaced at any time.
    payload: Any = attrs.field(default=None, on_setattr=attrs.setters.NO_OP)
    retry: Retry | None = attrs.field(default=None, validator=_check_retry)
    delay: float = attrs.field(default=0.0, converter=_delay)
    not_before: dt.datetime | None = attrs.field(default=None, validator=_check_not_before)
    schedule: Schedule = attrs.field(default=Schedule.FIXED_DELAY, validator=_check_schedule)
    # Derived at construction, read by the worker on every attempt.
    _async: bool = attrs.field(init=False, default=False)
    _bare: bool = attrs.field(init=False, default=False)
    _rec: _Rec = attrs.field(init=False, factory=_Rec, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.interval > 0 and self.deadline > self.interval:
            raise BadIntervals(
                f"deadline ({self.deadline!r} s) must not exceed interval "
                f"({self.interval!r} s) for a periodic envelope"
            )
        set_ = object.__setattr__
        set_(self, "_async", is_async_callable(self.invoke))
        set_(
            self,
            "_bare",
            self.before is None and self.after is None and not self.stamps and not self.deadline,
        )

    @property
    def periodic(self) -> bool:
        """True for a periodic envelope (``interval > 0``)."""
        return self.interval > 0

    def evolve(self, **changes: Any) -> Envelope:
        """A validated copy of this envelope with ``changes`` applied (a new identity)."""
        try:
            return attrs.evolve(self, **changes)
        except TypeError as exc:
            raise BadEnvelope(f"evolve: {exc}") from None

    def label(self) -> str:
        """``type/id`` for messages and logs."""
        return f"{self.type or '-'}/{self.id!r}"

    def __repr__(self) -> str:
        kind = f"every {self.interval:g}s" if self.interval > 0 else "one-off"
        return f"<Envelope {self.label()} {kind}>"
