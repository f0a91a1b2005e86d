"""When an envelope runs first: its ``delay``, longer to reach its ``not_before`` (by
the loop's wall clock when it has one, as the virtual-time loop does), then its
calendar's first fire; and the wall clock of a loop. Used where an envelope is
admitted, armed by a start, or rescheduled on a calendar.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any, cast

from envq import _checks
from envq._errors import BadEnvelope, BadEnvelopeType

if TYPE_CHECKING:
    from envq._envelope import Envelope

__all__ = [
    "calendar_delay",
    "first_delay",
    "first_delay_at",
    "first_run_at",
    "unschedulable",
    "wall_now",
    "wall_offset",
]


def _brief(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def unschedulable(where: str, env: Envelope, exc: Exception) -> BadEnvelope:
    """The error of an envelope whose schedule cannot place its first run: a
    ``BadEnvelopeType`` (a ``TypeError``) for a schedule that answered something not a
    time, a ``BadEnvelope`` (a ``ValueError``) for one that raised."""
    error = BadEnvelopeType if isinstance(exc, TypeError) else BadEnvelope
    return error(
        f"{where}: the first run of {env.label()} cannot be placed: "
        f"{_brief(_checks.show(env.schedule), 120)} (not_before={env.not_before!r}) "
        f"gave {_brief(_checks.show(exc))}"
    )


def wall_now(loop: asyncio.AbstractEventLoop) -> float:
    """The wall clock (seconds since the Unix epoch): ``loop``'s ``wall_time()`` if it
    has one (the virtual-time loop), else ``time.time()``."""
    wall = getattr(loop, "wall_time", None)
    return float(wall()) if callable(wall) else time.time()


def wall_offset(loop: asyncio.AbstractEventLoop) -> float:
    """The wall clock minus ``loop``'s time."""
    return wall_now(loop) - loop.time()


def first_run_at(env: Envelope, at: float, offset: float) -> float:
    """The loop time of ``env``'s calendar's first run from loop time ``at`` on, checked:
    a schedule must answer a real number that is not NaN."""
    schedule = cast("Any", env.schedule)
    run = schedule.first_run(at, offset)
    if run.__class__ is not float and (not isinstance(run, (int, float)) or isinstance(run, bool)):
        raise TypeError(f"first_run() returned {_brief(_checks.show(run), 80)}, not a loop time")
    if math.isnan(run):
        raise ValueError("first_run() returned nan")
    return float(run)


def calendar_delay(env: Envelope, delay: float, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds from now to the first run of ``env``'s calendar schedule, armed to run
    ``delay`` seconds from now on."""
    now = loop.time()
    return first_run_at(env, now + max(0.0, delay), wall_now(loop) - now) - now


def first_delay(env: Envelope, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds ``env`` waits before its first run: its ``delay``, or longer to reach
    ``not_before`` (by the loop's wall clock when it has one, as the virtual-time loop
    does, else the system's), and then to its calendar's first fire."""
    return first_delay_at(env, loop.time(), wall_now(loop))


def first_delay_at(env: Envelope, now: float, wall: float) -> float:
    """:func:`first_delay` at loop time ``now`` and wall time ``wall``."""
    delay = env.delay
    if env.not_before is not None:
        delay = max(delay, env.not_before.timestamp() - wall)
    if env._calendar:
        delay = first_run_at(env, now + max(0.0, delay), wall - now) - now
    return delay
