"""Argument checks shared by every public constructor and call (one wording, one place).

Each check takes ``what`` — the callable and the parameter, as the message should name
them, e.g. ``"Queue 'emails': workers"`` — and the value, and returns the value
normalised (seconds as a float, ...) or raises ``TypeError`` for a value of the wrong
type and ``ValueError`` for a wrong value, with a message naming ``what`` and the
value's repr. :class:`envq.Envelope` passes its own error classes
(``BadEnvelopeType``, ``BadEnvelope``) as ``type_error`` / ``value_error``.

The rules (docs/decisions.md, "Argument validation"): a ``bool`` is never a number;
a number is an ``int``, a ``float`` or another :class:`numbers.Real` (never a string);
an int too large for a float is a ``ValueError``, never ``OverflowError``; NaN and
infinities are refused, except that an infinite *timeout* means "no timeout". A
generator function is never accepted as a callable (calling it would not run its
body), and a callable the library calls synchronously must not be ``async def``.

This module imports nothing from envq (the error classes come in as arguments), so
every module can use it without an import cycle.
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import math
import numbers
import operator
import reprlib
from collections.abc import Iterable
from types import FunctionType
from typing import Any, Final, TypeVar, cast

__all__ = [
    "SHOW_LIMIT",
    "aware_datetime",
    "callable_",
    "finite",
    "flag",
    "hashable",
    "instance",
    "integer",
    "is_async_callable",
    "is_generator_function",
    "limiter",
    "member",
    "name",
    "optional_flag",
    "plain_callable",
    "seconds",
    "show",
    "stamps",
    "timeout",
]

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)

_GENERATOR_FLAGS: Final = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_COROUTINE: Final = inspect.CO_COROUTINE


#: How a value shows in a message: at most this many characters (``reprlib`` cuts
#: long strings, deep or long containers and big numbers short, without building the
#: whole ``repr`` first).
SHOW_LIMIT: Final = 200


class _Shower(reprlib.Repr):
    """``reprlib``'s cut-short repr, naming an int too long to show by its size
    (``repr`` raises past 4,300 digits, and is slow well before)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = SHOW_LIMIT
        self.maxlevel = 4

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 600:
            return f"<an int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWER: Final = _Shower()


def show(value: object) -> str:
    """``repr(value)`` bounded to about :data:`SHOW_LIMIT` characters, safe for ints
    too long for ``repr`` and for a failing ``__repr__``: a message never grows with
    what it names (an 8 MB payload, a million-digit int)."""
    try:
        shown = _SHOWER.repr(value)
    except Exception:
        shown = object.__repr__(value)
    if len(shown) > SHOW_LIMIT + 20:  # a repr reprlib cannot cut (a class's own)
        shown = shown[:SHOW_LIMIT] + f"... ({len(shown)} characters)"
    return shown


def _fail(error: type[Exception], what: str, want: str, value: object, why: str = "") -> Exception:
    return error(f"{what} must be {want}, got {show(value)}{why}")


# --------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------


def _real(
    what: str,
    value: object,
    want: str,
    type_error: type[TypeError],
    value_error: type[ValueError],
) -> float:
    """``value`` as a float (NaN and infinities included); never a bool or a string."""
    cls = value.__class__
    if cls is float:
        return value  # type: ignore[return-value]
    if cls is not int and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise _fail(type_error, what, want, value)
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        raise _fail(value_error, what, want, value, " (too large for a float)") from None


def finite(
    what: str,
    value: object,
    *,
    type_error: type[TypeError] = TypeError,
    value_error: type[ValueError] = ValueError,
) -> float:
    """A finite number (any sign), as a float."""
    want = "a finite number"
    v = _real(what, value, want, type_error, value_error)
    if not math.isfinite(v):
        raise _fail(value_error, what, want, value)
    return v


