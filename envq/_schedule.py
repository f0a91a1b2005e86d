"""Schedules: where a periodic envelope's next run falls.

Every schedule answers two questions, in loop time (the queue's clock, seconds):
when is the first run of an envelope armed at ``at``, and when is the run after one
that ended at ``ended``. :data:`envq.FIXED_DELAY` and :data:`envq.FIXED_RATE` answer
from the envelope's ``interval``; :class:`Cron` answers from a cron expression in a
time zone, for which it needs the wall clock: the queue passes ``offset``, the wall
clock's value (seconds since the Unix epoch) minus the loop time, read from the
loop's ``wall_time()`` when it has one (the virtual-time loop does) or ``time.time()``.
"""

from __future__ import annotations

import datetime as dt
import math
import zoneinfo
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import attrs

from envq import _checks

if TYPE_CHECKING:
    from cronsim import CronSim

__all__ = ["MIN_INTERVAL", "Cron", "Timing", "capped_exponential", "fixed_rate_slot"]

#: The smallest interval accepted (seconds). A shorter one is a busy loop, and past
#: 2**33 s of loop time (272 years) the clock could not tell one run from the next.
MIN_INTERVAL: Final = 1e-6

#: Cron fires on whole seconds; wall times within this of a whole second count as on
#: it. Loop and wall clock are two floats (about 2.4e-7 s apart at today's epoch),
#: and on a real loop they are read at slightly different moments.
CRON_SLACK: Final = 1e-3


@runtime_checkable
class Timing(Protocol):
    """A periodic envelope's schedule: when its first run and each next run fall.

    All times are loop times (seconds); ``offset`` is the wall clock minus the loop
    time, for schedules that follow the calendar. A schedule is plain data: it keeps
    no state between calls (what it needs is passed in).
    """

    def first_run(self, at: float, offset: float) -> float:
        """The loop time of the first run of an envelope armed to run from ``at`` on
        (``at`` already includes its ``delay`` or ``not_before``)."""
        ...

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        """The loop time of the next run, strictly after ``ended``.

        :param interval: the envelope's ``interval``.
        :param origin: the scheduled start of the last run not placed by this
            schedule (the first run, a retry, a restart): a grid's origin.
        :param previous: the scheduled start of the run that just ended.
        :param ended: the loop time its attempt ended (now).
        :param offset: wall clock minus loop time, in seconds.
        """
        ...


def capped_exponential(base: float, exponent: int, cap: float) -> float:
    """``min(cap, base · 2**exponent)`` without overflowing for large exponents."""
    try:
        raw = math.ldexp(base, exponent)
    except OverflowError:
        raw = math.inf
    return min(cap, raw)


def fixed_rate_slot(origin: float, interval: float, now: float) -> int:
    """The first grid point strictly after ``now``: the smallest ``n ≥ 1`` with
    ``origin + n × interval > now``.

    The quotient is only a first guess: ``(5.1 - 2.1) / 1`` is 2.9999999999999996, and
    flooring it would give a slot equal to ``now``, which would run at once.
    """
    n = max(1, math.floor((now - origin) / interval) + 1)
    while n > 1 and origin + (n - 1) * interval > now:
        n -= 1
    while origin + n * interval <= now:
        n += 1
    return n


def _cronsim() -> type[CronSim]:
    try:
        from cronsim import CronSim  # noqa: PLC0415 - an optional extra
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "envq.Cron needs the cronsim package: pip install 'envq[cron]'", name=exc.name
        ) from exc
    return CronSim


def _expr(value: object) -> str:
    expr = _checks.instance("Cron: expr", value, str, want="a str")
    return " ".join(expr.split())


def _zone(value: object) -> dt.tzinfo:
    if isinstance(value, dt.tzinfo):
        return value
    name = _checks.instance("Cron: tz", value, str, want="an IANA time zone name or a tzinfo")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # OSError: a folder of the zone database ("Europe"), read from the tzdata
        # package as a file (IsADirectoryError), or another unreadable path.
        raise ValueError(
            f"Cron: tz must be an IANA time zone name, got {_checks.show(name)[:100]}"
        ) from exc


