"""Envelopes that cross processes: callables by name, ``id`` and ``payload`` as JSON.

An envelope sent to a PostgreSQL queue is stored as a row and run, maybe, by another
process on another machine. What crosses is data: the callables (``invoke`` and the
hooks) by their import path ``module:qualname``, which must name the very same object
(no lambda, closure or bound method), ``id`` and ``payload`` as JSON, the retry policy
by its fields, a calendar schedule (:class:`envq.Cron`) by its expression and time
zone name. :func:`encode` checks all of it at the call site and names the field that
cannot cross; :func:`decode` rebuilds an :class:`envq.Envelope` from a row.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import math
import re
import zoneinfo
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final

import attrs

from envq._checks import show
from envq._envelope import Envelope
from envq._errors import BadEnvelope, BadEnvelopeType
from envq._schedule import Cron
from envq._values import Retry, Schedule

__all__ = [
    "MAX_ID_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_SECONDS",
    "Encoded",
    "calendar",
    "callable_name",
    "decode",
    "encode",
    "fire_wait",
    "first_wait",
    "resolve",
]

#: The hooks an envelope row names, as (Envelope attribute, row column).
HOOKS: Final = (  # in the order of Encoded.hooks (encode spells it out)
    ("before", "before_hook"),
    ("after", "after_hook"),
    ("on_success", "on_success"),
    ("on_failure", "on_failure"),
)


#: The names of callables already checked (a send checks each envelope's).
_NAMES: dict[Callable[..., Any], str] = {}


def callable_name(fn: Callable[..., Any], field: str, label: str) -> str:
    """The import path ``module:qualname`` of ``fn``, checked to resolve to ``fn``
    itself (so that another process runs the same code).

    :raises BadEnvelopeType: when ``fn`` has no stable name (a lambda, a closure, a
        bound method, a callable object, a function of ``__main__`` run as a script).
    """
    try:
        known = _NAMES.get(fn)
    except TypeError:  # unhashable: checked below, and refused
        known = None
    if known is not None:
        return known
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise BadEnvelopeType(
            f"{label}: {field}={show(fn)} cannot cross processes: it has no import path "
            "(give a function defined at the top level of an importable module)"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise BadEnvelopeType(
            f"{label}: {field}={show(fn)} cannot cross processes: a lambda or a function "
            "defined inside another has no import path (define it at module level)"
        )
    if module == "__main__":
        raise BadEnvelopeType(
            f"{label}: {field}={show(fn)} cannot cross processes: it is defined in __main__, "
            "which other processes cannot import (move it to a module)"
        )
    name = f"{module}:{qualname}"
    try:
        found = resolve(name)
    except (ImportError, AttributeError) as error:
        raise BadEnvelopeType(
            f"{label}: {field}={show(fn)} cannot cross processes: {name} does not resolve ({error})"
        ) from None
    if found is not fn:
        raise BadEnvelopeType(
            f"{label}: {field}={show(fn)} cannot cross processes: {name} names another object "
            f"({show(found)})"
        )
    if len(_NAMES) >= 4096:
        _NAMES.clear()
    _NAMES[fn] = name
    return name


@functools.lru_cache(maxsize=1024)
def resolve(name: str) -> Callable[..., Any]:
    """The callable an import path ``module:qualname`` names."""
    module, _, qualname = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise AttributeError(f"{name} is not callable")
    return found  # type: ignore[no-any-return]


#: The most bytes of JSON an envelope's ``payload`` may take in its row (a jsonb value
#: holds at most 255 MB, a statement's parameters 1 GB; a job queue's payload of more
#: than 64 MiB is a mistake to report at the call, not a failure of the database's).
MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
#: The most bytes of JSON an envelope's ``id`` may take: it is the dedup key, in a
#: unique index whose entries PostgreSQL bounds at about 2.7 kB.
MAX_ID_BYTES: Final = 1024

#: The characters PostgreSQL's text and jsonb cannot hold: NUL, and the UTF-16
#: surrogates (a lone one is no character; a pair would come back joined).
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


def _unstorable(value: object) -> str | None:
    """What in ``value`` (a JSON value) cannot cross processes unchanged, or None: a
    string PostgreSQL cannot store, or a mapping key that is not a string (JSON's keys
    are strings: ``{1: 'a'}`` would come back as ``{'1': 'a'}``, and ``{1: 'a', '1':
    'b'}`` as one key)."""
    if value is None or value.__class__ in _SCALARS:  # nothing to walk
        return None
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _UNSTORABLE.search(item):
                return (
                    f"{show(item)} holds a NUL character or a UTF-16 surrogate, which "
                    "PostgreSQL cannot store"
                )
        elif isinstance(item, Mapping):
            for key in item:
                if not isinstance(key, str):
                    return (
                        f"the key {show(key)} is not a str (JSON's keys are: it would come "
                        "back as a str, and could merge with another key)"
                    )
                stack.append(key)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


#: The JSON every column is written in: compact, refusing NaN and the infinities
#: (made once: ``json.dumps`` with options builds an encoder on every call).
_DUMPS: Final = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
#: Values with nothing inside to check (a str is checked for what PostgreSQL refuses).
_SCALARS: Final = frozenset({int, float, bool})


def _json(value: object, field: str, label: str, limit: int) -> str:
    """``value`` as compact JSON text for the row's column ``field``, checked to come
    back unchanged and to fit ``limit`` bytes; else the error naming the field."""
    problem = _unstorable(value)
    if problem is None:
        try:
            text = _DUMPS(value)
        except (TypeError, ValueError, RecursionError) as error:
            problem = f"it is not JSON ({show(str(error))})"
        else:
            # JSON escapes every non-ASCII character: its length is its size in bytes.
            if len(text) <= limit:
                return text
            problem = f"its JSON takes {len(text)} bytes, more than the {limit} allowed"
    raise BadEnvelopeType(f"{label}: {field}={show(value)} cannot cross processes: {problem}")


def _hashable(value: object) -> Hashable:
    """A JSON value as the hashable ``id`` it was sent as (arrays come back as tuples)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