def seconds(
    what: str,
    value: object,
    *,
    positive: bool = False,
    timedelta: bool = False,
    type_error: type[TypeError] = TypeError,
    value_error: type[ValueError] = ValueError,
) -> float:
    """A finite number of seconds ≥ 0 (> 0 when ``positive``), as a float; with
    ``timedelta`` a :class:`datetime.timedelta` is accepted too."""
    sign = "positive" if positive else "non-negative"
    want = f"a finite {sign} number of seconds{' or a timedelta' if timedelta else ''}"
    shown = value
    if timedelta and isinstance(value, dt.timedelta):
        value = value.total_seconds()
    v = _real(what, value, want, type_error, value_error)
    if not (v > 0 if positive else v >= 0) or v == math.inf:  # NaN fails both tests
        why = f" ({v!r} s)" if shown is not value else ""
        raise _fail(value_error, what, want, shown, why)
    return v


def timeout(what: str, value: object) -> float | None:
    """A timeout: None or a number of seconds ≥ 0, returned as given (so messages
    show it as the caller wrote it); ``math.inf`` means no timeout (None)."""
    if value is None:
        return None
    want = "None or a number of seconds >= 0"
    v = _real(what, value, want, TypeError, ValueError)
    if not v >= 0:  # negative or NaN
        raise _fail(ValueError, what, want, value)
    return None if v == math.inf else cast("float", value)


def integer(
    what: str,
    value: object,
    *,
    minimum: int,
    maximum: int | None = None,
    unlimited: bool = False,
) -> int:
    """An int ≥ ``minimum`` (and ≤ ``maximum``); with ``unlimited``, -1 as well."""
    if maximum is not None:
        want = f"an int from {minimum} to {maximum}"
    elif minimum == 1:
        want = "an int > 0"
    else:
        want = f"an int >= {minimum}"
    if unlimited:
        want += " or -1 (unlimited)"
    if value.__class__ is not int and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral)
    ):
        raise _fail(TypeError, what, want, value)
    n = operator.index(value)
    if (n < minimum and not (unlimited and n == -1)) or (maximum is not None and n > maximum):
        raise _fail(ValueError, what, want, value)
    return n


# --------------------------------------------------------------------------------------
# Flags, enums, instances
# --------------------------------------------------------------------------------------


def flag(what: str, value: object) -> bool:
    """A bool (``True``/``False``; no other truthy or falsy value)."""
    if not isinstance(value, bool):
        raise _fail(TypeError, what, "a bool", value)
    return value


def optional_flag(what: str, value: object) -> bool | None:
    """A bool or None."""
    if value is not None and not isinstance(value, bool):
        raise _fail(TypeError, what, "a bool or None", value)
    return value


def member(what: str, value: object, cls: type[E], *, type_error: type[TypeError] = TypeError) -> E:
    """A member of the enum ``cls``."""
    if not isinstance(value, cls):
        names = " or ".join(f"{cls.__name__}.{m.name}" for m in cls)
        raise _fail(type_error, what, names, value)
    return value


def instance(
    what: str,
    value: object,
    cls: type[T],
    *,
    want: str | None = None,
    type_error: type[TypeError] = TypeError,
) -> T:
    """An instance of ``cls`` (a class itself is refused with a hint); ``want`` names
    what is expected in the message (default: ``a <cls>``)."""
    if not isinstance(value, cls):
        hint = f"; pass an instance, e.g. {value.__name__}(...)" if isinstance(value, type) else ""
        raise _fail(type_error, what, want or f"a {cls.__qualname__}", value, hint)
    return value


def aware_datetime(
    what: str,
    value: object,
    *,
    type_error: type[TypeError] = TypeError,
    value_error: type[ValueError] = ValueError,
) -> dt.datetime:
    """A timezone-aware :class:`datetime.datetime`."""
    want = "an aware datetime (with a tzinfo)"
    if not isinstance(value, dt.datetime):
        raise _fail(type_error, what, want, value)
    if value.utcoffset() is None:
        raise _fail(value_error, what, want, value, " (naive)")
    return value


def hashable(what: str, value: T, *, type_error: type[TypeError] = TypeError) -> T:
    """A hashable value."""
    try:
        hash(value)
    except TypeError:
        raise _fail(type_error, what, "hashable", value) from None
    return value


#: What a queue name must be, as messages say it.
NAME_RULE: Final = "a non-empty str of printable characters, without surrounding whitespace"