def _check_expr(inst: Cron, attr: Any, value: str) -> None:
    cronsim = _cronsim()
    from cronsim import CronSimError  # noqa: PLC0415 - an optional extra

    try:
        cronsim(value, dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    except CronSimError as exc:
        raise ValueError(f"Cron: expr is not a cron expression ({exc}), got {value!r}") from exc


@attrs.frozen
class Cron:
    """A calendar schedule: run at the times a cron expression names, in a time zone.

    ``Cron("0 3 * * *", tz="Europe/Berlin")`` runs every day at 03:00 Berlin time,
    summer and winter. Five fields (minute, hour, day of month, month, day of week)
    or six (a leading seconds field); names (``MON``, ``JAN``), ranges, steps, lists,
    ``L`` and ``#`` are understood. Evaluated by the ``cronsim`` package (the
    ``envq[cron]`` extra), which follows Debian cron on daylight-saving changes: a
    job at a fixed time that falls in the hour skipped in spring runs when the clocks
    have jumped (02:30 runs at 03:00); one in the hour repeated in autumn runs once,
    at the first pass. Jobs with ``*`` in the minute or hour field (and six-field
    expressions) follow real time in every zone: they fire at each moment whose local
    time they name, through both passes of a repeated half hour or hour.

    A cron envelope's first run is the first fire at or after its arming (plus its
    ``delay`` / ``not_before``); each next run is the first fire after the previous
    run's attempt ended, so fires missed while it ran are skipped, not made up. After
    a stop, a restart waits for the first fire after it: fires missed while the queue
    was stopped are skipped too.

    :param expr: the cron expression.
    :param tz: an IANA time zone name (``"Europe/Berlin"``) or a ``tzinfo``; the
        default is UTC.
    :raises TypeError: ``expr`` is not a str, ``tz`` neither a str nor a tzinfo.
    :raises ValueError: ``expr`` is not a cron expression, ``tz`` not a known zone.
    :raises ModuleNotFoundError: the ``cronsim`` package is not installed.
    """

    expr: str = attrs.field(converter=_expr, validator=_check_expr)
    tz: dt.tzinfo = attrs.field(default=dt.UTC, converter=_zone)
    #: The expression follows real time (``*`` in its minute or hour field, or six
    #: fields) in a zone whose offset may change: its fires are walked offset by
    #: offset (see :meth:`_real_time_fire`).
    _walk: bool = attrs.field(init=False, default=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        fields = self.expr.split()
        real_time = len(fields) == 6 or fields[0].startswith("*") or fields[1].startswith("*")
        object.__setattr__(self, "_walk", real_time and not isinstance(self.tz, dt.timezone))

    def next_fire(self, after: float) -> float:
        """The first fire strictly after wall time ``after`` (seconds since the Unix
        epoch); a fire within a millisecond of ``after`` counts as at it."""
        start = math.floor(after + CRON_SLACK)
        if self._walk:
            return self._real_time_fire(start + 1)
        moment = dt.datetime.fromtimestamp(start, self.tz)
        for fire in _cronsim()(self.expr, moment):
            # Debian cron runs a fixed-time job once in a repeated hour: started in
            # the second pass, cronsim answers the first pass's time, already past.
            if fire.timestamp() > start:
                return fire.timestamp()
        return math.inf  # no fire in the next fifty years

    def _offset(self, t: int) -> float:
        offset = dt.datetime.fromtimestamp(t, self.tz).utcoffset()
        return 0.0 if offset is None else offset.total_seconds()

    def _real_time_fire(self, t: int) -> float:
        """The first instant at or after ``t`` (whole seconds since the epoch) whose
        local time the expression names, for an expression that follows real time.

        cronsim steps such expressions through an aware datetime by whole hours, which
        skips or misses fires where an offset changes by half an hour (Lord Howe).
        Here each stretch of constant offset is a plain, naive calendar: the naive
        match after the local time at ``t`` is a fire if the offset does not change
        before it; else the walk goes on from the change, with the new offset (so a
        repeated half hour has both passes, and a skipped one none)."""
        cronsim = _cronsim()
        for _ in range(10_000):
            offset = self._offset(t)
            local = dt.datetime(1970, 1, 1) + dt.timedelta(seconds=t + offset - 1)
            try:
                match = next(iter(cronsim(self.expr, local)))
            except StopIteration:
                return math.inf  # no fire in the next fifty years
            fire = int((match - dt.datetime(1970, 1, 1)).total_seconds() - offset)
            change = self._next_change(t, offset, fire)
            if change is None:
                return float(fire)
            t = change
        return math.inf

    def _next_change(self, t: int, offset: float, until: int) -> int | None:
        """The first whole second in ``(t, until]`` whose offset is not ``offset``;
        looked for a day at a time (two changes within one day are not seen), then
        by halves."""
        low = t
        while low < until:
            high = min(low + 86_400, until)
            if self._offset(high) != offset:
                while high - low > 1:
                    middle = (low + high) // 2
                    if self._offset(middle) == offset:
                        low = middle
                    else:
                        high = middle
                return high
            low = high
        return None

    def first_fire(self, at: float) -> float:
        """The first fire at or after wall time ``at``."""
        return self.next_fire(math.ceil(at - CRON_SLACK) - 1)

    def first_run(self, at: float, offset: float) -> float:
        """The loop time of the first fire at or after loop time ``at``."""
        return self.first_fire(at + offset) - offset

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        """The loop time of the first fire after the attempt ended (and after the
        previous run's fire)."""
        return self.next_fire(max(previous, ended) + offset) - offset

    def __repr__(self) -> str:
        return f"Cron({self.expr!r}, tz={str(self.tz)!r})"
