"""What every Python driver of the conformance protocol needs, whichever store it
drives: the checks of a command's arguments (a bad one is a :class:`DriverError`
answer, never an envq call error), the protocol's names of errors and causes, and
the waiting part of an attempt's plan (:func:`play`).

``envq.driver`` (the in-process queue) and ``envq.postgres.driver`` both use it, so
neither store's driver depends on the other's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import envq
from envq.conform.protocol import CAUSES, ERRORS, LONG_SECONDS, SLOW_SECONDS, Plan

__all__ = [
    "DriverError",
    "Gates",
    "arg_choice",
    "arg_count",
    "arg_flag",
    "arg_number",
    "arg_optional",
    "cause_name",
    "error_name",
    "member_name",
    "play",
]


def member_name(member: Any) -> str | None:
    """The protocol's name of an enum member (None stays None)."""
    return None if member is None else str(member.value)


def error_name(exc: BaseException) -> str:
    """The protocol's name of an error a call raised (the nearest known class)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS:
            return ERRORS[cls.__name__]
    return f"other:{type(exc).__name__}"


def cause_name(exc: BaseException) -> str:
    """The protocol's name of a move's cause."""
    name = type(exc).__name__
    return CAUSES.get(name, f"other:{name}")


Gates: TypeAlias = dict[str, tuple[asyncio.Event, list[Plan]]]


async def play(
    plan: Plan,
    name: str,
    gates: Gates,
    observe: Callable[..., None],
    real: Callable[[float], float],
) -> Plan:
    """The waiting part of an attempt's plan (``slow``, ``long``: sleep; ``hang``: wait
    for ``release``, which names the plan to go on with); the plan the attempt then ends
    by. A cancel seen while waiting is reported (``cancelled``) and goes on up."""
    try:
        if plan is Plan.SLOW or plan is Plan.LONG:
            await asyncio.sleep(real(SLOW_SECONDS if plan is Plan.SLOW else LONG_SECONDS))
            return Plan.OK
        if plan is Plan.HANG:
            gate = asyncio.Event()
            holder: list[Plan] = []
            entry = (gate, holder)
            gates[name] = entry
            try:
                await gate.wait()
            finally:
                # Only its own gate: a later attempt of the same envelope (run again
                # after this one's lease lapsed or its stop was committed) may already
                # hang on a gate of its own, which ``release`` must still find.
                if gates.get(name) is entry:
                    del gates[name]
            return holder[0]
    except asyncio.CancelledError:
        observe("cancelled", env=name)
        raise
    return plan


class DriverError(Exception):
    """A command the driver cannot carry out (a protocol error, not an envq one)."""


def arg_number(command: dict[str, Any], field: str, default: float | None = None) -> float:
    """A finite number >= 0 of the command (``default`` if it is missing)."""
    value = command.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DriverError(f"{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise DriverError(f"{field} must be finite and >= 0, got {value!r}")
    return float(value)


def arg_optional(command: dict[str, Any], field: str) -> float | None:
    """A finite number >= 0 of the command, or ``None`` if it is missing or null."""
    return None if command.get(field) is None else arg_number(command, field)


def arg_count(command: dict[str, Any], field: str, default: int) -> int:
    """A whole number >= 0 of the command (``default`` if it is missing)."""
    value = command.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DriverError(f"{field} must be a whole number >= 0, got {value!r}")
    return value


def arg_flag(command: dict[str, Any], field: str, default: bool | None) -> bool | None:
    """``true``/``false`` of the command (``default`` if it is missing; ``None`` only
    where null is allowed)."""
    value = command.get(field, default)
    if value is None and default is None:
        return None
    if not isinstance(value, bool):
        raise DriverError(f"{field} must be true or false, got {value!r}")
    return value


def arg_choice(kind: type[Plan] | type[envq.StopMode], value: object, field: str) -> Any:
    """The member of ``kind`` named ``value``."""
    try:
        return kind(value)
    except ValueError:
        names = [m.value for m in kind]
        raise DriverError(f"{field} must be one of {names}, got {value!r}") from None