def name(what: str, value: object) -> str:
    """A queue name: a non-empty str of printable characters (no control characters
    or line breaks) that neither starts nor ends with whitespace. It shows in
    messages, logs, thread names and as the value of the metrics' ``name`` label,
    which takes any string; ``"my-queue"``, ``"emails.eu"`` and ``"é"`` are fine."""
    if not isinstance(value, str):
        raise _fail(TypeError, what, NAME_RULE, value)
    if not value or not value.isprintable() or value.strip() != value:
        raise _fail(ValueError, what, NAME_RULE, value)
    return value


# --------------------------------------------------------------------------------------
# Callables
# --------------------------------------------------------------------------------------


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, a partial of one, or an
    object whose ``__call__`` is ``async def``; never a class, which returns an instance)."""
    if fn is None:  # an absent hook: the common case at construction
        return False
    if fn.__class__ is FunctionType:  # the common case; a function's __call__ is a wrapper
        # An ``async def`` by its code's flag; else inspect's test, which also knows a
        # plain function marked as a coroutine function.
        return bool(fn.__code__.co_flags & _COROUTINE) or inspect.iscoroutinefunction(fn)
    return inspect.iscoroutinefunction(fn) or (
        not isinstance(fn, type)
        and inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - the bound __call__, not callable()
        )
    )


def _generator_code(fn: object) -> bool:
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


def is_generator_function(fn: object) -> bool:
    """Whether calling ``fn`` returns a generator or an async generator instead of
    running its body (a plain function, a partial, a method or an object's ``__call__``)."""
    if fn.__class__ is FunctionType:
        return bool(fn.__code__.co_flags & _GENERATOR_FLAGS)
    return _generator_code(fn) or (
        not isinstance(fn, type) and _generator_code(getattr(fn, "__call__", None))  # noqa: B004
    )


def callable_(what: str, value: T, *, type_error: type[TypeError] = TypeError) -> T:
    """A callable, plain or ``async def``; never a generator function (its body would
    never run)."""
    if not callable(value):
        raise _fail(type_error, what, "callable", value)
    if is_generator_function(value):
        raise _fail(
            type_error,
            what,
            "a function, not a generator function",
            value,
            " (calling it would only make a generator and never run its body)",
        )
    return value


def plain_callable(what: str, value: T, why: str, *, type_error: type[TypeError] = TypeError) -> T:
    """A plain (not ``async def``) callable, because envq calls it synchronously;
    ``why`` says what an ``async def`` one would do wrong."""
    callable_(what, value, type_error=type_error)
    if is_async_callable(value):
        raise _fail(type_error, what, "a plain callable, not async def", value, f" ({why})")
    return value


#: Why a stamp must be plain.
STAMP_WHY: Final = (
    "a stamp is called synchronously to build the invoker chain and must return the "
    "invoker, (Invoker) -> Invoker; make the invoker it returns async instead"
)


def stamps(
    what: str,
    value: object,
    *,
    type_error: type[TypeError] = TypeError,
) -> tuple[Any, ...]:
    """An iterable of stamps, as a tuple; None means none."""
    if value is None:
        return ()
    cls = value.__class__
    if (cls is not tuple and cls is not list) and (
        isinstance(value, str | bytes) or not isinstance(value, Iterable)
    ):
        hint = " (a single stamp? pass [stamp])" if callable(value) else ""
        raise _fail(type_error, what, "an iterable of stamps, or None", value, hint)
    items = tuple(cast("Iterable[Any]", value))
    for i, item in enumerate(items):
        if not callable(item) or is_generator_function(item) or is_async_callable(item):
            plain_callable(f"{what}[{i}]", item, STAMP_WHY, type_error=type_error)  # raises
    return items


_LIMITER_METHODS: Final = ("when", "forget", "retries")


def limiter(what: str, value: T) -> T:
    """A rate limiter *instance* with plain ``when``/``forget``/``retries`` methods."""
    want = "a rate limiter instance with when/forget/retries methods"
    if isinstance(value, type):
        raise _fail(TypeError, what, want, value, f"; pass an instance, e.g. {value.__name__}(...)")
    for method in _LIMITER_METHODS:
        fn = getattr(value, method, None)
        if not callable(fn):
            raise _fail(TypeError, what, want, value, f" (it has no {method}() method)")
        if is_async_callable(fn):
            raise _fail(
                TypeError,
                what,
                want,
                value,
                f" (its {method}() is async def; the queue calls it synchronously)",
            )
    return value
