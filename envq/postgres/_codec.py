"""Envelopes that cross processes: callables by name, ``id`` and ``payload`` as JSON.

An envelope sent to a PostgreSQL queue is stored as a row and run, maybe, by another
process on another machine. What crosses is data: the callables (``invoke`` and the
hooks) by their import path ``module:qualname``, which must name the very same object
(no lambda, closure or bound method), ``id`` and ``payload`` as JSON, the retry policy
by its fields. :func:`encode` checks all of it at the call site and names the field
that cannot cross; :func:`decode` rebuilds an :class:`envq.Envelope` from a row.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import math
from collections.abc import Callable, Hashable
from typing import Any, Final

import attrs

from envq._envelope import Envelope
from envq._errors import BadEnvelope, BadEnvelopeType
from envq._values import Retry, Schedule

__all__ = ["Encoded", "callable_name", "decode", "encode", "resolve"]

#: The hooks an envelope row names, as (Envelope attribute, row column).
HOOKS: Final = (
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
            f"{label}: {field}={fn!r} cannot cross processes: it has no import path "
            "(give a function defined at the top level of an importable module)"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise BadEnvelopeType(
            f"{label}: {field}={fn!r} cannot cross processes: a lambda or a function "
            "defined inside another has no import path (define it at module level)"
        )
    if module == "__main__":
        raise BadEnvelopeType(
            f"{label}: {field}={fn!r} cannot cross processes: it is defined in __main__, "
            "which other processes cannot import (move it to a module)"
        )
    name = f"{module}:{qualname}"
    try:
        found = resolve(name)
    except (ImportError, AttributeError) as error:
        raise BadEnvelopeType(
            f"{label}: {field}={fn!r} cannot cross processes: {name} does not resolve ({error})"
        ) from None
    if found is not fn:
        raise BadEnvelopeType(
            f"{label}: {field}={fn!r} cannot cross processes: {name} names another object "
            f"({found!r})"
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


def _json(value: object, field: str, label: str) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise BadEnvelopeType(
            f"{label}: {field}={value!r} cannot cross processes: it is not JSON ({error})"
        ) from None


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
    #: Seconds from the send to the first run (0: at once).
    delay: float


def encode(env: object, label: str) -> Encoded:
    """The row of ``env``, or the error naming what cannot cross processes.

    :raises BadEnvelopeType: not an Envelope; a callable with no import path; ``id`` or
        ``payload`` not JSON; stamps (they are the queue's, not the row's); a schedule
        other than FIXED_DELAY / FIXED_RATE.
    """
    if not isinstance(env, Envelope):
        raise BadEnvelopeType(f"{label}: {env!r} is not an envq.Envelope")
    if env.stamps:
        raise BadEnvelopeType(
            f"{label}: stamps={env.stamps!r} cannot cross processes: give the queue's "
            "stamps to PgQueue(stamps=...) in every process instead"
        )
    if not isinstance(env.schedule, Schedule):
        raise BadEnvelopeType(
            f"{label}: schedule={env.schedule!r} cannot cross processes yet (only "
            "FIXED_DELAY and FIXED_RATE)"
        )
    retry = env.retry
    if retry is not None and not math.isfinite(retry.cap):
        raise BadEnvelope(f"{label}: retry={retry!r}: cap must be finite to cross processes")
    delay = env.delay
    if env.not_before is not None:
        wait = (env.not_before - dt.datetime.now(dt.UTC)).total_seconds()
        delay = max(delay, wait)
    return Encoded(
        id=None if env.id is None else _json(env.id, "id", label),
        type=env.type,
        invoke=callable_name(env.invoke, "invoke", label),
        payload=_json(env.payload, "payload", label),
        periodic=env.interval > 0,
        interval=env.interval,
        schedule=env.schedule.value,
        deadline=env.deadline,
        hooks=tuple(  # type: ignore[arg-type]
            None if getattr(env, attr) is None else callable_name(getattr(env, attr), attr, label)
            for attr, _column in HOOKS
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
        schedule=Schedule(row["schedule"]),
        before=hooks[0],
        after=hooks[1],
        on_success=hooks[2],
        on_failure=hooks[3],
    )