@attrs.frozen
class Encoded:
    """An envelope as the columns of its row (JSON as text)."""

    id: str | None
    type: str
    invoke: str
    payload: str
    periodic: bool
    interval: float
    schedule: str
    deadline: float
    hooks: tuple[str | None, str | None, str | None, str | None]
    retry: str | None
    #: Seconds from the send to the first run (0: at once); for a calendar, to the
    #: moment from which its first fire is looked for (the sender finds the fire).
    delay: float
    #: A calendar schedule's cron expression and time zone name (None: no calendar).
    cron: str | None = None
    cron_tz: str | None = None


def calendar(expr: str, tz: str) -> Cron:
    """The :class:`envq.Cron` a row's ``cron`` and ``cron_tz`` columns stand for (each
    built once: checking an expression parses it)."""
    key = (expr, tz)
    found = _CALENDARS.get(key)
    if found is None:
        if len(_CALENDARS) >= 256:
            _CALENDARS.clear()
        found = _CALENDARS[key] = Cron(expr, tz=tz)
    return found


_CALENDARS: dict[tuple[str, str], Cron] = {}


#: A calendar's wait when it has no fire in the next fifty years (an interval must be
#: finite): a hundred years.
_NEVER: Final = 100 * 365.25 * 86400.0


def fire_wait(fire: float, now: float) -> float:
    """Seconds from ``now`` to ``fire`` (both epoch seconds), finite."""
    return min(max(0.0, fire - now), _NEVER) if math.isfinite(fire) else _NEVER


def first_wait(enc: Encoded, now: float) -> Encoded:
    """``enc`` armed at ``now`` (epoch seconds, the database's clock): a calendar
    envelope's ``delay`` becomes the wait to its first fire at or after ``now`` plus
    that delay; any other envelope is returned as it is."""
    if enc.cron is None or enc.cron_tz is None:
        return enc
    fire = calendar(enc.cron, enc.cron_tz).first_fire(now + enc.delay)
    return attrs.evolve(enc, delay=fire_wait(fire, now))


def _zone_name(cron: Cron, label: str) -> str:
    """The IANA name of a Cron's time zone, checked to name the same zone here."""
    tz = cron.tz
    if tz is dt.UTC:
        return "UTC"
    key = getattr(tz, "key", None) if isinstance(tz, zoneinfo.ZoneInfo) else None
    if not isinstance(key, str):
        raise BadEnvelopeType(
            f"{label}: schedule={show(cron)} cannot cross processes: its tz={show(tz)} has no IANA "
            "time zone name (give the zone by name, e.g. Cron(expr, tz='Europe/Berlin'))"
        )
    return key


def _calendar(schedule: object, label: str) -> tuple[str, str]:
    """A calendar schedule as its row's ``(cron, cron_tz)``, or the error naming it."""
    if not isinstance(schedule, Cron):
        raise BadEnvelopeType(
            f"{label}: schedule={show(schedule)} cannot cross processes: only envq.FIXED_DELAY, "
            "envq.FIXED_RATE and envq.Cron do (another process cannot rebuild this one)"
        )
    return schedule.expr, _zone_name(schedule, label)


#: The longest time, in seconds, a PostgreSQL queue stores for an envelope: its
#: ``interval``, ``deadline``, first ``delay`` (or the wait to ``not_before``) and its
#: retry policy's ``base`` and ``cap`` (1000 years). The database computes each next
#: run as its clock plus such a time, and its ``timestamptz`` ends in the year 294276:
#: a longer time would make the end of an attempt fail, so a send refuses it.
MAX_SECONDS: Final = 1000 * 365.25 * 86400.0


def _storable(field: str, value: float, label: str) -> None:
    """Refuse a time the database cannot compute a next run from."""
    if value > MAX_SECONDS:
        raise BadEnvelope(
            f"{label}: {field}={show(value)} is longer than a PostgreSQL queue can time "
            f"(at most {MAX_SECONDS:g} s, 1000 years)"
        )


