"""Frozen value objects: decisions, retry policy, hook budgets, statistics (events and
reports are :mod:`envq._reports`')."""

from __future__ import annotations

import enum
import random
from collections.abc import Generator, Mapping
from typing import Any, Final

import attrs

from envq import _checks
from envq._machine import DecisionKind, EnvState, Outcome, QueueState, StopMode, _Enum
from envq._schedule import capped_exponential, fixed_rate_slot

__all__ = [
    "FIXED_DELAY",
    "FIXED_RATE",
    "Decision",
    "HookTimeout",
    "Rejection",
    "Retry",
    "Schedule",
    "Statistics",
    "StopMode",
    "drop",
    "retry_after",
    "retry_now",
]


class Rejection(enum.StrEnum):
    """Why a ``send`` was refused: the keys of ``Statistics.rejections``.

    Members are strings (``Rejection.CAPACITY == "capacity"``), so the mapping can be
    read with either.
    """

    #: The queue's state refuses sends (STOPPING, STOPPED, TERMINATED).
    STATE = "state"
    #: Not an :class:`envq.Envelope`.
    INVALID = "invalid"
    #: The envelope's ``type`` was blacklisted by a ``StopType``.
    BLACKLISTED = "blacklisted"
    #: The envelope is live in another queue.
    FOREIGN = "foreign"
    #: No room (or producers are waiting in ``send_wait``).
    CAPACITY = "capacity"

    def __repr__(self) -> str:
        # A mapping keyed by reasons prints as {'capacity': 1}, as it did with strings.
        return repr(self.value)


class Schedule(_Enum):
    """How a periodic envelope's next run is timed from its ``interval`` (both members
    are :class:`envq.Timing` schedules, as :class:`envq.Cron` is)."""

    #: Next run ``interval`` after the previous attempt ends (the seed's behaviour).
    FIXED_DELAY = "fixed_delay"
    #: Next run at the first point of the grid ``origin + n × interval`` after the
    #: attempt ends; missed slots are skipped, never burst.
    FIXED_RATE = "fixed_rate"

    def first_run(self, at: float, offset: float) -> float:
        """The first run is when the envelope is armed to run: ``at``."""
        return at

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        """FIXED_DELAY: ``ended + interval``; FIXED_RATE: the first grid point
        ``origin + n × interval`` strictly after ``ended``."""
        if self is Schedule.FIXED_DELAY:
            return ended + interval
        return origin + fixed_rate_slot(origin, interval, ended) * interval


FIXED_DELAY: Final = Schedule.FIXED_DELAY
FIXED_RATE: Final = Schedule.FIXED_RATE


@attrs.frozen
class Decision:
    """What ``on_failure`` decided for a failed attempt.

    Build one with :func:`drop`, :func:`retry_now` or :func:`retry_after`.
    """

    kind: DecisionKind
    #: Seconds to wait before the retry (RETRY_AFTER only; 0 otherwise).
    delay: float = 0.0


_DROP: Final = Decision(DecisionKind.DROP)
_RETRY_NOW: Final = Decision(DecisionKind.RETRY_NOW)


def drop() -> Decision:
    """Decide to drop the envelope: it ends FAILED."""
    return _DROP


def retry_now() -> Decision:
    """Decide to retry at once: the envelope goes back to READY."""
    return _RETRY_NOW


def retry_after(seconds: float) -> Decision:
    """Decide to retry after ``seconds``; a non-positive value means 1 s (as in the seed).

    :raises TypeError: ``seconds`` is not a number (a bool or a str is not).
    :raises ValueError: ``seconds`` is NaN, infinite or too large for a float.
    """
    delay = _checks.finite("retry_after: seconds", seconds)
    return Decision(DecisionKind.RETRY_AFTER, delay if delay > 0 else 1.0)


def _attempts(value: int) -> int:
    return _checks.integer("Retry: attempts", value, minimum=1, unlimited=True)


def _base(value: float) -> float:
    return _checks.seconds("Retry: base", value)


def _cap(value: float) -> float:
    return _checks.seconds("Retry: cap", value)


def _jitter(value: bool) -> bool:
    return _checks.flag("Retry: jitter", value)


def _check_rng(_inst: object, _attr: object, value: object) -> None:
    _checks.instance("Retry: rng", value, random.Random, want="a random.Random")


#: The default RNG for jitter; register it with Hypothesis so failures replay.
default_rng: Final = random.Random()


@attrs.frozen
class Retry:
    """Exponential-backoff retry policy for one-off envelopes.

    ``attempts`` counts every attempt including the first (``-1`` = unlimited). The
    delay after the k-th failure is ``min(cap, base * 2**(k-1))``; with ``jitter`` it
    is a uniform draw from ``[d/2, d]`` using ``rng`` (injectable for determinism).
    """

    attempts: int = attrs.field(default=3, converter=_attempts)
    base: float = attrs.field(default=1.0, converter=_base)
    cap: float = attrs.field(default=1800.0, converter=_cap)
    jitter: bool = attrs.field(default=True, converter=_jitter)
    rng: random.Random = attrs.field(
        default=default_rng, eq=False, repr=False, validator=_check_rng
    )

    def allows(self, attempt: int) -> bool:
        """Whether another attempt may follow failed attempt number ``attempt`` (1-based)."""
        return self.attempts == -1 or attempt < self.attempts

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (1-based):
        ``min(cap, base·2^(failures−1))``, or with ``jitter`` a uniform draw from
        ``[d/2, d]``."""
        d = capped_exponential(self.base, max(0, failures - 1), self.cap)
        if self.jitter:
            return self.rng.uniform(d / 2, d)
        return d


def _fraction(value: float) -> float:
    fraction = _checks.finite("HookTimeout: fraction", value)
    if not 0 < fraction <= 1:
        raise ValueError(f"HookTimeout: fraction must be in (0, 1], got {_checks.show(value)}")
    return fraction


def _floor(value: float | None) -> float | None:
    return None if value is None else _checks.seconds("HookTimeout: floor", value)


@attrs.frozen
class HookTimeout:
    """Each hook's time budget: ``max(fraction × deadline, floor)``.

    With ``deadline = 0`` the budget is ``floor``; ``floor=None`` with ``deadline = 0``
    means no budget.
    """

    fraction: float = attrs.field(default=0.5, converter=_fraction)
    floor: float | None = attrs.field(default=0.8, converter=_floor)

    def budget(self, deadline: float) -> float | None:
        """The budget for a hook of an envelope with this ``deadline`` (None: unbounded)."""
        share = self.fraction * deadline if deadline > 0 else None
        if self.floor is None:
            return share
        return self.floor if share is None else max(share, self.floor)


@attrs.frozen
class Statistics:
    """A snapshot of a queue: its state, counters and envelopes by state."""

    state: QueueState
    #: Live envelopes by state, and terminal envelopes counted since the queue was made.
    by_state: Mapping[EnvState, int]
    in_flight: int
    capacity_used: int
    #: 0 = unlimited.
    capacity_limit: int
    outcomes: Mapping[Outcome, int]
    dedups: int
    #: Rejected ``send`` calls by :class:`Rejection` (whose members are strings:
    #: ``rejections["capacity"]`` works too).
    rejections: Mapping[Rejection, int]
    #: Threads still running a call the queue stopped waiting for.
    stuck_threads: int

    def __await__(self) -> Generator[Any, None, Statistics]:
        """``await queue.statistics()`` gives the snapshot on either store (the
        in-process queue's is taken when called, and awaiting it gives it back)."""
        yield from ()
        return self