def encode(env: object, label: str) -> Encoded:
    """The row of ``env``, or the error naming what cannot cross processes.

    :raises BadEnvelopeType: not an Envelope; a callable with no import path; ``id`` or
        ``payload`` not JSON; stamps (they are the queue's, not the row's); a schedule
        other than FIXED_DELAY, FIXED_RATE or an :class:`envq.Cron` whose time zone has
        an IANA name.
    :raises BadEnvelope: a time longer than :data:`MAX_SECONDS` (``interval``,
        ``deadline``, ``delay``, the wait to ``not_before``, the retry policy's ``base``
        or ``cap``): the database could not compute the next run from it.
    """
    if not isinstance(env, Envelope):
        raise BadEnvelopeType(f"{label}: {show(env)} is not an envq.Envelope")
    if env.stamps:
        raise BadEnvelopeType(
            f"{label}: stamps={show(env.stamps)} cannot cross processes: give the queue's "
            "stamps to PgQueue(stamps=...) in every process instead"
        )
    if _UNSTORABLE.search(env.type):
        raise BadEnvelopeType(
            f"{label}: type={show(env.type)} cannot cross processes: it holds a NUL "
            "character or a UTF-16 surrogate, which PostgreSQL cannot store"
        )
    cron: str | None = None
    cron_tz: str | None = None
    if isinstance(env.schedule, Schedule):
        schedule = env.schedule.value
    else:
        cron, cron_tz = _calendar(env.schedule, label)
        schedule = Schedule.FIXED_DELAY.value  # a calendar row's cron columns time it
    retry = env.retry
    if retry is not None and not math.isfinite(retry.cap):
        raise BadEnvelope(f"{label}: retry={show(retry)}: cap must be finite to cross processes")
    _storable("interval", env.interval, label)
    _storable("deadline", env.deadline, label)
    _storable("delay", env.delay, label)
    if retry is not None:
        _storable("retry.base", retry.base, label)
        _storable("retry.cap", retry.cap, label)
    delay = env.delay
    if env.not_before is not None:
        wait = (env.not_before - dt.datetime.now(dt.UTC)).total_seconds()
        if wait > MAX_SECONDS:
            raise BadEnvelope(
                f"{label}: not_before={show(env.not_before)} is further away than a PostgreSQL "
                f"queue can time (at most {MAX_SECONDS:g} s, 1000 years)"
            )
        delay = max(delay, wait)
    return Encoded(
        id=None if env.id is None else _json(env.id, "id", label, MAX_ID_BYTES),
        type=env.type,
        invoke=callable_name(env.invoke, "invoke", label),
        payload=_json(env.payload, "payload", label, MAX_PAYLOAD_BYTES),
        periodic=env.periodic,
        interval=env.interval,
        schedule=schedule,
        deadline=env.deadline,
        hooks=(
            None if env.before is None else callable_name(env.before, "before", label),
            None if env.after is None else callable_name(env.after, "after", label),
            None if env.on_success is None else callable_name(env.on_success, "on_success", label),
            None if env.on_failure is None else callable_name(env.on_failure, "on_failure", label),
        ),
        retry=None
        if retry is None
        else json.dumps(
            {
                "attempts": retry.attempts,
                "base": retry.base,
                "cap": retry.cap,
                "jitter": retry.jitter,
            }
        ),
        delay=max(0.0, delay),
        cron=cron,
        cron_tz=cron_tz,
    )


def decode(row: Any) -> Envelope:
    """The envelope a row stands for, its callables resolved by name.

    Rows of one shape (the same callables, type, timing and policy) share one
    validated prototype; each row gets a sibling of it with its own ``id`` and
    ``payload`` (building and validating an Envelope per row cost more than the rest
    of an attempt's work on a node).
    """
    shape = (
        row["invoke"],
        row["type"],
        row["interval_s"],
        row["deadline_s"],
        row["retry"],
        row["schedule"],
        row["cron"],
        row["cron_tz"],
        *(row[column] for _attr, column in HOOKS),
    )
    proto = _PROTOTYPES.get(shape)
    if proto is None:
        proto = _prototype(row)
        if len(_PROTOTYPES) >= _MAX_PROTOTYPES:
            _PROTOTYPES.clear()
        _PROTOTYPES[shape] = proto
    ident = row["id"]
    payload = row["payload"]
    return proto._sibling(
        None if ident is None else _hashable(json.loads(ident)),
        None if payload is None else json.loads(payload),
    )


#: Validated envelopes by the shape of their rows (see :func:`decode`).
_PROTOTYPES: dict[tuple[object, ...], Envelope] = {}
_MAX_PROTOTYPES: Final = 4096


def _prototype(row: Any) -> Envelope:
    retry = row["retry"]
    policy = None if retry is None else Retry(**json.loads(retry))
    hooks = [None if row[column] is None else resolve(row[column]) for _attr, column in HOOKS]
    return Envelope(
        invoke=resolve(row["invoke"]),
        type=row["type"],
        interval=row["interval_s"],
        deadline=row["deadline_s"],
        retry=policy,
        schedule=Schedule(row["schedule"])
        if row["cron"] is None
        else calendar(row["cron"], row["cron_tz"]),
        before=hooks[0],
        after=hooks[1],
        on_success=hooks[2],
        on_failure=hooks[3],
    )
